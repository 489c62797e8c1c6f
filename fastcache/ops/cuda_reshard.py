"""The cuda device's part of a reshard (docs/design.md §9): head slices move GPU to GPU through CUDA IPC.

Worker side: the staging buffer is a framework allocation beside the cache (at most 256 MiB), exported by
IPC handle, so that it outlives a transfer manager that dies mid-chunk; the cache's tensors are re-viewed
in the new shape over the same allocations (`reshape`: the exported handles and offsets do not change,
only the byte counts in the manifest). Weights are re-viewed alike, except a tensor whose new slice outgrows
its allocation: the worker allocates and exports a new one at PREPARE (`CudaWeightAllocation`), the moves
fill it, and at COMMIT it becomes the tensor's base and the old allocation is freed.

Transfer-manager side: `CudaMemory` opens every source rank's allocations by IPC handle (with lazy peer
access: ranks on other GPUs are read over NVLink/PCIe peer copies; ranks sharing a GPU copy within it) and
runs the plan's device copies on one stream; `flush` synchronizes it before the journal records a chunk.
Two ways to copy, chosen by `copy_method` or else FASTCACHE_RESHARD_COPY (default "gather"):

- "gather": per plan copy (one source and one destination region) a table of runs {src offset, dst offset,
  bytes} (`copy_runs`: a run per row, rows consecutive on both sides joined where a row fills its pitch,
  long runs cut at RUN_SPLIT_BYTES), built once with NumPy and uploaded once into a bounded device arena
  (kept there per copy) on a stream of its own, so that the next table's build and upload overlap the
  previous copy's kernel; then one gather_runs launch (cuda_kernels) for the copy. A copy that is one run
  is a plain cudaMemcpyAsync. `GatherCopies` does this over any two device regions.
- "2d": one cudaMemcpy2DAsync per run of rows consecutive on both sides (the former path; head slices of
  about 1 KiB make it slow, 5-7 GB/s on an H100): kept for comparison (`gather_rate`).

Every copy's bounds are checked (ValueError naming the region) before anything of it is issued. The CPU
tier is host memory and is resharded with NumPy (`HostMemory`), unpinned meanwhile (the transfer manager
re-pins it in the new geometry on commit).
"""
from __future__ import annotations

import gc
import time

import numpy as np
from cuda.bindings import runtime

from ..config import ELEMENT_BYTES, RESHARD_COPY_METHODS, Settings, env_name
from ..errors import TransferError
from ..ipc.manifest import read_json_segment
from ..ipc.naming import reshard_exports_name
from ..reshard_plan import Copy, Plan
from .base import manifest_entry, new_weight_export, weight_entry
from .cuda_ipc import OpenAllocations, check_region, export_pointer
from .cuda_kernels import DeviceBuffer, GatherKernel, cuda_check, set_device
from .frameworks import device_pointer, empty_device, free_cached, view_as
from .host_memory import HostMemory, numpy_copy


# -- worker side -----------------------------------------------------------------------------------
class CudaStaging:
    """A worker's staging buffer: nbytes of the framework's device memory, exported by IPC handle."""

    def __init__(self, framework: str, nbytes: int, device_id: int, dtype: str = "uint8",
                 what: str = "reshard staging"):
        self.framework, self.nbytes = framework, nbytes
        set_device(device_id)
        self.tensor = empty_device(framework, (nbytes // ELEMENT_BYTES[dtype],), dtype, device_id)
        ptr = device_pointer(self.tensor)
        self.descriptor = {"device": "cuda", "device_id": device_id, "nbytes": nbytes, **export_pointer(ptr, what)}

    def close(self):
        self.tensor = None
        free_cached(self.framework)


class CudaWeightAllocation(CudaStaging):
    """A kept rank's new allocation of one weight tensor that outgrew its own (docs/design.md §9): the transfer
    managers fill it during the moves, and at COMMIT `reshape` makes it the tensor's base (the cache owns it
    from then on). It holds the tensor's dtype, so that the new shape is a view of it; close() frees it (an
    aborted step)."""

    def __init__(self, framework: str, nbytes: int, device_id: int, dtype: str, index: int):
        super().__init__(framework, nbytes, device_id, dtype, f"new allocation of weight tensor {index}")


def reshape(cache, spec, rank: int, device_id: int, framework: str, replaced=None):
    """Re-view a CudaLocalCache's tensors in spec's shape over the same allocations (no new memory). The
    tensors allocated first are kept as bases: every later shape is a view of them. A weight tensor in
    `replaced` ({index: CudaWeightAllocation}, docs/design.md §9) takes that allocation as its base and its
    export; its old base is dropped and the framework's cached memory freed (whatever else still holds the old
    views keeps their memory). Nothing changes unless every tensor fits."""
    infos = spec.tensors(rank, device_id)
    if len(infos) != len(cache.manifest):
        raise ValueError(f"the new spec has {len(infos)} tensors, the cache {len(cache.manifest)}")
    if getattr(cache, "bases", None) is None:
        cache.bases = [cache.tensors[info.name] for info in cache.infos]
        cache.base_bytes = [info.nbytes for info in cache.infos]
    replaced = replaced or {}
    bases, base_bytes, pointers = list(cache.bases), list(cache.base_bytes), list(cache.pointers)
    exports = list(cache.manifest)
    for i, alloc in replaced.items():
        bases[i], base_bytes[i], pointers[i] = alloc.tensor, alloc.nbytes, device_pointer(alloc.tensor)
        kept = {k: v for k, v in exports[i].items() if k != "vmm"}     # the new allocation is cudaMalloc memory
        exports[i] = {**kept, **{k: alloc.descriptor[k] for k in ("handle", "offset", "alloc_bytes")}}
    tensors, manifest = {}, []
    for i, (info, entry) in enumerate(zip(infos, exports)):
        if info.nbytes > base_bytes[i]:
            raise ValueError(f"{info.name}: {info.nbytes} bytes do not fit in its {base_bytes[i]}-byte "
                             f"allocation")
        elements = info.nbytes // ELEMENT_BYTES[info.dtype]
        view = view_as(bases[i], elements, info.shape)
        if device_pointer(view) != pointers[i]:
            raise TransferError(f"{framework} made a copy of {info.name} instead of a view; cannot reshard it in place")
        tensors[info.name] = view
        manifest.append({**entry, "name": info.name, "nbytes": info.nbytes})
    cache.tensors, cache.manifest, cache.infos = tensors, manifest, infos
    cache.bases, cache.base_bytes, cache.pointers = bases, base_bytes, pointers
    if replaced:
        gc.collect()
        free_cached(framework)          # the old bases' memory back to the driver


# -- transfer-manager side -------------------------------------------------------------------------
COPY_METHODS = RESHARD_COPY_METHODS
COPY_METHOD_ENV = env_name("reshard_copy")
RUN_SPLIT_BYTES = 64 << 10      # longer runs are cut, so that many thread blocks share one long run
TABLE_ARENA_BYTES = 32 << 20    # device memory for uploaded run tables (more only for one bigger table)
MIN_ARENA_BYTES = 1 << 20       # the arena's first allocation
ARENA_ALIGN = 256


def reshard_copy_method(method: str | None = None) -> str:
    """`method`, else FASTCACHE_RESHARD_COPY (Settings), else "gather"; ValueError for anything but COPY_METHODS."""
    method = method or Settings.from_env().reshard_copy
    if method not in COPY_METHODS:
        raise ValueError(f"reshard copy method must be one of {', '.join(COPY_METHODS)}, got {method!r} "
                         f"({COPY_METHOD_ENV})")
    return method


class DeviceRegion:
    """Bytes at a device address (an opened IPC allocation plus an offset, or any device buffer)."""

    def __init__(self, ptr: int, nbytes: int, what: str):
        self.ptr, self.size, self.what = ptr, nbytes, what


def check_bounds(c: Copy, src, dst):
    """ValueError naming the region unless every row of c lies inside src and dst (before anything is issued)."""
    if c.width <= 0:
        raise ValueError(f"reshard copy of {c.width} bytes a row from {c.src} to {c.dst}")
    for region, rows, pitch, off in ((src, c.src_rows, c.src_pitch, c.src_off), (dst, c.dst_rows, c.dst_pitch,
                                                                                   c.dst_off)):
        if not len(rows):
            continue
        lo, end = int(np.min(rows)) * pitch + off, int(np.max(rows)) * pitch + off + c.width
        if lo < 0 or end > _size(region):
            raise ValueError(f"reshard copy of bytes [{lo}, {end}) outside {_what(region)} ({_size(region)} bytes)")


def copy_runs(c: Copy, out: np.ndarray | None = None) -> np.ndarray:
    """c as runs: an (n, 3) int64 table of {src offset, dst offset, bytes}, written into the first n rows of
    `out` where it has them. A run per row, except that rows consecutive on both sides join into one run
    where a row fills its pitch on both sides (whole rows: compaction, and staging written into place); a
    head slice narrower than its row stays a run of its own."""
    src_rows, dst_rows = np.asarray(c.src_rows, np.int64), np.asarray(c.dst_rows, np.int64)
    nbytes = c.width
    if c.width == c.src_pitch == c.dst_pitch and len(src_rows) > 1:
        starts = np.flatnonzero(np.r_[True, (np.diff(src_rows) != 1) | (np.diff(dst_rows) != 1)])
        nbytes = np.diff(np.r_[starts, len(src_rows)]) * c.width
        src_rows, dst_rows = src_rows[starts], dst_rows[starts]
    n = len(src_rows)
    table = out[:n] if out is not None and len(out) >= n else np.empty((n, 3), np.int64)
    table[:, 0] = src_rows * c.src_pitch + c.src_off       # contiguous arithmetic, one strided store: the fastest
    table[:, 1] = dst_rows * c.dst_pitch + c.dst_off
    table[:, 2] = nbytes
    return table


def split_runs(table: np.ndarray, limit: int = RUN_SPLIT_BYTES) -> np.ndarray:
    """Runs longer than `limit` bytes cut into pieces of `limit` (the last one shorter): a thread block takes
    a run, so one long run would leave every other block idle. Both sides move by the same bytes, so the
    alignment a piece gets (int4, word or byte copies) is the run's."""
    if not len(table) or int(table[:, 2].max()) <= limit:
        return table
    pieces = -(-table[:, 2] // limit)
    which = np.repeat(np.arange(len(table)), pieces)
    skip = (np.arange(len(which)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * limit
    out = table[which]
    out[:, 0] += skip
    out[:, 1] += skip
    out[:, 2] = np.minimum(limit, out[:, 2] - skip)
    return out


class GatherCopies:
    """Plan copies between device regions as gathers on `stream`: per copy, one table of runs, built and
    uploaded once, then one gather_runs launch; a copy that is one run is a cudaMemcpyAsync.

    Tables are built in one reused host buffer (no fresh pages per table) and uploaded into a device arena on
    a stream of their own, so that one copy's kernel runs while the next table is built and uploaded; a
    launch waits (an event) for its own table's upload. The arena is only ever appended to and is the
    cache: a copy run again (a resumed chunk) launches from the table already there. When the arena is
    full, `stream` is synchronized first (every launch that reads it has run), then the arena starts over
    and the cache with it."""

    def __init__(self, device_id: int, stream):
        self.stream = stream
        self.kernel = GatherKernel(device_id)
        self.upload_stream = self.uploaded = None
        self.arena, self.used = DeviceBuffer(0), 0
        self.tables = {}        # Copy (by identity) -> (table's device address, runs) or (0, 1, its one run)
        self.scratch = np.empty((0, 3), np.int64)
        try:
            self.upload_stream = cuda_check(runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking),
                                            "cudaStreamCreateWithFlags")
            self.uploaded = cuda_check(runtime.cudaEventCreateWithFlags(runtime.cudaEventDisableTiming),
                                       "cudaEventCreateWithFlags")
        except Exception:
            self.close()
            raise

    def copy(self, c: Copy, src: DeviceRegion, dst: DeviceRegion):
        entry = self.tables.get(c)
        if entry is None:
            if not len(c.src_rows):
                return
            entry = self._prepare(c, src, dst)
        table, num_runs, *one = entry
        if not table:
            s, d, n = one[0]
            cuda_check(runtime.cudaMemcpyAsync(dst.ptr + d, src.ptr + s, n, runtime.cudaMemcpyKind.cudaMemcpyDefault,
                                               self.stream), "cudaMemcpyAsync")
        else:
            self.kernel.launch(self.stream, table, num_runs, src.ptr, dst.ptr)

    def _prepare(self, c: Copy, src: DeviceRegion, dst: DeviceRegion) -> tuple:
        check_bounds(c, src, dst)
        if len(self.scratch) < len(c.src_rows):
            self.scratch = np.empty((max(len(c.src_rows), 2 * len(self.scratch)), 3), np.int64)
        runs = copy_runs(c, self.scratch)
        if len(runs) == 1:
            entry = (0, 1, tuple(runs[0].tolist()))
        else:
            if len(runs) < len(c.src_rows) or c.width > RUN_SPLIT_BYTES:
                runs = split_runs(runs)          # only joined rows, or rows wider than the cut, can be long
            entry = (self._upload(runs), len(runs))
        self.tables[c] = entry
        return entry

    def _upload(self, runs: np.ndarray) -> int:
        need = -(-runs.nbytes // ARENA_ALIGN) * ARENA_ALIGN
        if self.used + need > self.arena.nbytes:
            cuda_check(runtime.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
            self.tables.clear()
            self.used = 0
            size = max(need, min(2 * self.arena.nbytes, TABLE_ARENA_BYTES), MIN_ARENA_BYTES)
            if size > self.arena.nbytes:
                self.arena.close()
                self.arena = DeviceBuffer(size)
        ptr = self.arena.ptr + self.used
        self.used += need
        # pageable source: the call returns once the bytes are staged, so the scratch buffer may be reused
        cuda_check(runtime.cudaMemcpyAsync(ptr, runs.ctypes.data, runs.nbytes,
                                           runtime.cudaMemcpyKind.cudaMemcpyHostToDevice, self.upload_stream),
                   "cudaMemcpyAsync(run table)")
        cuda_check(runtime.cudaEventRecord(self.uploaded, self.upload_stream), "cudaEventRecord")
        cuda_check(runtime.cudaStreamWaitEvent(self.stream, self.uploaded, 0), "cudaStreamWaitEvent")
        return ptr

    def close(self):
        """Once `stream` is synchronized: the upload stream, the arena and the kernel's module go."""
        try:
            if self.upload_stream is not None:
                cuda_check(runtime.cudaStreamSynchronize(self.upload_stream), "cudaStreamSynchronize")
                cuda_check(runtime.cudaStreamDestroy(self.upload_stream), "cudaStreamDestroy")
                self.upload_stream = None
            if self.uploaded is not None:
                cuda_check(runtime.cudaEventDestroy(self.uploaded), "cudaEventDestroy")
                self.uploaded = None
            self.arena.close()
            self.tables.clear()
        finally:
            self.kernel.close()


def copy_2d(c: Copy, src, dst, stream):
    """c as one cudaMemcpy2DAsync per run of rows consecutive on both sides (the "2d" method)."""
    check_bounds(c, src, dst)
    sp, dp = _address(src), _address(dst)
    kind = runtime.cudaMemcpyKind.cudaMemcpyDefault     # unified addressing: peer, device or host
    for s, d, rows in c.runs():
        cuda_check(runtime.cudaMemcpy2DAsync(dp + d, c.dst_pitch, sp + s, c.src_pitch, c.width, rows, kind, stream),
                   "cudaMemcpy2DAsync")


class CudaMemory(HostMemory):
    """Every memory a cuda transfer manager's reshard program touches, and the copies over it."""

    def __init__(self, suffix: str, plan: Plan, device_id: int, copy_method: str | None = None):
        self.copy_method = reshard_copy_method(copy_method)
        super().__init__(suffix, plan)
        self.device_id = device_id
        self._allocations = OpenAllocations(device_id)
        self._manifests, self._weight_manifests = {}, {}
        self.gather = None          # GatherCopies, made at the first device copy
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
        if ref[0] == "weights":     # the rank's current weight tensor: old rows as a source, new as a destination
            rank, index = ref[1], ref[2]
            entry = weight_entry(self._weight_manifests, self.suffix, self.plan, rank, index)
            return self._open(entry, self.plan.region_bytes(self.plan.weight_spaces[index], rank),
                              entry.get("name", "?"))
        if ref[0] == "weights_new":     # a kept rank's new allocation of a tensor that outgrew its own
            rank, index = ref[1], ref[2]
            return self._open(new_weight_export(self.suffix, rank, index, "cuda"),
                              self.plan.weight_spaces[index].new_bytes(),
                              f"new allocation of weight tensor {index} of rank {rank}")
        return super()._resolve(ref)

    def execute(self, c):
        src, dst = self.resolve(c.src), self.resolve(c.dst)
        on_device = isinstance(src, DeviceRegion), isinstance(dst, DeviceRegion)
        if not any(on_device):
            self._host_copy(c)                   # the CPU tier: host to host
        elif self.copy_method == "gather" and all(on_device):
            if self.gather is None:
                self.gather = GatherCopies(self.device_id, self.stream)
            self.gather.copy(c, src, dst)
        else:
            copy_2d(c, src, dst, self.stream)

    def flush(self):
        cuda_check(runtime.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def close(self):
        try:
            if self.stream is not None:
                set_device(self.device_id)
                try:
                    self.flush()
                finally:
                    gather, self.gather = self.gather, None
                    try:
                        if gather is not None:
                            gather.close()
                    finally:
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


def gather_rate(slice_bytes: int = 1024, slices: int = 2, rows: int = 131072, live: float = 0.5,
                chunk_rows: int = 65536, device_id: int = 0, repeat: int = 3, seed: int = 0) -> dict:
    """GB/s of a reshard's head-slice copies on device_id by each copy method, against one cudaMemcpyAsync
    device to device of the same bytes (d2d_rate). The source holds rows/live rows of `slices` head slices of
    slice_bytes each; `rows` of them, at random, are gathered slice by slice (a Copy per slice and chunk of
    chunk_rows rows, as Plan.program makes them) into consecutive rows of the destination.
    gather: wall time with new copies each time (tables built and uploaded, as in a reshard); gather_warm:
    the same copies again (tables kept); 2d: the cudaMemcpy2DAsync path. The gather's bytes are checked."""
    set_device(device_id)
    rng = np.random.default_rng(seed)
    row = slices * slice_bytes
    old_rows = max(rows, int(rows / live))
    ids = np.sort(rng.choice(old_rows, rows, replace=False))
    host = np.frombuffer(rng.bytes(old_rows * row), np.uint8)
    nbytes = rows * row
    src, dst = DeviceBuffer(old_rows * row), DeviceBuffer(nbytes)
    stream = cuda_check(runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
    gather = None
    try:
        cuda_check(runtime.cudaMemcpy(src.ptr, host.ctypes.data, host.nbytes,
                                      runtime.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy")
        regions = {"src": DeviceRegion(src.ptr, src.nbytes, "source"), "dst": DeviceRegion(dst.ptr, dst.nbytes,
                                                                                          "destination")}
        gather = GatherCopies(device_id, stream)

        def copies():
            return [Copy(("src",), row, p * slice_bytes, ids[c:c + chunk_rows], ("dst",), row, p * slice_bytes,
                         np.arange(c, min(c + chunk_rows, rows)), slice_bytes)
                    for c in range(0, rows, chunk_rows) for p in range(slices)]

        def timed(issue, plan):
            began = time.perf_counter()
            for c in plan:
                issue(c, regions[c.src[0]], regions[c.dst[0]])
            cuda_check(runtime.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
            return nbytes / (time.perf_counter() - began) / 1e9

        timed(gather.copy, copies())            # the first launch and the arena's allocation, untimed
        cuda_check(runtime.cudaMemset(dst.ptr, 0, nbytes), "cudaMemset")
        cuda_check(runtime.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        rates = {"gather": max(timed(gather.copy, copies()) for _ in range(repeat))}
        got = np.empty(nbytes, np.uint8)
        cuda_check(runtime.cudaMemcpy(got.ctypes.data, dst.ptr, nbytes, runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost),
                   "cudaMemcpy")
        same = bool(np.array_equal(got.reshape(rows, row), host.reshape(old_rows, row)[ids]))
        kept = copies()
        timed(gather.copy, kept)
        rates["gather_warm"] = max(timed(gather.copy, kept) for _ in range(repeat))
        rates["2d"] = max(timed(lambda c, a, b: copy_2d(c, a, b, stream), kept) for _ in range(repeat))
    finally:
        cuda_check(runtime.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        if gather is not None:
            gather.close()
        runtime.cudaStreamDestroy(stream)
        src.close()
        dst.close()
    reference = d2d_rate(nbytes, device_id, repeat)
    return {"bytes": nbytes, "slice_bytes": slice_bytes, "rows": rows, "live": live, "bit_for_bit": same,
            "d2d_gbps": reference, **{f"{k}_gbps": v for k, v in rates.items()},
            **{f"{k}_ratio": v / reference for k, v in rates.items()}}
