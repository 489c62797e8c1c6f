"""Checks of the ids and hashes an engine hands in, shared by SwapBackend, its store tasks and TieredCache:
each returns them in the form its caller sends, or raises ValueError naming what is wrong."""
from __future__ import annotations

import numpy as np

MASK = (1 << 64) - 1
MIN_HASH = -(1 << 63)
SMALL_IDS = 64          # a swap of at most this many blocks is checked in plain Python (the latency path)


def wire_dtype(spec):
    """The id dtype a task travels in: int32 unless a block count needs more."""
    return np.int32 if max(spec.num_gpu_blocks, spec.num_cpu_blocks) < 2**31 else np.int64


def as_ids(ids, label) -> np.ndarray:
    """Block ids as a 1-D int64 array; any integer type in a list, tuple, range or array is accepted."""
    if isinstance(ids, (str, bytes, dict, set)):
        raise ValueError(f"{label} must be a sequence of ints, got {type(ids).__name__}")
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{label} is not a sequence of ints: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{label} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{label} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{label}: block id {arr.max()} out of range")
    return arr.astype(np.int64)


def small_swap_ids(gpu_block_ids, cpu_block_ids, dest_is_cpu: bool, num_gpu_blocks: int, num_cpu_blocks: int):
    """(gpu ids, cpu ids) as lists of Python ints when a swap request is small (1..SMALL_IDS blocks: lists or
    tuples of ints, or 1-D integer arrays) and every check as_ids and protocol.check_ids make passes: in range,
    as many of each, no destination block twice. None for anything else, valid or not: the generic checks then
    decide, and name what is wrong."""
    gpu = gpu_block_ids if type(gpu_block_ids) is list else _small_list(gpu_block_ids)
    cpu = cpu_block_ids if type(cpu_block_ids) is list else _small_list(cpu_block_ids)
    if gpu is None or cpu is None:
        return None
    n = len(gpu)
    if n != len(cpu) or not 0 < n <= SMALL_IDS:
        return None
    if n == 1:                  # the common one-block task
        g, c = gpu[0], cpu[0]
        if type(g) is int and type(c) is int and 0 <= g < num_gpu_blocks and 0 <= c < num_cpu_blocks:
            return gpu, cpu
        return None
    for v in gpu:
        if type(v) is not int:      # bool, NumPy scalars, floats: the generic path
            return None
    for v in cpu:
        if type(v) is not int:
            return None
    if min(gpu) < 0 or max(gpu) >= num_gpu_blocks or min(cpu) < 0 or max(cpu) >= num_cpu_blocks:
        return None
    if len(set(cpu if dest_is_cpu else gpu)) != n:
        return None
    return gpu, cpu


def _small_list(ids):
    """ids as a list if it is a tuple or a 1-D integer array of at most SMALL_IDS ids; else None."""
    kind = type(ids)
    if kind is tuple:
        return list(ids) if len(ids) <= SMALL_IDS else None
    if kind is np.ndarray and ids.ndim == 1 and ids.size <= SMALL_IDS and ids.dtype.kind in "iu":
        return ids.tolist()
    return None


def as_gpu_ids(ids, bound) -> list[int]:
    """GPU block ids as a list of ints in 0..bound-1 (a list of Python ints skips NumPy: the common case)."""
    if isinstance(ids, (list, tuple, range)) and set(map(type, ids)) <= {int}:
        ids = list(ids)
    else:
        ids = as_ids(ids, "gpu_block_ids").tolist()
    if ids and (min(ids) < 0 or max(ids) >= bound):
        bad = next(i for i in ids if not 0 <= i < bound)
        raise ValueError(f"gpu block id {bad} out of range 0..{bound - 1}")
    return ids


def as_cpu_ids(ids, num_cpu_blocks) -> np.ndarray:
    if isinstance(ids, (str, bytes, dict, set)):
        raise ValueError(f"cpu_block_ids must be a sequence of ints, got {type(ids).__name__}")
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"cpu_block_ids must be a one-dimensional sequence of ints, got {arr.dtype} {arr.shape}")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= num_cpu_blocks):
        bad = arr[(arr < 0) | (arr >= num_cpu_blocks)][0]
        raise ValueError(f"cpu block id {int(bad)} out of range 0..{num_cpu_blocks - 1}")
    if len(np.unique(arr)) != len(arr):
        raise ValueError("duplicate cpu block ids")
    return arr


def as_hash_list(hashes) -> list[int]:
    """Hashes as Python ints in 0..2**64-1 (a negative int64 is the same 64 bits as its uint64)."""
    if isinstance(hashes, np.ndarray):
        if hashes.ndim != 1 or hashes.dtype.kind not in "iu":
            raise ValueError(f"hashes must be a 1-D integer array, got {hashes.dtype} of shape {hashes.shape}")
        wide = hashes.astype(np.uint64 if hashes.dtype.kind == "u" else np.int64, copy=False)
        return wide.view(np.uint64).tolist()
    if isinstance(hashes, (str, bytes, bytearray, dict, set, frozenset)):
        raise ValueError(f"hashes must be an ordered sequence of ints, got {type(hashes).__name__}")
    try:
        keys = list(hashes)
    except TypeError:
        raise ValueError(f"hashes must be a sequence of ints, got {type(hashes).__name__}") from None
    if set(map(type, keys)) <= {int}:              # the fast path: a list of Python ints
        if keys and (min(keys) < 0 or max(keys) > MASK):
            check_hash_range(keys)
            return [k & MASK for k in keys]
        return keys
    out = []
    for k in keys:
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
            raise ValueError(f"hashes must be ints, got {type(k).__name__} {k!r}")
        out.append(int(k))
    check_hash_range(out)
    return [k & MASK for k in out]


def check_hash_range(keys):
    for k in keys:
        if not MIN_HASH <= k <= MASK:
            raise ValueError(f"hash {k} does not fit in 64 bits")
