"""Bytes derived from a block hash, so a tier can be checked without keeping a copy of what it holds.

The block named by hash h holds, on rank r, a window of a fixed random pool chosen by a 64-bit mix of
(h, r), XORed with that mix: random-looking, non-zero in practice, different for every hash and every
rank (a rank that received another rank's slice, or a block that received another block, shows). The
image of a block is its block-major CPU layout (DESIGN §3): every tensor's row at its cpu_offset.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

POOL_WORDS = 1 << 19        # 4 MiB of random words: windows of it are the blocks' bytes


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class HashBytes:
    def __init__(self, spec, seed: int = 0):
        self.spec = spec
        self.block_bytes = spec.cpu_block_bytes
        self.words = -(-self.block_bytes // 8)
        pool = np.random.default_rng(seed).integers(1, 2**63, POOL_WORDS + self.words, dtype=np.uint64)
        self._windows = sliding_window_view(pool, self.words)

    def images(self, hashes, rank: int) -> np.ndarray:
        """uint8 [len(hashes), cpu_block_bytes]: what rank's blocks named by these hashes must hold."""
        h = np.asarray(hashes, dtype=np.uint64).reshape(-1)
        with np.errstate(over="ignore"):
            mix = _mix(h + np.uint64((rank + 1) * 0x9E3779B97F4A7C15 % 2**64))
        out = self._windows[mix % np.uint64(POOL_WORDS)]
        out ^= mix[:, None]
        return out.view(np.uint8)[:, :self.block_bytes]


def write_blocks(cache, gpu_ids, images: np.ndarray):
    """Write block images into an attached cache's GPU blocks (rows a draft layer lacks are skipped)."""
    gpu_ids = np.asarray(gpu_ids)
    for index, info in enumerate(cache.infos):
        keep = gpu_ids < info.num_blocks
        cache.write(index, images[keep, info.cpu_offset:info.cpu_offset + info.block_bytes], gpu_ids[keep])


def mismatched(cache, gpu_ids, images: np.ndarray) -> np.ndarray:
    """Positions in gpu_ids whose GPU bytes (every tensor) differ from the images."""
    gpu_ids = np.asarray(gpu_ids)
    bad = np.zeros(len(gpu_ids), bool)
    for index, info in enumerate(cache.infos):
        keep = np.flatnonzero(gpu_ids < info.num_blocks)
        rows = cache.read(index, gpu_ids[keep])
        want = images[keep, info.cpu_offset:info.cpu_offset + info.block_bytes]
        bad[keep] |= (rows != want).any(axis=1)
    return np.flatnonzero(bad)
