"""The engine-side CPU block allocator: hands out the lowest free ids, so tasks get long runs of
consecutive CPU blocks (fewer, larger copies on the device). Thread-safe: engine threads and a
TieredCache share it."""
from __future__ import annotations

import heapq
import threading


class CpuBlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._lock = threading.Lock()
        self.generation = 0         # counts resets, so a holder of blocks (TieredCache) sees they are gone
        self._free = list(range(self.num_blocks))
        self._used: set[int] = set()
        self._frozen = None         # why allocate is refused (a reshard renumbers the blocks)

    def freeze(self, why: str):
        """Refuse allocate (TransferError) until thaw(): the blocks are being renumbered."""
        self._frozen = why

    def thaw(self):
        self._frozen = None

    def used_ids(self) -> set:
        with self._lock:
            return set(self._used)

    def remap(self, mapping: dict, num_blocks: int):
        """After a reshard of the CPU tier: num_blocks blocks, used ones renamed by mapping; used blocks it
        does not name (TieredCache quotas, taken again by their caches) become free."""
        with self._lock:
            self._used = {mapping[b] for b in self._used if b in mapping}
            self.num_blocks = num_blocks
            self._free = sorted(set(range(num_blocks)) - self._used)     # sorted: a valid heap

    def reset(self):
        """Every block free again (after a clear every cached block is stale)."""
        with self._lock:
            self._free = list(range(self.num_blocks))
            self._used = set()
            self.generation += 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"number of CPU blocks must be a non-negative int, got {n!r}")
        if self._frozen is not None:
            from ..errors import TransferError
            raise TransferError(f"CPU blocks cannot be allocated now: {self._frozen}")
        with self._lock:
            if n > len(self._free):
                raise ValueError(f"asked for {n} CPU blocks, only {len(self._free)} of {self.num_blocks} are free")
            ids = [heapq.heappop(self._free) for _ in range(n)]
            self._used.update(ids)
            return ids

    def free(self, ids):
        ids = [int(i) for i in ids]
        with self._lock:
            not_used = [i for i in ids if i not in self._used]
            if not_used or len(set(ids)) != len(ids):
                raise ValueError(f"CPU blocks not allocated (or listed twice): {sorted(set(not_used)) or ids}")
            for i in ids:
                self._used.remove(i)
                heapq.heappush(self._free, i)
