"""The cuda device's part of a reshard (DESIGN §9): head slices move GPU to GPU through CUDA IPC.

Worker side: the staging buffer is a framework allocation beside the cache (at most 256 MiB), exported by
IPC handle, so that it outlives a transfer manager that dies mid-chunk; the cache's tensors are re-viewed
in the new shape over the same allocations (`reshape`: the exported handles and offsets do not change,
only the byte counts in the manifest).

Transfer-manager side: `CudaMemory` opens every source rank's allocations by IPC handle (with lazy peer
access: ranks on other GPUs are read over NVLink/PCIe peer copies; ranks sharing a GPU copy within it) and
runs the plan's row copies as cudaMemcpy2DAsync, one per run of rows consecutive on both sides, on one
stream; `flush` synchronizes it before the journal records a chunk. The CPU tier is host memory and is
resharded with NumPy (`HostMemory`), unpinned meanwhile (the transfer manager re-pins it in the new
geometry on commit).
"""
from __future__ import annotations

import ctypes

from cuda.bindings import driver, runtime

from ..engine.reshard import Plan, numpy_copy
from ..errors import TransferError
from ..ipc.naming import reshard_exports_name
from .base import manifest_entry
from .cuda_kernels import cuda_check, set_device
from .sim_reshard import HostMemory, read_json_segment

IPC_HANDLE_BYTES = 64


# -- worker side -----------------------------------------------------------------------------------
def export_pointer(ptr: int, what: str) -> dict:
    """IPC handle of the allocation holding ptr, and ptr's offset in it (caching allocators sub-allocate)."""
    base, size = cuda_check(driver.cuMemGetAddressRange(driver.CUdeviceptr(ptr)), "cuMemGetAddressRange")
    base = int(base)
    handle = cuda_check(runtime.cudaIpcGetMemHandle(base), f"cudaIpcGetMemHandle({what})")
    return {"handle": ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES).hex(), "offset": ptr - base,
            "alloc_bytes": int(size)}


class CudaStaging:
    """A worker's staging buffer: nbytes of the framework's device memory, exported by IPC handle."""

    def __init__(self, framework: str, nbytes: int, device_id: int):
        from .cuda import _data_ptr, _empty
        self.framework, self.nbytes = framework, nbytes
        set_device(device_id)
        self.tensor = _empty(framework, (nbytes,), "uint8", device_id)
        ptr = _data_ptr(self.tensor)
        self.descriptor = {"device": "cuda", "device_id": device_id, "nbytes": nbytes,
                           **export_pointer(ptr, "reshard staging")}

    def close(self):
        from .cuda import _free_cached
        self.tensor = None
        _free_cached(self.framework)


def allocate_staging(cache, suffix: str, rank: int, nbytes: int, framework: str, device_id: int):
    return CudaStaging(framework, nbytes, device_id)


def view_as(base, numel: int, shape: tuple):
    """A view of base's first numel elements in shape, sharing its memory (torch, cupy, paddle)."""
    if hasattr(base, "view") and hasattr(base, "data_ptr") and not hasattr(base, "place"):   # torch
        out = base.view(-1)[:numel].view(shape)
    elif hasattr(base, "ravel"):                                                             # cupy
        out = base.ravel()[:numel].reshape(shape)
    else:                                                                                    # paddle
        out = base.flatten()[:numel].reshape(shape)
    return out


def reshape(cache, spec, rank: int, device_id: int, framework: str):
    """Re-view a CudaLocalCache's tensors in spec's shape over the same allocations (no new memory). The
    tensors allocated first are kept as bases: every later shape is a view of them."""
    from .cuda import _data_ptr
    infos = spec.tensors(rank, device_id)
    if len(infos) != len(cache.manifest):
        raise ValueError(f"the new spec has {len(infos)} tensors, the cache {len(cache.manifest)}")
    bases = getattr(cache, "bases", None)
    if bases is None:
        bases = cache.bases = [cache.tensors[info.name] for info in cache.infos]
        cache.base_bytes = [info.nbytes for info in cache.infos]
    tensors, manifest = {}, []
    for i, (info, entry) in enumerate(zip(infos, cache.manifest)):
        if info.nbytes > cache.base_bytes[i]:
            raise ValueError(f"{info.name}: {info.nbytes} bytes do not fit in its {cache.base_bytes[i]}-byte "
                             f"allocation")
        elements = info.nbytes // _element_bytes(info.dtype)
        view = view_as(bases[i], elements, info.shape)
        if _data_ptr(view) != cache.pointers[i]:
            raise TransferError(f"{framework} made a copy of {info.name} instead of a view; cannot reshard it in place")
        tensors[info.name] = view
        manifest.append({**entry, "name": info.name, "nbytes": info.nbytes})
    cache.tensors, cache.manifest, cache.infos = tensors, manifest, infos


def _element_bytes(dtype: str) -> int:
    from ..config import ELEMENT_BYTES
    return ELEMENT_BYTES[dtype]


# -- transfer-manager side -------------------------------------------------------------------------
def open_handle(hex_handle: str) -> int:
    handle = runtime.cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), bytes.fromhex(hex_handle), IPC_HANDLE_BYTES)
    return int(cuda_check(runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess),
                          "cudaIpcOpenMemHandle"))


class DeviceRegion:
    """Bytes at a device address (an opened IPC allocation plus an offset)."""

    def __init__(self, ptr: int, nbytes: int, what: str):
        self.ptr, self.size, self.what = ptr, nbytes, what


class CudaMemory(HostMemory):
    """Every memory a cuda transfer manager's reshard program touches, and the copies over it."""

    def __init__(self, suffix: str, plan: Plan, device_id: int):
        super().__init__(suffix, plan)
        self.device_id = device_id
        self._bases = {}         # hex handle -> base address here (CUDA opens an allocation once per process)
        self._manifests = {}
        set_device(device_id)
        self.stream = cuda_check(runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking),
                                 "cudaStreamCreateWithFlags")
        self._host_copy = numpy_copy(super().resolve)

    def _open(self, entry: dict, nbytes: int, what: str) -> DeviceRegion:
        handle, offset, alloc = entry.get("handle"), entry.get("offset"), entry.get("alloc_bytes")
        if not isinstance(handle, str) or len(handle) != 2 * IPC_HANDLE_BYTES:
            raise ValueError(f"{what}: no valid IPC handle")
        if not all(isinstance(v, int) for v in (offset, alloc)) or offset < 0 or offset + nbytes > alloc:
            raise ValueError(f"{what}: {nbytes} bytes at offset {offset} lie outside its {alloc}-byte allocation")
        if handle not in self._bases:
            set_device(self.device_id)
            self._bases[handle] = open_handle(handle)
        return DeviceRegion(self._bases[handle] + offset, nbytes, what)

    def _resolve(self, ref):
        if ref[0] == "gpu":
            rank, index = ref[1], ref[2]
            entry = manifest_entry(self._manifests, self.suffix, self.plan, rank, index)
            return self._open(entry, self.plan.region_bytes(self.plan.spaces[index], rank), entry.get("name", "?"))
        if ref[0] == "staging" and ref[2] == "gpu":
            desc = read_json_segment(reshard_exports_name(self.suffix, ref[1]), self.suffix)
            if desc.get("device") != "cuda":
                raise ValueError(f"rank {ref[1]} exports a {desc.get('device')} staging buffer to a cuda transfer "
                                 f"manager")
            return self._open(desc, self.plan.staging_bytes_for(ref[1], "gpu"), f"staging of rank {ref[1]}")
        return super()._resolve(ref)

    def execute(self, c):
        src, dst = self.resolve(c.src), self.resolve(c.dst)
        if not isinstance(src, DeviceRegion) and not isinstance(dst, DeviceRegion):
            self._host_copy(c)                   # the CPU tier: host to host
            return
        sp, dp = _address(src), _address(dst)
        kind = runtime.cudaMemcpyKind.cudaMemcpyDefault     # unified addressing: peer, device or host
        for s, d, rows in c.runs():
            for region, off, pitch in ((src, s, c.src_pitch), (dst, d, c.dst_pitch)):
                end = off + (rows - 1) * pitch + c.width
                if off < 0 or end > _size(region):
                    raise ValueError(f"reshard copy up to byte {end} outside {_what(region)} ({_size(region)} bytes)")
            cuda_check(runtime.cudaMemcpy2DAsync(dp + d, c.dst_pitch, sp + s, c.src_pitch, c.width, rows, kind,
                                                 self.stream), "cudaMemcpy2DAsync")

    def flush(self):
        cuda_check(runtime.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def close(self):
        try:
            if self.stream is not None:
                set_device(self.device_id)
                self.flush()
                cuda_check(runtime.cudaStreamDestroy(self.stream), "cudaStreamDestroy")
                self.stream = None
        finally:
            self._views = {}
            bases, self._bases = self._bases, {}
            for base in bases.values():
                cuda_check(runtime.cudaIpcCloseMemHandle(base), "cudaIpcCloseMemHandle")
            super().close()


def _address(region) -> int:
    return region.ptr if isinstance(region, DeviceRegion) else region.ctypes.data


def _size(region) -> int:
    return region.size if isinstance(region, DeviceRegion) else region.nbytes


def _what(region) -> str:
    return region.what if isinstance(region, DeviceRegion) else "host memory"


def d2d_rate(nbytes: int, device_id: int = 0, repeat: int = 3) -> float:
    """GB/s of one cudaMemcpyAsync device to device of nbytes on device_id (the reshard's reference rate)."""
    set_device(device_id)
    src = int(cuda_check(runtime.cudaMalloc(nbytes), "cudaMalloc"))
    dst = int(cuda_check(runtime.cudaMalloc(nbytes), "cudaMalloc"))
    stream = cuda_check(runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
    start, stop = (cuda_check(runtime.cudaEventCreate(), "cudaEventCreate") for _ in range(2))
    try:
        best = 0.0
        for _ in range(repeat):
            cuda_check(runtime.cudaEventRecord(start, stream), "cudaEventRecord")
            cuda_check(runtime.cudaMemcpyAsync(dst, src, nbytes, runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                                               stream), "cudaMemcpyAsync")
            cuda_check(runtime.cudaEventRecord(stop, stream), "cudaEventRecord")
            cuda_check(runtime.cudaEventSynchronize(stop), "cudaEventSynchronize")
            ms = cuda_check(runtime.cudaEventElapsedTime(start, stop), "cudaEventElapsedTime")
            best = max(best, nbytes / (ms / 1e3) / 1e9)
        return best
    finally:
        for event in (start, stop):
            runtime.cudaEventDestroy(event)
        runtime.cudaStreamDestroy(stream)
        runtime.cudaFree(src)
        runtime.cudaFree(dst)
