"""TieredCache over an L3 store (docs/design.md §8), on the local-directory store: write-back and
write-through, lookups and loads through the store, fail-closed fetches, a store outage, and a clear.
test_store_mooncake.py runs the main path against Mooncake."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from conftest import all_tensors, cpu_image, deployment, round_trip, small_spec, wait_for
from fastcache import TieredCache, TransferError
from fastcache.engine import tiered_l3
from fastcache.engine.combined import CombinedHandle
from fastcache.store import fingerprint
from fastcache.store.keys import ObjectKeys
from test_store import object_path

SPEC = small_spec(num_gpu_blocks=24, num_cpu_blocks=16)


def fill(workers, gpu, rng):
    """Fresh random bytes in these GPU blocks of every rank; returns each rank's CPU-block images."""
    for w in workers:
        for rows in all_tensors(w):
            rows[gpu] = rng.integers(1, 256, rows[gpu].shape, dtype=np.uint8)
    return [cpu_image(w, gpu) for w in workers]


def poison(workers, gpu, rng):
    """Random bytes where a load must land: a block it misses shows."""
    fill(workers, gpu, rng)


def check(workers, gpu, want):
    for r, w in enumerate(workers):
        np.testing.assert_array_equal(cpu_image(w, gpu), want[r])


def write_back_then_load(url, tp=2):
    """Shared with the Mooncake tests: evictions go to the store, store hits come back, every byte checked."""
    rng = np.random.default_rng(3)
    with deployment(SPEC, tp=tp, store=url) as (backend, workers):
        cache = TieredCache(backend, "m/0", capacity=4)
        hashes, gpu = [int(h) for h in rng.integers(0, 2**63, 8)], list(range(8))
        want = fill(workers, gpu, rng)
        for i in range(0, 8, 2):                # each pair evicts the oldest pair once the 4 blocks are full
            cache.store(hashes[i:i + 2], gpu[i:i + 2]).result(timeout=30)
        assert backend.store_contains("m/0", hashes).tolist() == [True] * 4 + [False] * 4
        assert cache.lookup_tiers(hashes) == (8, 4)
        assert cache.lookup(hashes[4:]) == 4
        dst = list(range(10, 14))
        poison(workers, dst, rng)
        handle = cache.load(hashes[:4], dst)        # all four from the store, evicting the other four
        assert isinstance(handle, CombinedHandle)
        handle.result(timeout=30)
        check(workers, dst, [w[:4] for w in want])
        assert cache.lookup_tiers(hashes[:4]) == (4, 0)      # they came up through the CPU tier
        assert cache.lookup_tiers(hashes) == (8, 4)          # and the others went down
        dst = list(range(14, 22))
        poison(workers, dst, rng)
        cache.load(hashes[:2] + hashes[4:6], dst[:4]).result(timeout=30)     # a mix of both tiers
        check(workers, dst[:4], [np.concatenate([w[:2], w[4:6]]) for w in want])
        stats = cache.stats()
        assert stats["l3_hits"] == 4 + 4 and stats["l3_loaded_blocks"] == 4 + 2
        assert stats["l3_written_blocks"] == 4 + 4 and stats["l3_errors"] == 0
        assert stats["l3_loaded_bytes"] == 6 * SPEC.cpu_block_bytes * tp
        tasks = backend.counters.snapshot()["tasks"]
        assert tasks["to_store", "done"] >= 3 and tasks["from_store", "done"] == 2
        cache.close()


def test_write_back_then_load_through_the_store(tmp_path):
    write_back_then_load(f"file://{tmp_path}/l3")


def test_write_back_skips_what_the_store_has(tmp_path):
    rng = np.random.default_rng(4)
    with deployment(SPEC, tp=1, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=2)
        fill(workers, [0, 1, 2, 3], rng)
        cache.store([1, 2], [0, 1]).result(timeout=30)
        cache.store([3, 4], [2, 3]).result(timeout=30)          # 1, 2 written back
        assert cache.stats()["l3_written_blocks"] == 2
        cache.load([1, 2], [5, 6]).result(timeout=30)           # back up; 3, 4 written back
        assert cache.stats()["l3_written_blocks"] == 4
        cache.load([3, 4], [7, 8]).result(timeout=30)           # 1, 2 evicted again: the store has them
        assert cache.stats()["l3_written_blocks"] == 4
        assert cache.stats()["evicted"] == 6


def test_write_through_puts_every_stored_block(tmp_path):
    rng = np.random.default_rng(5)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=8, write="through")
        want = fill(workers, [0, 1, 2], rng)
        cache.store([7, 8, 9], [0, 1, 2]).result(timeout=30)
        wait_for(lambda: backend.store_contains("m", [7, 8, 9]).all(), 30, "the write-through puts")
        wait_for(lambda: cache.stats()["l3_written_blocks"] == 3, 30, "the write-through count")
        cache.close()
        # another cache of the same backend and namespace finds them in the store only
        other = TieredCache(backend, "m", capacity=8)
        assert other.lookup_tiers([7, 8, 9]) == (3, 3)
        poison(workers, [3, 4, 5], rng)
        other.load([7, 8, 9], [3, 4, 5]).result(timeout=30)
        check(workers, [3, 4, 5], want)
        other.close()
    with pytest.raises(ValueError, match="write must be one of"):
        TieredCache(backend, "x", write="around")


def test_a_corrupt_object_fails_the_load_closed_and_becomes_a_miss(tmp_path):
    rng = np.random.default_rng(6)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=2)
        fill(workers, [0, 1, 2, 3], rng)
        cache.store([1, 2], [0, 1]).result(timeout=30)
        cache.store([3, 4], [2, 3]).result(timeout=30)
        assert cache.lookup_tiers([1, 2]) == (2, 2)
        path = object_path(tmp_path, ObjectKeys("m", fingerprint(SPEC, 2), 1), 2)
        data = bytearray(open(path, "rb").read())
        data[5] ^= 1                            # a payload byte
        open(path, "wb").write(data)
        with pytest.raises(TransferError, match="rank 1: StoreError: L3 miss: .*1 of 2 objects"):
            cache.load([1, 2], [5, 6]).result(timeout=30)
        stats = cache.stats()
        assert stats["failed_loads"] == 1 and stats["l3_errors"] == 0      # a miss: the store is fine
        assert cache.lookup_tiers([1, 2]) == (1, 1)          # the corrupt object is gone, its neighbour not
        assert not os.path.exists(path)
        # nothing of the failed load is served: neither hash entered the CPU tier, and the two entries it
        # evicted to make room went down to the store
        assert cache.stats()["entries"] == 0 and cache.lookup_tiers([1, 3, 4]) == (3, 3)


def test_load_of_a_hash_neither_tier_holds_raises_before_anything_moves(tmp_path):
    with deployment(SPEC, tp=1, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=4)
        fill(workers, [0], np.random.default_rng(0))
        cache.store([1], [0]).result(timeout=30)
        before = backend.counters.snapshot()["tasks"]
        with pytest.raises(ValueError, match="held by neither the CPU tier nor the store"):
            cache.load([1, 99], [3, 4])
        assert backend.counters.snapshot()["tasks"] == before
        assert cache.lookup([1]) == 1       # its entry was not disturbed


def test_a_failing_store_never_stops_the_cpu_tier(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rng = np.random.default_rng(7)
    with deployment(SPEC, tp=1, store=f"file://{blocker}/l3") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=2)
        want = fill(workers, [0, 1, 2, 3], rng)
        cache.store([1, 2], [0, 1]).result(timeout=30)
        cache.store([3, 4], [2, 3]).result(timeout=30)     # evicts 1, 2: their write-back fails
        wait_for(lambda: cache.stats()["l3_errors"] >= 1, 30, "the failed write-back")
        assert cache.lookup_tiers([3, 4]) == (2, 0)
        assert cache.lookup_tiers([1, 2]) == (0, 0)          # the store is set aside: not even asked
        poison(workers, [5, 6], rng)
        cache.load([3, 4], [5, 6]).result(timeout=30)
        check(workers, [5, 6], [w[2:] for w in want])
        round_trip(backend, workers, rng, n=2)
        with pytest.raises(ValueError, match="set aside after an error"):
            cache.load([1], [7])


def refuse_puts_as_in_a_reshard(backend, monkeypatch) -> list:
    """The next puts meet a reshard that began after their blocks were named: the backend refuses them
    (RefusedError, the real refusal). Returns the list the refusals are recorded in."""
    from fastcache import RefusedError
    from fastcache.ipc.signal import NORMAL, RESHARDING
    real, refused = backend.cpu_to_store, []

    def during_a_reshard(*args):
        backend.signals.status = RESHARDING
        try:
            return real(*args)
        except RefusedError as exc:
            refused.append(exc)
            raise
        finally:
            backend.signals.status = NORMAL
    monkeypatch.setattr(backend, "cpu_to_store", during_a_reshard)
    return refused


def test_a_write_back_the_deployment_refuses_does_not_set_the_store_aside(tmp_path, monkeypatch):
    """A store() that named its victims just before a reshard (or clear) began has its write-back refused:
    that says nothing about the store, which stays in use (it used to be set aside for 10 s)."""
    rng = np.random.default_rng(8)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=2)
        want = fill(workers, [0, 1, 2, 3], rng)
        cache.store([1, 2], [0, 1]).result(timeout=30)
        refused = refuse_puts_as_in_a_reshard(backend, monkeypatch)
        cache.store([3], [2]).result(timeout=30)        # evicts 2: its write-back is refused
        monkeypatch.undo()
        assert len(refused) == 1 and cache.stats()["l3_errors"] == 0
        assert cache.lookup_tiers([2]) == (0, 0)        # not written back: a miss, not an error
        cache.store([4], [3]).result(timeout=30)        # evicts 1: written back, the store in use
        wait_for(lambda: cache.stats()["l3_written_blocks"] == 1, 30, "the write-back")
        assert cache.lookup_tiers([1]) == (1, 1)
        poison(workers, [5], rng)
        cache.load([1], [5]).result(timeout=30)
        check(workers, [5], [w[:1] for w in want])


def test_a_write_through_the_deployment_refuses_does_not_set_the_store_aside(tmp_path, monkeypatch):
    rng = np.random.default_rng(9)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=4, write="through")
        fill(workers, [0, 1], rng)
        refused = refuse_puts_as_in_a_reshard(backend, monkeypatch)
        cache.store([1], [0]).result(timeout=30)        # its put, on the writer thread, is refused
        wait_for(lambda: refused, 30, "the refused write-through")
        monkeypatch.undo()
        cache.store([2], [1]).result(timeout=30)
        wait_for(lambda: cache.stats()["l3_written_blocks"] == 1, 30, "the next write-through")
        assert cache.stats()["l3_errors"] == 0
        assert backend.store_contains("m", [1, 2]).tolist() == [False, True]


def test_after_a_clear_the_new_namespace_misses_the_old_objects(tmp_path):
    rng = np.random.default_rng(8)
    with deployment(SPEC, tp=1, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "llama/step-0", capacity=4, write="through")
        fill(workers, [0, 1], rng)
        cache.store([1, 2], [0, 1]).result(timeout=30)
        wait_for(lambda: backend.store_contains("llama/step-0", [1, 2]).all(), 30, "the puts")
        backend.clear_caches(timeout=60)
        with pytest.raises(TransferError, match="cleared"):
            cache.lookup([1, 2])
        backend.restore_caches(timeout=60)
        cache.namespace = "llama/step-1"
        assert cache.lookup_tiers([1, 2]) == (0, 0)
        with pytest.raises(ValueError):
            cache.namespace = "llama/step-0"            # never again


def test_two_deployments_share_prefixes_through_the_store(tmp_path):
    url, rng = f"file://{tmp_path}/l3", np.random.default_rng(9)
    hashes = [int(h) for h in rng.integers(0, 2**63, 5)]
    with deployment(SPEC, tp=2, store=url) as (backend, workers):
        cache = TieredCache(backend, "shared", capacity=8, write="through")
        want = fill(workers, list(range(5)), rng)
        cache.store(hashes, list(range(5))).result(timeout=30)
        wait_for(lambda: backend.store_contains("shared", hashes).all(), 30, "the puts")
        cache.close()
    with deployment(SPEC, tp=2, store=url) as (backend, workers):
        cache = TieredCache(backend, "shared", capacity=8)
        assert cache.lookup_tiers(hashes) == (5, 5)
        assert cache.lookup_tiers(hashes[:2] + [12345] + hashes[2:]) == (2, 2)
        poison(workers, list(range(10, 15)), rng)
        cache.load(hashes, list(range(10, 15))).result(timeout=30)
        check(workers, list(range(10, 15)), want)
        cache.close()
        assert TieredCache(backend, "shared-other", capacity=4).lookup(hashes) == 0


# -- races between engine threads (found by a stress run: engine threads, a small CPU tier, the store) --
def test_a_load_through_the_store_refuses_when_its_cpu_tier_hashes_leave_while_the_store_is_asked(tmp_path):
    """load() lets go of the lock while it asks the store; it must decide again afterwards, not assume
    that what the CPU tier held before is still there."""
    rng = np.random.default_rng(11)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m/0", capacity=2)
        a, b = 101, 102
        want = fill(workers, list(range(6)), rng)
        cache.store([b], [0]).result(30)
        cache.store([103, 104], [1, 2]).result(30)      # b goes down to the store
        cache.store([a], [3]).result(30)                # the CPU tier holds a and 103
        assert cache.lookup_tiers([a, b]) == (2, 1)
        real = backend.store_contains

        def meanwhile(namespace, hashes):               # another engine thread stores while load() asks
            backend.store_contains = real
            cache.store([201, 202], [4, 5]).result(30)  # evicts a (into the store)
            return real(namespace, hashes)
        backend.store_contains = meanwhile
        with pytest.raises(ValueError, match="retry the load"):
            cache.load([a, b], [6, 7])
        assert all(not e[2] for e in cache._index.values())          # nothing left pinned
        poison(workers, [6, 7], rng)
        cache.load([a, b], [6, 7]).result(30)           # retried: both come up from the store
        check(workers, [6, 7], [np.stack([w[3], w[0]]) for w in want])
        cache.close()


@pytest.mark.parametrize("when", ["while the store is asked", "while the fetch runs"])
def test_an_l3_load_racing_a_namespace_change_never_serves_old_bytes_under_the_new_namespace(tmp_path, when):
    """New weights, a new namespace: what a load fetches from the old namespace's objects must not become an
    entry of the new one, whether the change comes while load() asks the store or while its fetch runs."""
    rng = np.random.default_rng(13)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "weights/0", capacity=2)
        hashes = [401, 402]
        fill(workers, [0, 1, 2, 3], rng)
        cache.store(hashes, [0, 1]).result(30)
        cache.store([403, 404], [2, 3]).result(30)      # 401 and 402 go down to the store
        assert cache.lookup_tiers(hashes) == (2, 2)
        asking, fetching = backend.store_contains, backend.store_to_cpu

        def change_while_asked(namespace, keys):
            backend.store_contains = asking
            answer = asking(namespace, keys)
            cache.namespace = "weights/1"
            return answer

        def change_while_fetching(namespace, keys, cpu):
            backend.store_to_cpu = fetching
            handle = fetching(namespace, keys, cpu)
            cache.namespace = "weights/1"
            return handle
        if when == "while the store is asked":
            backend.store_contains = change_while_asked
            with pytest.raises(TransferError, match="namespace changed"):
                cache.load(hashes, [4, 5])
        else:
            backend.store_to_cpu = change_while_fetching
            cache.load(hashes, [4, 5]).result(30)       # the caller asked under the old namespace
        assert cache.namespace == "weights/1"
        assert cache.lookup_tiers(hashes) == (0, 0)     # neither tier holds them under the new namespace
        assert all(not e[2] for e in cache._index.values())
        new = fill(workers, [6, 7], rng)                # the new weights' bytes for the same hashes
        cache.store(hashes, [6, 7]).result(30)
        poison(workers, [8, 9], rng)
        cache.load(hashes, [8, 9]).result(30)
        check(workers, [8, 9], new)
        cache.close()


def test_a_load_short_of_blocks_puts_its_victims_into_the_store_before_their_blocks_are_reused(tmp_path):
    """A load that evicts, then finds too few blocks for its store hits, hands the blocks back; the
    write-back of what it evicted must be queued before another thread can take those blocks, or the
    store would keep another block's bytes (under a valid header) for the evicted hash."""
    rng = np.random.default_rng(12)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m/0", capacity=2)
        h1, h2, a, v, w = 301, 302, 303, 304, 305
        want = fill(workers, list(range(5)), rng)       # GPU block i holds the bytes of [h1, h2, a, v, w][i]
        for h, g in ((h1, 0), (h2, 1), (a, 2), (v, 3)):
            cache.store([h], [g]).result(30)            # h1 and h2 go down; the CPU tier holds a and v
        assert backend.store_contains("m/0", [h1, h2]).all()
        real = backend.cpu_to_store

        def meanwhile(namespace, hashes, blocks):       # another engine thread stores before the put is queued
            if v in list(hashes):
                backend.cpu_to_store = real
                cache.store([w], [4]).result(30)
            return real(namespace, hashes, blocks)
        backend.cpu_to_store = meanwhile
        with pytest.raises(TransferError, match="no CPU block free"):
            cache.load([a, h1, h2], [10, 11, 12])       # a is its own, v is evicted: one block for two hits
        backend.cpu_to_store = real
        wait_for(lambda: backend.store_contains("m/0", [v]).all(), 30, "the write-back of v")
        poison(workers, [13], rng)
        cache.load([v], [13]).result(30)                # v comes back from the store, with its own bytes
        check(workers, [13], [w_[3:4] for w_ in want])
        cache.close()


class OnceAfterLock:
    """Stands in for a cache's lock: the first time the cache's method `method` lets it go, action() runs (what
    another thread could do right then)."""

    def __init__(self, cache, method: str, action):
        self.lock, self._method, self._action = cache._lock, method, action
        self.armed = True

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()
        if self.armed and sys._getframe(1).f_code.co_name == self._method:
            self.armed = False
            self._action()


def test_a_write_through_is_put_under_the_namespace_its_block_was_stored_in(tmp_path):
    """The namespace may change the moment the swap-out's callback lets go of the lock: the put must still
    go under the old one (new weights must never find old KV)."""
    rng = np.random.default_rng(13)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m/0", write="through")
        fill(workers, [0], rng)
        lock = cache._lock

        def change():                       # the namespace changes as _write_through's lock is let go
            cache.namespace = "m/1"
        cache._lock = OnceAfterLock(cache, "_write_through", change)
        cache.store([7], [0]).result(30)
        assert cache.namespace == "m/1"
        wait_for(lambda: cache.stats()["l3_written_blocks"] == 1, 30, "the write-through")
        assert backend.store_contains("m/0", [7]).all() and not backend.store_contains("m/1", [7]).any()
        cache._lock = lock
        cache.close()


@pytest.mark.parametrize("closing", ["cache", "backend"])
def test_puts_in_flight_land_before_close_returns(tmp_path, closing):
    """Write-through puts still queued or in flight when the cache (or the backend, with the cache left
    open) is closed are waited for: every object is in the store afterwards, none is reported as failed,
    and the cache's writer thread is gone."""
    spec = small_spec(num_gpu_blocks=64, num_cpu_blocks=64, num_layers=8, head_dim=128)
    url = f"file://{tmp_path}/l3"
    rng = np.random.default_rng(9)
    hashes = list(range(1000, 1048))
    with deployment(spec, tp=2, store=url) as (backend, workers):
        cache = TieredCache(backend, "m", capacity=64, write="through")
        fill(workers, list(range(48)), rng)
        for k in range(0, 48, 8):
            cache.store(hashes[k:k + 8], list(range(k, k + 8))).result(timeout=30)
        writer = cache._l3_writer
        if closing == "cache":
            cache.close()
        else:
            backend.close()
        assert writer is None or not writer.is_alive()
        stats = cache.stats()
        assert stats["l3_written_blocks"] == 48 and stats["l3_errors"] == 0, stats
    with deployment(spec, tp=2, store=url) as (backend, _):
        assert backend.store_contains("m", hashes).all()


def test_flush_waits_for_the_puts_and_reports_what_did_not_land(tmp_path):
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=16)
    with deployment(spec, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=8, write="through")
        fill(workers, [0, 1, 2], np.random.default_rng(10))
        cache.store([1, 2, 3], [0, 1, 2]).result(timeout=30)
        assert cache.flush(timeout=30) == 0
        assert backend.store_contains("m", [1, 2, 3]).all()
        os.rename(tmp_path / "l3", tmp_path / "aside")
        (tmp_path / "l3").write_bytes(b"")          # a file where the store's directory was: puts fail
        try:
            cache.store([4, 5], [3, 4]).result(timeout=30)
            assert cache.flush(timeout=30) == 2
            assert cache.flush(timeout=30) == 0     # counted once
        finally:
            os.remove(tmp_path / "l3")
            os.rename(tmp_path / "aside", tmp_path / "l3")
        with pytest.raises(ValueError, match="timeout"):
            cache.flush(timeout=-1)
        cache.close()


def test_a_store_set_aside_is_probed_and_used_again_as_soon_as_it_answers(tmp_path, monkeypatch):
    """After the pause the store is probed, not used: a lookup while it still fails neither asks it nor
    counts an error (which would start a second pause), and once it answers it is back within a probe
    interval."""
    monkeypatch.setattr(tiered_l3, "L3_BACKOFF", 2.0)
    monkeypatch.setattr(tiered_l3, "L3_PROBE_INTERVAL", 0.1)
    store, aside = tmp_path / "l3", tmp_path / "aside"
    rng = np.random.default_rng(11)
    with deployment(SPEC, tp=2, store=f"file://{store}") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=2)
        fill(workers, [0, 1, 2, 3], rng)
        backend.cpu_to_store("m", [77], [15]).result(timeout=30)      # an object only the store holds
        cache.store([1, 2], [0, 1]).result(timeout=30)
        os.rename(store, aside)
        store.write_bytes(b"")                                          # the store now fails
        cache.store([3, 4], [2, 3]).result(timeout=30)                  # evicts 1, 2: write-back fails
        wait_for(lambda: cache.stats()["l3_errors"] == 1, 30, "the failed write-back")
        time.sleep(2.5)                                                 # the pause is over; probes fail
        assert cache.lookup_tiers([77]) == (0, 0)                       # not asked: still set aside
        assert cache.stats()["l3_errors"] == 1
        os.remove(store)
        os.rename(aside, store)                                         # the store answers again
        fixed = time.monotonic()
        wait_for(lambda: cache.lookup_tiers([77]) == (1, 1), 10, "the store back in use")
        print(f"store back in use {time.monotonic() - fixed:.2f} s after it answered")
        assert cache.stats()["l3_errors"] == 1
        cache.close()


def test_a_store_task_failed_by_a_lost_rank_is_not_a_store_error(tmp_path, monkeypatch):
    """A put failed because the engine lost a rank (restart_rank, a dead process) does not set the
    store aside; one that a rank failed itself does."""
    from fastcache.engine.handle import TransferHandle
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=4, write="through")
        fill(workers, [0, 1], np.random.default_rng(12))
        handles = []

        def held_put(namespace, keys, blocks):
            handles.append(TransferHandle(10_000 + len(handles), "CPU_TO_STORE", [0, 1], 2 * len(keys)))
            return handles[-1]
        monkeypatch.setattr(backend, "cpu_to_store", held_put)
        cache.store([1], [0]).result(timeout=30)
        wait_for(lambda: handles, 30, "the write-through put")
        handles[0].rank_finished(0, "rank 0 was restarted (restart_rank)", lost=True)
        handles[0].rank_finished(1, nbytes=1)
        assert handles[0].ranks_lost and cache.stats()["l3_errors"] == 0
        cache.store([2], [1]).result(timeout=30)
        wait_for(lambda: len(handles) == 2, 30, "the next write-through, the store still in use")
        handles[1].rank_finished(0, "OSError: disk full")
        handles[1].rank_finished(1, nbytes=1)
        assert not handles[1].ranks_lost and cache.stats()["l3_errors"] == 1
        monkeypatch.undo()
        cache.close()


def test_a_fetch_failed_by_a_lost_rank_is_not_a_store_error(tmp_path, monkeypatch):
    """A load's fetch failed because the engine lost a rank (restart_rank, a dead process) fails the load but
    does not set the store aside, as for a put; a store error of any rank does, even beside another rank's miss."""
    from fastcache.engine.handle import TransferHandle
    from fastcache.store.base import MISS
    rng = np.random.default_rng(13)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=4)
        fill(workers, [0, 1], rng)
        cpu = backend.allocate_cpu_blocks(2)
        backend.swap_out([0, 1], cpu).result(timeout=30)
        hashes = [int(h) for h in rng.integers(0, 2**63, 2)]
        backend.cpu_to_store("m", hashes, cpu).result(timeout=30)           # objects only the store holds
        handles = []

        def held_fetch(namespace, keys, blocks):
            handles.append(TransferHandle(10_000 + len(handles), "STORE_TO_CPU", [0, 1], 2 * len(keys)))
            return handles[-1]
        monkeypatch.setattr(backend, "store_to_cpu", held_fetch)
        load = cache.load(hashes[:1], [5])
        handles[0].rank_finished(0, "rank 0 was restarted (restart_rank)", lost=True)
        handles[0].rank_finished(1, nbytes=1)
        with pytest.raises(TransferError, match="restart_rank"):
            load.result(timeout=30)
        assert handles[0].ranks_lost and cache.stats()["l3_errors"] == 0
        assert cache.lookup_tiers(hashes) == (2, 2)                         # the store is still asked
        load = cache.load(hashes[1:], [6])          # one rank's object is missing, the other's read fails
        handles[1].rank_finished(0, f"StoreError: {MISS}: store file://...: 1 of 1 objects missing")
        handles[1].rank_finished(1, "StoreError: store file://...: reading ... failed: I/O error")
        with pytest.raises(TransferError, match="I/O error"):
            load.result(timeout=30)
        assert not handles[1].ranks_lost and cache.stats()["l3_errors"] == 1
        monkeypatch.undo()
        cache.close()


def test_an_l3_load_refreshes_the_held_hashes_it_loads_not_only_the_fetched_ones(tmp_path):
    """Under lru, a load of a held hash and a store-only one is one store of both to the policy: the held
    one is refreshed, so the next eviction takes the least recently used other hash. Worked by hand,
    capacity 4: stored 9, 1, 2, 3, 4 (9 evicted into the store); load [1, 9] fetches 9 into 2's block;
    order now 3, 4, then 1 and 9; a store of 5 evicts 3 (were 1 not refreshed: 1)."""
    rng = np.random.default_rng(47)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "refresh", capacity=4, write="through", policy="lru")
        try:
            want = fill(workers, list(range(6)), rng)
            for gpu, h in enumerate([9, 1, 2, 3, 4]):
                cache.store([h], [gpu]).result(timeout=30)
                assert cache.flush(timeout=30) == 0                 # its put landed: its block can go
            assert cache.stats()["l3_written_blocks"] == 5
            assert cache.lookup_tiers([1, 2, 3, 4]) == (4, 0) and cache.lookup_tiers([9]) == (1, 1)
            poison(workers, [10, 11], rng)
            cache.load([1, 9], [10, 11]).result(timeout=30)
            check(workers, [10, 11], [w[[1, 0]] for w in want])
            assert cache.lookup_tiers([2]) == (1, 1)                # its block went to the fetch
            cache.store([5], [5]).result(timeout=30)
            assert cache.stats()["store_full"] == 0
            assert cache.lookup_tiers([3]) == (1, 1), "the least recently used hash was not the one evicted"
            assert cache.lookup_tiers([1, 9, 4, 5]) == (4, 0)
        finally:
            cache.close(timeout=10)


def test_a_write_through_held_up_across_a_clear_never_puts_the_reused_block_under_the_old_namespace(tmp_path):
    """The write-through thread may be held up between queuing a put and submitting it for as long as a clear,
    a restore and a store under the new namespace take: the put must then be refused, never read the block
    the allocator's reset gave to a new entry and publish its bytes (new weights' KV) under the old namespace."""
    rng = np.random.default_rng(21)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m/0", capacity=4, write="through")
        old = fill(workers, [0], rng)
        reached, go, quiet = threading.Event(), threading.Event(), threading.Event()
        put = backend.cpu_to_store

        def held_up(*args):         # the writer thread stops right before it submits its put
            if threading.current_thread().name == "fastcache-l3-writer" and not reached.is_set():
                reached.set()
                assert go.wait(60)
            return put(*args)
        backend.cpu_to_store = held_up
        wait_quiet = cache.wait_quiet

        def watched(timeout):
            quiet.set()
            return wait_quiet(timeout)
        cache.wait_quiet = watched
        cache.store([7], [0]).result(30)
        assert reached.wait(30)
        clearing = threading.Thread(target=lambda: (backend.clear_caches(60), backend.restore_caches(60)))
        clearing.start()
        wait_for(lambda: quiet.is_set() or not clearing.is_alive(), 60, "the clear")
        if quiet.is_set():          # the clear waits for the cache's put: it is refused, the clear goes on
            go.set()
        clearing.join(60)
        assert not clearing.is_alive()
        cache.namespace = "m/1"
        new = fill(workers, [1], rng)
        assert not np.array_equal(new[0], old[0])
        cache.store([8], [1]).result(30)            # the reset allocator gave block 0 to it
        go.set()
        cache.flush(30)
        if backend.store_contains("m/0", [7]).any():    # a put that landed holds the old bytes, on every rank
            reader = TieredCache(backend, "m/0", capacity=2)
            dst = [20]
            poison(workers, dst, rng)
            reader.load([7], dst).result(30)
            loaded = [cpu_image(w, dst) for w in workers]
            assert not all(np.array_equal(a, b) for a, b in zip(loaded, new)), "the new weights' KV under m/0"
            check(workers, dst, old)
            reader.close()
        cache.close()


def test_a_write_through_queued_as_the_cache_closes_lets_go_of_its_pins_and_blocks(tmp_path):
    """close() may run the moment a swap-out's callback has pinned its entries for a put and let go of the
    lock, before the write-through thread exists: the put must still be made (or given up), and its entries'
    pins, the call count a clear waits on and the quota's blocks must not stay taken for ever."""
    rng = np.random.default_rng(22)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        total = backend.allocator.num_free
        cache = TieredCache(backend, "m/0", capacity=4, write="through")
        fill(workers, [0], rng)
        lock = cache._lock
        # close(timeout=0) as _write_through's lock is let go
        cache._lock = hook = OnceAfterLock(cache, "_write_through", lambda: cache.close(timeout=0))
        cache.store([7], [0]).result(30)
        assert not hook.armed
        wait_for(lambda: backend.allocator.num_free == total, 30, "the quota's blocks back in the allocator")
        assert cache.wait_quiet(0)
        cache._lock = lock


def test_a_write_back_the_deployment_cannot_submit_for_a_lost_rank_does_not_set_the_store_aside(tmp_path):
    """With a transfer manager dead, the backend refuses to submit a put (TransferError naming the rank): the
    store was never asked, so it stays in use once the rank is restarted."""
    rng = np.random.default_rng(23)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=2)
        want = fill(workers, [0, 1, 2, 3, 4], rng)
        cache.store([1, 2], [0, 1]).result(timeout=30)
        cache.flush(30)
        os.kill(backend.transfer_pids[1], signal.SIGKILL)
        wait_for(lambda: 1 in backend.failed_ranks, 30, "the lost rank")
        with pytest.raises(TransferError, match="rank 1"):
            cache.store([3], [2]).result(timeout=30)        # evicts 2: its write-back cannot be submitted
        backend.restart_rank(1, timeout=30)
        assert cache.flush(30) == 1                         # 2 did not land
        assert cache.stats()["l3_errors"] == 0
        cache.store([4, 5], [3, 4]).result(timeout=30)      # the store still in use: 1 goes down to it
        assert cache.flush(30) == 0
        assert cache.lookup_tiers([1, 4, 5]) == (3, 1)
        poison(workers, [6], rng)
        cache.load([1], [6]).result(timeout=30)
        check(workers, [6], [w[:1] for w in want])
        cache.close()


def test_a_write_through_the_deployment_cannot_submit_for_a_lost_rank_does_not_set_the_store_aside(tmp_path):
    rng = np.random.default_rng(24)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=4, write="through")
        fill(workers, [0, 1], rng)
        reached, go, failed = threading.Event(), threading.Event(), []
        put = backend.cpu_to_store

        def held_up(*args):         # the rank dies while the writer thread is about to submit its put
            if not reached.is_set():
                reached.set()
                assert go.wait(60)
            try:
                return put(*args)
            except TransferError as exc:
                failed.append(exc)
                raise
        backend.cpu_to_store = held_up
        cache.store([1], [0]).result(timeout=30)
        assert reached.wait(30)
        os.kill(backend.transfer_pids[1], signal.SIGKILL)
        wait_for(lambda: 1 in backend.failed_ranks, 30, "the lost rank")
        go.set()
        assert cache.flush(30) == 1 and "rank 1" in str(failed[0])
        backend.restart_rank(1, timeout=30)
        assert cache.stats()["l3_errors"] == 0
        cache.store([2], [1]).result(timeout=30)        # the store still in use: written through
        assert cache.flush(30) == 0
        assert backend.store_contains("m", [1, 2]).tolist() == [False, True]
        cache.close()


def test_a_load_whose_hashes_finish_storing_as_it_starts_loads_them_while_the_store_is_set_aside(tmp_path):
    """load() asks the CPU tier whether it holds every hash, then (when not) looks again under the lock before
    going to the store: a store that completes in between leaves nothing to fetch, and the load must serve
    the CPU tier's blocks even while the store is set aside (it raised IndexError)."""
    from fastcache.engine.handle import TransferHandle
    from fastcache.ipc import protocol
    rng = np.random.default_rng(25)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "m", capacity=4)
        want = fill(workers, [0], rng)
        asked = backend.store_contains

        def down(*args):
            raise TransferError("store down")
        backend.store_contains = down
        assert cache.lookup([9]) == 0               # the store is set aside
        backend.store_contains = asked
        assert cache.stats()["l3_errors"] == 1
        swap, held = backend.submit_checked_swap, []

        def held_out(kind, gpu, cpu, fences=()):    # the swap-out runs; its handle completes when the test says
            real = swap(kind, gpu, cpu, fences)
            if kind != protocol.SWAP_TO_CPU:
                return real
            held.append((real, TransferHandle(real.task_id, kind, range(2), real.nbytes)))
            return held[-1][1]
        backend.submit_checked_swap = held_out
        cache.store([7], [0])
        backend.submit_checked_swap = swap
        lock = cache._lock

        def stored():                   # the store completes as load()'s first look lets go of the lock
            real, fake = held[0]
            real.result(30)
            for r in range(2):
                fake.rank_finished(r, nbytes=real.nbytes // 2)
        cache._lock = hook = OnceAfterLock(cache, "_l2_holds", stored)
        dst = [10]
        poison(workers, dst, rng)
        cache.load([7], dst).result(30)
        assert not hook.armed
        cache._lock = lock
        check(workers, dst, want)
        cache.close()
