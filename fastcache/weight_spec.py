"""Geometry of a model's weights as a tensor group (docs/design.md §11).

Every layer holds the same named tensors. As a group it has CacheSpec's shape, so the devices' allocate,
attach, CPU-region and copier code serves it unchanged: a "block" is one layer's tensors (one row per
name), CPU block l holds layer l (every layer has one, block-major like the CPU tier), and the device
holds `resident_layers` blocks (layer l < R in block l) followed by the ring's `ring_slots` slots, into
which the offloaded layers R.. stream in turn (layer l into block R + (l - R) % k).

Tensor parallelism: a tensor may name the dimension TP splits (column-parallel linears dim 0, row-parallel
dim 1; none: replicated, every rank holds it whole). The shapes given are the full model's; `tp_size` picks the
rank's slice, and everything the devices see (`layer_tensors`, `tensors()`, the byte counts) is that slice.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from .config import ELEMENT_BYTES, TensorInfo

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,63}\Z")
DEFAULT_RING_SLOTS = 2


def _positive_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _entries(given):
    """(name, shape, dtype, split dim) of each tensor given as {name: (shape, dtype[, split])} or as
    (name, shape, dtype[, split]) sequences."""
    items = given.items() if isinstance(given, dict) else ((t[0], tuple(t[1:])) for t in given)
    for name, rest in items:
        if not isinstance(rest, (tuple, list)) or len(rest) not in (2, 3):
            raise ValueError(f"weight {name!r} must be given as (shape, dtype) or (shape, dtype, split dim)")
        yield (name, *rest, None) if len(rest) == 2 else (name, *rest)


def _split_dim(name, shape, split, tp_size):
    """Check the dim TP splits (None: replicated): in range, and the full size divides over tp_size ranks."""
    if split is None:
        return None
    if isinstance(split, bool) or not isinstance(split, int) or not 0 <= split < len(shape):
        raise ValueError(f"weight {name!r}: split dim {split!r} is out of range for its {len(shape)}-D shape {shape}")
    if shape[split] % tp_size:
        raise ValueError(f"weight {name!r}: dim {split} ({shape[split]}) does not divide over tp_size {tp_size}")
    return split


@dataclass(frozen=True)
class WeightSpec:
    """`WeightSpec(num_layers, {"w": ((512, 512), "float32"), ...})`: per-layer weight tensors by name.
    resident_layers (None: all) and ring_slots are the placement; SwapBackend sets them from its budget.
    `{"qkv": ((3072, 1024), "float16", 0)}` with `tp_size=2`: the full shape, split over 2 ranks along dim 0.

    It is given full shapes and keeps the rank's: rebuild the model with `resharded`, `placed` or `to_json`,
    not from `layer_tensors` (the rank's shapes, without the split dims)."""
    num_layers: int
    layer_tensors: tuple      # ((name, shape, dtype), ...): one rank's tensors of a layer (its slices)
    resident_layers: int | None = None
    ring_slots: int = DEFAULT_RING_SLOTS
    tp_size: int = 1
    split_dims: tuple = field(default=(), init=False)    # per tensor: the dim TP splits, None: replicated

    def __post_init__(self):
        _positive_int("num_layers", self.num_layers)
        _positive_int("tp_size", self.tp_size)
        tensors, splits, seen = [], [], set()
        for name, shape, dtype, split in _entries(self.layer_tensors):
            if not isinstance(name, str) or not NAME.match(name) or name in seen:
                raise ValueError(f"weight name {name!r} is not a unique identifier")
            seen.add(name)
            shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
            for n in shape:
                _positive_int(f"a dimension of weight {name!r}", n)
            if dtype not in ELEMENT_BYTES:
                raise ValueError(f"weight {name!r}: unknown dtype {dtype!r}; expected one of {tuple(ELEMENT_BYTES)}")
            split = _split_dim(name, shape, split, self.tp_size)
            if split is not None:
                shape = (*shape[:split], shape[split] // self.tp_size, *shape[split + 1:])
            tensors.append((name, shape, dtype))
            splits.append(split)
        if not tensors:
            raise ValueError("a WeightSpec names at least one tensor per layer")
        object.__setattr__(self, "layer_tensors", tuple(tensors))
        object.__setattr__(self, "split_dims", tuple(splits))
        if self.resident_layers is None:
            object.__setattr__(self, "resident_layers", self.num_layers)
        _positive_int("resident_layers", self.resident_layers, minimum=0)
        if self.resident_layers > self.num_layers:
            raise ValueError(f"resident_layers {self.resident_layers} exceeds num_layers {self.num_layers}")
        _positive_int("ring_slots (a ring needs at least one slot)", self.ring_slots)

    # -- placement ------------------------------------------------------------------------------
    def placed(self, offload_fraction=None, budget_bytes=None, ring_slots=DEFAULT_RING_SLOTS,
               device_bytes=None) -> "WeightSpec":
        """This model placed on a device: the leading layers stay resident up to the budget (a fraction of
        the layers offloaded, or a byte budget for weights including the ring), the rest stream. ValueError
        for a budget below one layer, above the device (`device_bytes`), or too small for the ring."""
        _positive_int("ring_slots (a ring needs at least one slot)", ring_slots)
        if offload_fraction is not None and budget_bytes is not None:
            raise ValueError("give offload_fraction or a weight budget, not both")
        resident = self.num_layers
        if offload_fraction is not None:
            if isinstance(offload_fraction, bool) or not isinstance(offload_fraction, (int, float)) or \
                    not math.isfinite(offload_fraction) or not 0 <= offload_fraction <= 1:
                raise ValueError(f"offload_fraction must be a number in [0, 1], got {offload_fraction!r}")
            resident = self.num_layers - round(offload_fraction * self.num_layers)
        elif budget_bytes is not None:
            _positive_int("the weight budget (bytes)", budget_bytes)
            if budget_bytes < self.layer_bytes:
                raise ValueError(f"a weight budget of {budget_bytes} bytes is below one layer ({self.layer_bytes} bytes)")
            if device_bytes is not None and budget_bytes > device_bytes:
                raise ValueError(f"a weight budget of {budget_bytes} bytes is above the device's {device_bytes} bytes")
            if budget_bytes < self.num_layers * self.layer_bytes:
                resident = budget_bytes // self.layer_bytes - ring_slots
                if resident < 0:
                    raise ValueError(f"a weight budget of {budget_bytes} bytes holds {budget_bytes // self.layer_bytes} "
                                     f"layers, fewer than the ring's {ring_slots} slots")
        placed = WeightSpec(self.num_layers, self._model(), resident, ring_slots, self.tp_size)
        if device_bytes is not None and placed.gpu_cache_bytes > device_bytes:
            raise ValueError(f"the resident weights and ring take {placed.gpu_cache_bytes} bytes, above the "
                             f"device's {device_bytes} bytes")
        return placed

    @property
    def streamed_layers(self) -> range:
        """The offloaded layers, in the order a forward streams them."""
        return range(self.resident_layers, self.num_layers)

    def block_of(self, layer: int) -> int:
        """The device block that holds `layer` when the forward computes it."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer!r}")
        if layer < self.resident_layers:
            return layer
        return self.resident_layers + (layer - self.resident_layers) % self.ring_slots

    # -- tensor parallelism -------------------------------------------------------------------------
    def resharded(self, tp_size: int) -> "WeightSpec":
        """The same model, placed alike, at another tp (ValueError naming a tensor whose split dim does not
        divide over tp_size)."""
        return WeightSpec(self.num_layers, self._model(), self.resident_layers, self.ring_slots, tp_size)

    def full_shape(self, name: str) -> tuple:
        """The model's shape of tensor `name` (the rank holds a slice of it along its split dim)."""
        i = self._index(name)
        _, shape, _ = self.layer_tensors[i]
        d = self.split_dims[i]
        return shape if d is None else (*shape[:d], shape[d] * self.tp_size, *shape[d + 1:])

    def rank_slice(self, name: str, rank: int) -> tuple:
        """Rank's part of the full tensor `name`, as an index (a tuple of slices): `full[spec.rank_slice(name, r)]`."""
        i = self._index(name)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.tp_size:
            raise ValueError(f"rank must be in [0, {self.tp_size}), got {rank!r}")
        _, shape, _ = self.layer_tensors[i]
        d = self.split_dims[i]
        out = [slice(None)] * len(shape)
        if d is not None:
            out[d] = slice(rank * shape[d], (rank + 1) * shape[d])
        return tuple(out)

    def _index(self, name):
        self.check_names([name])
        return [n for n, _, _ in self.layer_tensors].index(name)

    def _model(self):
        """The constructor's input for this model: (name, full shape, dtype, split dim) per tensor."""
        return tuple((name, self.full_shape(name), dtype, d)
                     for (name, _, dtype), d in zip(self.layer_tensors, self.split_dims))

    def check_names(self, names):
        unknown = sorted(set(names) - {name for name, _, _ in self.layer_tensors})
        if unknown:
            raise ValueError(f"unknown weight names {unknown}; this model's are {[n for n, _, _ in self.layer_tensors]}")

    # -- the group's geometry (CacheSpec's interface, for the devices' code) -------------------------
    @property
    def layer_bytes(self) -> int:
        return sum(math.prod(shape) * ELEMENT_BYTES[dtype] for _, shape, dtype in self.layer_tensors)

    @property
    def num_gpu_blocks(self) -> int:
        return self.resident_layers + (self.ring_slots if self.streamed_layers else 0)

    @property
    def num_cpu_blocks(self) -> int:
        return self.num_layers

    total_layers = 1        # the group is not published layer by layer; a stream publishes per block
    cpu_slot_bytes = 0
    cpu_block_bytes = layer_bytes
    cpu_block_stride = layer_bytes

    @property
    def cpu_cache_bytes(self) -> int:
        return self.num_cpu_blocks * self.layer_bytes

    @property
    def gpu_cache_bytes(self) -> int:
        return self.num_gpu_blocks * self.layer_bytes

    def tensors(self, rank: int = 0, device_id: int = 0) -> list[TensorInfo]:
        """One tensor per name, [device blocks, *shape], in layer_tensors order."""
        out, offset = [], 0
        for name, shape, dtype in self.layer_tensors:
            row = math.prod(shape) * ELEMENT_BYTES[dtype]
            out.append(TensorInfo(f"weights.{name}_rank{rank}.device{device_id}", "weights", 0,
                                  (self.num_gpu_blocks, *shape), dtype, self.num_gpu_blocks, row, offset))
            offset += row
        return out

    def task_bytes(self, gpu_ids) -> int:
        return len(gpu_ids) * self.layer_bytes

    def to_json(self) -> str:
        """Full shapes, a split dim as a 4th element where there is one, and tp_size."""
        tensors = [[n, list(s), d] + ([split] if split is not None else []) for n, s, d, split in self._model()]
        return json.dumps({"num_layers": self.num_layers, "layer_tensors": tensors, "tp_size": self.tp_size,
                           "resident_layers": self.resident_layers, "ring_slots": self.ring_slots}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "WeightSpec":
        data = json.loads(text)
        required = {"num_layers", "layer_tensors", "resident_layers", "ring_slots"}
        if not isinstance(data, dict) or not required <= set(data) <= required | {"tp_size"}:
            raise ValueError("a WeightSpec is a JSON object with num_layers, layer_tensors, resident_layers, "
                             "ring_slots and optionally tp_size")
        given = data["layer_tensors"]
        if not isinstance(given, list) or not all(isinstance(t, list) and len(t) in (3, 4) for t in given):
            raise ValueError("WeightSpec layer_tensors must be [name, shape, dtype] or [name, shape, dtype, split dim]")
        return cls(data["num_layers"], tuple(given), data["resident_layers"], data["ring_slots"],
                   data.get("tp_size", 1))
