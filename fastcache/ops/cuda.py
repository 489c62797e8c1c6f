"""The CUDA device (DESIGN §2): framework tensors exported through CUDA IPC, the engine's shared-memory
CPU tier pinned with cudaHostRegister, and four ways to move a task's rows between them.

Copy methods (FASTCACHE_COPY_METHOD):
  staged  (default) an NVRTC kernel gathers the rows of a chunk of blocks into a device staging buffer laid
          out like the CPU tier, the copy engine moves it in runs of consecutive CPU blocks; two staging
          buffers per direction so the gather of chunk i+1 overlaps the DMA of chunk i (swap-in: reverse)
  kernel  the same kernel on mapped host memory, FASTCACHE_KERNEL_BLOCKS thread blocks (default 8)
  batch   cudaMemcpyBatchAsync (CUDA 12.8+) of the rows, merged where adjacent on both sides
  memcpy  one cudaMemcpyAsync per merged row: the FastDeploy baseline

A copier needs only per-tensor device pointers (`DeviceTensors`), so the same code serves tensors
attached over IPC and, in the exporting process, a worker's own tensors (tests, benchmarks).
"""
from __future__ import annotations

import bisect
import ctypes
import gc
import math
import mmap
import threading
import time

import numpy as np
from cuda.bindings import driver, runtime

from ..config import COPY_METHODS as METHODS, CacheSpec, Settings, TensorInfo
from ..errors import TransferError
from ..ipc.shm import SharedSegment
from .base import AttachedCache, Copier, DeviceOps, LocalCache, SwapSpace
from .cuda_kernels import Lane, RowKernel, cuda_check, device_attribute, memcpy_async, set_device
from .frameworks import NUMPY_STORAGE, check_framework

PIN_CHUNK_BYTES = 256 << 20      # cudaHostRegister granularity: ~0.1 s of pinning per chunk
STAGING_RING = 2                 # staging buffers per direction: one filling while the other drains
SMALL_TASK_IDS = 64              # staged tasks of at most this many blocks take the one-stream path
IPC_HANDLE_BYTES = 64


# -- framework specifics ---------------------------------------------------------------------------
def _empty(framework: str, shape: tuple, dtype: str, device_id: int):
    if framework == "torch":
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{device_id}")
    if framework == "cupy":
        import cupy
        with cupy.cuda.Device(device_id):
            return cupy.empty(shape, dtype=NUMPY_STORAGE[dtype])     # CuPy has no bfloat16: uint16 bits
    if framework == "paddle":
        import paddle
        return paddle.empty(shape, dtype=dtype, device=f"gpu:{device_id}")
    raise ValueError(f"framework {framework!r} holds host memory: it needs device='sim'")


def _data_ptr(tensor) -> int:
    """Device address of a tensor's first element: data_ptr() (torch, paddle) or the CUDA array interface."""
    if hasattr(tensor, "data_ptr"):
        return int(tensor.data_ptr())
    return int(tensor.__cuda_array_interface__["data"][0])


def _free_cached(framework: str):
    """Hand the framework's cached blocks back to the driver, so cudaMemGetInfo sees them free (§6)."""
    if framework == "torch":
        import torch
        torch.cuda.empty_cache()
    elif framework == "cupy":
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
    elif framework == "paddle":
        import paddle
        paddle.device.cuda.empty_cache()


# -- export and attach -----------------------------------------------------------------------------
def export_tensors(infos: list, pointers: list, device_id: int) -> list:
    """Manifest entries: per tensor, the IPC handle of the allocation holding it and its offset there.
    Caching allocators sub-allocate, and a handle always opens at its allocation's base; tensors sharing
    an allocation share one handle string, so an attacher opens it once."""
    handles, manifest = {}, []
    for info, ptr in zip(infos, pointers):
        base, size = cuda_check(driver.cuMemGetAddressRange(driver.CUdeviceptr(ptr)), "cuMemGetAddressRange")
        base = int(base)
        if base not in handles:
            handles[base] = _ipc_handle(base, info.name)
        manifest.append({"name": info.name, "handle": handles[base], "offset": ptr - base, "alloc_bytes": int(size),
                         "nbytes": info.nbytes, "device": device_id})
    return manifest


def _ipc_handle(base: int, name: str) -> str:
    try:
        handle = cuda_check(runtime.cudaIpcGetMemHandle(base), f"cudaIpcGetMemHandle({name})")
    except TransferError as exc:
        raise TransferError(f"{exc} (CUDA IPC exports cudaMalloc memory only: a virtual-memory allocator such as "
                            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cannot be shared)") from None
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES).hex()


def _check_entry(entry: dict, info: TensorInfo):
    if entry.get("name") != info.name or entry.get("nbytes") != info.nbytes:
        raise ValueError(f"manifest entry {entry.get('name')} does not match the spec's {info.name}")
    handle, offset, size = entry.get("handle"), entry.get("offset"), entry.get("alloc_bytes")
    if not isinstance(handle, str) or len(handle) != 2 * IPC_HANDLE_BYTES:
        raise ValueError(f"manifest entry {info.name} has no valid IPC handle")
    if not all(isinstance(v, int) for v in (offset, size)) or offset < 0 or offset + info.nbytes > size:
        raise ValueError(f"manifest entry {info.name} lies outside its allocation")


def _open_handle(hex_handle: str) -> int:
    handle = runtime.cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), bytes.fromhex(hex_handle), IPC_HANDLE_BYTES)
    return int(cuda_check(runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess),
                          "cudaIpcOpenMemHandle"))


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
        self._bases = {}             # hex handle -> base address in this process
        try:
            set_device(self.device_id)
            for entry, info in zip(manifest, infos):
                _check_entry(entry, info)
                if entry["handle"] not in self._bases:
                    self._bases[entry["handle"]] = _open_handle(entry["handle"])
                self.pointers.append(self._bases[entry["handle"]] + entry["offset"])
        except BaseException:
            self.close()
            raise

    def close(self):
        super().close()
        bases, self._bases = self._bases, {}
        if bases:
            set_device(self.device_id)
        for base in bases.values():
            cuda_check(runtime.cudaIpcCloseMemHandle(base), "cudaIpcCloseMemHandle")


class CudaLocalCache(LocalCache):
    def __init__(self, spec: CacheSpec, rank: int, device_id: int, framework: str):
        self.framework, self.device_id = framework, device_id
        self.infos = spec.tensors(rank, device_id)
        set_device(device_id)
        self.tensors = {info.name: _empty(framework, info.shape, info.dtype, device_id) for info in self.infos}
        self.pointers = [_data_ptr(self.tensors[info.name]) for info in self.infos]
        self.manifest = export_tensors(self.infos, self.pointers, device_id)

    def view(self) -> DeviceTensors:
        """The tensors as a copier sees them, in this process (a handle cannot be opened where it was made)."""
        return DeviceTensors(self.infos, list(self.pointers), self.device_id)

    def release(self):
        self.tensors, self.pointers = {}, []
        gc.collect()
        _free_cached(self.framework)


# -- the CPU tier ----------------------------------------------------------------------------------
class CudaSwapSpace(SwapSpace):
    """The CPU tier, registered (mapped, portable) chunk by chunk on a background thread: start-up does not
    wait for a large tier, and a swap waits only for the chunks holding its CPU blocks."""

    def __init__(self, segment: SharedSegment, spec: CacheSpec, device_id: int, chunk_bytes: int = PIN_CHUNK_BYTES):
        super().__init__(segment, spec)
        self.device_id = device_id
        self.stride, self.num_blocks = spec.cpu_block_stride, spec.num_cpu_blocks   # a block and its slot
        self.host_ptr = self.blocks.ctypes.data
        self.pin_seconds = None                  # wall time to pin the whole tier, once done
        # Chunks hold whole pages (two registrations never share one) and whole CPU blocks (a row never
        # straddles two); DMA runs are split at chunk edges (dma_runs), since one cudaMemcpy must lie in
        # one registered range to run as DMA
        page = mmap.PAGESIZE
        if self.host_ptr % page:
            raise TransferError("the CPU tier must start on a page boundary (SharedSegment payloads do)")
        unit = math.lcm(page, self.stride)
        chunk_bytes = max(1, chunk_bytes // unit) * unit
        self.chunk_blocks = chunk_bytes // self.stride
        start, end = self.host_ptr, -(-(self.host_ptr + self.blocks.nbytes) // page) * page
        self._chunks = [(addr, min(chunk_bytes, end - addr)) for addr in range(start, end, chunk_bytes)]
        self._registered = []
        self._pinned_end = start                 # every byte below this address is registered
        self._mapping_delta = set()              # device address minus host address, per chunk
        self._error = None
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._pin, name="fastcache-pin", daemon=True)
        self._thread.start()

    def _pin(self):
        began = time.perf_counter()
        flags = runtime.cudaHostRegisterMapped | runtime.cudaHostRegisterPortable
        try:
            set_device(self.device_id)
            for k, (addr, size) in enumerate(self._chunks):
                with self._cond:
                    if self._closing:
                        return
                cuda_check(runtime.cudaHostRegister(addr, size, flags), f"cudaHostRegister({size} bytes)")
                self._registered.append(addr)
                mapped = int(cuda_check(runtime.cudaHostGetDevicePointer(addr, 0), "cudaHostGetDevicePointer"))
                with self._cond:
                    self._mapping_delta.add(mapped - addr)
                    self._pinned_end = addr + size
                    if k == len(self._chunks) - 1:      # set before any waiter for the whole tier wakes
                        self.pin_seconds = time.perf_counter() - began
                    self._cond.notify_all()
        except Exception as exc:        # reported to every waiter: a silent pin thread would hang swaps
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def wait_pinned(self, num_blocks: int | None = None):
        """Block until CPU blocks [0, num_blocks) (default: all) are registered."""
        end = self.host_ptr + (self.num_blocks if num_blocks is None else num_blocks) * self.stride
        if self._pinned_end >= end:          # the common case, without the lock
            return
        with self._cond:
            while self._pinned_end < end and self._error is None and not self._closing:
                self._cond.wait()
            if self._error is not None:
                raise TransferError(f"pinning the swap space failed: {self._error}")
            if self._closing:
                raise TransferError("the swap space is closed")

    def mapped_ptr(self) -> int:
        """Device address of the tier's first block (the kernel method reads and writes it directly)."""
        with self._cond:
            if len(self._mapping_delta) != 1:
                raise TransferError("copy method 'kernel' needs the CPU tier mapped at one device range "
                                    "(cudaDevAttrCanUseHostPointerForRegisteredMem); use 'staged'")
            return self.host_ptr + next(iter(self._mapping_delta))

    def close(self):
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        try:
            if self._registered:
                set_device(self.device_id)
            while self._registered:
                cuda_check(runtime.cudaHostUnregister(self._registered.pop()), "cudaHostUnregister")
        finally:
            super().close()


# -- copiers ---------------------------------------------------------------------------------------
class _CudaCopier(Copier):
    """What every method shares: id checks, waiting for the pinned chunks a task touches, and one lane per
    direction (swap_out and swap_in run on two threads; each sets the device for itself). Ids reach the
    methods as Python lists: on a one-block task NumPy's per-call overhead is most of the host time."""

    def __init__(self, cache: DeviceTensors, swap: CudaSwapSpace, spec: CacheSpec):
        self.device_id = cache.device_id
        self.infos = cache.infos
        self.pointers = list(cache.pointers)
        self.swap = swap
        self.spec = spec
        self.stride = spec.cpu_block_stride     # CPU block to CPU block; whole blocks move with their slots
        set_device(self.device_id)
        self._lanes = {True: self._new_lane(), False: self._new_lane()}     # keyed by "to host"

    def _new_lane(self) -> Lane:
        return Lane()

    def swap_out(self, gpu_ids, cpu_ids):
        self._swap(gpu_ids, cpu_ids, to_host=True)

    def swap_in(self, gpu_ids, cpu_ids):
        self._swap(gpu_ids, cpu_ids, to_host=False)

    def _swap(self, gpu_ids, cpu_ids, to_host):
        gpu, cpu = _id_list(gpu_ids), _id_list(cpu_ids)
        if len(gpu) != len(cpu):
            raise ValueError(f"{len(gpu)} gpu ids and {len(cpu)} cpu ids: they must pair up")
        if not gpu:
            return
        # a stray id would make the kernel fault and poison the context: refuse it here
        for ids, limit, what in ((gpu, self.spec.num_gpu_blocks, "gpu"), (cpu, self.spec.num_cpu_blocks, "cpu")):
            if min(ids) < 0 or max(ids) >= limit:
                raise ValueError(f"{what} block ids must lie in [0, {limit})")
        self.swap.wait_pinned(max(cpu) + 1)
        lane = self._lanes[to_host]
        with lane.lock:
            set_device(self.device_id)
            self._run(lane, gpu, cpu, to_host)

    def _run(self, lane: Lane, gpu: list, cpu: list, to_host: bool):
        raise NotImplementedError

    def close(self):
        lanes, self._lanes = self._lanes, {}
        if lanes:
            set_device(self.device_id)
        for lane in lanes.values():
            lane.close()


def _id_list(ids) -> list:
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            raise ValueError(f"block ids must be a vector, got shape {ids.shape}")
        return ids.tolist()
    return [int(i) for i in ids]


def dma_runs(cpu: list, lengths: list, block_bytes: int, chunk_blocks: int = 0):
    """(index of first block, first cpu id, bytes) per run of consecutive cpu ids. A block shorter than a
    whole CPU block (a draft layer lacks its rows) ends its run, so the tier keeps the bytes after it; so
    does a pinned chunk's last block (chunk_blocks), so that no copy spans two registered ranges."""
    runs, prev, prev_length = [], -2, 0
    for k, (cpu_id, length) in enumerate(zip(cpu, lengths)):
        if cpu_id == prev + 1 and prev_length == block_bytes and not (chunk_blocks and cpu_id % chunk_blocks == 0):
            runs[-1][2] += length
        else:
            runs.append([k, cpu_id, length])
        prev, prev_length = cpu_id, length
    return runs


class StagedCopier(_CudaCopier):
    """Gather into device staging at HBM speed, then bulk DMA; chunks pipeline through a ring of buffers.
    A task that fits one chunk and the lane's pinned id buffer takes the small path: one stream, no events,
    ids read by the kernel from pinned host memory, no upload."""

    def __init__(self, cache, swap, spec, staging_bytes: int):
        sizes = [i.block_bytes for i in cache.infos]
        row_ends = np.cumsum(sizes).tolist()
        row_blocks = [i.num_blocks for i in cache.infos]
        offsets = [i.cpu_offset for i in cache.infos]
        # a partial block is a prefix of its CPU block: tensors side by side, those with fewer blocks last
        if offsets != [end - size for end, size in zip(row_ends, sizes)] or \
                any(b > a for a, b in zip(row_blocks, row_blocks[1:])):
            raise ValueError("staged copies need tensors laid out in order, those with fewer blocks last")
        self._row_ends = row_ends
        self._neg_blocks = [-b for b in row_blocks]          # ascending, for bisect
        self._full_blocks = row_blocks[-1]                   # ids below this have every tensor's row
        self.chunk_blocks = max(1, staging_bytes // spec.cpu_block_stride)
        super().__init__(cache, swap, spec)
        self._kernel = RowKernel(self.infos, self.pointers, self.device_id)
        self._grid = 4 * device_attribute(self.device_id, "cudaDevAttrMultiProcessorCount")
        self._small_ids = min(self.chunk_blocks, SMALL_TASK_IDS)

    def _new_lane(self):
        return Lane(STAGING_RING, self.chunk_blocks * self.stride, host_ids=SMALL_TASK_IDS)

    def _lengths(self, gpu: list) -> list:
        """Bytes of each task block present on the device: a prefix of the CPU block."""
        full, ends, neg = self.stride, self._row_ends, self._neg_blocks
        return [full if g < self._full_blocks else ends[bisect.bisect_left(neg, -g) - 1] for g in gpu]

    def _run(self, lane, gpu, cpu, to_host):
        lengths = self._lengths(gpu) if to_host else [self.stride] * len(gpu)
        if len(gpu) <= self._small_ids:
            return self._run_small(lane, gpu, cpu, lengths, to_host)
        (ids,) = lane.upload_ids(gpu)
        for k, lo in enumerate(range(0, len(gpu), self.chunk_blocks)):
            hi = min(lo + self.chunk_blocks, len(gpu))
            chunk = (k % STAGING_RING, k >= STAGING_RING, ids + 8 * lo, cpu[lo:hi], lengths[lo:hi])
            (self._gather if to_host else self._scatter)(lane, *chunk)
        lane.sync()

    def _run_small(self, lane, gpu, cpu, lengths, to_host):
        stage, stream = lane.slots[0].ptr, lane.stream
        ids = lane.put_host_ids(gpu)        # the lane's last task has finished (sync): the buffer is free
        runs = dma_runs(cpu, lengths, self.stride, self.swap.chunk_blocks)
        if to_host:
            self._kernel.launch(stream, self._grid, ids, 0, len(gpu), stage, self.stride, True)
        for first, cpu_id, nbytes in runs:
            host, dev = self.swap.host_ptr + cpu_id * self.stride, stage + first * self.stride
            memcpy_async(*((host, dev) if to_host else (dev, host)), nbytes, to_host, stream)
        if not to_host:
            self._kernel.launch(stream, self._grid, ids, 0, len(gpu), stage, self.stride, False)
        lane.sync_stream()

    def _gather(self, lane, slot, reused, ids, cpu, lengths):
        stage = lane.slots[slot].ptr
        if reused:      # its previous chunk must have left for the host
            cuda_check(runtime.cudaStreamWaitEvent(lane.stream, lane.drained[slot], 0), "cudaStreamWaitEvent")
        self._kernel.launch(lane.stream, self._grid, ids, 0, len(cpu), stage, self.stride, True)
        cuda_check(runtime.cudaEventRecord(lane.filled[slot], lane.stream), "cudaEventRecord")
        cuda_check(runtime.cudaStreamWaitEvent(lane.dma_stream, lane.filled[slot], 0), "cudaStreamWaitEvent")
        for first, cpu_id, nbytes in dma_runs(cpu, lengths, self.stride, self.swap.chunk_blocks):
            memcpy_async(self.swap.host_ptr + cpu_id * self.stride, stage + first * self.stride, nbytes,
                         True, lane.dma_stream)
        cuda_check(runtime.cudaEventRecord(lane.drained[slot], lane.dma_stream), "cudaEventRecord")

    def _scatter(self, lane, slot, reused, ids, cpu, lengths):
        stage = lane.slots[slot].ptr
        if reused:      # its previous chunk must have been scattered
            cuda_check(runtime.cudaStreamWaitEvent(lane.dma_stream, lane.drained[slot], 0), "cudaStreamWaitEvent")
        for first, cpu_id, nbytes in dma_runs(cpu, lengths, self.stride, self.swap.chunk_blocks):
            memcpy_async(stage + first * self.stride, self.swap.host_ptr + cpu_id * self.stride, nbytes,
                         False, lane.dma_stream)
        cuda_check(runtime.cudaEventRecord(lane.filled[slot], lane.dma_stream), "cudaEventRecord")
        cuda_check(runtime.cudaStreamWaitEvent(lane.stream, lane.filled[slot], 0), "cudaStreamWaitEvent")
        self._kernel.launch(lane.stream, self._grid, ids, 0, len(cpu), stage, self.stride, False)
        cuda_check(runtime.cudaEventRecord(lane.drained[slot], lane.stream), "cudaEventRecord")

    def close(self):
        super().close()
        self._kernel.close()


class KernelCopier(_CudaCopier):
    """The row kernel reading and writing the mapped CPU tier directly, on a fixed number of thread blocks."""

    def __init__(self, cache, swap, spec, blocks: int):
        super().__init__(cache, swap, spec)
        self.blocks = blocks
        self._kernel = RowKernel(self.infos, self.pointers, self.device_id)

    def _run(self, lane, gpu_ids, cpu_ids, to_host):
        ids, slots = lane.upload_ids(gpu_ids, cpu_ids)
        self._kernel.launch(lane.stream, self.blocks, ids, slots, len(gpu_ids), self.swap.mapped_ptr(),
                            self.stride, to_host)
        lane.sync()

    def close(self):
        super().close()
        self._kernel.close()


def row_copies(infos, pointers, host_ptr, block_bytes, gpu_ids, cpu_ids, to_host):
    """(dst, src, size) of every (tensor, block) row, tensor by tensor, rows adjacent on both sides merged."""
    gpu_ids, cpu_ids = np.asarray(gpu_ids, np.int64), np.asarray(cpu_ids, np.int64)
    gpu, cpu, size = [], [], []
    for info, ptr in zip(infos, pointers):
        keep = gpu_ids < info.num_blocks
        gpu.append(ptr + gpu_ids[keep] * info.block_bytes)
        cpu.append(host_ptr + cpu_ids[keep] * block_bytes + info.cpu_offset)
        size.append(np.full(int(keep.sum()), info.block_bytes, np.int64))
    gpu, cpu, size = (np.concatenate(parts) for parts in (gpu, cpu, size))
    src, dst = (gpu, cpu) if to_host else (cpu, gpu)
    start = np.ones(len(size), bool)
    start[1:] = (src[1:] != src[:-1] + size[:-1]) | (dst[1:] != dst[:-1] + size[:-1])
    first = np.flatnonzero(start)
    return dst[first], src[first], np.add.reduceat(size, first)


class MemcpyCopier(_CudaCopier):
    """One cudaMemcpyAsync per merged row (FastDeploy's cache_transfer_manager does this)."""

    def _rows(self, gpu_ids, cpu_ids, to_host):
        return row_copies(self.infos, self.pointers, self.swap.host_ptr, self.stride, gpu_ids, cpu_ids, to_host)

    def _run(self, lane, gpu_ids, cpu_ids, to_host):
        for dst, src, size in zip(*(a.tolist() for a in self._rows(gpu_ids, cpu_ids, to_host))):
            memcpy_async(dst, src, size, to_host, lane.stream)
        lane.sync()


class BatchCopier(MemcpyCopier):
    """All rows in one cudaMemcpyBatchAsync. CUDA 12.8 has an out-parameter failIdx that CUDA 13 dropped;
    cuda-bindings returns it after the status (12.x) or not at all (13.x), the arguments are the same."""

    def __init__(self, cache, swap, spec):
        driver_version = cuda_check(runtime.cudaDriverGetVersion(), "cudaDriverGetVersion")
        if not hasattr(runtime, "cudaMemcpyBatchAsync") or driver_version < 12080:
            raise TransferError(f"copy method 'batch' needs cudaMemcpyBatchAsync: a CUDA 12.8+ driver (this one "
                                f"is {driver_version}) and cuda-bindings 12.8+")
        super().__init__(cache, swap, spec)
        self._attrs = runtime.cudaMemcpyAttributes()
        self._attrs.srcAccessOrder = runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        self._attrs.flags = runtime.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute

    def _run(self, lane, gpu_ids, cpu_ids, to_host):
        dst, src, size = (a.tolist() for a in self._rows(gpu_ids, cpu_ids, to_host))
        cuda_check(runtime.cudaMemcpyBatchAsync(dst, src, size, len(size), [self._attrs], [0], 1, lane.stream),
                   "cudaMemcpyBatchAsync")
        lane.sync()


def make_copier(method: str, cache: DeviceTensors, swap: CudaSwapSpace, spec: CacheSpec) -> Copier:
    """A copier of `method` over plain per-tensor device pointers (`cache.pointers`)."""
    if method == "staged":
        return StagedCopier(cache, swap, spec, staging_bytes=int(Settings.from_env().staging_mb * (1 << 20)))
    if method == "kernel":
        return KernelCopier(cache, swap, spec, blocks=Settings.from_env().kernel_blocks)
    if method == "batch":
        return BatchCopier(cache, swap, spec)
    if method == "memcpy":
        return MemcpyCopier(cache, swap, spec)
    raise ValueError(f"unknown copy method {method!r}; expected one of {METHODS}")


class CudaOps(DeviceOps):
    name = "cuda"

    def allocate(self, spec, rank, device_id, framework, suffix, generation):
        check_framework(framework)
        if framework == "numpy":
            raise ValueError("framework 'numpy' holds host memory: it needs device='sim'")
        return CudaLocalCache(spec, rank, device_id, framework)

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

    def copier(self, cache, swap, spec):
        return make_copier(Settings.from_env().copy_method, cache, swap, spec)
