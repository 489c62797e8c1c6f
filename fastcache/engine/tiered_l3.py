"""TieredCache's third tier: the backend's store (docs/design.md §8), mixed into TieredCache.

- **Write-back** (default): an entry evicted from the CPU tier is put into the store, unless this cache
  knows the store has it (it came from there, or was written there). The put is submitted before the
  task that reuses the block, and the transfer manager orders tasks that share a CPU block, so the put
  reads the old bytes. `write="through"` puts every stored block once its swap-out succeeded.
- **Lookup** counts the leading hashes held by the CPU tier or the store (the store is asked only when
  the CPU tier's run ends early); `lookup_tiers` says how many of them only the store has.
- **Load** of a store hit takes fresh CPU blocks (evicting as a store does), fetches the objects into
  them, and swaps every block in, under one handle; the fetched entries join the CPU tier (to the eviction
  policy, one store of the load's hashes: the fetched ones new, the others refreshed). A fetch that
  fails fails the handle (the GPU blocks are then undefined, as after any failed load) and drops them.
- **The store failing never stops the CPU tier**: an error (other than a miss) counts in `l3_errors`
  and sets the store aside for L3_BACKOFF seconds, during which lookups, write-back and write-through
  skip it; then a thread of the cache probes it every L3_PROBE_INTERVAL seconds and puts it back in use
  as soon as it answers. A put the deployment does not submit (a clear, a reshard, a lost rank) and a task
  failed because the engine lost a rank (dead or restarted) are not the store's errors. Everything
  submitted to the store is best effort; only a load depends on it.

The cache's lock is never held while calling the backend, and completion callbacks never call it: the
write-through puts are submitted by a thread of this cache, fed by the swap-outs' callbacks.
"""
from __future__ import annotations

import logging
import queue
import threading

import numpy as np

from ..errors import TransferError
from ..ipc import protocol
from ..store import fingerprint
from ..store.base import MISS
from .combined import CombinedHandle

log = logging.getLogger("fastcache.engine")

L3_BACKOFF = 10.0            # seconds the store is set aside after an error, before it is probed
L3_PROBE_INTERVAL = 1.0      # seconds between probes of a store set aside
WRITE_MODES = ("back", "through")
# TieredCache's entry: a 4-item list, [CPU block, quota generation, pins, state]. A store makes 64 of them
# per prompt, and a list costs a third of a slotted object to make. The quota generation is the
# allocator's generation the block was reserved under; pins count loads in flight.
BLOCK, QUOTA, PINS, STATE = range(4)
STORING, READY, DONE = range(3)      # DONE: its store ended but it is not (or no longer) in the index


class L3Tier:
    """Mixed into TieredCache (which provides the index, the lock and the counters)."""

    def _init_l3(self, write: str):
        if write not in WRITE_MODES:
            raise ValueError(f"write must be one of {WRITE_MODES}, got {write!r}")
        self.write = write
        self._l3 = getattr(self.backend, "store_url", None) is not None     # a backend without a store
        self._l3_victims = []               # (hash, block) evicted under the lock, written back by the caller
        self._l3_known = set()              # hashes the store has under _l3_known_as, as far as we know
        self._l3_known_as = self._l3_names()
        self._l3_prober = None              # probes a store set aside; None while the store is in use
        self._l3_closing = threading.Event()
        self._l3_writer = None              # the write-through thread, started on first use
        self._l3_jobs = queue.SimpleQueue()
        self._l3_outstanding = 0            # blocks queued for a put or in a put not yet finished
        self._l3_unwritten = 0              # blocks whose put failed or was skipped, since the last flush
        self._l3_idle = threading.Condition(self._lock)

    def _l2_holds(self, keys) -> bool:
        with self._lock:
            return self._visible.issuperset(keys)

    # -- under the lock ----------------------------------------------------------------------------
    def _l3_usable(self) -> bool:
        return self._l3 and self._l3_prober is None

    def _l3_names(self):
        """What the store's keys begin with: the namespace, and the geometry (which a reshard changes)."""
        return self._namespace, fingerprint(self.backend.spec, self.backend.tp_size) if self._l3 else None

    def _known(self) -> set:
        names = self._l3_names()
        if self._l3_known_as != names:      # new weights or a new geometry: nothing known about the store
            self._l3_known, self._l3_known_as = set(), names
        return self._l3_known

    def _note_evicted(self, victims, entries):
        """Called by _take_blocks: remember what to write back (the caller submits it)."""
        known = self._known()
        usable = self._l3_usable()
        for key, entry in zip(victims, entries):
            if key in known:
                known.discard(key)
            elif usable:
                self._l3_victims.append((key, entry[BLOCK]))

    def _take_victims(self):
        victims, self._l3_victims = self._l3_victims, []
        return self._namespace, victims

    # -- write-back and write-through ----------------------------------------------------------------
    def _write_back(self, taken):
        """Put the evicted blocks into the store. Must be submitted before any task that reuses them."""
        namespace, victims = taken
        if not victims:
            return
        keys = [key for key, _ in victims]
        self._puts_begin(len(keys))
        try:
            handle = self.backend.cpu_to_store(namespace, keys, [block for _, block in victims])
        except (TransferError, ValueError):     # not submitted (a clear, a reshard, a lost rank): the store was
            self._puts_end(len(keys), len(keys))    # not asked, so it stays in use; these victims go unwritten
            return
        handle.add_done_callback(lambda h: self._l3_written(h, len(keys)))

    def _write_through(self, handle, batch):
        """Swap-out callback of a write-through cache (runs before the entries become visible): pin them
        and queue their put."""
        if handle.error is not None:
            return
        new, _, _, entries, _ = batch
        with self._lock:
            if not self._l3_usable():
                return
            namespace = self._namespace     # read here: a namespace set after the lock must not name these
            pinned = [(k, e) for k, e in zip(new, entries) if self._index.get(k) is e]
            for _, entry in pinned:
                entry[PINS] += 1            # not evicted (its block not reused) before the put has read it
            self._pinned += len(pinned)
            self._busy += bool(pinned)      # until the writer has submitted the put
            self._l3_outstanding += len(pinned)
            if pinned:      # queued and its writer started before a close can look: it stops the writer after
                self._l3_jobs.put((namespace, pinned))
                self._start_writer()

    def _start_writer(self):
        """Under the lock (the cache is not closed: it pinned indexed entries)."""
        if self._l3_writer is None:
            self._l3_writer = threading.Thread(target=self._writer, name="fastcache-l3-writer", daemon=True)
            self._l3_writer.start()

    def _writer(self):
        while True:
            job = self._l3_jobs.get()
            if job is None:
                return
            namespace, pinned = job
            keys = [k for k, _ in pinned]
            try:
                handle = self.backend.cpu_to_store(namespace, keys, [e[BLOCK] for _, e in pinned])
            except (TransferError, ValueError):     # not submitted: says nothing about the store (see _write_back)
                self._puts_end(len(pinned), len(pinned))
                self._unpin_all(pinned)
                continue
            finally:
                self._end()
            handle.add_done_callback(lambda h, pinned=pinned, ns=namespace: self._written_through(h, pinned, ns))

    def _written_through(self, handle, pinned, namespace):
        self._l3_written(handle, len(pinned))
        with self._lock:
            # a full store skipped some puts (which, the reports do not say): none is known to be there
            if handle.error is None and not handle.skipped and namespace == self._namespace:
                self._known().update(k for k, e in pinned if self._index.get(k) is e)
        self._unpin_all(pinned)

    def _unpin_all(self, pinned):
        with self._lock:
            for key, entry in pinned:
                self._unpin(key, entry)

    def _l3_written(self, handle, n):
        self._puts_end(n, n if handle.error is not None else handle.skipped)
        if handle.error is not None:
            if not handle.ranks_lost:       # a rank restarted or died: says nothing about the store
                self._l3_failed(handle.error)
            return
        with self._lock:
            self._counts["l3_written_blocks"] += n - handle.skipped
            self._counts["l3_skipped_blocks"] += handle.skipped
            self._counts["l3_written_bytes"] += handle.nbytes

    def _puts_begin(self, n):
        with self._lock:
            self._l3_outstanding += n

    def _puts_end(self, n, unwritten):
        with self._lock:
            self._l3_outstanding -= n
            self._l3_unwritten += unwritten
            if not self._l3_outstanding:
                self._l3_idle.notify_all()

    def flush(self, timeout: float = 30.0) -> int:
        """Wait up to `timeout` seconds until every put this cache has queued or submitted to the store has
        finished. Returns how many of the blocks it tried to put since the last flush are not in the store:
        failed, skipped by a full store, or still in flight at the timeout (0: every one landed)."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= 86400:
            raise ValueError(f"flush timeout must be a number of seconds in [0, 86400], got {timeout!r}")
        with self._lock:
            self._l3_idle.wait_for(lambda: not self._l3_outstanding, timeout)
            lost, self._l3_unwritten = self._l3_unwritten + self._l3_outstanding, 0
        return lost

    def _l3_failed(self, why: str):
        with self._lock:
            self._counts["l3_errors"] += 1
            first = self._l3_prober is None and not self._closed
            if first:
                self._l3_prober = threading.Thread(target=self._probe, args=(L3_BACKOFF,), name="fastcache-l3-probe",
                                                   daemon=True)
                self._l3_prober.start()
        if first:
            log.warning("L3 store set aside for %.0f s, then probed (the CPU tier serves meanwhile): %s",
                        L3_BACKOFF, why)

    def _probe(self, wait: float):
        """After the pause, ask the store (the engine's client: one existence query) until it answers."""
        while not self._l3_closing.wait(wait):
            try:
                self.backend.store_contains(self._namespace, [0])
            except (TransferError, ValueError) as exc:
                log.debug("L3 store probe: %s", exc)
                wait = L3_PROBE_INTERVAL
                continue
            with self._lock:
                self._l3_prober = None
            log.info("L3 store answers again: back in use")
            return

    # -- lookup ------------------------------------------------------------------------------------
    def _l3_extend(self, keys, n, in_l2):
        """The leading run of keys[n:] held by the CPU tier (in_l2) or the store: (run, of which store-only)."""
        try:
            in_l3 = self.backend.store_contains(self._namespace, keys[n:])
        except (TransferError, ValueError) as exc:
            self._l3_failed(f"lookup: {exc}")
            return 0, 0
        run = from_l3 = 0
        for l2, l3 in zip(in_l2, in_l3.tolist()):
            if not (l2 or l3):
                break
            run += 1
            from_l3 += not l2
        return run, from_l3

    # -- load through the store ----------------------------------------------------------------------
    def _load_l3(self, keys, gpu, fences=()):
        """load() when some hashes are not in the CPU tier: fetch them from the store first. Returns None
        when the CPU tier turns out to hold them all (the caller then loads as usual)."""
        with self._lock:
            self._busy += 1                 # see TieredCache._busy
        try:
            return self._fetch_and_load(keys, gpu, fences)
        finally:
            self._end()

    def _fetch_and_load(self, keys, gpu, fences):
        with self._lock:
            self._check_usable()
            namespace = self._namespace
            wanted = list(dict.fromkeys(k for k in keys if k not in self._visible))
            usable = self._l3_usable()
        if not wanted:                      # stored meanwhile: the CPU tier has them all (the caller loads them)
            return None
        if not usable:
            raise ValueError(f"hash {wanted[0]:#x} is not held by the CPU tier, and the store is "
                             f"{'set aside after an error' if self._l3 else 'not configured'}")
        try:
            present = self.backend.store_contains(namespace, wanted)
        except (TransferError, ValueError) as exc:
            self._l3_failed(f"load: {exc}")
            raise TransferError(f"load: the store failed: {exc}") from None
        if not present.all():
            raise ValueError(f"hash {wanted[int(np.flatnonzero(~present)[0])]:#x} is held by neither the CPU tier "
                             f"nor the store; lookup() says how many leading hashes can be loaded")
        with self._lock:
            self._check_usable()
            if namespace != self._namespace:
                raise TransferError("the namespace changed during the load")
            # the lock was let go while the store was asked: decide again from what the CPU tier holds now
            fetch = [k for k in dict.fromkeys(keys) if k not in self._visible]
            if not fetch:                   # the CPU tier has them all by now
                return None
            asked = set(wanted)
            moved = next((k for k in fetch if k not in asked or k in self._index), None)
            if moved is not None:           # evicted since (maybe stored again), or being stored or fetched
                raise ValueError(f"hash {moved:#x} left the CPU tier or is being stored or fetched right now; "
                                 f"retry the load")
            quota = self._quota
            blocks = self._take_blocks(len(fetch), keys)
            taken = self._take_victims()
            full = len(blocks) < len(fetch)
            if full:
                self._counts["store_full"] += len(fetch)
            else:
                new = [[block, self._quota, 0, STORING] for block in blocks]
                self._index.update(zip(fetch, new))
                # the store hits come up through the CPU tier: to the policy, one store of the load's hashes
                # (the fetched ones new, the others held and refreshed), as trace_model's tier does it
                self._policy.stored(list(dict.fromkeys(keys)), fetch)
                entries = [self._index[k] for k in keys]
                for entry in entries:
                    entry[PINS] += 1
                self._pinned += len(entries)
                drops = self._drops
        self._write_back(taken)             # before the fetch that reuses the evicted blocks
        if full:        # the blocks go back only now: a put of an evicted one must be queued before any reuse
            with self._lock:
                self._give_back(blocks, quota)
            raise TransferError(f"load: no CPU block free for {len(fetch)} store hits: the CPU tier's "
                                f"{self.capacity} blocks hold this load's other hashes or are in use by transfers")
        batch = (keys, entries, fetch, new, drops)
        try:
            fetched = self.backend.store_to_cpu(namespace, fetch, [e[BLOCK] for e in new])
        except BaseException:
            self._l3_undo(batch)
            raise
        try:
            swap = self.backend.submit_checked_swap(protocol.SWAP_TO_GPU, gpu, [e[BLOCK] for e in entries], fences)
        except BaseException:
            fetched.add_done_callback(lambda _: self._l3_undo(batch))     # not before the fetch is over
            raise
        handle = CombinedHandle([fetched, swap], protocol.SWAP_TO_GPU, swap.nbytes)
        handle.add_done_callback(lambda h: self._l3_loaded(h, fetched, batch))
        return handle

    def _l3_loaded(self, handle, fetched, batch):
        keys, entries, fetch, new, drops = batch
        ok = handle.error is None
        with self._lock:
            for key, entry in zip(fetch, new):
                if ok and self._index.get(key) is entry:
                    entry[STATE] = READY
                    self._visible.add(key)
                    self._known().add(key)
                else:
                    entry[STATE] = DONE
            if ok:
                self._counts["l3_loaded_blocks"] += len(fetch)
                self._counts["l3_loaded_bytes"] += fetched.nbytes
        # a miss is the store working, and a lost rank (dead, restarted) says nothing about it; any other
        # rank's error is the store's, beside another rank's miss too
        if fetched.error is not None and any(MISS not in error for error in fetched.own_errors()):
            self._l3_failed(fetched.error)
        self._loaded(handle, (keys, entries, drops))

    def _l3_undo(self, batch):
        """A load that could not be submitted: drop the fetched entries, unpin everything."""
        keys, entries, fetch, new, _ = batch
        with self._lock:
            for key, entry in zip(fetch, new):
                entry[STATE] = DONE
                self._drop(key, entry)
            for key, entry in zip(keys, entries):
                self._unpin(key, entry)

    def _stop_l3(self):
        self._l3_closing.set()              # a prober returns at its next wait
        writer, self._l3_writer = self._l3_writer, None
        if writer is not None:
            self._l3_jobs.put(None)
            writer.join(timeout=10)
