"""What a vLLM worker's fastcache shares with the scheduler's manager: one segment per worker rank holding
its cache geometry (JSON) and a stamp per CPU chunk.

vLLM tells the scheduler only that a job finished, never whether it succeeded (0.32 asserts success), so the
manager learns it here: a worker writes a chunk's stamp (the manager's number for that store, or L3 fetch)
once its bytes are in the CPU tier, and the manager shows an entry to lookups only when every rank wrote
the stamp it handed out. A failed or lost copy leaves an old stamp: the entry is dropped, never served.
"""
from __future__ import annotations

import json
import re
import time

import numpy as np

from ...config import CacheSpec
from ...ipc.naming import segment_name
from ...ipc.shm import SegmentError, SharedSegment

HEADER_BYTES = 4096


def link_suffix(engine_id: str) -> str:
    """A deployment-style suffix from vLLM's engine id (names and clean-up follow fastcache's rules)."""
    return "vllm-" + re.sub(r"[^A-Za-z0-9-]", "", str(engine_id))[:24]


def link_name(engine_id: str, rank: int) -> str:
    return segment_name(link_suffix(engine_id), f"link_rank{rank}")


class WorkerLink:
    """A worker rank's side: created with the rank's geometry, stamps written as copies land."""

    def __init__(self, engine_id: str, rank: int, spec: CacheSpec, num_chunks: int, namespace: str,
                 reset_scope: str | None = None):
        header = json.dumps({"spec": json.loads(spec.to_json()), "namespace": namespace,
                             "reset_scope": reset_scope}).encode()
        if len(header) > HEADER_BYTES:
            raise ValueError("link header too long")
        self.segment = SharedSegment.create(link_name(engine_id, rank), HEADER_BYTES + 8 * num_chunks,
                                            link_suffix(engine_id))
        self.segment.array(np.uint8, (len(header),))[:] = np.frombuffer(header, np.uint8)
        self.stamps = self.segment.array(np.uint64, (num_chunks,), HEADER_BYTES)

    def stamp(self, chunks, stamps):
        if len(chunks) <= 2:        # most jobs are one chunk: plain indexing beats NumPy's call overhead
            for chunk, value in zip(np.asarray(chunks).tolist(), np.asarray(stamps).tolist()):
                self.stamps[chunk] = value
            return
        self.stamps[np.asarray(chunks, dtype=np.int64)] = np.asarray(stamps, dtype=np.uint64)

    def close(self):
        self.stamps = None
        self.segment.close()


class ManagerLinks:
    """The scheduler's view of every worker rank's link, attached on first use (workers create theirs when
    vLLM registers its KV caches, before the scheduler exists)."""

    def __init__(self, engine_id: str, world_size: int, wait: float = 60.0):
        self.engine_id, self.world_size, self._wait = engine_id, world_size, wait
        self._segments = None
        self._stamps = []
        self.spec: CacheSpec | None = None
        self.namespace: str | None = None
        self.reset_scopes: list[str | None] = []        # each rank's: its worker process names its own

    def _attach(self):
        if self._segments is not None:
            return
        deadline, segments = time.monotonic() + self._wait, []
        try:
            for rank in range(self.world_size):
                while True:
                    try:
                        segments.append(SharedSegment.attach(link_name(self.engine_id, rank)))
                        break
                    except SegmentError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)
        except BaseException:
            for seg in segments:
                seg.close()
            raise
        headers = [json.loads(bytes(seg.array(np.uint8, (HEADER_BYTES,))).rstrip(b"\0")) for seg in segments]
        self.spec, self.namespace = CacheSpec(**headers[0]["spec"]), headers[0]["namespace"]
        self.reset_scopes = [header.get("reset_scope") for header in headers]
        num_chunks = (segments[0].size - HEADER_BYTES) // 8
        self._stamps = [seg.array(np.uint64, (num_chunks,), HEADER_BYTES) for seg in segments]
        self._segments = segments

    def stamped(self, chunks, stamps) -> np.ndarray:
        """A bool per chunk: did every rank write its stamp?"""
        self._attach()
        if len(chunks) <= 2:        # most checks are one chunk: plain indexing beats NumPy's call overhead
            return np.array([all(int(rank_stamps[c]) == s for rank_stamps in self._stamps)
                             for c, s in zip(chunks, stamps)], dtype=bool)
        chunks = np.asarray(chunks, dtype=np.int64)
        stamps = np.asarray(stamps, dtype=np.uint64)
        ok = np.ones(len(chunks), dtype=bool)
        for rank_stamps in self._stamps:
            ok &= rank_stamps[chunks] == stamps
        return ok

    def geometry(self) -> tuple[CacheSpec, str]:
        self._attach()
        return self.spec, self.namespace

    def close(self):
        self._stamps = []
        for seg in self._segments or ():
            seg.close()
        self._segments = None
