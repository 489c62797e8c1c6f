"""The cuda device's part of a reshard (docs/design.md §9): head slices move GPU to GPU through CUDA IPC.

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

from cuda.bindings import runtime

from ..config import ELEMENT_BYTES
from ..errors import TransferError
from ..ipc.manifest import read_json_segment
from ..ipc.naming import reshard_exports_name
from ..reshard_plan import Plan
from .base import manifest_entry
from .cuda_ipc import OpenAllocations, check_region, export_pointer
from .cuda_kernels import cuda_check, set_device
from .frameworks import device_pointer, empty_device, free_cached, view_as
from .host_memory import HostMemory, numpy_copy


# -- worker side -----------------------------------------------------------------------------------
class CudaStaging:
    """A worker's staging buffer: nbytes of the framework's device memory, exported by IPC handle."""

    def __init__(self, framework: str, nbytes: int, device_id: int):
        self.framework, self.nbytes = framework, nbytes
        set_device(device_id)
        self.tensor = empty_device(framework, (nbytes,), "uint8", device_id)
        ptr = device_pointer(self.tensor)
        self.descriptor = {"device": "cuda", "device_id": device_id, "nbytes": nbytes,
                           **export_pointer(ptr, "reshard staging")}

    def close(self):
        self.tensor = None
        free_cached(self.framework)


def reshape(cache, spec, rank: int, device_id: int, framework: str):
    """Re-view a CudaLocalCache's tensors in spec's shape over the same allocations (no new memory). The
    tensors allocated first are kept as bases: every later shape is a view of them."""
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
        elements = info.nbytes // ELEMENT_BYTES[info.dtype]
        view = view_as(bases[i], elements, info.shape)
        if device_pointer(view) != cache.pointers[i]:
            raise TransferError(f"{framework} made a copy of {info.name} instead of a view; cannot reshard it in place")
        tensors[info.name] = view
        manifest.append({**entry, "name": info.name, "nbytes": info.nbytes})
    cache.tensors, cache.manifest, cache.infos = tensors, manifest, infos


# -- transfer-manager side -------------------------------------------------------------------------
class DeviceRegion:
    """Bytes at a device address (an opened IPC allocation plus an offset)."""

    def __init__(self, ptr: int, nbytes: int, what: str):
        self.ptr, self.size, self.what = ptr, nbytes, what


class CudaMemory(HostMemory):
    """Every memory a cuda transfer manager's reshard program touches, and the copies over it."""

    def __init__(self, suffix: str, plan: Plan, device_id: int):
        super().__init__(suffix, plan)
        self.device_id = device_id
        self._allocations = OpenAllocations(device_id)
        self._manifests = {}
        set_device(device_id)
        self.stream = cuda_check(runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking),
                                 "cudaStreamCreateWithFlags")
        self._host_copy = numpy_copy(super().resolve)

    def _open(self, entry: dict, nbytes: int, what: str) -> DeviceRegion:
        check_region(entry, nbytes, what)
        return DeviceRegion(self._allocations.address(entry), nbytes, what)

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
            self._allocations.close()
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
