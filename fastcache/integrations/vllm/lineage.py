"""The weights' identity in every L3 key: a content fingerprint of the checkpoint an engine serves (no vLLM
import).

KV bytes are a function of the weights, the model's config and the dtypes, so the default namespace binds
all of them: two engines on the same bytes share, anything else misses. The checkpoint is named by what it
holds, never by where it lies or when it was written: every weight file's name, size and the xxh3-128 digest
of every byte (in pieces of `PIECE` bytes, hashed by a few threads: xxhash releases the GIL), so a
checkpoint overwritten in place (even with its old mtime), another checkpoint under the same model name, and
a copy of the same checkpoint on another host are all told apart correctly.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import xxhash

PIECE = 64 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class LineageError(ValueError):
    """The weights an engine serves cannot be named by their content."""


def weight_files(path: str) -> list[str]:
    """The files vLLM's loaders read the weights from: a .gguf file itself, or a directory's top-level
    safetensors files (vLLM prefers them), else its .bin/.pt/.pth files."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise LineageError(f"{path!r} is not a local file or directory")
    names = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)))
    for suffixes in ((".safetensors",), WEIGHT_SUFFIXES[1:]):
        files = [os.path.join(path, n) for n in names if n.endswith(suffixes)]
        if files:
            return files
    raise LineageError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {path!r}")


def _piece_digest(job) -> bytes:
    path, offset, length = job
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return xxhash.xxh3_128_digest(memoryview(m)[offset:offset + length])


def checkpoint_digest(path: str, threads: int | None = None) -> str:
    """Hex digest of the weights under `path`: file names (relative), sizes and every byte's content."""
    files = weight_files(path)
    root = path if os.path.isdir(path) else os.path.dirname(path)
    jobs, layout = [], []
    for f in files:
        size = os.path.getsize(f)
        layout.append((os.path.relpath(f, root), size))
        jobs += [(f, off, min(PIECE, size - off)) for off in range(0, size, PIECE)]
    threads = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastcache-lineage") as pool:
        pieces = list(pool.map(_piece_digest, jobs))
    h = hashlib.blake2b(json.dumps(layout).encode(), digest_size=16)
    for digest in pieces:
        h.update(digest)
    return h.hexdigest()


def default_namespace(name: str, weights_digest: str, parts: dict) -> str:
    """`{name}/w{digest}`: a name for people (the architecture, never the path: copies of one checkpoint at
    two paths must share), then one digest of the weights' content and everything else that shapes the KV
    bytes (`parts`: the model config as loaded, dtypes, quantization)."""
    h = hashlib.blake2b(weights_digest.encode(), digest_size=16)
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    label = "".join(c if c.isprintable() else "_" for c in str(name))[-120:] or "model"
    return f"{label}/w{h.hexdigest()}"
