"""Low-level CUDA for the cuda device: status checks, device memory, per-direction streams and staging
buffers, the row-copy kernel and the reshard's gather kernel.

Everything goes through cuda-python (`cuda.bindings`); every call returns a tuple whose first element
is the status, which `cuda_check` turns into a TransferError naming the call. The kernels (copy_rows for
swaps, gather_runs for a reshard's head slices) share one source, compiled with NVRTC for the device's
architecture; the cubin is cached on disk, so a transfer manager pays for the compilation once per
machine, not once per start.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from pathlib import Path

import numpy as np
from cuda.bindings import driver, nvrtc, runtime

from ..errors import TransferError

THREADS = 512          # threads per block of the row-copy kernel: one 8 KiB row per pass of int4 stores

KERNEL_SOURCE = r"""
// Copies the (tensor, block) rows of one task between the cache tensors and a block-major tier: the
// CPU tier itself (through mapped host memory) or a device staging buffer laid out the same way.
typedef long long i64;

// dst and src are congruent modulo sizeof(T): a byte head up to T's alignment, a T body, a byte tail
template <typename T>
__device__ __forceinline__ void copy_as(char* dst, const char* src, i64 n) {
  i64 head = (i64)((sizeof(T) - ((unsigned long long)dst % sizeof(T))) % sizeof(T));
  if (head > n) head = n;
  const i64 body = (n - head) / (i64)sizeof(T);
  for (i64 i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
  T* d = reinterpret_cast<T*>(dst + head);
  const T* s = reinterpret_cast<const T*>(src + head);
  for (i64 i = threadIdx.x; i < body; i += blockDim.x) d[i] = s[i];
  for (i64 i = head + body * (i64)sizeof(T) + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

// rows of any size: 16-byte vectors where both sides allow it, else 4-byte words, else bytes
__device__ __forceinline__ void copy_row(char* dst, const char* src, i64 n) {
  const unsigned long long skew = (unsigned long long)dst ^ (unsigned long long)src;
  if ((skew & 15) == 0) copy_as<int4>(dst, src, n);
  else if ((skew & 3) == 0) copy_as<unsigned int>(dst, src, n);
  else copy_as<unsigned char>(dst, src, n);
}

// table: per tensor {device address of row 0, row bytes, offset inside a tier block, number of rows}.
// Row b of the task moves between gpu block gpu_ids[b] and tier block slots[b] (b itself if slots is null).
// 512 threads, 4 blocks an SM: without the bound NVRTC gives it 40 registers, too many for 4 resident blocks
extern "C" __global__ void __launch_bounds__(512, 4) copy_rows(const i64* __restrict__ table, int num_tensors,
                                     const i64* __restrict__ gpu_ids, const i64* __restrict__ slots,
                                     int num_ids, char* tier, i64 tier_block_bytes, int to_tier) {
  const i64 work = (i64)num_ids * num_tensors;
  for (i64 w = blockIdx.x; w < work; w += gridDim.x) {
    const i64* t = table + 4 * (w / num_ids);
    const i64 b = w % num_ids;
    const i64 g = gpu_ids[b];
    if (g >= t[3]) continue;  // draft layers hold fewer blocks
    char* gpu = reinterpret_cast<char*>(t[0]) + g * t[1];
    char* cpu = tier + (slots ? slots[b] : b) * tier_block_bytes + t[2];
    if (to_tier) copy_row(cpu, gpu, t[1]);
    else copy_row(gpu, cpu, t[1]);
  }
}

// A reshard's head slices between two allocations: runs[3r..3r+2] = {src offset, dst offset, bytes} of run r,
// relative to src and dst. Blocks take runs grid-stride. 64 threads move a 1 KiB head slice in one pass of
// int4 stores; 32 resident blocks an SM fill its 2048 thread slots (the bound caps registers at 32).
extern "C" __global__ void __launch_bounds__(64, 32) gather_runs(const i64* __restrict__ runs, i64 num_runs,
                                                                 const char* src, char* dst) {
  for (i64 r = blockIdx.x; r < num_runs; r += gridDim.x) {
    const i64* t = runs + 3 * r;
    copy_row(dst + t[1], src + t[0], t[2]);
  }
}
"""
KERNEL_NAME = b"copy_rows"
GATHER_NAME = b"gather_runs"
GATHER_THREADS = 64            # threads per block of gather_runs: its __launch_bounds__
GATHER_BLOCKS_PER_SM = 32      # resident blocks an SM at that bound: the most a grid needs


def _error_text(err) -> str:
    if isinstance(err, runtime.cudaError_t):
        _, name = runtime.cudaGetErrorName(err)
        _, text = runtime.cudaGetErrorString(err)
    elif isinstance(err, driver.CUresult):
        name, text = driver.cuGetErrorName(err)[1], driver.cuGetErrorString(err)[1]
    else:
        name, text = nvrtc.nvrtcGetErrorString(err)[1], b""
    return " ".join(s.decode(errors="replace") for s in (name, text) if s)


def cuda_check(result, call_name: str):
    """Status of a cuda-python call -> TransferError, else the call's value (a tuple if several)."""
    err, *values = result
    if int(err) != 0:
        raise TransferError(f"{call_name} failed: {_error_text(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


_initialised = set()


def set_device(device_id: int):
    """Make the device's primary context current on this thread (runtime and driver calls alike)."""
    cuda_check(runtime.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")
    if device_id not in _initialised:
        cuda_check(runtime.cudaFree(0), "cudaFree(0)")      # creates the primary context now
        cuda_check(driver.cuInit(0), "cuInit")
        _initialised.add(device_id)


class DeviceBuffer:
    """cudaMalloc'd bytes, freed on close."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = int(cuda_check(runtime.cudaMalloc(nbytes), f"cudaMalloc({nbytes})")) if nbytes else 0

    def close(self):
        if self.ptr:
            cuda_check(runtime.cudaFree(self.ptr), "cudaFree")
            self.ptr = 0


class HostBuffer:
    """cudaHostAlloc'd bytes, pinned and mapped (the device reads them in place at device_ptr)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = self.device_ptr = 0
        if nbytes:
            self.ptr = int(cuda_check(runtime.cudaHostAlloc(nbytes, runtime.cudaHostAllocMapped),
                                      f"cudaHostAlloc({nbytes})"))
            self.device_ptr = int(cuda_check(runtime.cudaHostGetDevicePointer(self.ptr, 0),
                                             "cudaHostGetDevicePointer"))

    def close(self):
        if self.ptr:
            cuda_check(runtime.cudaFreeHost(self.ptr), "cudaFreeHost")
            self.ptr = self.device_ptr = 0


def create_stream():
    """A non-blocking stream of the device's highest priority: beside a model that fills every SM, the
    copies' kernels get the SMs that free up first instead of waiting behind the model's queued blocks."""
    _, greatest = cuda_check(runtime.cudaDeviceGetStreamPriorityRange(), "cudaDeviceGetStreamPriorityRange")
    return cuda_check(runtime.cudaStreamCreateWithPriority(runtime.cudaStreamNonBlocking, greatest),
                      "cudaStreamCreateWithPriority")


def create_event():
    return cuda_check(runtime.cudaEventCreateWithFlags(runtime.cudaEventDisableTiming), "cudaEventCreateWithFlags")


def memcpy_async(dst: int, src: int, nbytes: int, to_host: bool, stream):
    kind = runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost if to_host else runtime.cudaMemcpyKind.cudaMemcpyHostToDevice
    cuda_check(runtime.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")


def device_attribute(device_id: int, name: str) -> int:
    return cuda_check(runtime.cudaDeviceGetAttribute(getattr(runtime.cudaDeviceAttr, name), device_id),
                      f"cudaDeviceGetAttribute({name})")


class Lane:
    """One direction's CUDA resources: swap-out and swap-in never share a stream, a buffer or an event."""

    def __init__(self, ring: int = 0, slot_bytes: int = 0, host_ids: int = 0):
        self.lock = threading.Lock()
        self.stream = create_stream()                          # kernels, or every copy of a plain lane
        self.dma_stream = create_stream() if ring else None    # staged: bulk copies beside the kernels
        # staged: a second copy stream takes half of a chunk's runs, so that one copy engine's pause between
        # runs is the other's transfer (8 KiB rows: 85-94% of the bulk rate on one stream, 94-106% on two)
        self.dma_stream2 = create_stream() if ring else None
        self.slots = [DeviceBuffer(slot_bytes) for _ in range(ring)]
        self.filled = [create_event() for _ in range(ring)]    # slot written (by gather or H2D)
        self.drained = [create_event() for _ in range(ring)]   # slot consumed (by D2H or scatter)
        self.joined = [create_event() for _ in range(ring)]    # the second copy stream's half of a slot done
        self._ids = DeviceBuffer(0)
        self._host_ids = HostBuffer(8 * host_ids)              # small tasks: ids the kernel reads in place
        self._host_id_slots = (ctypes.c_longlong * host_ids).from_address(self._host_ids.ptr) if host_ids else None

    def put_host_ids(self, ids: list) -> int:
        """Device address of `ids` written into the lane's pinned, mapped buffer. Only while no launch of
        this lane may still read it (the lane syncs at the end of every task, under its lock)."""
        self._host_id_slots[:len(ids)] = ids
        return self._host_ids.device_ptr

    def upload_ids(self, *arrays) -> list[int]:
        """Device addresses of int64 copies of `arrays`, uploaded in stream order on self.stream."""
        data = np.concatenate([np.asarray(a, np.int64) for a in arrays])
        if self._ids.nbytes < data.nbytes:
            self._ids.close()
            self._ids = DeviceBuffer(2 * data.nbytes)
        # pageable source: the call returns once the bytes are staged, so `data` may go right after
        memcpy_async(self._ids.ptr, data.ctypes.data, data.nbytes, False, self.stream)
        offsets = np.cumsum([0] + [len(a) for a in arrays[:-1]]) * 8
        return [self._ids.ptr + int(off) for off in offsets]

    def sync(self):
        for stream in (self.stream, self.dma_stream, self.dma_stream2):
            if stream is not None:
                cuda_check(runtime.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def settle(self):
        """After a failed task: wait for whatever it queued, errors ignored (the task reports its own)."""
        for stream in (self.stream, self.dma_stream, self.dma_stream2):
            if stream is not None:
                runtime.cudaStreamSynchronize(stream)

    def sync_stream(self):
        cuda_check(runtime.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def close(self):
        self.sync()
        self._host_id_slots = None
        for buf in [*self.slots, self._ids, self._host_ids]:
            buf.close()
        for event in [*self.filled, *self.drained, *self.joined]:
            cuda_check(runtime.cudaEventDestroy(event), "cudaEventDestroy")
        for stream in (self.stream, self.dma_stream, self.dma_stream2):
            if stream is not None:
                cuda_check(runtime.cudaStreamDestroy(stream), "cudaStreamDestroy")


# -- the row-copy kernel ---------------------------------------------------------------------------
def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastcache"


def _nvrtc_check(result, call_name, prog=None):
    err, *values = result
    if int(err) != 0:
        log = ""
        if prog is not None:
            buf = bytearray(nvrtc.nvrtcGetProgramLogSize(prog)[1])      # written in place: never a bytes
            nvrtc.nvrtcGetProgramLog(prog, buf)
            log = "\n" + buf.decode(errors="replace").rstrip("\0 ")
        raise TransferError(f"{call_name} failed: {_error_text(err)}{log}")
    return values[0] if len(values) == 1 else tuple(values)


def kernel_target(arch: int, supported) -> tuple[str, bool]:
    """(NVRTC target, is a cubin): the device's own architecture, else PTX for the newest one NVRTC knows
    that is not above it (the driver can JIT PTX forward, never backward)."""
    if arch in supported:
        return f"sm_{arch}", True
    older = [a for a in supported if a <= arch]
    if not older:
        raise TransferError(f"NVRTC supports architectures {sorted(supported)}, none at or below the device's "
                            f"sm_{arch}")
    return f"compute_{max(older)}", False


def compile_kernel(major: int, minor: int) -> bytes:
    """A cubin for sm_{major}{minor}, or PTX (kernel_target) if NVRTC lacks this architecture."""
    supported = _nvrtc_check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    target, as_cubin = kernel_target(major * 10 + minor, list(supported))
    prog = _nvrtc_check(nvrtc.nvrtcCreateProgram(KERNEL_SOURCE.encode(), b"fastcache_rows.cu", 0, [], []),
                        "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture={target}".encode(), b"--std=c++17"]
        _nvrtc_check(nvrtc.nvrtcCompileProgram(prog, len(options), options), "nvrtcCompileProgram", prog)
        get_size, get = ((nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if as_cubin
                         else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX))
        image = bytearray(_nvrtc_check(get_size(prog), get_size.__name__))
        _nvrtc_check(get(prog, image), get.__name__)
        return bytes(image)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def kernel_image(major: int, minor: int) -> bytes:
    """The compiled kernel, from the on-disk cache keyed by source, architecture and NVRTC version."""
    version = _nvrtc_check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    key = hashlib.sha256(f"{KERNEL_SOURCE}|sm_{major}{minor}|nvrtc {version}".encode()).hexdigest()
    path = _cache_dir() / f"kernels/{key}.bin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    image = compile_kernel(major, minor)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(image)
        os.replace(tmp, path)      # atomic: a concurrent transfer manager never reads half a file
    except OSError:
        pass                       # an unwritable cache only costs the next start a compilation
    return image


_functions: dict = {}
_functions_lock = threading.Lock()


def row_kernel(device_id: int):
    """The loaded copy_rows function of the device's primary context (loaded once per process)."""
    with _functions_lock:
        function = _functions.get(device_id)
        if function is None:
            set_device(device_id)
            major = device_attribute(device_id, "cudaDevAttrComputeCapabilityMajor")
            minor = device_attribute(device_id, "cudaDevAttrComputeCapabilityMinor")
            module = cuda_check(driver.cuModuleLoadData(kernel_image(major, minor)), "cuModuleLoadData")
            function = _functions[device_id] = cuda_check(driver.cuModuleGetFunction(module, KERNEL_NAME),
                                                          "cuModuleGetFunction")
        return function


def launch_rows(function, stream, grid: int, table: int, num_tensors: int, gpu_ids: int, slots: int,
                num_ids: int, tier: int, tier_block_bytes: int, to_tier: bool):
    """Launch copy_rows; pointers are plain ints (slots=0: row b goes to tier block b)."""
    args = (table, num_tensors, gpu_ids, slots, num_ids, tier, tier_block_bytes, int(to_tier))
    types = (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
             ctypes.c_longlong, ctypes.c_int)
    cuda_check(driver.cuLaunchKernel(function, grid, 1, 1, THREADS, 1, 1, 0, stream, (args, types), 0),
               "cuLaunchKernel(copy_rows)")


class RowKernel:
    """The copy_rows kernel with this cache's tensor table on the device."""

    def __init__(self, infos: list, pointers: list, device_id: int):
        table = np.array([(ptr, i.block_bytes, i.cpu_offset, i.num_blocks) for i, ptr in zip(infos, pointers)],
                         np.int64)
        self.num_tensors = len(infos)
        self.function = row_kernel(device_id)
        self.table = DeviceBuffer(table.nbytes)
        cuda_check(runtime.cudaMemcpy(self.table.ptr, table.ctypes.data, table.nbytes,
                                      runtime.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy(tensor table)")
        # from pageable memory cudaMemcpy may return before the bytes land, and the copiers' streams do not
        # wait for the legacy stream: the table must be on the device before the first launch reads it
        cuda_check(runtime.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def launch(self, stream, grid, gpu_ids, slots, num_ids, tier, tier_block_bytes, to_tier):
        grid = max(1, min(grid, num_ids * self.num_tensors))
        launch_rows(self.function, stream, grid, self.table.ptr, self.num_tensors, gpu_ids, slots, num_ids,
                    tier, tier_block_bytes, to_tier)

    def close(self):
        self.table.close()


# -- the gather kernel (a reshard's head slices) ---------------------------------------------------
def launch_gather(function, stream, grid: int, runs: int, num_runs: int, src: int, dst: int):
    """Launch gather_runs over the device table `runs` ({src offset, dst offset, bytes} i64 each)."""
    args = (runs, num_runs, src, dst)
    types = (ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p)
    cuda_check(driver.cuLaunchKernel(function, grid, 1, 1, GATHER_THREADS, 1, 1, 0, stream, (args, types), 0),
               "cuLaunchKernel(gather_runs)")


class GatherKernel:
    """gather_runs, in a module this object loads into the device's primary context and unloads on close
    (a reshard's transfer manager holds one per move, not for the life of the process)."""

    def __init__(self, device_id: int):
        set_device(device_id)
        major = device_attribute(device_id, "cudaDevAttrComputeCapabilityMajor")
        minor = device_attribute(device_id, "cudaDevAttrComputeCapabilityMinor")
        # more blocks than can be resident only queue behind the first wave: the grid strides instead
        self.max_grid = GATHER_BLOCKS_PER_SM * device_attribute(device_id, "cudaDevAttrMultiProcessorCount")
        self.module = cuda_check(driver.cuModuleLoadData(kernel_image(major, minor)), "cuModuleLoadData")
        try:
            self.function = cuda_check(driver.cuModuleGetFunction(self.module, GATHER_NAME), "cuModuleGetFunction")
        except TransferError:
            self.close()
            raise

    def launch(self, stream, runs: int, num_runs: int, src: int, dst: int):
        """Copy num_runs runs of the device table at `runs` from the allocation at src to the one at dst."""
        grid = max(1, min(num_runs, self.max_grid))
        launch_gather(self.function, stream, grid, runs, num_runs, src, dst)

    def close(self):
        if self.module is not None:
            module, self.module = self.module, None
            cuda_check(driver.cuModuleUnload(module), "cuModuleUnload")
