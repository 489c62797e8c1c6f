"""The deployment's store tasks (docs/design.md §8): CPU blocks to and from the store, by hash, on every rank.

The bytes never pass through the engine: each transfer manager puts or fetches its own rank's slice
(CPU_TO_STORE, STORE_TO_CPU tasks). The engine only asks the store which objects exist, through a client
of its own in a child process (store/remote.py), started on first use: a hung store costs a call at most
QUERY_TIMEOUT seconds and never stalls the engine's other threads.

A part of SwapBackend, which delegates its store methods here. It owns the store's URL and the engine's
client; what it needs of the rest of the backend it is given as callables (see StoreTasks).
"""
from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from ..config import CacheSpec
from ..errors import TransferError
from ..ipc import protocol
from ..store import ObjectKeys, StoreURL, as_hashes, check_namespace, fingerprint, parse_store_url
from ..store.remote import RemoteStore
from .handle import TransferHandle
from .ids import as_cpu_ids


class StoreTasks:
    """The store side of one deployment.

    geometry() gives the spec and tp_size now (a reshard changes both); new_task(kind, nbytes, what) is the
    handle of a task about to be sent, or why none can be (RefusedError, TransferError); send_task(handle,
    message) sends it to every rank; closed() says whether the backend is closed (no client may start then);
    gate: a SubmitGate a submission holds from its status check, before it reads the geometry, until it is sent."""

    def __init__(self, store: str | None, geometry: Callable[[], tuple[CacheSpec, int]],
                 new_task: Callable[..., TransferHandle], send_task: Callable[..., TransferHandle],
                 closed: Callable[[], bool], gate):
        self.url: StoreURL | None = parse_store_url(store) if store is not None else None   # ValueError first
        self._geometry, self._new_task, self._send_task, self._closed = geometry, new_task, send_task, closed
        self._gate = gate                       # a SubmitGate (engine/submit_gate.py), held from status to send
        self._client = None                     # the engine's own client (a child process), made on first use
        self._client_lock = threading.Lock()    # this deployment's alone: opening can take seconds

    def cpu_to_store(self, namespace: str, hashes, cpu_block_ids) -> TransferHandle:
        return self._submit(protocol.CPU_TO_STORE, namespace, hashes, cpu_block_ids)

    def store_to_cpu(self, namespace: str, hashes, cpu_block_ids) -> TransferHandle:
        return self._submit(protocol.STORE_TO_CPU, namespace, hashes, cpu_block_ids)

    def store_contains(self, namespace: str, hashes) -> np.ndarray:
        hashes, keys = self._keys(namespace, hashes)
        return self._client_now().exists_every_rank(keys, hashes)

    def store_remove(self, namespace: str, hashes):
        hashes, keys = self._keys(namespace, hashes)
        for rank_keys in keys:
            self._client_now().remove(rank_keys, hashes)

    def close(self):
        """Stop the engine's client, if it started (a later query starts none once the backend is closed)."""
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- helpers ---------------------------------------------------------------------------------
    def _keys(self, namespace, hashes):
        self._require_store()
        check_namespace(namespace)
        hashes = as_hashes(hashes)
        spec, tp_size = self._geometry()
        fp = fingerprint(spec, tp_size)
        return hashes, [ObjectKeys(namespace, fp, rank) for rank in range(tp_size)]

    def _require_store(self):
        if self.url is None:
            raise ValueError("this backend has no store: give SwapBackend(..., store='mooncake://HOST:PORT' "
                             "or 'file:///DIR')")

    def _submit(self, kind, namespace, hashes, cpu_block_ids) -> TransferHandle:
        self._require_store()
        check_namespace(namespace)
        hashes = as_hashes(hashes)
        self._gate.enter("store task")         # the status before the geometry the ids are checked against
        try:
            spec, tp_size = self._geometry()
            cpu_ids = as_cpu_ids(cpu_block_ids, spec.num_cpu_blocks)
            if len(hashes) != len(cpu_ids):
                raise ValueError(f"hashes has {len(hashes)} entries but cpu_block_ids has {len(cpu_ids)}")
            if not 0 < len(hashes) <= protocol.MAX_IDS:
                raise ValueError(f"a store task moves 1..{protocol.MAX_IDS} blocks, got {len(hashes)}")
            if len(np.unique(hashes)) != len(hashes):
                raise ValueError("duplicate hashes")
            handle = self._new_task(kind, len(cpu_ids) * spec.cpu_block_bytes * tp_size, "store task")
            return self._send_task(handle, protocol.encode_store_task(handle.task_id, kind, namespace, hashes,
                                                                      cpu_ids))
        finally:
            self._gate.leave()

    def _client_now(self):
        with self._client_lock:
            if self._closed():              # a cache's probe after close must not start a new client
                raise TransferError("the backend is closed")
            if self._client is None:
                self._client = RemoteStore(self.url.url)
            return self._client
