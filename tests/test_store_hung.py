"""A hung store costs only itself (docs/design.md §8): with the Mooncake master or memory server stopped
(SIGSTOP: a stalled or partitioned host), a lookup returns within its bound, no other thread of the engine
process stalls, the store is set aside, and swaps go on meanwhile and after it resumes."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

if os.environ.get("FASTCACHE_REQUIRE_MOONCAKE") == "1":
    import mooncake.store  # noqa: F401  (fail loudly: CI installs it)
else:
    pytest.importorskip("mooncake.store", reason="Mooncake not installed (pip install 'fastcache[mooncake]')")

from conftest import deployment, round_trip, small_spec, wait_for
from fastcache import TieredCache
from fastcache.engine import tiered_l3
from fastcache.store.remote import QUERY_TIMEOUT
from fastcache.store.service import MooncakeService
from test_tiered_l3 import check, fill, poison

SPEC = small_spec(num_cpu_blocks=32)


class GapMeter:
    """A thread of the engine process that notes the longest time it could not run."""

    def __init__(self):
        self.longest, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        last = time.monotonic()
        while not self._stop.wait(0.01):
            now = time.monotonic()
            self.longest, last = max(self.longest, now - last), now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.fixture
def quick_probe(monkeypatch):
    monkeypatch.setattr(tiered_l3, "L3_BACKOFF", 1.0)
    monkeypatch.setattr(tiered_l3, "L3_PROBE_INTERVAL", 0.2)


def test_a_hung_master_costs_a_lookup_its_bound_and_stalls_no_thread_of_the_engine(quick_probe):
    rng = np.random.default_rng(50)
    with MooncakeService(segment_mb=64) as svc, deployment(SPEC, tp=2, store=svc.url) as (backend, workers):
        cache = TieredCache(backend, "hung/master", capacity=8, write="through")
        try:
            want = fill(workers, list(range(8)), rng)
            cache.store([1, 2, 3, 4], [0, 1, 2, 3]).result(timeout=30)
            wait_for(lambda: cache.stats()["l3_written_blocks"] == 4, 30, "the write-through puts")
            pids = backend.transfer_pids
            svc.suspend("master")
            try:
                with GapMeter() as gaps:
                    began = time.monotonic()
                    assert cache.lookup_tiers([1, 2, 50, 51]) == (2, 0)     # the store is asked, and hangs
                    took = time.monotonic() - began
                    round_trip(backend, workers, rng)                   # swaps go on while it hangs
                    cache.store([5, 6], [4, 5]).result(timeout=30)
                    poison(workers, [10, 11], rng)
                    cache.load([5, 6], [10, 11]).result(timeout=30)
                    check(workers, [10, 11], [w[4:6] for w in want])
                print(f"lookup against a hung master: {took:.2f} s; "
                      f"longest stall of another thread {gaps.longest:.2f} s")
                assert took < QUERY_TIMEOUT + 1.0, "a lookup against a hung store outlived its bound"
                assert gaps.longest < 1.0, f"the engine's other threads stalled {gaps.longest:.1f} s"
                assert cache.stats()["l3_errors"] >= 1
                assert cache.lookup_tiers([1, 2, 50]) == (2, 0)         # set aside: not asked again
            finally:
                svc.resume("master")
            # the store comes back: the probe finds it, and its objects are served again
            cache.store([7, 8, 9, 10, 11, 12], [6, 7, 0, 1, 2, 3]).result(timeout=30)    # evicts 1..4 from L2
            wait_for(lambda: cache.lookup_tiers([1, 2]) == (2, 2), 60, "the resumed store in use again")
            poison(workers, [12, 13], rng)
            cache.load([1, 2], [12, 13]).result(timeout=30)
            check(workers, [12, 13], [w[0:2] for w in want])
            round_trip(backend, workers, rng)
            assert backend.transfer_pids == pids            # no transfer manager was lost on the way
        finally:
            cache.close(timeout=10)


def test_a_hung_memory_server_stalls_no_swap_and_its_objects_serve_again_once_it_resumes(quick_probe):
    rng = np.random.default_rng(51)
    with MooncakeService(segment_mb=64) as svc, deployment(SPEC, tp=2, store=svc.url) as (backend, workers):
        cache = TieredCache(backend, "hung/server", capacity=8, write="through")
        try:
            want = fill(workers, list(range(8)), rng)
            cache.store([1, 2], [0, 1]).result(timeout=30)
            wait_for(lambda: cache.stats()["l3_written_blocks"] == 2, 30, "the write-through puts")
            pids = backend.transfer_pids
            svc.suspend("server")
            try:
                with GapMeter() as gaps:
                    cache.store([3, 4], [2, 3]).result(timeout=30)     # their puts wait on the stopped server
                    began = time.monotonic()
                    for _ in range(3):
                        round_trip(backend, workers, rng)               # swaps go on meanwhile
                    assert time.monotonic() - began < 10
                    assert cache.lookup_tiers([3, 4, 60]) == (2, 0)
                assert gaps.longest < 1.0, f"the engine's other threads stalled {gaps.longest:.1f} s"
            finally:
                svc.resume("server")
            assert cache.flush(timeout=90) in (0, 2)         # the stalled puts land, or fail and are reported
            cache.store([5, 6, 7, 8, 9, 10], [4, 5, 6, 7, 0, 1]).result(timeout=30)     # evicts 1, 2 from L2
            wait_for(lambda: cache.lookup_tiers([1, 2]) == (2, 2), 90, "the resumed store in use again")
            poison(workers, [12, 13], rng)
            cache.load([1, 2], [12, 13]).result(timeout=60)
            check(workers, [12, 13], [w[0:2] for w in want])
            assert backend.transfer_pids == pids
        finally:
            cache.close(timeout=10)


def test_close_keeps_its_timeout_with_puts_stuck_on_a_hung_store():
    """Write-through puts wait on a stopped memory server (Mooncake gives up after STALL_TIMEOUT_S):
    close(timeout) still returns in time, reports them as not landed, and leaves no process or segment behind."""
    rng = np.random.default_rng(52)
    with MooncakeService(segment_mb=64) as svc:
        try:
            with deployment(SPEC, tp=2, store=svc.url) as (backend, workers):
                cache = TieredCache(backend, "hung/close", capacity=8, write="through")
                fill(workers, list(range(4)), rng)
                cache.store([1], [0]).result(timeout=30)
                wait_for(lambda: cache.stats()["l3_written_blocks"] == 1, 30, "the first put")
                svc.suspend("server")
                cache.store([2, 3, 4], [1, 2, 3]).result(timeout=30)      # their puts hang
                with pytest.raises(ValueError, match="close timeout"):
                    backend.close(timeout=-1)
                began = time.monotonic()
                backend.close(timeout=4)
                took = time.monotonic() - began
                print(f"close with puts stuck on a hung store: {took:.2f} s")
                assert took < 4 + 2.0
                assert not backend.running
        finally:
            svc.resume("server")


def test_a_hung_memory_server_fails_the_store_task_within_its_bound_and_swaps_go_on():
    """A fetch whose data waits on a stopped memory server fails within Mooncake's stall timeouts as
    fastcache sets them (STALL_TIMEOUT_S, not its default 30 s), as that store task's error naming the
    store; swaps go on meanwhile, and once the server resumes the same objects fetch byte for byte."""
    from fastcache.errors import TransferError
    from fastcache.store.mooncake import STALL_TIMEOUT_S
    rng = np.random.default_rng(53)
    with MooncakeService(segment_mb=64) as svc, deployment(SPEC, tp=2, store=svc.url) as (backend, workers):
        want = fill(workers, [0, 1, 2], rng)
        src, dst = backend.allocate_cpu_blocks(3), backend.allocate_cpu_blocks(3)
        hashes = [int(h) for h in rng.integers(0, 2**63, 3)]
        backend.swap_out([0, 1, 2], src).result(timeout=30)
        backend.cpu_to_store("hung/task", hashes, src).result(timeout=30)
        pids = backend.transfer_pids
        svc.suspend("server")
        try:
            fetch = backend.store_to_cpu("hung/task", hashes, dst)
            for _ in range(3):
                round_trip(backend, workers, rng)                   # swaps go on meanwhile
            with pytest.raises(TransferError, match=f"store {svc.url}: get of .* TRANSFER_FAIL"):
                fetch.result(timeout=STALL_TIMEOUT_S + 15)          # well before Mooncake's own 30 s
        finally:
            svc.resume("server")
        for r in range(2):
            backend.cpu_tier(r)[dst] = rng.integers(0, 256, backend.cpu_tier(r)[dst].shape, dtype=np.uint8)
        backend.store_to_cpu("hung/task", hashes, dst).result(timeout=60)
        for r in range(2):
            np.testing.assert_array_equal(backend.cpu_tier(r)[dst], want[r])
        assert backend.transfer_pids == pids
