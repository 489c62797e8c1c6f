"""vLLM's offload keys as fastcache's 64-bit hashes, and vLLM's chunks as fastcache CPU blocks (no vLLM import).

A key is a 32-byte block hash (SHA-256 based) plus a 4-byte KV group index. The CPU tier's index keys on the
whole key, so two keys never share an entry. Only L3 objects are named by 64 bits: the hash's first 8 bytes
with the group mixed in (and, for a chunk of several blocks, the block's place in it). Two different keys
meet there with probability about n²/2^65 for n stored blocks (1e-8 at 1e6 blocks); such a meeting would
serve the other key's bytes, which is why the namespace names the model and weight version.
"""
from __future__ import annotations

import numpy as np

MASK = (1 << 64) - 1
SMALL = 64                            # GPU blocks a transfer may have for gpu_to_cpu_blocks' plain-Python path
_GOLDEN = 0x9E3779B97F4A7C15          # odd constant: spreads small integers over 64 bits


def key_hash(key: bytes) -> int:
    """64-bit hash of a vLLM OffloadKey (block hash + 4-byte big-endian group index)."""
    group = int.from_bytes(key[-4:], "big")
    return int.from_bytes(key[:8], "little") ^ ((group * _GOLDEN) & MASK)


def block_hashes(keys, blocks_per_chunk: int) -> np.ndarray:
    """The L3 name of each fastcache CPU block of these chunks, chunk by chunk."""
    base = np.array([key_hash(k) for k in keys], dtype=np.uint64)
    if blocks_per_chunk == 1:
        return base
    step = (np.arange(blocks_per_chunk, dtype=np.uint64) * np.uint64(_GOLDEN))
    return (base[:, None] + step[None, :]).reshape(-1)       # wraps modulo 2^64, as intended


def chunk_blocks(chunks, blocks_per_chunk: int) -> np.ndarray:
    """Every fastcache CPU block of these chunks, in order."""
    chunks = np.asarray(chunks, dtype=np.int64)
    return (chunks[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk)).reshape(-1)


def gpu_to_cpu_blocks(gpu_ids, group_sizes, block_indices, chunks, blocks_per_chunk: int):
    """Pair each GPU block of a vLLM transfer with its fastcache CPU block: (GPU ids, CPU ids), lists of ints for
    a transfer of at most SMALL GPU blocks (paired in plain Python: a one-block job's NumPy calls cost more than
    the rest of its submission), int64 arrays otherwise; swap_out and swap_in take either, and both ways give
    the same pairs.

    GPU blocks come grouped by KV group; group g's first block is block block_indices[g] of its request, so
    its first chunk may be entered part-way (vLLM's own CPU worker counts the same way)."""
    bpc = blocks_per_chunk
    small = len(gpu_ids) <= SMALL
    if small:
        gpu_ids = gpu_ids.tolist() if isinstance(gpu_ids, np.ndarray) else [int(g) for g in gpu_ids]
        chunks = chunks.tolist() if isinstance(chunks, np.ndarray) else [int(c) for c in chunks]
    else:
        gpu_ids = np.asarray(gpu_ids, dtype=np.int64)
        chunks = np.asarray(chunks, dtype=np.int64)
    cpu, g0, c0 = [], 0, 0
    for size, first in zip(group_sizes, block_indices):
        if size == 0:
            continue
        skip = first % bpc
        used = -(-(size + skip) // bpc)
        if c0 + used > len(chunks):
            raise ValueError(f"{size} GPU blocks from block {first} need {used} chunks, "
                             f"{len(chunks) - c0} given")
        if small:
            cpu += [chunks[c0 + i // bpc] * bpc + i % bpc for i in range(skip, skip + size)]
        else:
            logical = np.arange(size) + skip
            cpu.append(chunks[c0 + logical // bpc] * bpc + logical % bpc)
        g0, c0 = g0 + size, c0 + used
    if g0 != len(gpu_ids) or c0 != len(chunks):
        raise ValueError(f"group sizes {list(group_sizes)} cover {g0} of {len(gpu_ids)} GPU blocks and "
                         f"{c0} of {len(chunks)} chunks")
    if small:
        return gpu_ids, cpu
    return gpu_ids, (np.concatenate(cpu) if cpu else np.zeros(0, dtype=np.int64))
