"""The CUDA device (docs/design.md §2): framework tensors exported through CUDA IPC, the engine's
shared-memory CPU tier pinned with cudaHostRegister (cuda_swap_space), and four ways to move a task's rows
between them (cuda_copiers)."""
from __future__ import annotations

import gc
import os

import numpy as np
from cuda.bindings import runtime

from ..config import CacheSpec, Settings
from ..ipc.fds import fetch_fds
from .base import AttachedCache, DeviceOps, LocalCache, check_adopted
from .cuda_copiers import dma_runs, make_copier
from .cuda_ipc import OpenAllocations, check_entry, export_tensors
from .cuda_vmm import VmmExports, VmmImports
from .cuda_kernels import cuda_check, set_device
from .cuda_swap_space import CudaSwapSpace
from .frameworks import allocator_memory, check_framework, device_pointer, empty_device, free_cached


class DeviceTensors(AttachedCache):
    """A rank's tensors addressed by plain device pointers: all a copier needs, plus read/write for checks."""

    def __init__(self, infos: list, pointers: list, device_id: int):
        self.infos = infos
        self.pointers = pointers
        self.device_id = device_id

    def read(self, index, blocks=None):
        info = self.infos[index]
        blocks = np.arange(info.num_blocks) if blocks is None else np.asarray(blocks, np.int64).reshape(-1)
        out = np.empty((len(blocks), info.block_bytes), np.uint8)
        self._copy_rows(index, blocks, out, runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost)
        return out

    def write(self, index, rows, blocks=None):
        info = self.infos[index]
        blocks = np.arange(info.num_blocks) if blocks is None else np.asarray(blocks, np.int64).reshape(-1)
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        if rows.shape != (len(blocks), info.block_bytes):
            raise ValueError(f"{info.name} takes rows of shape {(len(blocks), info.block_bytes)}, got {rows.shape}")
        self._copy_rows(index, blocks, rows, runtime.cudaMemcpyKind.cudaMemcpyHostToDevice)

    def _copy_rows(self, index, blocks, host, kind):
        """cudaMemcpy between `host` rows and the tensor's `blocks`, one call per run of consecutive blocks."""
        info = self.infos[index]
        if len(blocks) and (blocks.min() < 0 or blocks.max() >= info.num_blocks):
            raise ValueError(f"block ids of {info.name} must lie in [0, {info.num_blocks})")
        set_device(self.device_id)
        for first, block, nbytes in dma_runs(blocks.tolist(), [info.block_bytes] * len(blocks), info.block_bytes):
            dev = self.pointers[index] + block * info.block_bytes
            ptr = host.ctypes.data + first * info.block_bytes
            dst, src = (ptr, dev) if kind == runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost else (dev, ptr)
            cuda_check(runtime.cudaMemcpy(dst, src, nbytes, kind), f"cudaMemcpy({info.name})")
        if kind == runtime.cudaMemcpyKind.cudaMemcpyHostToDevice:
            # from pageable memory cudaMemcpy may return before the bytes land, and the copiers' non-blocking
            # streams do not wait for it: the write must be done before any later swap reads the blocks
            cuda_check(runtime.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def close(self):
        self.pointers = []


class CudaAttachedCache(DeviceTensors):
    """Another process's tensors, each distinct allocation opened once (CUDA allows one open per process)."""

    def __init__(self, manifest: list, infos: list):
        if len(manifest) != len(infos):
            raise ValueError(f"manifest lists {len(manifest)} tensors, the spec has {len(infos)}")
        devices = {entry.get("device") for entry in manifest}
        if len(devices) != 1 or not isinstance(next(iter(devices)), int):
            raise ValueError(f"manifest tensors must share one device, got {sorted(map(str, devices))}")
        super().__init__(infos, [], devices.pop())
        self._open = OpenAllocations(self.device_id)
        try:
            self._open.vmm = import_descriptors(manifest, self.device_id)
            for entry, info in zip(manifest, infos):
                check_entry(entry, info)
                self.pointers.append(self._open.address(entry))
        except BaseException:
            self.close()
            raise

    def close(self):
        super().close()
        self._open.close()


def import_descriptors(manifest: list, device_id: int) -> VmmImports | None:
    """The virtual-memory allocations a manifest names, their descriptors fetched from the exporting worker's
    socket (every entry names the same one: "socket", "pid", "count") and imported; None if it names none."""
    served = {(e["vmm"].get("socket"), e["vmm"].get("pid"), e["vmm"].get("count"))
              for e in manifest if isinstance(e.get("vmm"), dict)}
    if not served:
        return None
    if len(served) != 1:
        raise ValueError(f"manifest names {len(served)} descriptor sockets; a worker serves one")
    path, pid, count = served.pop()
    if not (isinstance(path, str) and isinstance(pid, int) and isinstance(count, int) and count > 0):
        raise ValueError("manifest's virtual-memory exports name no valid descriptor socket")
    header, fds = fetch_fds(path, pid, count)
    sizes = header.get("sizes")
    if not isinstance(sizes, list) or len(sizes) != count or not all(isinstance(n, int) and n > 0 for n in sizes):
        for fd in fds:
            os.close(fd)
        raise ValueError(f"descriptor socket {path} sent no valid allocation sizes")
    set_device(device_id)
    return VmmImports(fds, sizes, device_id)


def export_cache(infos: list, pointers: list, device_id: int):
    """(manifest, VmmExports or None): the tensors exported by CUDA IPC, virtual-memory ones as descriptors."""
    vmm = VmmExports()
    try:
        manifest = export_tensors(infos, pointers, device_id, vmm)
    except BaseException:
        vmm.close()
        raise
    return manifest, (vmm if vmm.fds else None)


class CudaLocalCache(LocalCache):
    def __init__(self, spec: CacheSpec, rank: int, device_id: int, framework: str):
        self.framework, self.device_id = framework, device_id
        self.infos = spec.tensors(rank, device_id)
        set_device(device_id)
        self.tensors = {info.name: empty_device(framework, info.shape, info.dtype, device_id) for info in self.infos}
        self.pointers = [device_pointer(self.tensors[info.name]) for info in self.infos]
        self.manifest, self.fd_exports = export_cache(self.infos, self.pointers, device_id)

    def view(self) -> DeviceTensors:
        """The tensors as a copier sees them, in this process (a handle cannot be opened where it was made)."""
        return DeviceTensors(self.infos, list(self.pointers), self.device_id)

    def release(self):
        close_exports(self)
        self.tensors, self.pointers = {}, []
        self.bases = self.base_bytes = None      # a reshard's bases (cuda_reshard.reshape) hold the memory too
        gc.collect()
        free_cached(self.framework)


class CudaAdoptedCache(LocalCache):
    """An engine's own device tensors (vLLM's KV cache), exported by CUDA IPC where they lie (allocation base
    plus offset, as for fastcache's own tensors); release leaves the memory to its owner."""

    def __init__(self, spec: CacheSpec, rank: int, device_id: int, tensors: dict):
        self.device_id, self.infos = device_id, spec.tensors(rank, device_id)
        check_adopted(self.infos, tensors)
        self.tensors = dict(tensors)
        self.pointers = [device_pointer(self.tensors[info.name]) for info in self.infos]
        self.manifest, self.fd_exports = export_cache(self.infos, self.pointers, device_id)

    def release(self):
        close_exports(self)
        self.tensors, self.pointers = {}, []


def close_exports(cache: LocalCache):
    exports, cache.fd_exports = cache.fd_exports, None
    if exports is not None:
        exports.close()


class CudaOps(DeviceOps):
    name = "cuda"

    def allocate(self, spec, rank, device_id, framework, suffix, generation):
        check_framework(framework)
        if framework == "numpy":
            raise ValueError("framework 'numpy' holds host memory: it needs device='sim'")
        return CudaLocalCache(spec, rank, device_id, framework)

    def adopt(self, spec, rank, device_id, tensors):
        return CudaAdoptedCache(spec, rank, device_id, tensors)

    def attach(self, manifest, infos, suffix):
        return CudaAttachedCache(manifest, infos)

    def attach_swap_space(self, segment, spec, device_id: int = 0):
        """Pin the tier through `device_id`. Registration is portable and mapped, so every device's copier
        may use it."""
        return CudaSwapSpace(segment, spec, device_id)

    def device_memory_free(self, device_id):
        set_device(device_id)
        free, _total = cuda_check(runtime.cudaMemGetInfo(), "cudaMemGetInfo")
        return int(free)

    def device_memory(self, framework, device_id):
        set_device(device_id)
        free, total = cuda_check(runtime.cudaMemGetInfo(), "cudaMemGetInfo")
        out = {"free_bytes": int(free), "total_bytes": int(total)}
        held = allocator_memory(framework, device_id)
        if held:
            out.update(held, fragmented_bytes=held["reserved_bytes"] - held["allocated_bytes"])
        return out

    def release_device(self, device_id):
        # the driver keeps a /dev/shm file per process that exported interprocess events (cuda.shm.*) until
        # the context is destroyed, and an exiting process does not destroy its primary context
        set_device(device_id)
        cuda_check(runtime.cudaDeviceReset(), "cudaDeviceReset")

    def copier(self, cache, swap, spec):
        return make_copier(Settings.from_env().copy_method, cache, swap, spec)

    def reshard_staging(self, nbytes, suffix, rank, framework, device_id):
        from .cuda_reshard import CudaStaging
        return CudaStaging(framework, nbytes, device_id)

    def reshape(self, cache, spec, rank, device_id, framework):
        from .cuda_reshard import reshape
        reshape(cache, spec, rank, device_id, framework)

    def reshape_group(self, cache, spec, rank, device_id, framework, replaced):
        from .cuda_reshard import reshape
        reshape(cache, spec, rank, device_id, framework, replaced)

    def weight_allocation(self, nbytes, suffix, rank, index, seq, framework, device_id, dtype):
        from .cuda_reshard import CudaWeightAllocation
        return CudaWeightAllocation(framework, nbytes, device_id, dtype, index)

    def reshard_memory(self, suffix, plan, device_id):
        from .cuda_reshard import CudaMemory
        return CudaMemory(suffix, plan, device_id)
