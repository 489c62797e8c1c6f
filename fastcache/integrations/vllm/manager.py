"""The scheduler side: vLLM's OffloadingManager over fastcache's index of CPU chunks.

TieredCache's rules, in vLLM's terms (docs/design.md §8, §10):
- Eviction: a policy of fastcache/eviction.py (the same implementation TieredCache uses), chosen by
  kv_connector_extra_config "policy" ("lru", "arc", "probation", "adaptive", "laps", "shadow"; default: eviction.DEFAULT_POLICY). The
  manager keeps the index (key -> entry) and tells the policy what happened: prepare_store's keys (the
  inserted ones new, the held ones refreshed), prepare_load's (read: touched; with L3 fetches, one store of
  them, as TieredCache does), touch(), a dropped entry, a reset. Lookups only read. Under lru a call's
  first key ends most recent, so a chain goes from its tail (a store too: before, a store's keys went in
  head first, so its head was evicted first, as in vLLM's own LRU manager).
- Eviction takes the policy's victims among ready entries no load is reading (vLLM pins through
  prepare_load) that the call does not name; a store that cannot fit evicts nothing and is skipped.
- Fail closed: a stored chunk becomes visible only once every worker rank stamped it (link.py); a failed
  store drops it, as does a failed fetch from L3.
- Weights change, the cache goes: reset_cache() (vLLM's reset_prefix_cache(reset_connector=True)) drops every
  entry and moves L3 to a new namespace generation, so nothing stored before is served; a request vLLM showed
  the manager before the reset stores nothing after it (vLLM offers its chunks again, KV of the old weights).
- KV events (vLLM's `kv_events_config.enable_kv_cache_events`): take_events() gives what the CPU tier gained and
  lost since the last call, in order, as vLLM's own CPU manager does: a key is announced stored once every
  worker rank stamped it (a store, or an L3 fetch into a chunk), never at prepare_store, and removed when an
  announced entry goes (an eviction); a failed store or fetch was never announced and announces nothing. A
  reset announces nothing (vLLM's reset_prefix_cache clears every medium's blocks in one event of its own).
- Metrics (get_stats, vLLM's Prometheus metrics of the connector; docs/design.md §10): vLLM's CPU cache gauges
  (the share of chunks pinned by stores in flight, by loads and fetches in flight, and both), the share of
  chunks holding an entry, and counters of evictions and of stores and fetches dropped because they did not
  land on every rank. Kept as counts as the calls go: get_stats runs every scheduler step.
- L3 (optional): a key missing from the CPU tier but held by the store for every rank is a hit; its load
  first fetches it into a chunk (the worker runs the fetch, then the swap-in). The manager asks the store
  through the engine's bounded client in a child process (store/remote.py), never a store client of its
  own: Mooncake's client can hold the GIL for a whole RPC timeout against a hung master, which would freeze
  vLLM's scheduler. A lookup waits for the store at most `store_timeout` seconds; a store that failed or did
  not answer is a miss and is set aside for STORE_BACKOFF seconds (lookups then miss without asking it).
"""
from __future__ import annotations

import itertools
import logging
import time

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (LookupResult, Medium, OffloadingCounterMetadata, OffloadingEvent,
                                     OffloadingGaugeMetadata, OffloadingManager, PrepareStoreOutput,
                                     RequestOffloadingContext)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

from ...eviction import DEFAULT_POLICY, make_policy
from ...store.keys import ObjectKeys, fingerprint
from ...store.remote import QUERY_TIMEOUT, RemoteStore
from .keys import block_hashes
from .link import ManagerLinks
from .jobs import FastcacheLoadSpec, FastcacheStoreSpec, rank_namespace

log = logging.getLogger("fastcache.vllm")

STORING, READY, FETCHING = "storing", "ready", "fetching"
NO_CHUNK = -1               # a load's L3 hit no chunk could take: the worker fails its blocks (vLLM recomputes)
STORE_BACKOFF = 10.0        # seconds a failed or silent store is not asked (every lookup a miss meanwhile)
USED = "fastcache:kv_offload_cpu_used_perc"
EVICTIONS = "fastcache:kv_offload_cpu_evictions"
DROPPED = "fastcache:kv_offload_cpu_dropped"
METRICS = {     # what get_stats reports: FastcacheOffloadingSpec.build_metric_definitions gives vLLM these
    CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC: OffloadingGaugeMetadata(
        "Share of the CPU tier's chunks pinned by stores, loads and L3 fetches in flight (1.0: every chunk)."),
    CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC: OffloadingGaugeMetadata(
        "Share of the CPU tier's chunks pinned by stores in flight."),
    CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC: OffloadingGaugeMetadata(
        "Share of the CPU tier's chunks pinned by loads and L3 fetches in flight."),
    USED: OffloadingGaugeMetadata("Share of the CPU tier's chunks holding an entry (stored, or on its way)."),
    EVICTIONS: OffloadingCounterMetadata("Entries the CPU tier evicted to make room."),
    DROPPED: OffloadingCounterMetadata(
        "Stores and L3 fetches dropped because their copy did not land on every worker rank (fail closed)."),
}


class Born:
    """A request's state in its ReqContext: the manager's generation when vLLM first showed it the request."""
    __slots__ = ("generation",)

    def __init__(self, generation: int):
        self.generation = generation


class Entry:
    __slots__ = ("chunk", "state", "pins", "stamp")

    def __init__(self, chunk: int, state: str, stamp: int):
        self.chunk, self.state, self.pins, self.stamp = chunk, state, 0, stamp


class FastcacheManager(OffloadingManager):
    def __init__(self, num_chunks: int, blocks_per_chunk: int, links: ManagerLinks, world_size: int,
                 store: str | None = None, policy: str = DEFAULT_POLICY, store_timeout: float = QUERY_TIMEOUT,
                 enable_events: bool = False):
        self.num_chunks, self.blocks_per_chunk, self.world_size = num_chunks, blocks_per_chunk, world_size
        self._policy = make_policy(policy, num_chunks)     # ValueError naming the choices
        self._links = links
        self._entries: dict[bytes, Entry] = {}             # every entry; the policy knows these keys and no other
        self._free = list(range(num_chunks - 1, -1, -1))
        self._stamps = itertools.count(1)      # one per store or fetch: a stale stamp never matches
        self.generation = 0                     # reset_cache() count: part of every L3 namespace
        self._store_url, self._store, self._l3_keys = store, None, None
        self._store_timeout = store_timeout
        self._store_aside_until = 0.0           # monotonic time before which the store is not asked
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._writing = self._reading = 0       # chunks of entries being stored; of entries a load pins
        self._evicted = self._dropped = 0       # since the last get_stats

    # -- lookups ---------------------------------------------------------------------------------
    def lookup(self, key, req_context) -> LookupResult:
        entry = self._entries.get(key)
        if entry is not None:
            if entry.state != READY:
                return LookupResult.HIT_PENDING
            return LookupResult.HIT
        if self._store_url is not None and self._in_store(key):
            return LookupResult.HIT
        return LookupResult.MISS

    def prepare_load(self, keys, req_context) -> FastcacheLoadSpec:
        keys = list(keys)
        protect = set(keys)
        chunks, fetch, stamps, fetched = [], [], [], []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:                   # an L3 hit: fetched into a chunk before the swap-in
                chunk = self._take_chunk(protect)
                if chunk is None:               # none free or evictable: the worker fails this key's blocks
                    chunk = NO_CHUNK            # (vLLM recomputes them); raising would stop vLLM's scheduler
                entry = self._entries[key] = Entry(chunk, FETCHING, self._new_stamp())
                fetched.append(key)
                fetch.append(True)
            else:
                fetch.append(False)
            if not entry.pins and entry.chunk != NO_CHUNK:
                self._reading += 1
            entry.pins += 1
            chunks.append(entry.chunk)
            stamps.append(entry.stamp)
        if keys:
            chain = list(dict.fromkeys(keys))
            if fetched:     # the L3 hits join the CPU tier: one store of the load's keys (as TieredCache)
                self._policy.stored(chain, fetched)
            else:
                self._policy.touched(chain)
        fetch = np.array(fetch, dtype=bool)
        hashes = block_hashes([k for k, f in zip(keys, fetch) if f], self.blocks_per_chunk)
        return FastcacheLoadSpec(chunks, fetch, np.array(stamps, dtype=np.uint64), hashes, self.generation)

    def touch(self, keys, req_context):
        held = [k for k in dict.fromkeys(keys) if k in self._entries]
        if held:
            self._policy.touched(held)          # under lru the first key ends most recent: chains die tail first

    def complete_load(self, keys, req_context):
        keys = [k for k in keys if k in self._entries]
        fetched = [k for k in keys if self._entries[k].state == FETCHING]
        ok = self._stamped(fetched)
        for key, good in zip(fetched, ok):
            if good:
                self._entries[key].state = READY
                self._announce(key, removed=False)
        for key in keys:
            entry = self._entries[key]
            entry.pins -= 1
            if entry.pins:
                continue
            placed = entry.chunk != NO_CHUNK
            self._reading -= placed
            if entry.state == FETCHING:         # its fetch did not land on every rank (or, with no chunk, never ran)
                self._dropped += placed
                self._drop(key)

    # -- stores ----------------------------------------------------------------------------------
    def prepare_store(self, keys, req_context) -> PrepareStoreOutput | None:
        born = req_context.get_state(Born) if req_context is not None else None
        if born is not None and born.generation != self.generation:
            # vLLM offers a request running across a reset every chunk again, and that KV may be of the weights
            # before it (a reset with running requests leaves them their blocks): it never enters the new cache
            return PrepareStoreOutput(keys_to_store=[], evicted_keys=[], store_spec=FastcacheStoreSpec(
                [], np.zeros(0, dtype=np.uint64), np.zeros(0, np.uint64), self.generation))
        keys = list(dict.fromkeys(keys))
        new = [k for k in keys if k not in self._entries]
        evicted = []
        if len(new) > len(self._free):
            victims = self._victims(len(new) - len(self._free), protect=set(keys))
            if victims is None:
                return None                     # vLLM skips this store: nothing is lost, a later one may fit
            for key in victims:
                evicted.append(key)
                self._drop(key, evicted=True)
        chunks, stamps = [], []
        self._writing += len(new)
        for key in new:
            entry = self._entries[key] = Entry(self._free.pop(), STORING, self._new_stamp())
            chunks.append(entry.chunk)
            stamps.append(entry.stamp)
        if keys:
            self._policy.stored(keys, new)      # the inserted keys new, the held ones refreshed
        hashes = block_hashes(new, self.blocks_per_chunk) if self._store_url else np.zeros(0, np.uint64)
        spec = FastcacheStoreSpec(chunks, np.array(stamps, dtype=np.uint64), hashes, self.generation)
        return PrepareStoreOutput(keys_to_store=new, store_spec=spec, evicted_keys=evicted)

    def complete_store(self, keys, req_context, success: bool = True):
        pending = [k for k in keys if k in self._entries and self._entries[k].state == STORING]
        ok = self._stamped(pending) if success else np.zeros(len(pending), dtype=bool)
        self._writing -= len(pending)
        for key, good in zip(pending, ok):
            if good:
                self._entries[key].state = READY
                self._announce(key, removed=False)
            else:
                self._dropped += 1
                self._drop(key)

    def get_stats(self) -> OffloadingConnectorStats:
        """The gauges now and the counters since the last call (METRICS)."""
        stats, n = OffloadingConnectorStats(), self.num_chunks
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, (self._writing + self._reading) / n)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, self._writing / n)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, self._reading / n)
        stats.set_gauge(USED, (n - len(self._free)) / n)
        stats.increase_counter(EVICTIONS, self._evicted)
        stats.increase_counter(DROPPED, self._dropped)
        self._evicted = self._dropped = 0
        return stats

    def take_events(self):
        """The CPU tier's stores and removals since the last call, in order (none unless events are enabled)."""
        events = self._events
        if events:
            self._events = []
            yield from events

    # -- requests and resets ---------------------------------------------------------------------
    def on_new_request(self, req_context) -> RequestOffloadingContext:
        if req_context is not None:
            req_context.set_state(Born(self.generation))
        return RequestOffloadingContext()

    def reset_cache(self):
        """New weights: every entry goes and L3 moves to the next namespace generation. vLLM promises no
        completion of an earlier job arrives afterwards."""
        self._entries.clear()
        self._policy.clear()
        self._free = list(range(self.num_chunks - 1, -1, -1))
        self._writing = self._reading = 0
        self.generation += 1
        self._l3_keys = None

    def shutdown(self):
        self._links.close()
        if self._store is not None:
            self._store.close()
            self._store = None

    # -- helpers ---------------------------------------------------------------------------------
    def _new_stamp(self) -> int:
        return next(self._stamps)

    def _stamped(self, keys) -> np.ndarray:
        if not keys:
            return np.zeros(0, dtype=bool)
        entries = [self._entries[k] for k in keys]
        if any(e.chunk == NO_CHUNK for e in entries):         # no chunk, no fetch: never stamped
            ok = np.zeros(len(entries), dtype=bool)
            placed = [i for i, e in enumerate(entries) if e.chunk != NO_CHUNK]
            if placed:
                ok[placed] = self._stamped([keys[i] for i in placed])
            return ok
        try:
            return self._links.stamped([e.chunk for e in entries], [e.stamp for e in entries])
        except Exception as exc:                # no link, no proof: fail closed
            log.warning("fastcache: cannot read the workers' stamps (%s); dropping %d entries", exc, len(keys))
            return np.zeros(len(keys), dtype=bool)

    def _take_chunk(self, protect):
        if not self._free:
            victims = self._victims(1, protect)
            if victims is None:
                return None
            self._drop(victims[0], evicted=True)
        return self._free.pop()

    def _victims(self, n, protect):
        """n keys the policy gives up (it forgets them), none of an entry that is not ready (being stored or
        fetched), pinned by a load, or in protect; None, and nothing given up, when fewer than n can go."""
        entries = self._entries
        found = 0
        for key, entry in entries.items():      # enough to evict? (the policy forgets every victim it returns)
            if entry.state == READY and entry.pins == 0 and key not in protect:
                found += 1
                if found == n:
                    break
        else:
            return None

        def skip(key):
            entry = entries[key]
            return entry.state != READY or entry.pins or key in protect
        victims = self._policy.victims(n, skip)
        if len(victims) < n:                    # cannot happen (the policy holds every entry): fail closed
            log.warning("fastcache: the eviction policy gave %d of %d victims; dropping them", len(victims), n)
            for key in victims:
                self._drop(key, evicted=True)
            return None
        return victims

    def _drop(self, key, evicted: bool = False):
        """Remove an entry and free its chunk; the policy forgets it (a victim: already forgotten)."""
        entry = self._entries.pop(key)
        if evicted:
            self._evicted += 1
        else:
            self._policy.remove(key)
        if entry.state == READY:                # announced as stored: its removal is announced
            self._announce(key, removed=True)
        if entry.chunk != NO_CHUNK:
            self._free.append(entry.chunk)

    def _announce(self, key, removed: bool):
        """A KV event for key, joined to the last one when that is of the same kind (one event per run)."""
        events = self._events
        if events is None:
            return
        if events and events[-1].removed == removed:
            events[-1].keys.append(key)
        else:
            events.append(OffloadingEvent(keys=[key], medium=Medium.CPU, removed=removed))

    def _in_store(self, key) -> bool:
        if time.monotonic() < self._store_aside_until:
            return False
        try:
            if self._l3_keys is None:
                spec, namespace = self._links.geometry()
                if self._store is None:
                    self._store = RemoteStore(self._store_url, self._store_timeout)
                fp = fingerprint(spec, 1)
                scopes = self._links.reset_scopes
                self._l3_keys = [ObjectKeys(rank_namespace(namespace, self.generation, r, self.world_size, scopes[r]),
                                            fp, 0) for r in range(self.world_size)]
            hashes = block_hashes([key], self.blocks_per_chunk)
            return bool(self._store.exists_every_rank(self._l3_keys, hashes).all())
        except Exception as exc:                # an unreachable store is a miss, never a stall
            self._store_aside_until = time.monotonic() + STORE_BACKOFF
            log.warning("fastcache: L3 lookup failed (%s); treating as a miss, and not asking the store for %g s",
                        exc, STORE_BACKOFF)
            return False
