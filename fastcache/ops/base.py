"""The device interface: what workers, transfer managers and the verifier need from a device.

A device exports a rank's cache tensors under their names (worker side), attaches them by name in
another process (transfer-manager side), pins the engine-owned CPU tier, and moves the block rows of
one task over every tensor in one call. `sim` and `cuda` implement it; callers never branch on which.

The CPU tier of a rank is block-major: CPU block c holds the row of every tensor at
`c * cpu_block_stride + tensor.cpu_offset`, so one block of all layers is one contiguous chunk and a
swap of n blocks moves n large chunks instead of n * tensors small rows. Each block is followed by a
small scratch slot (`cpu_slot_bytes`), where L3 tasks put an object's header beside the block's bytes;
copiers may overwrite slots, so only a task that owns the block (the scheduler orders tasks sharing it)
may use its slot.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import numpy as np

from ..config import CacheSpec, TensorInfo
from ..ipc.manifest import read_json_segment, read_manifest
from ..ipc.naming import weights_name
from ..ipc.shm import SharedSegment


class LocalCache(ABC):
    """A rank's cache as its worker holds it: framework tensors plus the manifest that exports them."""
    tensors: dict          # tensor name -> framework tensor
    manifest: list         # JSON-able descriptor per tensor, in CacheSpec.tensors() order
    fd_exports = None      # cuda, virtual memory: a VmmExports whose descriptors the worker serves (§2)

    @abstractmethod
    def release(self):
        """Free the memory (the caller has dropped its references to the tensors)."""


class AttachedCache(ABC):
    """A rank's cache tensors as another process sees them."""
    infos: list            # TensorInfo per tensor, in CacheSpec.tensors() order

    @abstractmethod
    def read(self, index: int, blocks=None) -> np.ndarray:
        """Host copy of tensor `index` as uint8 rows [len(blocks), block_bytes], all blocks if None
        (verification, tests)."""

    @abstractmethod
    def write(self, index: int, rows: np.ndarray, blocks=None):
        """Overwrite the given blocks (all if None) of tensor `index` from uint8 rows."""

    @abstractmethod
    def close(self):
        """Drop every mapping of the tensors, so their owner can free them."""


class SwapSpace:
    """The engine-owned CPU tier of one rank, attached (and on CUDA pinned) by its transfer manager."""

    def __init__(self, segment: SharedSegment, spec: CacheSpec):
        self.segment = segment
        self.blocks = segment.array(np.uint8, (spec.num_cpu_blocks, spec.cpu_block_stride))  # block, then slot
        self.rows = self.blocks[:, :spec.cpu_block_bytes]       # the blocks' bytes (a strided view)

    def paused(self):
        """A block inside which the device pins none of the tier (on cuda: CudaSwapSpace.paused)."""
        return contextlib.nullcontext(self)

    def close(self):
        self.rows = self.blocks = None
        self.segment.close()


class Copier(ABC):
    """Moves the rows of a task's blocks over every tensor. One instance serves both directions;
    swap_out and swap_in may run at the same time on two threads."""

    # first (cuda): first(stream) is called with the stream that touches the device tensors before any work of
    # the task is queued on it, to make it wait for the model's stream (a fence, docs/design.md §4); a device
    # whose copies are host copies ignores it.
    @abstractmethod
    def swap_out(self, gpu_ids: np.ndarray, cpu_ids: np.ndarray, first=None):
        """GPU blocks -> CPU blocks; returns once the bytes are in the CPU tier."""

    @abstractmethod
    def swap_in(self, gpu_ids: np.ndarray, cpu_ids: np.ndarray, first=None):
        """CPU blocks -> GPU blocks; returns once the bytes are on the device."""

    def swap_in_layers(self, gpu_ids: np.ndarray, cpu_ids: np.ndarray, layers: int, published, first=None):
        """swap_in, calling published(layer) once the rows of every layer up to `layer` are on the device.
        This default copies every layer at once and then publishes the last (a device that copies layer by
        layer overrides it); a layer is never published before its bytes are in place."""
        self.swap_in(gpu_ids, cpu_ids, first=first)
        published(layers - 1)

    def close(self):
        pass


class DeviceOps(ABC):
    name: str

    # worker side
    @abstractmethod
    def allocate(self, spec: CacheSpec, rank: int, device_id: int, framework: str, suffix: str,
                 generation: int) -> LocalCache:
        """Allocate and export every tensor of one rank."""

    def allocate_group(self, spec, rank: int, device_id: int, framework: str, suffix: str, generation: int,
                       group: str) -> LocalCache:
        """Allocate and export another tensor group of one rank beside its cache (the model's weights,
        docs/design.md §11); `spec` has CacheSpec's geometry interface."""
        return self.allocate(spec, rank, device_id, framework, suffix, generation)

    def adopt(self, spec: CacheSpec, rank: int, device_id: int, tensors: dict) -> LocalCache:
        """Export tensors an engine allocated itself ({name: tensor} for every tensor of spec.tensors()),
        without copying them: the engine keeps computing on the very bytes the transfer manager moves."""
        raise ValueError(f"device {self.name!r} cannot adopt an engine's tensors")

    # transfer-manager side
    @abstractmethod
    def attach(self, manifest: list, infos: list[TensorInfo], suffix: str) -> AttachedCache:
        ...

    def attach_swap_space(self, segment: SharedSegment, spec: CacheSpec, device_id: int = 0) -> SwapSpace:
        """Attach (and on CUDA pin, through device_id) the rank's engine-owned CPU tier."""
        return SwapSpace(segment, spec)

    @abstractmethod
    def copier(self, cache: AttachedCache, swap: SwapSpace, spec: CacheSpec) -> Copier:
        ...

    def device_memory_free(self, device_id: int) -> int | None:
        """Free device memory in bytes (cudaMemGetInfo); None where the device has no memory of its own."""
        return None

    def device_memory(self, framework: str, device_id: int) -> dict:
        """A worker's view of its device's memory, in its own process (docs/design.md §9): on cuda the driver's
        `free_bytes` and `total_bytes` (cudaMemGetInfo) and the framework allocator's `allocated_bytes`,
        `reserved_bytes` and `fragmented_bytes` (reserved, not in a live tensor); {} where the engine reads it
        from shared memory instead (sim)."""
        return {}

    def release_device(self, device_id: int):
        """For a process that owns its device context alone (a transfer manager) and is done with it: the
        context's resources go now, not whenever the process ends."""

    # reshard (docs/design.md §9)
    @abstractmethod
    def reshard_staging(self, nbytes: int, suffix: str, rank: int, framework: str, device_id: int):
        """A worker's reshard staging buffer, exported (its `descriptor`) so that it outlives a transfer
        manager that dies mid-chunk; close() frees it."""

    @abstractmethod
    def reshape(self, cache: LocalCache, spec: CacheSpec, rank: int, device_id: int, framework: str):
        """Re-view a worker's tensors in `spec`'s shape over the same memory (no new allocation)."""

    def reshape_group(self, cache: LocalCache, spec, rank: int, device_id: int, framework: str, replaced: dict):
        """reshape for the weight group (docs/design.md §9): tensors in `replaced` ({index: allocation from
        weight_allocation}) move into their new allocation, which the cache then owns; the rest are re-viewed
        in place."""
        if replaced:
            raise ValueError(f"device {self.name!r} cannot move weights into a new allocation")
        self.reshape(cache, spec, rank, device_id, framework)

    def weight_allocation(self, nbytes: int, suffix: str, rank: int, index: int, seq: int, framework: str,
                          device_id: int, dtype: str):
        """A new allocation for weight tensor `index` (elements of `dtype`) of a kept rank whose new slice outgrows
        its own, exported by its `descriptor` for the reshard's moves; close() frees it (if the step is aborted)."""
        raise ValueError(f"device {self.name!r} cannot move weights into a new allocation")

    @abstractmethod
    def reshard_memory(self, suffix: str, plan, device_id: int):
        """A transfer manager's view of every memory a reshard plan touches, with `execute(copy)`,
        `flush()` and `close()`."""


def check_adopted(infos: list[TensorInfo], tensors: dict):
    """Adopted tensors must be exactly the spec's, each a stack of contiguous block rows of its geometry."""
    names = [info.name for info in infos]
    if set(tensors) != set(names):
        missing, extra = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
        raise ValueError(f"adopted tensors do not match the spec: missing {missing}, unexpected {extra}")
    for info in infos:
        t = tensors[info.name]
        nbytes = t.numel() * t.element_size()
        rows_contiguous = t.is_contiguous() if hasattr(t, "is_contiguous") else True
        if t.shape[0] != info.num_blocks or nbytes != info.nbytes or not rows_contiguous:
            raise ValueError(f"tensor {info.name}: shape {tuple(t.shape)}, {nbytes} bytes"
                             f"{'' if rows_contiguous else ', not contiguous'}; the spec wants "
                             f"{info.num_blocks} contiguous rows of {info.block_bytes} bytes")


def usable_ids(ids: np.ndarray, num_blocks: int, full: int):
    """Index of the ids a tensor with `num_blocks` rows has (draft layers hold fewer blocks)."""
    return None if num_blocks == full else np.flatnonzero(ids < num_blocks)


def manifest_entry(manifests: dict, suffix: str, plan, rank: int, index: int) -> dict:
    """Entry `index` of `rank`'s export manifest (read once per rank into `manifests`), for a reshard program;
    a manifest that does not match the plan's tensors is refused."""
    manifest = manifests.get(rank)
    if manifest is None:
        manifest = manifests[rank] = read_manifest(suffix, rank)
    if len(manifest) != len(plan.spaces) - 1:
        raise ValueError(f"rank {rank} exports {len(manifest)} tensors, the plan has {len(plan.spaces) - 1}")
    return manifest[index]


def weight_entry(manifests: dict, suffix: str, plan, rank: int, index: int) -> dict:
    """Entry `index` of `rank`'s weights export manifest (read once per rank into `manifests`), for a reshard
    program; a manifest that does not list the plan's weight tensors is refused."""
    manifest = manifests.get(rank)
    if manifest is None:
        manifest = manifests[rank] = read_json_segment(weights_name(suffix, rank, "exports"), suffix)
    if len(manifest) != len(plan.weight_spaces):
        raise ValueError(f"rank {rank} exports {len(manifest)} weight tensors, the plan has {len(plan.weight_spaces)}")
    return manifest[index]


def new_weight_export(suffix: str, rank: int, index: int, device: str) -> dict:
    """The descriptor of `rank`'s new allocation of weight tensor `index` (DeviceOps.weight_allocation), as its
    worker exported it at PREPARE; ValueError if there is none for this device."""
    desc = read_json_segment(weights_name(suffix, rank, "reshard_exports"), suffix).get(str(index))
    if not isinstance(desc, dict) or desc.get("device") != device:
        raise ValueError(f"rank {rank} exports no {device} allocation for weight tensor {index}")
    return desc
