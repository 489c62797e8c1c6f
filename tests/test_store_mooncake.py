"""The L3 tier in Mooncake Store: a real master and memory server on free loopback ports, started by the
tests and stopped after them. Skips where Mooncake is not installed, unless FASTCACHE_REQUIRE_MOONCAKE=1
(CI sets it, so that a broken install fails instead of skipping)."""
from __future__ import annotations

import dataclasses
import os
import threading
import time
import urllib.request

import numpy as np
import pytest

if os.environ.get("FASTCACHE_REQUIRE_MOONCAKE") == "1":
    import mooncake.store  # noqa: F401  (fail loudly: CI installs it)
else:
    pytest.importorskip("mooncake.store", reason="Mooncake not installed (pip install 'fastcache[mooncake]')")

from conftest import deployment, round_trip, small_spec, wait_for
from fastcache import TieredCache, TransferError
from fastcache.metrics import serve
from fastcache.store import ObjectKeys, StoreError, as_hashes, fingerprint, open_store
from fastcache.store import mooncake as mooncake_store
from fastcache.store.keys import HEADER_BYTES
from fastcache.store.service import MooncakeService, free_port
from store_peer import run_peer
from test_store import kill_during_put

SPEC = small_spec(num_cpu_blocks=32)


@pytest.fixture(scope="module")
def service():
    with MooncakeService(segment_mb=256) as svc:
        yield svc


@pytest.fixture
def store(service):
    blocks = np.random.default_rng(3).integers(1, 256, (SPEC.num_cpu_blocks, SPEC.cpu_block_stride), dtype=np.uint8)
    s = open_store(service.url)
    s.attach(blocks, SPEC.cpu_block_bytes)
    yield s
    s.close()


def keys(namespace, rank=0, spec=SPEC, tp=1):
    return ObjectKeys(namespace, fingerprint(spec, tp), rank)


def unique(prefix):
    return f"{prefix}/{time.monotonic_ns()}"        # the module's tests share one store


def test_round_trip_in_place_of_random_blocks(store):
    tier, ns = store.tier, unique("rt")
    k = keys(ns)
    hashes = as_hashes(np.random.default_rng(4).integers(0, 2**63, 10))
    want = tier[:10].copy()
    store.put(k, hashes, np.arange(10))
    assert store.exists(k, hashes).all()
    tier[10:20] = 0
    assert store.get(k, hashes, np.arange(10, 20)).all()
    np.testing.assert_array_equal(tier[10:20], want)
    for other in (keys(unique("other")), keys(ns, rank=1), keys(ns, tp=2),
                  keys(ns, spec=dataclasses.replace(SPEC, head_dim=16))):
        assert not store.exists(other, hashes).any()
        assert not store.get(other, hashes, np.arange(20, 30)).any()
    store.remove(k, hashes[:4])
    np.testing.assert_array_equal(store.exists(k, hashes), [False] * 4 + [True] * 6)


def test_a_task_in_several_parts_round_trips_and_reports_each_miss_in_place(store, monkeypatch):
    """Large tasks go to Mooncake in parts (checksums of one overlap the next one's transfer)."""
    monkeypatch.setattr(mooncake_store, "BATCH_OBJECTS", 3)
    assert len(store._chunks(10)) == 4
    tier, k = store.tier, keys(unique("parts"))
    hashes = as_hashes(range(100, 110))
    want = tier[:10].copy()
    store.put(k, hashes, np.arange(10))
    store.remove(k, hashes[[4, 8]])
    tier[10:20] = 0
    hits = store.get(k, hashes, np.arange(10, 20))
    np.testing.assert_array_equal(hits, ~np.isin(np.arange(10), [4, 8]))
    np.testing.assert_array_equal(tier[10:20][hits], want[hits])


@pytest.fixture
def raw(service):
    """A plain Mooncake client, to put objects that fastcache would never write."""
    from mooncake.store import MooncakeDistributedStore
    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", service.url[len("mooncake://"):]) == 0
    yield client
    client.close()


def test_a_failed_part_raises_only_once_no_part_is_in_flight(store, monkeypatch):
    """A fetch still writing into CPU blocks after its task failed would corrupt blocks handed out again:
    the part in flight when an earlier one fails is waited for."""
    monkeypatch.setattr(mooncake_store, "BATCH_OBJECTS", 2)
    k = keys(unique("fail"))
    hashes = as_hashes(range(200, 208))
    store.put(k, hashes, np.arange(8))
    real, calls, running = store._client, [], []

    class SecondPartFails:
        def __getattr__(self, name):
            return getattr(real, name)

        def batch_get_into(self, names, ptrs, sizes):
            calls.append(names)
            running.append(names)
            try:
                time.sleep(0.2)
                codes = real.batch_get_into(names, ptrs, sizes)
                return [-900] * len(codes) if len(calls) == 2 else codes
            finally:
                running.remove(names)
    monkeypatch.setattr(store, "_client", SecondPartFails())
    with pytest.raises(StoreError, match="RPC_FAIL"):
        store.get(k, hashes, np.arange(10, 18))
    assert len(calls) == 3 and not running      # the third part had started, and had finished


def test_an_object_is_one_buffer_of_the_tier_the_block_then_its_header(store, raw):
    """Put from and fetched into [CPU block, the slot after it]: Mooncake holds exactly the block's bytes and
    its header, and nothing but the named blocks and their slots changes."""
    tier, k = store.tier, keys(unique("one"))
    hashes = as_hashes([7, 8])
    before = store.blocks.copy()
    store.put(k, hashes, np.array([2, 3]))
    assert raw.get(k.name(7)) == k.object(7, tier[2]) and raw.get(k.name(8)) == k.object(8, tier[3])
    assert store.get(k, hashes, np.array([5, 4])).all()
    np.testing.assert_array_equal(tier[[5, 4]], before[[2, 3], :SPEC.cpu_block_bytes])
    changed = np.flatnonzero((store.blocks != before).any(axis=1))
    assert set(changed.tolist()) <= {2, 3, 4, 5}
    np.testing.assert_array_equal(tier[:6], np.concatenate([before[:4], before[[3, 2]]])[:, :SPEC.cpu_block_bytes])


@pytest.mark.parametrize("damage", ["flip_payload", "foreign", "short", "long", "garbage"])
def test_corrupt_or_foreign_object_is_a_miss_and_is_replaced(store, raw, damage):
    tier, k = store.tier, keys(unique("bad"))
    good = k.object(5, tier[0])
    if damage == "flip_payload":
        obj = bytearray(good)
        obj[3] ^= 0x10
    elif damage == "foreign":                                  # hash 6's object under hash 5's key
        obj = k.object(6, tier[0])
    elif damage == "short":
        obj = good[:-100]
    elif damage == "long":
        obj = good + b"x" * 100
    else:
        obj = np.random.default_rng(1).integers(0, 256, len(good), dtype=np.uint8).tobytes()
    assert raw.put(k.name(5), bytes(obj)) == 0
    assert store.exists(k, as_hashes([5])).all()
    tier[1] = 0
    assert not store.get(k, as_hashes([5]), np.array([1])).any()
    assert not store.exists(k, as_hashes([5])).any()           # removed, so that a put can replace it
    store.put(k, as_hashes([5]), np.array([0]))
    assert store.get(k, as_hashes([5]), np.array([1])).all()
    np.testing.assert_array_equal(tier[1], tier[0])


def test_two_deployments_share_blocks_through_mooncake(service):
    spec, ns = dataclasses.asdict(SPEC), unique("llama")
    hashes = [int(h) for h in np.random.default_rng(8).integers(0, 2**63, 8)]
    put = run_peer(url=service.url, namespace=ns, spec=spec, tp=2, mode="put", hashes=hashes)
    assert put["present"] == [True] * 8
    # the first deployment has exited: its blocks live on in the store's memory server
    got = run_peer(url=service.url, namespace=ns, spec=spec, tp=2, mode="get", hashes=hashes)
    assert got.get("error") is None and got["verified_bytes"] == 8 * 2 * SPEC.cpu_block_bytes
    other_ns = run_peer(url=service.url, namespace=ns + "-next", spec=spec, tp=2, mode="get", hashes=hashes)
    assert other_ns["present"] == [False] * 8 and "8 of 8 objects missing" in other_ns["error"]
    other_geometry = run_peer(url=service.url, namespace=ns, spec={**spec, "num_kv_heads": 4}, tp=2, mode="get",
                              hashes=hashes)
    assert other_geometry["present"] == [False] * 8 and "missing" in other_geometry["error"]


def test_transfer_manager_killed_during_a_put_leaves_no_visible_entry(service):
    # parts of 1 MiB (16 blocks): a put becomes visible part by part, so the kill lands in the middle
    kill_during_put(service.url + "?batch_mb=1")


def test_unreachable_master_fails_l3_by_name_within_bounded_time():
    url = f"mooncake://127.0.0.1:{free_port()}"        # nothing listens there
    with deployment(SPEC, tp=1, store=url) as (backend, workers):
        cpu = backend.allocate_cpu_blocks(1)
        start = time.monotonic()
        with pytest.raises(TransferError, match=f"store {url}: cannot connect to the Mooncake master"):
            backend.cpu_to_store("m", [1], cpu).result(timeout=30)
        with pytest.raises(StoreError, match=f"store {url}"):
            backend.store_contains("m", [1])
        assert time.monotonic() - start < 20
        round_trip(backend, workers, np.random.default_rng(0))       # L2 serves regardless


def test_master_killed_fails_l3_by_name_then_a_restarted_master_is_used_again():
    rng = np.random.default_rng(21)
    with MooncakeService(segment_mb=64) as svc, deployment(SPEC, tp=2, store=svc.url) as (backend, workers):
        cpu = backend.allocate_cpu_blocks(4)
        for r in range(2):
            backend.cpu_tier(r)[cpu] = rng.integers(1, 256, (4, SPEC.cpu_block_bytes), dtype=np.uint8)
        want = [backend.cpu_tier(r)[cpu].copy() for r in range(2)]
        backend.cpu_to_store("m", [1, 2, 3, 4], cpu).result(timeout=30)
        assert backend.store_contains("m", [1, 2, 3, 4]).all()

        svc.kill_master()
        start = time.monotonic()
        for call in (lambda: backend.cpu_to_store("m", [5, 6], cpu[:2]).result(timeout=60),
                     lambda: backend.store_to_cpu("m", [1, 2], cpu[2:]).result(timeout=60),
                     lambda: backend.store_contains("m", [1, 2])):
            t = time.monotonic()
            with pytest.raises(TransferError, match=f"store {svc.url}.*RPC_FAIL"):
                call()
            assert time.monotonic() - t < 15, "an L3 call with the master down must fail within seconds"
            round_trip(backend, workers, rng, n=3)          # L2 keeps serving between the failures
        assert time.monotonic() - start < 45

        svc.start_master()      # a fresh master knows no objects; the memory server mounts again
        deadline = time.monotonic() + 60
        while True:
            try:
                backend.cpu_to_store("m", [7, 8, 9, 10], cpu).result(timeout=60)
                if backend.store_contains("m", [7, 8, 9, 10]).all():
                    break
            except TransferError:
                pass
            assert time.monotonic() < deadline, "the restarted master was not used again"
            time.sleep(0.5)
        for r in range(2):
            backend.cpu_tier(r)[cpu] = 0
        backend.store_to_cpu("m", [7, 8, 9, 10], cpu).result(timeout=60)
        for r in range(2):
            np.testing.assert_array_equal(backend.cpu_tier(r)[cpu], want[r])


# -- TieredCache over Mooncake ---------------------------------------------------------------------------
def test_tiered_cache_writes_back_and_loads_through_mooncake(service):
    from test_tiered_l3 import write_back_then_load
    write_back_then_load(service.url)


def test_tiered_cache_keeps_serving_from_the_cpu_tier_with_the_master_dead():
    from fastcache import TieredCache
    from test_tiered_l3 import check, fill, poison
    rng = np.random.default_rng(30)
    with MooncakeService(segment_mb=64) as svc, deployment(SPEC, tp=2, store=svc.url) as (backend, workers):
        cache = TieredCache(backend, "m", capacity=4)
        want = fill(workers, list(range(8)), rng)
        cache.store([1, 2, 3, 4], [0, 1, 2, 3]).result(timeout=30)
        svc.kill_master()
        start = time.monotonic()
        cache.store([5, 6], [4, 5]).result(timeout=60)         # evicts 3, 4: their write-back fails
        cache.store([7, 8], [6, 7]).result(timeout=60)
        assert time.monotonic() - start < 20
        wait_for_errors = time.monotonic() + 30
        while cache.stats()["l3_errors"] == 0:
            assert time.monotonic() < wait_for_errors, "the dead master was never noticed"
            time.sleep(0.05)
        assert cache.lookup_tiers([5, 6, 7, 8]) == (4, 0)
        assert cache.lookup_tiers([1, 2]) == (0, 0)             # the store is set aside, not asked
        poison(workers, [10, 11, 12, 13], rng)
        cache.load([5, 6, 7, 8], [10, 11, 12, 13]).result(timeout=30)
        check(workers, [10, 11, 12, 13], [w[4:] for w in want])
        cache.close()


def test_tiered_cache_uses_a_restarted_master_once_a_probe_reaches_it(monkeypatch):
    """Master killed: the cache sets the store aside. Restarted: the probe after the pause reaches it, and
    the cache uses it again without a second pause (no error counted after the restart)."""
    from fastcache.engine import tiered_l3
    monkeypatch.setattr(tiered_l3, "L3_BACKOFF", 2.0)
    monkeypatch.setattr(tiered_l3, "L3_PROBE_INTERVAL", 0.2)
    with MooncakeService(segment_mb=64) as svc, deployment(SPEC, tp=2, store=svc.url) as (backend, workers):
        cache = TieredCache(backend, "m", capacity=4)
        svc.kill_master()
        cache.lookup_tiers([1, 2])                  # the CPU tier misses: the store is asked, and fails
        assert cache.stats()["l3_errors"] == 1
        svc.start_master()
        restarted = time.monotonic()
        cpu = backend.allocate_cpu_blocks(1)
        wait_for(lambda: _put_succeeds(backend, cpu), 60, "a put to the restarted master")
        wait_for(lambda: cache.lookup_tiers([99]) == (1, 1), 30, "the cache using the restarted master")
        print(f"store back in the cache {time.monotonic() - restarted:.1f} s after the master restarted")
        assert cache.stats()["l3_errors"] == 1
        cache.close()


def _put_succeeds(backend, cpu) -> bool:
    """A put that landed: a restarted master skips puts until the memory server has mounted its memory again."""
    try:
        return backend.cpu_to_store("m", [99], cpu).result(timeout=60).skipped == 0
    except TransferError:
        return False


def test_a_full_store_skips_puts_instead_of_failing_them():
    """A cache's store is full most of the time: a put that finds no room is a later miss, never an error
    (an error would set the store aside for every lookup and load)."""
    spec = small_spec(num_layers=8, block_size=32, num_kv_heads=4, head_dim=128, num_gpu_blocks=8,
                      num_cpu_blocks=64)                # 512 KiB blocks: 32 MiB of them for a 16 MiB store
    rng = np.random.default_rng(21)
    with MooncakeService(segment_mb=16) as svc, deployment(spec, tp=1, store=svc.url) as (backend, _):
        tier = backend.cpu_tier(0)
        tier[:] = rng.integers(1, 256, tier.shape, dtype=np.uint8)
        want = tier.copy()
        hashes = [int(h) for h in rng.integers(0, 2**63, 64)]
        backend.cpu_to_store("full", hashes, range(64)).result(timeout=60)
        held = np.flatnonzero(backend.store_contains("full", hashes))
        assert 0 < len(held) < 64
        tier[held] = 0
        backend.store_to_cpu("full", [hashes[i] for i in held], held).result(timeout=60)
        np.testing.assert_array_equal(tier[held], want[held])


def test_a_pool_with_no_memory_counts_its_skipped_puts_and_says_why(capfd):
    """A master with no memory server: every put is skipped. The task succeeds (a skipped put is a later
    miss), but nothing counts the skipped puts as written: not the handle's bytes, not the swap metrics, not
    TieredCache's l3 counters, which count them as l3_skipped_blocks (also on the metrics endpoint); and the
    transfer managers log one WARNING naming the likely cause."""
    spec = small_spec(num_cpu_blocks=16, num_gpu_blocks=16)
    with MooncakeService(segment_mb=0) as svc, deployment(spec, tp=2, store=svc.url) as (backend, workers):
        assert svc.server is None
        hashes = [int(h) for h in np.random.default_rng(4).integers(0, 2**63, 4)]
        handle = backend.cpu_to_store("empty-pool", hashes, range(4)).result(timeout=60)
        assert (handle.nbytes, handle.skipped) == (0, 4)
        assert backend.counters.snapshot()["bytes"]["to_store"] == 0
        assert not backend.store_contains("empty-pool", hashes).any()

        cache = TieredCache(backend, "empty-pool/tiered", capacity=8, write="through")
        try:
            cache.store([11, 12, 13], [1, 2, 3]).result(timeout=30)
            wait_for(lambda: cache.stats()["l3_skipped_blocks"] == 3, 30, "the skipped write-through")
            stats = cache.stats()
            assert (stats["l3_written_blocks"], stats["l3_written_bytes"], stats["l3_errors"]) == (0, 0, 0)
            server = serve(0, backend, [cache])
            try:
                text = urllib.request.urlopen(f"http://{server.host}:{server.port}/metrics", timeout=10).read()
            finally:
                server.close()
            assert b'fastcache_tier_l3_skipped_blocks_total{cache="0"} 3.0' in text
        finally:
            cache.close()
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "WARNING" in line and "took 0 of" in line]
    assert len(warnings) == 2, err[-3000:]          # one per rank, the first skip only
    assert "no memory is lent to the pool" in warnings[0] and "segment_mb=" in warnings[0]


def test_sealed_objects_round_trip_in_parts_hold_no_plaintext_and_a_forgery_is_a_miss(service, raw, tmp_path,
                                                                                       monkeypatch):
    """With a deployment key (docs/design.md §12) puts go through registered staging in parts, two at a
    time; what a plain client reads is ciphertext, and what it writes under our keys is a miss, left there
    (this engine cannot tell another key's object from a forgery)."""
    from fastcache.store import seal
    key = tmp_path / "key"
    key.write_bytes(os.urandom(seal.KEY_BYTES))
    key.chmod(0o600)
    monkeypatch.setattr(mooncake_store, "SEAL_BYTES", 3 * SPEC.cpu_block_stride)   # parts of 3 objects
    blocks = np.random.default_rng(11).integers(1, 256, (SPEC.num_cpu_blocks, SPEC.cpu_block_stride), np.uint8)
    s = open_store(f"{service.url}?key_file={key}")
    try:
        s.attach(blocks, SPEC.cpu_block_bytes)
        k = ObjectKeys(unique("sealed"), fingerprint(SPEC, 1), 0, s.sealer)
        hashes = as_hashes(range(300, 310))
        want = s.tier[:10].copy()
        assert s.put(k, hashes, np.arange(10)) == 0
        np.testing.assert_array_equal(s.tier[:10], want)                     # the CPU tier keeps plaintext
        stored = bytes(raw.get(k.name(300)))
        assert len(stored) == SPEC.cpu_block_bytes + HEADER_BYTES
        assert want[0].tobytes()[:64] not in stored                           # the store sees no plaintext
        s.tier[10:20] = 0
        assert s.get(k, hashes, np.arange(10, 20)).all()
        np.testing.assert_array_equal(s.tier[10:20], want)
        forged = keys(k.namespace).object(400, want[3])                        # a valid plain object
        assert raw.put(k.name(400), forged) == 0
        foreign = np.zeros(1, bool)
        assert not s.get(k, as_hashes([400]), np.array([25]), foreign).any()
        assert foreign.all() and raw.is_exist(k.name(400)) == 1      # not authenticated: a miss, left in place
        s.tier[26] = 0
        assert s.get(k, hashes[:1], np.array([26])).all()                     # the honest objects still serve
        np.testing.assert_array_equal(s.tier[26], want[0])
    finally:
        s.close()


def test_sealed_puts_in_parts_smaller_than_a_staging_half_never_share_staging_rows(service, tmp_path, monkeypatch):
    """A part of a sealed put is staged while the one before it moves: the two must be staged in different
    rows also when batch_mb cuts parts smaller than a staging half, or the part in flight is sent with the
    next part's ciphertexts under its own names: a put reported done whose objects never open (and, as
    objects that fail authentication, stay in the store)."""
    from fastcache.store import seal
    key = tmp_path / "key"
    key.write_bytes(os.urandom(seal.KEY_BYTES))
    key.chmod(0o600)
    spec = small_spec(num_layers=4, block_size=16, num_kv_heads=8, head_dim=128, num_cpu_blocks=24)  # 256 KiB
    blocks = np.random.default_rng(12).integers(1, 256, (spec.num_cpu_blocks, spec.cpu_block_stride), np.uint8)
    s = open_store(f"{service.url}?key_file={key}&batch_mb=1")
    try:
        s.attach(blocks, spec.cpu_block_bytes)
        n = 12
        step = len(range(*s._chunks(n, s._seal_staging().shape[1])[0].indices(n)))
        assert step < n // 2 < s._seal_staging().shape[1]       # several parts, all within one half's rows
        sealed, seal_object = [0], s.sealer.seal
        prepared = threading.Condition()

        def counting_seal(*args):
            seal_object(*args)
            with prepared:
                sealed[0] += 1
                prepared.notify_all()
        monkeypatch.setattr(s.sealer, "seal", counting_seal)
        real, puts = s._client, [0]

        class PutsOnceTheNextPartIsStaged:
            """Each part moves only once the part after it is staged: a transfer slower than sealing."""
            def __getattr__(self, name):
                return getattr(real, name)

            def batch_put_from(self, names, ptrs, sizes):
                puts[0] += 1
                with prepared:
                    assert prepared.wait_for(lambda: sealed[0] >= min(n, (puts[0] + 1) * step), timeout=10)
                return real.batch_put_from(names, ptrs, sizes)
        monkeypatch.setattr(s, "_client", PutsOnceTheNextPartIsStaged())
        k = ObjectKeys(unique("sealed-parts"), fingerprint(spec, 1), 0, s.sealer)
        hashes = as_hashes(np.random.default_rng(13).integers(0, 2**63, n))
        want = s.tier[:n].copy()
        assert s.put(k, hashes, np.arange(n)) == 0 and puts[0] == -(-n // step)
        s.tier[n:2 * n] = 0
        foreign = np.zeros(n, bool)
        hits = s.get(k, hashes, np.arange(n, 2 * n), foreign)
        assert hits.all(), f"objects {np.flatnonzero(~hits).tolist()} do not open ({foreign.sum()} foreign)"
        np.testing.assert_array_equal(s.tier[n:2 * n], want)
    finally:
        s.close()


def test_a_store_task_against_an_unreachable_master_holds_up_no_swap():
    """Mooncake's setup holds the GIL while it fails to reach a master (about 4.4 s against a closed port,
    retry included), and a transfer manager that never opened its store tries again on every store task: a
    swap of that rank waited out each attempt. An unreachable store never holds up swaps (docs/design.md §8)."""
    url = f"mooncake://127.0.0.1:{free_port()}"        # nothing listens there
    rng = np.random.default_rng(14)
    with deployment(SPEC, tp=1, store=url) as (backend, workers):
        cpu = backend.allocate_cpu_blocks(1)
        round_trip(backend, workers, rng)                   # warm
        longest = 0.0
        for _ in range(2):
            put = backend.cpu_to_store("m", [int(rng.integers(0, 2**63))], cpu)
            while not put.done():                           # swaps while the transfer manager opens the store
                began = time.monotonic()
                round_trip(backend, workers, rng)
                longest = max(longest, time.monotonic() - began)
            with pytest.raises(TransferError, match=f"store {url}: cannot connect to the Mooncake master"):
                put.result(timeout=0)
        assert longest < 1.0, f"a swap waited {longest:.1f} s for a store task against an unreachable master"
