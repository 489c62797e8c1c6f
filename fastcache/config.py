"""Cache geometry (CacheSpec) and process settings (FASTCACHE_* environment variables)."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass

import numpy as np

# Bytes per element of each supported dtype. bfloat16 has no NumPy dtype: NumPy callers see uint16 storage.
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}
CACHE_DTYPES = ("bfloat16", "float16", "uint8", "block_wise_fp8")
SCALE_DTYPES = ("float32", "bfloat16", "float16")
# Bytes after each CPU block per KV head: scratch room where an L3 task lays the object header beside the
# block's bytes, so that header and block move as one buffer. Per head, so that a rank's CPU tier holds the
# same bytes per head-block at any tp (resharding rewrites it in place).
CPU_SLOT_BYTES_PER_HEAD = 64


MAX_NAMESPACE_CHARS = 256


def check_namespace(namespace) -> str:
    """A namespace names a model and weight version; it goes into keys and paths, so it is kept printable."""
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace must be a non-empty str, got {namespace!r}")
    if len(namespace) > MAX_NAMESPACE_CHARS:
        raise ValueError(f"namespace has {len(namespace)} characters, at most {MAX_NAMESPACE_CHARS} allowed")
    if not namespace.isprintable():
        raise ValueError(f"namespace {namespace!r} holds non-printable characters")
    return namespace


@dataclass(frozen=True)
class TensorInfo:
    """One exported tensor of a rank: a stack of `num_blocks` contiguous rows of `block_bytes`."""
    name: str            # FastDeploy's name, e.g. key_caches_3_rank0.device0
    kind: str            # key_caches | value_caches | key_cache_scales | value_cache_scales
    layer: int
    shape: tuple
    dtype: str           # element dtype of the framework tensor
    num_blocks: int
    block_bytes: int
    cpu_offset: int      # offset of this tensor's row inside one CPU block (the CPU tier is block-major)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True)
class CacheSpec:
    """Geometry of one rank's KV cache (docs/design.md §3).

    Key cache per layer: [num_gpu_blocks, num_kv_heads, block_size, head_dim]; the value cache has the
    same shape unless has_value=False. Draft layers (num_extra_layers) hold num_extra_gpu_blocks blocks:
    block ids at or above that have no draft-layer rows, so a swap moves only the main layers for them.
    block_wise_fp8 adds per-block scale tensors [num_blocks, num_kv_heads, block_size] in scale_dtype.
    """
    num_layers: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    cache_dtype: str = "bfloat16"
    has_value: bool = True
    num_extra_layers: int = 0
    num_extra_gpu_blocks: int | None = None
    scale_dtype: str = "float32"

    def __post_init__(self):
        for field in ("num_layers", "num_gpu_blocks", "num_cpu_blocks", "block_size", "num_kv_heads", "head_dim"):
            _check_int(field, getattr(self, field), minimum=1)
        _check_int("num_extra_layers", self.num_extra_layers, minimum=0)
        if self.num_extra_gpu_blocks is None:
            object.__setattr__(self, "num_extra_gpu_blocks", self.num_gpu_blocks)
        _check_int("num_extra_gpu_blocks", self.num_extra_gpu_blocks, minimum=1)
        if self.num_extra_gpu_blocks > self.num_gpu_blocks:
            raise ValueError(f"num_extra_gpu_blocks ({self.num_extra_gpu_blocks}) exceeds num_gpu_blocks "
                             f"({self.num_gpu_blocks})")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"unknown cache_dtype {self.cache_dtype!r}; expected one of {CACHE_DTYPES}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"unknown scale_dtype {self.scale_dtype!r}; expected one of {SCALE_DTYPES}")
        if not isinstance(self.has_value, bool):
            raise ValueError(f"has_value must be a bool, got {self.has_value!r}")

    # -- derived geometry ------------------------------------------------------------------------
    @property
    def element_dtype(self) -> str:
        return "uint8" if self.cache_dtype == "block_wise_fp8" else self.cache_dtype

    @property
    def has_scales(self) -> bool:
        return self.cache_dtype == "block_wise_fp8"

    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_extra_layers

    def tensors(self, rank: int = 0, device_id: int = 0) -> list[TensorInfo]:
        """Every tensor of one rank in a fixed order: per layer K, V, K scales, V scales."""
        kinds = ["key_caches"] + (["value_caches"] if self.has_value else [])
        if self.has_scales:
            kinds += ["key_cache_scales"] + (["value_cache_scales"] if self.has_value else [])
        out, cpu_offset = [], 0
        for layer in range(self.total_layers):
            blocks = self.num_gpu_blocks if layer < self.num_layers else self.num_extra_gpu_blocks
            for kind in kinds:
                if kind.endswith("scales"):
                    row, dtype = (self.num_kv_heads, self.block_size), self.scale_dtype
                else:
                    row, dtype = (self.num_kv_heads, self.block_size, self.head_dim), self.element_dtype
                block_bytes = ELEMENT_BYTES[dtype]
                for n in row:
                    block_bytes *= n
                out.append(TensorInfo(f"{kind}_{layer}_rank{rank}.device{device_id}", kind, layer,
                                      (blocks, *row), dtype, blocks, block_bytes, cpu_offset))
                cpu_offset += block_bytes
        return out

    @functools.cached_property
    def cpu_block_bytes(self) -> int:
        """Bytes of one CPU block: the rows of every tensor of that block, side by side."""
        return sum(t.block_bytes for t in self.tensors())

    @property
    def cpu_slot_bytes(self) -> int:
        """Scratch bytes after each CPU block (room for an L3 object header; a swap may overwrite them)."""
        return CPU_SLOT_BYTES_PER_HEAD * self.num_kv_heads

    @property
    def cpu_block_stride(self) -> int:
        """Distance between CPU blocks in the tier: the block's bytes, then its slot."""
        return self.cpu_block_bytes + self.cpu_slot_bytes

    @property
    def gpu_cache_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    @property
    def cpu_cache_bytes(self) -> int:
        return self.num_cpu_blocks * self.cpu_block_stride

    @functools.cached_property
    def _row_bytes(self):
        main = sum(t.block_bytes for t in self.tensors() if t.layer < self.num_layers)
        return main, self.cpu_block_bytes - main

    def task_bytes(self, gpu_ids) -> int:
        """Bytes one rank moves for these GPU blocks (draft layers only have their first blocks)."""
        main, extra = self._row_bytes
        n = len(gpu_ids)
        if extra:
            n_extra = int((np.asarray(gpu_ids) < self.num_extra_gpu_blocks).sum())
            return main * n + extra * n_extra
        return main * n

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CacheSpec":
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a CacheSpec must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown CacheSpec fields: {sorted(unknown)}")
        return cls(**data)


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


COPY_METHODS = ("staged", "kernel", "batch", "memcpy")    # implemented by fastcache/ops/cuda.py
RESHARD_COPY_METHODS = ("gather", "2d")                   # a reshard's GPU copies: fastcache/ops/cuda_reshard.py
MIN_HEARTBEAT_INTERVAL = 0.01     # seconds; below it the beat thread (which also checks its peers) spins
# seconds; a longer timeout is a typo or a way of saying "never", and waits on it can overflow (threading
# refuses timeouts above threading.TIMEOUT_MAX, about 292 years)
MAX_TIMEOUT = 86400.0
_BOOLS = {"0": False, "false": False, "no": False, "off": False,
          "1": True, "true": True, "yes": True, "on": True}


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v):
    return isinstance(v, int) and not isinstance(v, bool)


_SECONDS = (lambda v: _number(v) and 0 < v <= MAX_TIMEOUT,
            f"must be a positive number of seconds, at most {MAX_TIMEOUT:g} (a day)")
_FAULT = (lambda v: v is None or (isinstance(v, tuple) and len(v) == 2 and all(_whole(x) for x in v)
                                  and v[0] >= 0 and v[1] >= 1),
          "must be RANK:N with N >= 1 (fault injection, for tests)")
# Settings field -> (valid?, what is allowed); the second is the message when a value is refused
RULES = {
    "heartbeat_interval": (lambda v: _number(v) and v >= MIN_HEARTBEAT_INTERVAL,
                           f"must be a number of seconds >= {MIN_HEARTBEAT_INTERVAL}, below the worker and "
                           "transfer timeouts"),
    "worker_timeout": _SECONDS,
    "transfer_timeout": _SECONDS,
    "phase_timeout": _SECONDS,
    "clear_swap_space": (lambda v: isinstance(v, bool), "must be 1 or 0 (true/false, yes/no, on/off)"),
    "reaper": (lambda v: isinstance(v, bool), "must be 1 or 0 (true/false, yes/no, on/off)"),
    "task_ring": (lambda v: isinstance(v, bool), "must be 1 or 0 (true/false, yes/no, on/off)"),
    "copy_method": (lambda v: v in COPY_METHODS, f"must be one of {', '.join(COPY_METHODS)}"),
    "reshard_copy": (lambda v: v in RESHARD_COPY_METHODS, f"must be one of {', '.join(RESHARD_COPY_METHODS)}"),
    "inline_bytes": (lambda v: _whole(v) and v >= 0, "must be a whole number of bytes >= 0"),
    "spin_us": (lambda v: _whole(v) and 0 <= v <= 1_000_000, "must be a whole number of microseconds in [0, 1000000]"),
    "staging_mb": (lambda v: _number(v) and v > 0, "must be a positive number of MiB"),
    "kernel_blocks": (lambda v: _whole(v) and v >= 1, "must be a whole number >= 1"),
    "staged_blocks": (lambda v: _whole(v) and v >= 0, "must be a whole number >= 0 (0: four per multiprocessor)"),
    "fail_every": _FAULT,
    "fail_attach": _FAULT,
}


def env_name(field: str) -> str:
    """The environment variable of a Settings field: heartbeat_interval -> FASTCACHE_HEARTBEAT_INTERVAL."""
    return "FASTCACHE_" + field.upper()


def _refuse(field, value, allowed=None):
    shown = f"{value:g}" if isinstance(value, float) else value
    return ValueError(f"{env_name(field)}={shown}: {allowed or RULES[field][1]}")


def _parse(field, default, raw):
    """One FASTCACHE_* string as the type of its field's default; Settings checks the range."""
    try:
        if isinstance(default, bool):
            return _BOOLS[raw.lower()]
        if isinstance(default, (int, float)):
            return type(default)(raw)
        if field.startswith("fail_"):
            rank, n = raw.split(":")
            return int(rank), int(n)
        return raw
    except (KeyError, ValueError):
        raise _refuse(field, raw) from None


@dataclass(frozen=True)
class Settings:
    """Process settings, read from FASTCACHE_* environment variables (inherited by child processes).

    Every value is checked on construction, so a bad one is refused at start with its variable named,
    instead of misbehaving later (a timeout that kills healthy peers, a spinning beat thread)."""
    heartbeat_interval: float = 1.0     # FASTCACHE_HEARTBEAT_INTERVAL: seconds between beats
    worker_timeout: float = 10.0        # FASTCACHE_WORKER_TIMEOUT: silent worker => its transfer manager exits
    transfer_timeout: float = 10.0      # FASTCACHE_TRANSFER_TIMEOUT: silent transfer manager => rank failed
    phase_timeout: float = 60.0         # FASTCACHE_PHASE_TIMEOUT: clear/restore barrier timeout
    clear_swap_space: bool = False      # FASTCACHE_CLEAR_SWAP_SPACE=1: clear also releases the CPU tier
    reaper: bool = True                 # FASTCACHE_REAPER=0: no reaper process (what a killed engine left stays)
    task_ring: bool = True              # FASTCACHE_TASK_RING=0: every task over the task pipes, none in shared memory
    spin_us: int = 1000                 # FASTCACHE_SPIN_US: a transfer manager stays awake this long after its last work
    copy_method: str = "staged"         # FASTCACHE_COPY_METHOD (cuda): staged | kernel | batch | memcpy
    reshard_copy: str = "gather"        # FASTCACHE_RESHARD_COPY (cuda): gather | 2d, a reshard's GPU copies
    inline_bytes: int = 4 << 20         # FASTCACHE_INLINE_BYTES: smaller tasks skip the executor thread hop
    staging_mb: float = 128.0           # FASTCACHE_STAGING_MB (cuda staged): size of each staging buffer (4 per rank)
    kernel_blocks: int = 8              # FASTCACHE_KERNEL_BLOCKS (cuda kernel): thread blocks of the copy kernel
    staged_blocks: int = 0              # FASTCACHE_STAGED_BLOCKS (cuda staged): gather/scatter thread blocks, 0: 4 per SM
    fail_every: tuple | None = None     # FASTCACHE_FAIL_EVERY=RANK:N (tests): every Nth task of RANK fails
    fail_attach: tuple | None = None    # FASTCACHE_FAIL_ATTACH=RANK:N (tests): the Nth attach of RANK fails

    def __post_init__(self):
        for field, (valid, _) in RULES.items():
            if not valid(getattr(self, field)):
                raise _refuse(field, getattr(self, field))
        for timeout in ("worker_timeout", "transfer_timeout"):
            # a peer is declared dead after `timeout` without a beat: beats must come more often than that
            if self.heartbeat_interval >= getattr(self, timeout):
                raise _refuse("heartbeat_interval", self.heartbeat_interval,
                              f"must be below {env_name(timeout)}={getattr(self, timeout):g}")

    def injected_fault(self, field: str, rank: int) -> int:
        """N of fail_every / fail_attach when it targets `rank`, else 0."""
        target = getattr(self, field)
        return target[1] if target is not None and target[0] == rank else 0

    @classmethod
    def from_env(cls, env=None) -> "Settings":
        """Settings from FASTCACHE_* variables (unset or empty: the default). Raises ValueError naming the
        variable, its value and what is allowed."""
        env = os.environ if env is None else env
        values = {}
        for f in dataclasses.fields(cls):
            raw = env.get(env_name(f.name), "").strip()
            if raw:
                values[f.name] = _parse(f.name, f.default, raw)
        return cls(**values)
