"""What the scheduler's manager hands a worker for one job (vLLM carries it inside its connector metadata)."""
from __future__ import annotations

import uuid

import numpy as np
from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec


def rank_namespace(namespace: str, generation: int, rank: int, world_size: int, reset_scope: str | None = None) -> str:
    """L3 namespace of one worker rank's slices: each vLLM worker runs its own one-rank deployment, so the
    rank and the weight generation (reset count) go into the name.

    reset_scope (engine_scope(): vLLM's engine id and the worker process's own number, under a default
    namespace): after a reset the weights came into this engine by a path fastcache cannot see, so their KV
    is named by this engine start alone; another engine, or this one started again, reset as many times, to
    other weights, must not meet it. An explicit namespace has no scope: its user promised that the
    namespace and the reset count name the weights."""
    if generation and reset_scope:
        return f"{namespace}/{reset_scope}/gen{generation}/tp{world_size}r{rank}"
    return f"{namespace}/gen{generation}/tp{world_size}r{rank}"


def engine_scope(engine_id: str) -> str:
    """A worker's reset scope under a default namespace: vLLM's engine id, which the user may set and keep
    across restarts, and a number of this process's own, so that no other engine start, under any id, meets
    the KV of weights this one was given unseen."""
    return f"{engine_id}-{uuid.uuid4().hex[:16]}"


class FastcacheStoreSpec(BlockIDsLoadStoreSpec):
    """CPU chunks to fill, with the stamp each worker writes once a chunk's bytes landed, and (with L3) the
    objects' hashes, chunk by chunk."""

    def __init__(self, chunks, stamps: np.ndarray, hashes: np.ndarray, generation: int):
        super().__init__(list(chunks))
        self.stamps, self.hashes, self.generation = stamps, hashes, generation


class FastcacheLoadSpec(BlockIDsLoadStoreSpec):
    """CPU chunks to read; `fetch` marks chunks that first come up from L3 (their hashes, in order)."""

    def __init__(self, chunks, fetch: np.ndarray, stamps: np.ndarray, hashes: np.ndarray, generation: int):
        super().__init__(list(chunks))
        self.fetch, self.stamps, self.hashes, self.generation = fetch, stamps, hashes, generation
