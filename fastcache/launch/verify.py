"""What a deployment's blocks must hold, checked bit for bit.

`Checks` counts passed and failed checks; `Verifier` keeps the expected bytes of every GPU and CPU block
of every rank through swaps. `HashBytes`: bytes derived from a block hash, so a tier can be checked without keeping a copy of what it holds.

The block named by hash h holds, on rank r, a window of a fixed random pool chosen by a 64-bit mix of
(h, r), XORed with that mix: random-looking, non-zero in practice, different for every hash and every
rank (a rank that received another rank's slice, or a block that received another block, shows). The
image of a block is its block-major CPU layout (docs/design.md §3): every tensor's row at its cpu_offset.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..engine import SwapBackend
from ..ipc.manifest import read_manifest
from ..ops import get_ops


class Checks:
    def __init__(self):
        self.passed, self.failed = 0, []

    def check(self, ok: bool, what: str):
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
            print(f"  CHECK FAILED: {what}", flush=True)


class Verifier:
    """Keeps the expected bytes of every GPU and CPU block of every rank and compares them after swaps."""

    def __init__(self, backend: SwapBackend, device: str, rng):
        self.backend, self.spec, self.rng = backend, backend.spec, rng
        self.ops = get_ops(device)
        self.infos = [self.spec.tensors(r, backend.device_ids[r]) for r in range(backend.tp_size)]
        self.layout = self.spec.tensors()     # geometry, the same on every rank
        self.attached = []
        self.gpu = []      # rank -> tensor -> expected uint8 rows
        self.cpu = [np.zeros((self.spec.num_cpu_blocks, self.spec.cpu_block_bytes), np.uint8)
                    for _ in range(backend.tp_size)]

    def attach(self):
        suffix = self.backend.suffix
        self.attached = [self.ops.attach(read_manifest(suffix, r), self.infos[r], suffix)
                         for r in range(self.backend.tp_size)]

    def detach(self):
        for cache in self.attached:
            cache.close()
        self.attached = []

    def fill_all(self):
        """Random bytes in every block of every tensor (never zeros: a missed copy must show)."""
        self.gpu = []
        for cache in self.attached:
            rows = [self.rng.integers(0, 256, (i.num_blocks, i.block_bytes), np.uint8) for i in cache.infos]
            for index, r in enumerate(rows):
                cache.write(index, r)
            self.gpu.append(rows)

    def overwrite(self, blocks):
        for cache, expected in zip(self.attached, self.gpu):
            for index, info in enumerate(cache.infos):
                mine = blocks[blocks < info.num_blocks]
                fresh = self.rng.integers(0, 256, (len(mine), info.block_bytes), np.uint8)
                cache.write(index, fresh, mine)
                expected[index][mine] = fresh

    def swapped_out(self, gpu_ids, cpu_ids):
        for expected, cpu in zip(self.gpu, self.cpu):
            for rows, info in zip(expected, self.layout):
                keep = gpu_ids < info.num_blocks
                cpu[cpu_ids[keep], info.cpu_offset:info.cpu_offset + info.block_bytes] = rows[gpu_ids[keep]]

    def swapped_in(self, gpu_ids, cpu_ids):
        for expected, cpu in zip(self.gpu, self.cpu):
            for rows, info in zip(expected, self.layout):
                keep = gpu_ids < info.num_blocks
                rows[gpu_ids[keep]] = cpu[cpu_ids[keep], info.cpu_offset:info.cpu_offset + info.block_bytes]

    def cpu_matches(self, cpu_ids) -> bool:
        return all(np.array_equal(self.backend.cpu_tier(r)[cpu_ids], self.cpu[r][cpu_ids])
                   for r in range(self.backend.tp_size))

    def gpu_matches(self, gpu_ids) -> bool:
        for cache, expected in zip(self.attached, self.gpu):
            for index, info in enumerate(cache.infos):
                mine = gpu_ids[gpu_ids < info.num_blocks]
                if not np.array_equal(cache.read(index, mine), expected[index][mine]):
                    return False
        return True


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
