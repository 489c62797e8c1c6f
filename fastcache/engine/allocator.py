"""The engine-side CPU block allocator: hands out the lowest free ids, so tasks get long runs of
consecutive CPU blocks (fewer, larger copies on the device)."""
from __future__ import annotations

import heapq


class CpuBlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.reset()

    def reset(self):
        """Every block free again (after a clear every cached block is stale)."""
        self._free = list(range(self.num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"number of CPU blocks must be a non-negative int, got {n!r}")
        if n > len(self._free):
            raise ValueError(f"asked for {n} CPU blocks, only {len(self._free)} of {self.num_blocks} are free")
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids):
        ids = [int(i) for i in ids]
        not_used = [i for i in ids if i not in self._used]
        if not_used or len(set(ids)) != len(ids):
            raise ValueError(f"CPU blocks not allocated (or listed twice): {sorted(set(not_used)) or ids}")
        for i in ids:
            self._used.remove(i)
            heapq.heappush(self._free, i)
