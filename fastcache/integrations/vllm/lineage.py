"""The weights' identity in every L3 key: a content fingerprint of the checkpoint an engine serves (no vLLM
import).

KV bytes are a function of the weights, the model's config and the dtypes, so the default namespace binds
all of them: two engines on the same bytes share, anything else misses. The checkpoint is named by what it
holds, never by where it lies or when it was written: the files vLLM 0.32's DefaultModelLoader reads for the
engine's load format (`weight_files`), each by relative name and size, and the xxh3-128 digest of every byte
(in pieces of `PIECE` bytes, hashed by a few threads: xxhash and pread release the GIL), so a checkpoint
overwritten in place (even with its old mtime), another checkpoint under the same model name, and a copy of
the same checkpoint on another host are all told apart correctly.

The hash is taken after vLLM loaded the weights, so it names what was loaded only if no weight file changed
since the load began: a file whose status changed (ctime, which no user can set back) at or after
`not_changed_since` (the worker process's start) is a `LineageError`, as is a file that changes while it is
hashed (read with pread, never mapped: a file truncated under a mapping kills the reader with SIGBUS).

LoRA adapters are not part of the digest (vLLM loads them per request, after the namespace is fixed): vLLM
0.32's block hash carries `("lora", lora_name, lora_path)` for every block of a LoRA request, so KV computed
under an adapter never shares a key with the base model's or with another adapter name or path. Only new
adapter bytes under the same name and path (rewritten in place) keep the old keys.
"""
from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import xxhash

PIECE = 64 << 20
READ = 4 << 20          # one pread's buffer inside a piece (within the caches: hashed while hot)
# A file's ctime is the kernel's coarse clock (up to a tick early) and /proc's start time is in 10 ms ticks:
# a process's start is taken this much early, so that every write after it reads as after.
CLOCK_SLACK_NS = 20_000_000

# vLLM 0.32 default_loader.py `_prepare_weights`: the glob patterns of each load format, tried in order, the
# first that matches wins (every format but the safetensors-only ones falls back to *.pt), and the index file
# that selects the safetensors shards.
_PATTERNS = {"hf": ("*.safetensors", "*.bin", "*.pt"),
             "safetensors": ("*.safetensors",), "fastsafetensors": ("*.safetensors",),
             "instanttensor": ("*.safetensors",), "mistral": ("consolidated*.safetensors",),
             "pt": ("*.pt",), "npcache": ("*.bin", "*.pt")}
_SAFETENSORS_ONLY = frozenset({"safetensors", "fastsafetensors", "instanttensor", "mistral"})
_INDEX = {"mistral": "consolidated.safetensors.index.json"}
_SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
# weight_utils.filter_files_not_needed_for_inference
_NOT_FOR_INFERENCE = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
LOAD_FORMATS = frozenset({"auto", *_PATTERNS})


class LineageError(ValueError):
    """The weights an engine serves cannot be named by their content."""


def _resolve_format(folder: str, load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise LineageError(f"load_format {load_format!r} does not read the weights from checkpoint files")
    if load_format != "auto":
        return load_format
    # "auto" is "mistral" if any file of the repository (every level) is consolidated*.safetensors.
    for _, _, names in os.walk(folder):
        if any(fnmatch.fnmatch(n, "consolidated*.safetensors") for n in names):
            return "mistral"
    return "hf"


def _np_cache(folder: str) -> list[str]:
    """npcache serves the numpy copies it wrote under `np/` on the first load, named by weight_names.json."""
    names_file = os.path.join(folder, "np", "weight_names.json")
    if not os.path.exists(names_file):
        return []
    try:
        with open(names_file) as f:
            names = json.load(f)
    except (OSError, ValueError) as exc:
        raise LineageError(f"cannot read npcache's {names_file!r}: {exc}") from None
    return [names_file, *(os.path.join(folder, "np", str(n)) for n in names)]


def weight_files(folder: str, load_format: str = "auto") -> list[str]:
    """The files vLLM 0.32's DefaultModelLoader reads the weights from for `load_format`, in a model
    directory (a local path or a Hugging Face snapshot): the top-level files of the first pattern that
    matches, filtered by the safetensors index as vLLM does, or, for .bin/.pt, less training-only files;
    for npcache also the numpy copies it reads. Not followed: a model class's own allow_patterns_overrides or
    secondary weights (Cosmos3, RoBERTa and a few audio models)."""
    if not os.path.isdir(folder):
        raise LineageError(f"{folder!r} is not a local model directory")
    fmt = _resolve_format(folder, load_format)
    files, safetensors = [], fmt in _SAFETENSORS_ONLY
    for pattern in _PATTERNS[fmt]:
        files = glob.glob(os.path.join(glob.escape(folder), pattern))
        if files:
            safetensors = safetensors or pattern.endswith(".safetensors")
            break
    if safetensors:
        index = os.path.join(folder, _INDEX.get(fmt, _SAFE_WEIGHTS_INDEX))
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    named = {os.path.join(folder, v) for v in json.load(f)["weight_map"].values()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise LineageError(f"cannot read the safetensors index {index!r}: {exc!r}") from None
            if named - set(files):
                raise LineageError(f"{index!r} names weight files that are missing: {sorted(named - set(files))}")
            files = [f for f in files if f in named]
    else:
        files = [f for f in files if not f.endswith(_NOT_FOR_INFERENCE)]
    if fmt == "npcache":
        files += _np_cache(folder)
    if not files:
        raise LineageError(f"no weight files for load_format {fmt!r} ({', '.join(_PATTERNS[fmt])}) in {folder!r}")
    return sorted(files)


def _identity(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise LineageError(f"cannot read weight file {path!r}: {exc}") from None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _piece_digest(job) -> bytes:
    """xxh3-128 of `length` bytes at `offset`, read with pread: a file cut short is an error, not a signal."""
    path, offset, length = job
    h = xxhash.xxh3_128()
    view = memoryview(bytearray(max(1, min(READ, length))))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise LineageError(f"cannot read weight file {path!r}: {exc}") from None
    try:
        done = 0
        while done < length:
            got = os.preadv(fd, [view[:min(len(view), length - done)]], offset + done)
            if got <= 0:
                raise LineageError(f"weight file {path!r} changed while it was hashed: it ended at byte "
                                   f"{offset + done}, {length - done} bytes short of the size it had")
            h.update(view[:got])
            done += got
    except OSError as exc:
        raise LineageError(f"cannot read weight file {path!r}: {exc}") from None
    finally:
        os.close(fd)
    return h.digest()


def checkpoint_digest(folder: str, load_format: str = "auto", threads: int | None = None,
                      not_changed_since: int | None = None) -> str:
    """Hex digest of the weights vLLM reads from `folder` for `load_format`: file names (relative), sizes and
    every byte's content. `not_changed_since` (wall-clock ns): a file changed at or after it is an error."""
    files = weight_files(folder, load_format)
    before = {f: _identity(f) for f in files}
    if not_changed_since is not None:
        for f, ident in before.items():
            if ident[4] >= not_changed_since:
                raise LineageError(f"weight file {f!r} changed (ctime {ident[4] / 1e9:.3f}) after this engine "
                                   f"began to load its weights ({not_changed_since / 1e9:.3f}): the bytes "
                                   "hashed now may not be the bytes it serves")
    jobs, layout = [], []
    for f in files:
        size = before[f][2]
        layout.append((os.path.relpath(f, folder), size))
        jobs += [(f, off, min(PIECE, size - off)) for off in range(0, size, PIECE)]
    threads = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastcache-lineage") as pool:
        pieces = list(pool.map(_piece_digest, jobs))
    for f in files:
        if _identity(f) != before[f]:
            raise LineageError(f"weight file {f!r} changed while it was hashed")
    # The layout (every name and size) frames the pieces: the same bytes split otherwise hash apart.
    h = hashlib.blake2b(json.dumps(layout).encode(), digest_size=16)
    for digest in pieces:
        h.update(digest)
    return h.hexdigest()


def process_start_ns() -> int:
    """This process's start, wall clock, in ns, taken early by CLOCK_SLACK_NS (a file changed after the start
    has a later ctime; one changed just before it may read as after: a miss, never a wrong name)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        since_boot = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        return time.time_ns() - since_boot + ticks * 10**9 // os.sysconf("SC_CLK_TCK") - CLOCK_SLACK_NS
    except (OSError, ValueError, IndexError, AttributeError):
        import psutil
        return int(psutil.Process().create_time() * 1e9) - 1_000_000_000


def default_namespace(name: str, weights_digest: str, parts: dict) -> str:
    """`{name}/w{digest}`: a name for people (the architecture, never the path: copies of one checkpoint at
    two paths must share), then one digest of the weights' content and everything else that shapes the KV
    bytes (`parts`: the model config as loaded, dtypes, quantization)."""
    h = hashlib.blake2b(weights_digest.encode(), digest_size=16)
    try:
        h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    except TypeError as exc:        # sort_keys over keys of several types (1 and "1" would also collide)
        raise LineageError(f"the namespace's parts cannot be named: a mapping mixes key types ({exc})") from None
    label = "".join(c if c.isprintable() else "_" for c in str(name))[-120:] or "model"
    return f"{label}/w{h.hexdigest()}"
