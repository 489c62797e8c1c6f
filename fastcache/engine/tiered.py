"""TieredCache: prefix reuse over the CPU tier, addressed by block hash (docs/design.md §8).

The engine names each full KV block by a chained hash of its tokens. `store` copies GPU blocks into CPU
blocks the cache owns and indexes them by hash, `lookup` says how many leading hashes of a prompt are
held, `load` copies held blocks back to GPU blocks. The bytes move through the backend's ordinary swap
tasks (every rank copies its own slice); the cache only keeps the index, on the engine side.

Rules, in the order an engine meets them:

- **CPU blocks: a quota.** The cache reserves `capacity` blocks from the backend's CPU block allocator
  when it is made (default: every block free then), so `allocate_cpu_blocks` keeps serving preemption
  swaps from the rest and the two never share a block. `close()` gives the quota back.
- **Eviction: a policy** (`policy=`: `probation`, `adaptive`, `laps`, `lru` or `arc`, fastcache/eviction.py's POLICIES; the
  default is its DEFAULT_POLICY). The cache keeps the index (hash -> entry) and tells the policy, which
  knows hashes only, what happened: a store's hashes (deduplicated, less those that did not fit) and
  which of them are new, a load's hashes (touched), a load's store hits (one store of the load's hashes),
  an entry dropped, every entry dropped. `lookup` only reads. The vLLM manager uses the same policy
  classes, so each policy has one implementation. Under `lru`, `store` and `load` refresh the hashes they
  name from last to first, so a call's first hash ends most recently used and a prompt's chain is evicted
  from its tail, never its head first (a tail without its head is useless to a prefix lookup).
- **Eviction never takes an entry in use**: the policy is asked for victims with a skip of entries being
  stored (not visible yet), entries pinned (being loaded until their load's handle completes, or read by a
  write-through put) and the hashes the call itself names.
- **Fail closed.** An entry becomes visible to `lookup` only when every rank has finished storing it
  (the handle's completion callback runs before `result()` returns); a failed store or load drops its
  entries; `load` of a hash that is not held raises before anything moves.
- **Weights change, the cache goes.** A clear resets the CPU block allocator (its `generation` moves):
  every entry and the quota are gone, and `lookup`/`store`/`load` raise TransferError until the cache
  is given a namespace it has never used (`cache.namespace = "model/step-1"`); the quota is then taken
  again. A new namespace without a clear drops every entry too (new weights, stale KV).

Thread-safe: one lock guards the index. It is never held while calling into the backend, since a
handle's completion callback, which takes it, may run on a submitting thread.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from itertools import filterfalse, takewhile
from operator import itemgetter

from .. import metrics
from ..config import check_namespace
from ..errors import RefusedError, TransferError
from ..eviction import DEFAULT_POLICY, make_policy
from ..ipc import protocol
from ..ipc.signal import NORMAL, STATUS_NAMES
from .handle import TransferHandle
from .ids import as_gpu_ids, as_hash_list
from .tiered_l3 import BLOCK, DONE, PINS, QUOTA, READY, STATE, STORING, WRITE_MODES, L3Tier

log = logging.getLogger("fastcache.engine")

_block = itemgetter(BLOCK)


class TieredCache(L3Tier):
    """`TieredCache(backend, namespace="llama-3-8b/step-0", capacity=None, write="back", policy=DEFAULT_POLICY)`:
    see the module docstring; with a backend that has a store, tiered_l3 adds the store below the CPU tier."""

    def __init__(self, backend, namespace: str, capacity: int | None = None, write: str = "back",
                 policy: str = DEFAULT_POLICY):
        check_namespace(namespace)
        if write not in WRITE_MODES:
            raise ValueError(f"write must be one of {WRITE_MODES}, got {write!r}")
        self.backend = backend
        allocator = backend.allocator
        if capacity is None:
            capacity = allocator.num_free
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive number of CPU blocks, got {capacity!r}")
        self.capacity = capacity
        # the eviction order (ValueError naming the choices for an unknown name, before any block is taken);
        # it knows hashes only: every hash in _index, and no other
        self._policy = make_policy(policy, capacity)
        self._lock = threading.Lock()
        # calls between naming CPU blocks (under the lock) and submitting them (after it): a reshard, once it
        # refuses new calls, waits for none to be left before it counts and renames the blocks
        self._busy = 0
        self._quiet = threading.Condition(self._lock)
        self._index: dict[int, list] = {}                        # every entry (the order: self._policy)
        self._visible: set[int] = set()                          # the READY ones: what lookup sees
        self._pinned = 0    # pins not yet released, on any entry (indexed or not): 0 = no entry is pinned
        self._drops = 0     # counts removals other than evictions (which never touch an entry in flight)
        self._quota = allocator.generation
        self._free = allocator.allocate(capacity)[::-1]          # ValueError if they are not free
        self._namespace = namespace
        self._used = {namespace}
        self._refused = None          # why lookup/store/load are refused (a clear, close)
        self._closed = False
        self._counts = dict.fromkeys(metrics.TIER_COUNTERS, 0)
        self._latency = {"store": metrics.Histogram(), "load": metrics.Histogram()}
        self._init_l3(write)
        register = getattr(backend, "register_cache", None)
        if register is not None:        # a reshard renames the CPU blocks of the entries (docs/design.md §9)
            register(self)

    # -- namespace (model and weight version) ------------------------------------------------------
    @property
    def namespace(self) -> str:
        return self._namespace

    @namespace.setter
    def namespace(self, name: str):
        check_namespace(name)
        with self._lock:
            self._sync()
            if self._closed:
                raise TransferError("the cache is closed")
            if name == self._namespace and self._refused is None:
                return
            if name in self._used:
                raise ValueError(f"namespace {name!r} was used before: a namespace names one model and weight "
                                 f"version, and cached KV of old weights must never be served; pick a new one")
            if self._refused is not None:       # after a clear: the quota went with the allocator's reset
                state = self._backend_refusal()
                if state:
                    raise TransferError(f"cannot take CPU blocks for the cache: {state}")
                generation = self.backend.allocator.generation
                self._free = self.backend.allocator.allocate(self.capacity)[::-1]
                self._quota = generation        # a clear racing this shows at the next _sync
            else:
                self._drop_all()
            self._namespace = name
            self._used.add(name)
            self._refused = None

    # -- the API -----------------------------------------------------------------------------------
    def lookup(self, hashes) -> int:
        """How many leading hashes are held (stored by every rank and not evicted), by the CPU tier or, when
        the backend has a store, by the store. Reads only."""
        return self.lookup_tiers(hashes)[0]

    def lookup_tiers(self, hashes) -> tuple[int, int]:
        """(leading hashes held, how many of those only the store holds)."""
        keys = as_hash_list(hashes)
        with self._lock:
            self._check_usable()
            n = len(list(takewhile(self._visible.__contains__, keys)))
            if n == len(keys) or not self._l3_usable():
                self._count_lookup(len(keys), n, 0)
                return n, 0
            in_l2 = [k in self._visible for k in keys[n:]]
        run, from_l3 = self._l3_extend(keys, n, in_l2)      # asks the store, outside the lock
        with self._lock:
            self._count_lookup(len(keys), n + run, from_l3)
        return n + run, from_l3

    def _count_lookup(self, asked, n, from_l3):
        counts = self._counts
        counts["lookups"] += 1
        counts["lookup_blocks"] += asked
        counts["hits"] += n - from_l3
        counts["l3_hits"] += from_l3
        counts["misses"] += asked - n

    def store(self, hashes, gpu_block_ids, fence=None) -> TransferHandle:
        """Copy GPU blocks into the CPU tier under their hashes. Hashes already held (or being stored)
        are skipped and refreshed; a hash listed twice is stored once. When every CPU block is in use by
        a transfer, the hashes that do not fit are skipped (counted as store_full). Returns the swap's
        handle (an already completed one when nothing had to move). fence: as SwapBackend.swap_out's (what
        CacheWorker.fence(stream) returned): the copy reads the blocks after the work queued before it."""
        keys, gpu = self._validate(hashes, gpu_block_ids, "store")
        fences = self.backend.checked_fences(fence)     # before the index changes: bad input loses nothing
        with self._lock:
            self._check_usable()
            batch = self._place(keys, gpu)
            taken = self._take_victims()
            self._busy += 1
        try:
            self._write_back(taken)     # L3: before the swap-out that reuses the evicted blocks
            if batch is None:
                return TransferHandle.completed(protocol.SWAP_TO_CPU)
            new, new_gpu, blocks, entries, _ = batch
            try:
                handle = self.backend.submit_checked_swap(protocol.SWAP_TO_CPU, new_gpu, blocks, fences)
            except BaseException:
                with self._lock:
                    for key, entry in zip(new, entries):
                        entry[STATE] = DONE
                        self._drop(key, entry)
                raise
        finally:
            self._end()
        if self.write == "through":     # before _stored: see tiered_l3
            handle.add_done_callback(lambda h: self._write_through(h, batch))
        handle.add_done_callback(lambda h: self._stored(h, batch))
        return handle

    def load(self, hashes, gpu_block_ids, fence=None) -> TransferHandle:
        """Copy held blocks to GPU blocks. Every hash must be held (see lookup), else ValueError and
        nothing moves; the entries are pinned against eviction until the handle completes. fence: as
        SwapBackend.swap_in's: the copy writes the blocks after the work queued before it."""
        keys, gpu = self._validate(hashes, gpu_block_ids, "load")
        fences = self.backend.checked_fences(fence)
        if len(set(gpu)) != len(gpu):
            raise ValueError("duplicate destination gpu block ids")
        if not keys:
            return TransferHandle.completed(protocol.SWAP_TO_GPU)
        if self._l3 and not self._l2_holds(keys):
            handle = self._load_l3(keys, gpu, fences)   # store hits come up through the CPU tier
            if handle is not None:
                return handle
        with self._lock:
            self._check_usable()
            if not self._visible.issuperset(keys):
                key = next(k for k in keys if k not in self._visible)
                raise ValueError(f"hash {key:#x} is not held by the CPU tier (never stored, evicted, or still "
                                 f"being stored); lookup() says how many leading hashes can be loaded")
            entries = list(map(self._index.__getitem__, keys))
            for entry in entries:
                entry[PINS] += 1
            self._pinned += len(entries)
            self._touch(keys)
            batch = (keys, entries, self._drops)
            self._busy += 1
        try:
            handle = self.backend.submit_checked_swap(protocol.SWAP_TO_GPU, gpu, list(map(_block, entries)), fences)
        except BaseException:
            with self._lock:
                for key, entry in zip(keys, entries):
                    self._unpin(key, entry)
            raise
        finally:
            self._end()
        handle.add_done_callback(lambda h: self._loaded(h, batch))
        return handle

    def stats(self) -> dict:
        """Counters since the cache was made (see metrics.TIER_COUNTERS), entries held, capacity, the hit
        rate of lookups, and store/load latency histograms."""
        with self._lock:
            out = dict(self._counts)
            out["entries"] = len(self._visible)
            out["capacity"] = self.capacity if self._refused is None else 0
            out["store_latency"] = self._latency["store"].snapshot()
            out["load_latency"] = self._latency["load"].snapshot()
            out["namespace"] = self._namespace
            out["policy"] = self._policy.name
        out["hit_rate"] = out["hits"] / out["lookup_blocks"] if out["lookup_blocks"] else 0.0
        return out

    def close(self, timeout: float = 30.0):
        """Wait up to `timeout` seconds for the puts to the store in flight (flush), then drop every entry
        and give the quota back to the allocator (blocks in flight: once done). Blocks that did not reach
        the store are logged in one WARNING. The backend's close closes its caches first."""
        with self._lock:
            if self._closed:
                return
        lost = self.flush(timeout) if self._l3 else 0
        if lost:
            log.warning("TieredCache %r: %d blocks did not reach the store %s before close (failed, skipped by a "
                        "full store, or still in flight after %.1f s)", self._namespace, lost, self.backend.store_url.url,
                        timeout)
        with self._lock:
            if self._closed:
                return
            self._sync()
            self._drop_all()
            self._closed, self._refused = True, "the cache is closed"
            free, self._free = self._free, []
            if free and self._quota == self.backend.allocator.generation:
                self.backend.allocator.free(free)
        self._stop_l3()

    def wait_quiet(self, timeout: float) -> bool:
        """Wait until no call is between naming CPU blocks and submitting them; False on timeout."""
        with self._lock:
            return self._quiet.wait_for(lambda: not self._busy, timeout)

    def _end(self):
        """A call has submitted (or given up on) the blocks it named."""
        with self._lock:
            self._busy -= 1
            if not self._busy:
                self._quiet.notify_all()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- bookkeeping (under the lock) ---------------------------------------------------------------
    def _validate(self, hashes, gpu_block_ids, what):
        keys = as_hash_list(hashes)
        gpu = as_gpu_ids(gpu_block_ids, self.backend.spec.num_gpu_blocks)
        if len(keys) != len(gpu):
            raise ValueError(f"{what}: {len(keys)} hashes but {len(gpu)} gpu_block_ids")
        if len(gpu) > protocol.MAX_IDS:
            raise ValueError(f"{what} moves at most {protocol.MAX_IDS} blocks, got {len(gpu)}")
        return keys, gpu

    def _place(self, keys, gpu):
        """Entries for the new hashes of a store, evicting as needed, and the call's hashes told to the policy
        (the new ones inserted, the held ones refreshed). Returns (new hashes, their GPU ids, their CPU blocks,
        their entries, drop count) or None when nothing is new.
        Written with C-level builtins (filterfalse, map): per hash, this is the cost of a store."""
        if len(set(keys)) != len(keys):             # a hash listed twice: its first GPU block wins
            where = dict(zip(reversed(keys), reversed(gpu)))
            keys = list(dict.fromkeys(keys))
            gpu = list(map(where.__getitem__, keys))
        index = self._index
        new = list(filterfalse(index.__contains__, keys))
        all_new = len(new) == len(keys)
        # the call's held hashes must survive its evictions (when every hash is new, none can be hit)
        blocks = self._take_blocks(len(new), () if all_new else keys) if new else []
        new_gpu = gpu[:len(blocks)] if all_new else list(map(dict(zip(keys, gpu)).__getitem__, new[:len(blocks)]))
        if len(blocks) < len(new):                  # no block for the rest: skipped, and not refreshed
            self._counts["store_full"] += len(new) - len(blocks)
            left = set(new[len(blocks):])
            new = new[:len(blocks)]
            keys = [key for key in keys if key not in left]
        quota = self._quota
        entries = [[block, quota, 0, STORING] for block in blocks]
        self._counts["store_skipped"] += len(keys) - len(new)
        index.update(zip(new, entries))
        if keys:
            self._policy.stored(keys, new)          # exactly the hashes placed or refreshed, in chain order
        if not new:
            return None
        return new, new_gpu, blocks, entries, self._drops

    def _take_blocks(self, n, protect):
        """n CPU blocks (fewer if there are not): free ones first, then the policy's victims among the
        entries that no transfer uses and that the call does not name (protect)."""
        free = self._free                           # lowest ids last: taken in ascending runs
        take = min(n, len(free))
        blocks = free[len(free) - take:][::-1]
        del free[len(free) - take:]
        n -= take
        if not n:
            return blocks
        index = self._index
        victims = self._victims(n, protect)
        candidates = list(map(index.__getitem__, victims))
        deque(map(index.__delitem__, victims), maxlen=0)
        if self._l3:
            self._note_evicted(victims, candidates)     # written back to the store by the caller
        self._visible.difference_update(victims)
        self._counts["evicted"] += len(victims)
        return blocks + list(map(_block, candidates))

    def _victims(self, n, protect):
        """Up to n hashes the policy gives up (it forgets them), none of an entry that is not READY (being
        stored or fetched: not visible), pinned, or named by the call (protect). The skip is as cheap as
        what needs skipping: none when every entry is READY and unpinned and the call names no held hash."""
        index, visible = self._index, self._visible
        if self._pinned or len(visible) != len(index):         # some entry is in flight: the slow way
            if protect:
                protect = set(protect)

                def skip(key):
                    return key in protect or key not in visible or index[key][PINS]
            else:
                def skip(key):
                    return key not in visible or index[key][PINS]
        elif protect:
            skip = (protect if isinstance(protect, (set, frozenset)) else set(protect)).__contains__
        else:
            skip = None
        return self._policy.victims(n, skip)

    def _touch(self, keys):
        """Held hashes read (a load): the policy refreshes them. A hash listed twice counts once, at its first
        place (under lru the order is the same as refreshing every listing from last to first)."""
        if len(keys) > 1 and len(set(keys)) != len(keys):
            keys = list(dict.fromkeys(keys))
        self._policy.touched(keys)

    def _stored(self, handle, batch):
        """Completion of a store (runs before its result() returns)."""
        new, _, _, entries, drops = batch
        with self._lock:
            ok = handle.error is None
            if ok and drops == self._drops:          # nothing was dropped meanwhile: all still indexed
                for entry in entries:
                    entry[STATE] = READY
                self._visible.update(new)
            else:
                for key, entry in zip(new, entries):
                    if ok and self._index.get(key) is entry:
                        entry[STATE] = READY
                        self._visible.add(key)
                    else:
                        entry[STATE] = DONE
                        self._drop(key, entry)
            if ok:
                self._counts["stored_blocks"] += len(new)
                self._counts["stored_bytes"] += handle.nbytes
                self._latency["store"].observe(handle.elapsed)
            else:
                self._counts["failed_stores"] += 1

    def _loaded(self, handle, batch):
        keys, entries, drops = batch
        with self._lock:
            ok = handle.error is None
            if ok and drops == self._drops:          # all still indexed: nothing to release
                for entry in entries:
                    entry[PINS] -= 1
                self._pinned -= len(entries)
            else:
                for key, entry in zip(keys, entries):
                    if not ok:
                        self._drop(key, entry)      # fail closed: its bytes are not trusted any more
                    self._unpin(key, entry)
            if ok:
                self._counts["loads"] += 1
                self._counts["loaded_blocks"] += len(keys)
                self._counts["loaded_bytes"] += handle.nbytes
                self._latency["load"].observe(handle.elapsed)
            else:
                self._counts["failed_loads"] += 1

    # -- resharding (the backend calls these) ------------------------------------------------------
    def free_quota(self) -> list | None:
        """The quota's free CPU blocks now (None once closed): a reshard's snapshot of what is not live."""
        with self._lock:
            return None if self._closed else list(self._free)

    def remap_blocks(self, cpu_map: dict, free: list, allocator):
        """After the CPU tier was resharded: every entry's block renamed by cpu_map, and a quota of free blocks
        taken again (fewer if the smaller tier has not as many free: the capacity shrinks). `free` is the
        free_quota() the reshard planned with."""
        with self._lock:
            if self._closed:
                return
            for key, entry in list(self._index.items()):
                block = entry[BLOCK]
                if block is None:
                    continue
                if block not in cpu_map:     # cannot happen (every entry's block was live): fail closed
                    self._drop(key, entry)
                    continue
                entry[BLOCK] = cpu_map[block]
            # a block let go after the snapshot (a store refused as the step began) was live: renamed, still ours
            released = [cpu_map[b] for b in self._free if b in cpu_map]
            take = min(len(free), allocator.num_free)
            self._free = allocator.allocate(take)[::-1] + released

    def _unpin(self, key, entry):
        entry[PINS] -= 1
        self._pinned -= 1
        if self._index.get(key) is not entry:
            self._release(entry)

    def _drop(self, key, entry):
        """Remove an entry from the index; its block is reused once no transfer uses it."""
        self._drops += 1
        if self._index.get(key) is entry:
            del self._index[key]
            self._policy.remove(key)
            self._visible.discard(key)
            if entry[STATE] == READY:
                entry[STATE] = DONE
        self._release(entry)

    def _release(self, entry):
        if entry[PINS] or entry[STATE] != DONE or entry[BLOCK] is None:
            return
        block, entry[BLOCK] = entry[BLOCK], None
        self._give_back([block], entry[QUOTA])

    def _give_back(self, blocks, quota):
        """Blocks taken under `quota` and not used: free again, unless a clear took the quota meanwhile."""
        if quota != self._quota or quota != self.backend.allocator.generation:
            return
        if self._closed:
            self.backend.allocator.free(blocks)
        else:
            self._free.extend(blocks)

    def _drop_all(self):
        self._drops += 1
        index, self._index, self._visible = self._index, {}, set()
        self._policy.clear()
        for entry in index.values():
            if entry[STATE] == READY:
                entry[STATE] = DONE
            self._release(entry)

    def _sync(self):
        """Notice a clear: the allocator was reset, so the quota and every entry are gone."""
        if self._refused is None and self._quota != self.backend.allocator.generation:
            self._free = []
            self._drop_all()
            self._refused = (f"the cache was cleared (clear_caches): its entries are gone and the weights may "
                             f"have changed; set cache.namespace to one not used before (was {self._namespace!r})")

    def _check_usable(self):
        self._sync()
        if self._refused is not None:
            raise TransferError(self._refused)
        state = self._backend_refusal()
        if state:
            raise RefusedError(f"the cache refuses requests now: {state}")

    def _backend_refusal(self) -> str | None:
        backend = self.backend
        if not backend.running:
            return "the backend is not running"
        status = backend.signals.status
        if status != NORMAL:
            return f"kv_cache_status is {STATUS_NAMES.get(status, status)}"
        return None
