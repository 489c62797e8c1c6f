"""Cache geometry (CacheSpec) and process settings (FASTCACHE_* environment variables)."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass

import numpy as np

# Bytes per element of each supported dtype. bfloat16 has no NumPy dtype: NumPy callers see uint16 storage.
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}
CACHE_DTYPES = ("bfloat16", "float16", "uint8", "block_wise_fp8")
SCALE_DTYPES = ("float32", "bfloat16", "float16")


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
    """Geometry of one rank's KV cache (DESIGN §3).

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
    def gpu_cache_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    @property
    def cpu_cache_bytes(self) -> int:
        return self.num_cpu_blocks * self.cpu_block_bytes

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


def _env_float(name, default, positive=False):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if positive and value <= 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return value


@dataclass(frozen=True)
class Settings:
    """Process settings, read from FASTCACHE_* environment variables (inherited by child processes)."""
    heartbeat_interval: float = 1.0     # FASTCACHE_HEARTBEAT_INTERVAL: seconds between beats
    worker_timeout: float = 10.0        # FASTCACHE_WORKER_TIMEOUT: silent worker => its transfer manager exits
    transfer_timeout: float = 10.0      # FASTCACHE_TRANSFER_TIMEOUT: silent transfer manager => rank failed
    phase_timeout: float = 60.0         # FASTCACHE_PHASE_TIMEOUT: clear/restore barrier timeout
    clear_swap_space: bool = False      # FASTCACHE_CLEAR_SWAP_SPACE=1: clear also releases the CPU tier
    copy_method: str = "staged"         # FASTCACHE_COPY_METHOD (cuda): staged | kernel | batch | memcpy
    inline_bytes: int = 4 << 20         # FASTCACHE_INLINE_BYTES: smaller tasks skip the executor thread hop
    staging_mb: float = 32.0            # FASTCACHE_STAGING_MB (cuda staged): size of each staging buffer
    kernel_blocks: int = 8              # FASTCACHE_KERNEL_BLOCKS (cuda kernel): thread blocks of the copy kernel

    @classmethod
    def from_env(cls) -> "Settings":
        env = os.environ
        return cls(
            heartbeat_interval=_env_float("FASTCACHE_HEARTBEAT_INTERVAL", cls.heartbeat_interval),
            worker_timeout=_env_float("FASTCACHE_WORKER_TIMEOUT", cls.worker_timeout),
            transfer_timeout=_env_float("FASTCACHE_TRANSFER_TIMEOUT", cls.transfer_timeout),
            phase_timeout=_env_float("FASTCACHE_PHASE_TIMEOUT", cls.phase_timeout),
            clear_swap_space=env.get("FASTCACHE_CLEAR_SWAP_SPACE", "0") not in ("", "0", "false", "False"),
            copy_method=env.get("FASTCACHE_COPY_METHOD", cls.copy_method),
            inline_bytes=int(_env_float("FASTCACHE_INLINE_BYTES", cls.inline_bytes)),
            staging_mb=_env_float("FASTCACHE_STAGING_MB", cls.staging_mb, positive=True),
            kernel_blocks=int(_env_float("FASTCACHE_KERNEL_BLOCKS", cls.kernel_blocks, positive=True)),
        )
