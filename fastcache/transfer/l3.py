"""The transfer manager's side of L3: CPU_TO_STORE and STORE_TO_CPU tasks for its own rank.

The store is opened on the first L3 task, not at start-up, so that an unreachable store never holds up
swaps; a failed open fails that task (naming the store) and the next task tries again. The rank's CPU
tier is attached to the store once and again whenever the transfer manager attaches a new one.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..config import CacheSpec
from ..ipc import protocol
from ..store import ObjectKeys, StoreError, fingerprint, open_store
from ..store.base import MISS
from .scheduler import Task

log = logging.getLogger("fastcache.transfer")


@dataclass
class StoreTask(Task):
    """A scheduler task whose blocks are CPU blocks only (gpu_ids is empty), named by hash."""
    hashes: np.ndarray = None
    namespace: str = ""


def store_task(header: dict, hashes: np.ndarray, cpu_ids: np.ndarray) -> StoreTask:
    return StoreTask(header["task_id"], header["kind"], np.empty(0, np.int64), cpu_ids, hashes=hashes,
                     namespace=header["namespace"])


class StoreIO:
    def __init__(self, url: str, rank: int):
        self.url, self.rank = url, rank
        self._store = None
        self._tier = None               # the CPU tier the store has attached
        self._keys = {}                 # (namespace, fingerprint) -> ObjectKeys
        self._lock = threading.Lock()   # both L3 executor threads may open the store
        self.skipped_full = 0           # objects a full store did not take
        self.unauthenticated = 0        # fetched objects this rank could not authenticate (left in the store)
        self._full_logged = -60.0

    def run(self, task: StoreTask, blocks: np.ndarray, spec: CacheSpec, tp_size: int) -> tuple[int, int]:
        """Execute one L3 task against the rank's CPU tier (`blocks`: each block with its slot); returns the
        bytes moved and the puts a full store skipped."""
        store = self._open(blocks, spec.cpu_block_bytes)
        fp = fingerprint(spec, tp_size)
        keys = self._keys.get((task.namespace, fp))
        if keys is None:
            keys = self._keys[(task.namespace, fp)] = ObjectKeys(task.namespace, fp, self.rank, store.sealer)
        if task.kind == protocol.CPU_TO_STORE:
            full = store.put(keys, task.hashes, task.cpu_ids)
            if full:
                self._note_full(full, len(task.cpu_ids))
            return (len(task.cpu_ids) - full) * spec.cpu_block_bytes, full
        else:
            foreign = np.zeros(len(task.hashes), bool)
            hits = store.get(keys, task.hashes, task.cpu_ids, foreign)
            if not hits.all():
                raise StoreError(f"{MISS}: store {self.url}: {int((~hits).sum())} of {len(hits)} objects missing "
                                 f"or not matching their header (evicted, foreign or corrupt), e.g. hash "
                                 f"{int(task.hashes[~hits][0]):#018x}{self._note_foreign(int(foreign.sum()))}")
        return len(task.cpu_ids) * spec.cpu_block_bytes, 0

    def _note_foreign(self, n) -> str:
        """Objects that failed authentication: counted apart and left in the store, since a wrong key (this
        deployment's or the writer's) is no proof of corruption. Logged once; returns the error's words."""
        if not n:
            return ""
        self.unauthenticated += n
        if self.unauthenticated == n:
            log.warning("rank %d: store %s holds objects this rank cannot authenticate: wrong key or foreign object "
                        "(check key_file); they are misses and stay in the store", self.rank, self.url)
        return f"; {n} of them failed authentication (wrong key or foreign object; left in the store)"

    def _note_full(self, n, asked):
        """Puts a full store skipped: later misses, not errors. The first is a WARNING naming the likely
        cause; then a line at most once a minute."""
        self.skipped_full += n
        now = time.monotonic()
        if self.skipped_full == n:
            self._full_logged = now
            log.warning("rank %d: store %s took %d of %d objects: no memory is lent to the pool (start a memory "
                        "server, or lend some with segment_mb= in the store URL) or the pool is full; skipped "
                        "puts are later misses (l3_skipped_blocks)", self.rank, self.url, asked - n, asked)
        elif now >= self._full_logged + 60:
            self._full_logged = now
            log.info("rank %d: store %s full: %d puts skipped so far (it evicts to make room)", self.rank, self.url,
                     self.skipped_full)

    def _open(self, blocks, block_bytes):
        with self._lock:
            if self._store is None:
                self._store = open_store(self.url)
            if self._tier is not blocks:
                self._store.attach(blocks, block_bytes)
                self._tier = blocks
            return self._store

    def detach(self):
        """The CPU tier is about to be unmapped: the store must let go of it first."""
        with self._lock:
            if self._store is not None and self._tier is not None:
                self._store.detach()
            self._tier = None

    def close(self):
        with self._lock:
            if self._store is not None:
                self._store.close()
            self._store, self._tier = None, None
