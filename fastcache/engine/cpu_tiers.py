"""The CPU tier of each rank (docs/design.md §3, §6): one shared-memory segment per rank, created and owned by
the engine, so that a transfer manager's restart loses no swapped-out block.

A part of SwapBackend, the one owner of the segments: start and restore create them, a clear that releases
the CPU tier (FASTCACHE_CLEAR_SWAP_SPACE=1) and close release them, and a reshard grows, creates, drops and
keeps them per rank (engine/reshard_host.py).
"""
from __future__ import annotations

import numpy as np

from ..config import CacheSpec
from ..errors import TransferError
from ..ipc.naming import swap_space_name
from ..ipc.shm import SharedSegment


class CpuTiers:
    """The CPU tiers of one deployment's ranks (suffix names them), None for a rank that has none now. The list
    is replaced, never changed in length in place."""

    def __init__(self, tp_size: int, suffix: str):
        self._suffix = suffix
        self._segments: list[SharedSegment | None] = [None] * tp_size

    @property
    def size(self) -> int:
        """Ranks with room here (during a reshard, those of both tps)."""
        return len(self._segments)

    def has(self, rank: int) -> bool:
        return self._segments[rank] is not None

    def create(self, rank: int, spec: CacheSpec):
        """Rank's CPU tier for spec, unless it has one."""
        if self._segments[rank] is None:
            self._segments[rank] = SharedSegment.create(swap_space_name(self._suffix, rank), spec.cpu_cache_bytes,
                                                        self._suffix)

    def create_all(self, spec: CacheSpec, tp: int):
        """The CPU tier of every rank below tp that has none."""
        for rank in range(tp):
            self.create(rank, spec)

    def release(self):
        """Every rank's CPU tier goes."""
        for rank, seg in enumerate(self._segments):
            if seg is not None:
                seg.close()
                self._segments[rank] = None

    def drop(self, rank: int):
        """Rank's CPU tier goes (a retired rank's)."""
        seg, self._segments[rank] = self._segments[rank], None
        if seg is not None:
            seg.close()

    def grow(self, tp: int):
        """Room for ranks up to tp, none with a CPU tier yet."""
        grow = tp - len(self._segments)
        if grow > 0:
            self._segments = self._segments + [None] * grow

    def keep(self, tp: int):
        """Room for the ranks below tp only (those from tp on have been dropped)."""
        self._segments = self._segments[:tp]

    def blocks(self, rank: int, spec: CacheSpec) -> np.ndarray:
        """Rank's CPU tier as uint8 [num_cpu_blocks, cpu_block_bytes], a view of its blocks without their slots."""
        seg = self._segments[rank]
        if seg is None:
            raise TransferError(f"rank {rank} has no CPU tier (released by clear_caches)")
        return seg.array(np.uint8, (spec.num_cpu_blocks, spec.cpu_block_stride))[:, :spec.cpu_block_bytes]
