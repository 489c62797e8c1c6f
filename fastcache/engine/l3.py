"""SwapBackend's L3 methods (docs/design.md §8): CPU blocks to and from the store, by hash, on every rank.

The bytes never pass through the engine: each transfer manager puts or fetches its own rank's slice
(CPU_TO_STORE, STORE_TO_CPU tasks). The engine only asks the store which objects exist, through a client
of its own in a child process (store/remote.py), started on first use: a hung store costs a call at most
QUERY_TIMEOUT seconds and never stalls the engine's other threads.
"""
from __future__ import annotations

import threading

import numpy as np

from ..errors import TransferError
from ..ipc import protocol
from ..store import ObjectKeys, StoreURL, as_hashes, check_namespace, fingerprint, parse_store_url
from ..store.remote import RemoteStore
from .handle import TransferHandle
from .ids import as_cpu_ids


class StoreTasks:
    """Mixed into SwapBackend, whose __init__ calls _init_store_tasks."""
    store_url: StoreURL | None = None

    def _init_store_tasks(self, store: str | None):
        self.store_url = parse_store_url(store) if store is not None else None
        self._store = None                      # the engine's own client (a child process), made on first use
        self._store_lock = threading.Lock()

    def cpu_to_store(self, namespace: str, hashes, cpu_block_ids) -> TransferHandle:
        """Put CPU block cpu_block_ids[i] of every rank into the store as the object of hashes[i]."""
        return self._submit_store(protocol.CPU_TO_STORE, namespace, hashes, cpu_block_ids)

    def store_to_cpu(self, namespace: str, hashes, cpu_block_ids) -> TransferHandle:
        """Fetch the object of hashes[i] of every rank into CPU block cpu_block_ids[i]. The handle fails
        (TransferError naming the store) if any object is missing or does not match its header; those
        CPU blocks then hold undefined bytes."""
        return self._submit_store(protocol.STORE_TO_CPU, namespace, hashes, cpu_block_ids)

    def store_contains(self, namespace: str, hashes) -> np.ndarray:
        """A bool per hash: does the store hold its object for every rank? (Existence only: a fetch still
        checks each header.) StoreError if the store does not answer within QUERY_TIMEOUT seconds."""
        hashes, keys = self._store_keys(namespace, hashes)
        return self._store_client().exists_every_rank(keys, hashes)

    def store_remove(self, namespace: str, hashes):
        """Remove the objects of these hashes, every rank's (absent ones are ignored)."""
        hashes, keys = self._store_keys(namespace, hashes)
        for rank_keys in keys:
            self._store_client().remove(rank_keys, hashes)

    # -- helpers ---------------------------------------------------------------------------------
    def _store_keys(self, namespace, hashes):
        self._require_store()
        check_namespace(namespace)
        hashes = as_hashes(hashes)
        fp = fingerprint(self.spec, self.tp_size)
        return hashes, [ObjectKeys(namespace, fp, rank) for rank in range(self.tp_size)]

    def _require_store(self):
        if self.store_url is None:
            raise ValueError("this backend has no store: give SwapBackend(..., store='mooncake://HOST:PORT' "
                             "or 'file:///DIR')")

    def _submit_store(self, kind, namespace, hashes, cpu_block_ids) -> TransferHandle:
        self._require_store()
        check_namespace(namespace)
        hashes = as_hashes(hashes)
        cpu_ids = as_cpu_ids(cpu_block_ids, self.spec.num_cpu_blocks)
        if len(hashes) != len(cpu_ids):
            raise ValueError(f"hashes has {len(hashes)} entries but cpu_block_ids has {len(cpu_ids)}")
        if not 0 < len(hashes) <= protocol.MAX_IDS:
            raise ValueError(f"a store task moves 1..{protocol.MAX_IDS} blocks, got {len(hashes)}")
        if len(np.unique(hashes)) != len(hashes):
            raise ValueError("duplicate hashes")
        handle = self._new_task(kind, len(cpu_ids) * self.spec.cpu_block_bytes * self.tp_size, "store task")
        return self._send_task(handle, protocol.encode_store_task(handle.task_id, kind, namespace, hashes, cpu_ids))

    def _store_client(self):
        with self._store_lock:
            if getattr(self, "_closed", False):     # a cache's probe after close must not start a new client
                raise TransferError("the backend is closed")
            if self._store is None:
                self._store = RemoteStore(self.store_url.url)
            return self._store

    def _close_store(self):
        with self._store_lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()
