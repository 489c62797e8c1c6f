"""The cuda device's four ways to move a task's rows between device tensors and the pinned CPU tier.

Copy methods (FASTCACHE_COPY_METHOD):
  staged  (default) an NVRTC kernel gathers the rows of a chunk of blocks into a device staging buffer laid
          out like the CPU tier, the copy engine moves it in runs of consecutive CPU blocks; two staging
          buffers per direction so the gather of chunk i+1 overlaps the DMA of chunk i (swap-in: reverse)
  kernel  the same kernel on mapped host memory, FASTCACHE_KERNEL_BLOCKS thread blocks (default 8)
  batch   cudaMemcpyBatchAsync (CUDA 12.8+) of the rows, merged where adjacent on both sides
  memcpy  one cudaMemcpyAsync per merged row: the FastDeploy baseline

A copier needs only per-tensor device pointers (`cache.infos`, `cache.pointers`, `cache.device_id`), so
the same code serves tensors attached over IPC and, in the exporting process, a worker's own tensors.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools

import numpy as np
from cuda.bindings import runtime

from ..config import COPY_METHODS as METHODS, CacheSpec, Settings
from ..errors import TransferError
from .base import Copier
from .cuda_events import Completions, create_events, destroy_events, record, stream_wait
from .cuda_kernels import Lane, RowKernel, cuda_check, device_attribute, memcpy_async, set_device

STAGING_RING = 2                 # staging buffers per direction: one filling while the other drains
SMALL_TASK_IDS = 64              # staged tasks of at most this many blocks take the one-stream path
DMA_STREAMS = 2                  # staged: copy streams a chunk's runs are spread over (1 or 2)


class _CudaCopier(Copier):
    """What every method shares: id checks, waiting for the pinned chunks a task touches, and one lane per
    direction (swap_out and swap_in run on two threads; each sets the device for itself). Ids reach the
    methods as Python lists: on a one-block task NumPy's per-call overhead is most of the host time."""

    def __init__(self, cache, swap, spec: CacheSpec):
        self.device_id = cache.device_id
        self.infos = cache.infos
        self.pointers = list(cache.pointers)
        self.swap = swap
        self.spec = spec
        self.stride = spec.cpu_block_stride     # CPU block to CPU block; whole blocks move with their slots
        by_layer = {}
        for index, info in enumerate(self.infos):
            by_layer.setdefault(info.layer, []).append(index)
        self._by_layer = sorted(by_layer.items())      # layer-by-layer swap-ins: each layer's tensors
        set_device(self.device_id)
        self._batch = batch_attributes(required=False)     # None where the driver predates it
        self._lanes = {True: self._new_lane(), False: self._new_lane()}     # keyed by "to host"
        self._layer_events = None       # per layer, for layer-by-layer swap-ins given no events of their own

    def _new_lane(self) -> Lane:
        return Lane()

    def swap_out(self, gpu_ids, cpu_ids, first=None):
        self._swap(gpu_ids, cpu_ids, to_host=True, first=first)

    def swap_in(self, gpu_ids, cpu_ids, first=None):
        self._swap(gpu_ids, cpu_ids, to_host=False, first=first)

    def swap_in_layers(self, gpu_ids, cpu_ids, layers, published, events=None, recorded=None, first=None):
        """Layer by layer in layer order, back to back on one stream: each layer's rows in one
        cudaMemcpyBatchAsync (one call per row where the driver predates it), then that layer's event recorded
        on the stream and recorded(layer) called (a worker's stream may wait on the event from then on), and
        published(layer) once the event has completed, so that a host waiter never sees a layer before its
        bytes are on the device, whatever the copy method. events: one per layer (interprocess ones, shared
        with workers), else the copier's own.

        No host sync between layers: a sync there would leave the copy engine idle while the host publishes
        and enqueues the next layer. Layers that have landed are published (cudaEventQuery) while later ones
        are enqueued, the rest in order (cudaEventSynchronize) once all are; on this thread, not a second
        one, so the slot has one writer and the task is reported done only after its last layer is in place."""
        def run(lane, gpu, cpu):
            self._run_layers(lane, gpu, cpu, published, events or self._own_layer_events(), recorded)
        self._swap(gpu_ids, cpu_ids, to_host=False, run=run, first=first)

    def enqueue_swap_in(self, gpu_ids, cpu_ids, event, after=()):
        """The blocks' rows queued on the swap-in stream behind the `after` events (in stream order, no host
        wait), then `event` recorded; returns before they land (a streamed weight layer)."""
        def run(lane, gpu, cpu):
            for other in after:
                stream_wait(lane.stream, other)
            dst, src, size = (a.tolist() for a in row_copies(
                self.infos, self.pointers, self.swap.host_ptr, self.stride, gpu, cpu, False, self.swap.chunk_blocks))
            self._copies(dst, src, size, False, lane.stream)
            record(event, lane.stream)
        self._swap(gpu_ids, cpu_ids, to_host=False, run=run)

    def _own_layer_events(self) -> list:
        if self._layer_events is None:
            self._layer_events = create_events(len(self._by_layer), interprocess=False)
        return self._layer_events

    def _swap(self, gpu_ids, cpu_ids, to_host, run=None, first=None):
        """first(stream): called under the lane's lock before anything is queued, with the lane's stream: in
        every method the one stream that reads or writes the device tensors (a staged copy's DMA streams touch
        only its staging buffers, behind events recorded on it), so whatever first makes it wait for (a fence,
        docs/design.md §4) comes before every access of the task to the tensors."""
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
            try:
                if first is not None:
                    first(lane.stream)
                if run is None:
                    self._run(lane, gpu, cpu, to_host)
                else:
                    run(lane, gpu, cpu)
            except BaseException:
                # what the task queued before the failure still runs, on streams the lane's next task need not
                # wait on (a staged DMA reading a staging slot, writing the task's CPU blocks): let it finish
                # first, or it lands on memory a later task wrote and reported done
                lane.settle()
                raise

    def _run_layers(self, lane, gpu, cpu, published, events, recorded):
        landed = Completions()
        for layer, tensors in self._by_layer:
            dst, src, size = (a.tolist() for a in row_copies(
                [self.infos[i] for i in tensors], [self.pointers[i] for i in tensors], self.swap.host_ptr,
                self.stride, gpu, cpu, False, self.swap.chunk_blocks))
            if size:                        # else a draft layer none of the task's blocks reach
                self._copies(dst, src, size, False, lane.stream)
            record(events[layer], lane.stream)
            if recorded is not None:
                recorded(layer)             # only now: a stream waiting on the event before would not wait
            landed.add(events[layer], functools.partial(published, layer))
            landed.poll()
        landed.drain()

    def _copies(self, dst: list, src: list, sizes: list, to_host: bool, stream):
        """Host-device copies in one cudaMemcpyBatchAsync where the driver has it, else one call each."""
        if self._batch is not None and len(sizes) > 1:
            cuda_check(runtime.cudaMemcpyBatchAsync(dst, src, sizes, len(sizes), [self._batch], [0], 1, stream),
                       "cudaMemcpyBatchAsync")
            return
        for d, s, n in zip(dst, src, sizes):
            memcpy_async(d, s, n, to_host, stream)

    def _run(self, lane: Lane, gpu: list, cpu: list, to_host: bool):
        raise NotImplementedError

    def close(self):
        lanes, self._lanes = self._lanes, {}
        if lanes:
            set_device(self.device_id)
        for lane in lanes.values():
            lane.close()
        events, self._layer_events = self._layer_events, None
        if events:
            destroy_events(events)


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


def in_cpu_order(gpu: list, cpu: list) -> tuple[list, list]:
    """The task's (gpu, cpu) pairs sorted by CPU id, so that blocks adjacent in the tier, wherever they sit in
    the task, are staged side by side and leave in one DMA run: a run costs the copy engine a few µs, as much
    as 100-200 KiB of transfer. Destinations are distinct (protocol.check_ids), so the order is free."""
    if all(a < b for a, b in zip(cpu, cpu[1:])):
        return gpu, cpu
    order = sorted(range(len(cpu)), key=cpu.__getitem__)
    return [gpu[k] for k in order], [cpu[k] for k in order]


class StagedCopier(_CudaCopier):
    """Gather into device staging at HBM speed, then bulk DMA; chunks pipeline through a ring of buffers.
    A task that fits one chunk and the lane's pinned id buffer takes the small path: one stream, no events,
    ids read by the kernel from pinned host memory, no upload."""

    def __init__(self, cache, swap, spec, staging_bytes: int, blocks: int = 0):
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
        self._grid = blocks or 4 * device_attribute(self.device_id, "cudaDevAttrMultiProcessorCount")
        self._small_ids = min(self.chunk_blocks, SMALL_TASK_IDS)
        self._layer_slices = None        # per layer (its bytes' offset in a CPU block, their size, a kernel)

    def _new_lane(self):
        return Lane(STAGING_RING, self.chunk_blocks * self.stride, host_ids=SMALL_TASK_IDS)

    def _lengths(self, gpu: list) -> list:
        """Bytes of each task block present on the device: a prefix of the CPU block."""
        full, ends, neg = self.stride, self._row_ends, self._neg_blocks
        return [full if g < self._full_blocks else ends[bisect.bisect_left(neg, -g) - 1] for g in gpu]

    def _run(self, lane, gpu, cpu, to_host):
        gpu, cpu = in_cpu_order(gpu, cpu)
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
        self._dma(stage, runs, to_host, stream)
        if not to_host:
            self._kernel.launch(stream, self._grid, ids, 0, len(gpu), stage, self.stride, False)
        lane.sync_stream()

    def _gather(self, lane, slot, reused, ids, cpu, lengths):
        stage = lane.slots[slot].ptr
        if reused:      # its previous chunk must have left for the host
            stream_wait(lane.stream, lane.drained[slot])
        self._kernel.launch(lane.stream, self._grid, ids, 0, len(cpu), stage, self.stride, True)
        record(lane.filled[slot], lane.stream)
        self._dma_both(lane, slot, stage, dma_runs(cpu, lengths, self.stride, self.swap.chunk_blocks), True,
                       after=lane.filled[slot], done=lane.drained[slot])

    def _scatter(self, lane, slot, reused, ids, cpu, lengths):
        stage = lane.slots[slot].ptr
        self._dma_both(lane, slot, stage, dma_runs(cpu, lengths, self.stride, self.swap.chunk_blocks), False,
                       after=lane.drained[slot] if reused else None, done=lane.filled[slot])
        stream_wait(lane.stream, lane.filled[slot])
        self._kernel.launch(lane.stream, self._grid, ids, 0, len(cpu), stage, self.stride, False)
        record(lane.drained[slot], lane.stream)

    def _dma_both(self, lane, slot, stage, runs, to_host, after, done):
        """A chunk's runs over the lane's two copy streams, each half behind `after`; `done` recorded on the
        first stream once both halves are (the second's joined event), so one wait covers the chunk."""
        half = len(runs) // 2 if DMA_STREAMS > 1 else 0
        streams = (lane.dma_stream, lane.dma_stream2) if half else (lane.dma_stream,)
        for stream, part in zip(streams, (runs[half:], runs[:half])):
            if after is not None:
                stream_wait(stream, after)
            self._dma(stage, part, to_host, stream)
        if half:
            record(lane.joined[slot], lane.dma_stream2)
            stream_wait(lane.dma_stream, lane.joined[slot])
        record(done, lane.dma_stream)

    def _run_layers(self, lane, gpu, cpu, published, events, recorded):
        """Layer by layer through the staging ring. A layer's tensors sit side by side in a CPU block, so its
        slice of a run of adjacent CPU blocks is one strided copy (cudaMemcpy2DAsync) into a staging slot,
        and a kernel scatters the slot into the layer's tensors while the next layer's copy fills the other
        slot. A layer's rows one copy each (the base class's way) keep the copy engine at a fraction of its
        rate: rows are 8-32 KiB, and each copy costs it a few µs."""
        slices = self._layer_slices_once()
        if slices is None:              # a layer's tensors not side by side: row by row
            return super()._run_layers(lane, gpu, cpu, published, events, recorded)
        gpu, cpu = in_cpu_order(gpu, cpu)
        (ids,) = lane.upload_ids(gpu)
        landed, used = Completions(), 0
        for layer, _ in self._by_layer:
            offset, nbytes, kernel = slices[layer]
            per_slot = max(1, lane.slots[0].nbytes // nbytes)
            for lo in range(0, len(gpu), per_slot):
                hi, slot = min(lo + per_slot, len(gpu)), used % STAGING_RING
                stage = lane.slots[slot].ptr
                if used >= STAGING_RING:        # its previous piece must have been scattered
                    stream_wait(lane.dma_stream, lane.drained[slot])
                self._layer_dma(stage, cpu[lo:hi], offset, nbytes, lane.dma_stream)
                record(lane.filled[slot], lane.dma_stream)
                stream_wait(lane.stream, lane.filled[slot])
                kernel.launch(lane.stream, self._grid, ids + 8 * lo, 0, hi - lo, stage, nbytes, False)
                record(lane.drained[slot], lane.stream)
                used += 1
            record(events[layer], lane.stream)
            if recorded is not None:
                recorded(layer)
            landed.add(events[layer], functools.partial(published, layer))
            landed.poll()
        landed.drain()

    def _layer_slices_once(self):
        """Per layer: where its tensors' rows start in a CPU block, their bytes, and the kernel that scatters
        them from a staging slot holding that slice of each block side by side; None where some layer's
        tensors do not sit side by side in the CPU block."""
        if self._layer_slices is None:
            slices = {}
            for layer, tensors in self._by_layer:
                infos = [self.infos[i] for i in tensors]
                offset = infos[0].cpu_offset
                if any(b.cpu_offset != a.cpu_offset + a.block_bytes for a, b in zip(infos, infos[1:])):
                    self._layer_slices = False
                    return None
                rebased = [dataclasses.replace(i, cpu_offset=i.cpu_offset - offset) for i in infos]
                slices[layer] = (offset, sum(i.block_bytes for i in infos),
                                 RowKernel(rebased, [self.pointers[i] for i in tensors], self.device_id))
            self._layer_slices = slices
        return self._layer_slices or None

    def _layer_dma(self, stage: int, cpu: list, offset: int, nbytes: int, stream):
        """One layer's slice of each CPU block into staging, block k at stage + k * nbytes: a strided copy per
        run of adjacent blocks, lone blocks in one batch."""
        dst, src, sizes = [], [], []
        kind = runtime.cudaMemcpyKind.cudaMemcpyHostToDevice
        for first, cpu_id, run_bytes in dma_runs(cpu, [self.stride] * len(cpu), self.stride, self.swap.chunk_blocks):
            host, dev, count = self.swap.host_ptr + cpu_id * self.stride + offset, stage + first * nbytes, \
                run_bytes // self.stride
            if count == 1:
                dst.append(dev), src.append(host), sizes.append(nbytes)
            else:
                cuda_check(runtime.cudaMemcpy2DAsync(dev, nbytes, host, self.stride, nbytes, count, kind, stream),
                           "cudaMemcpy2DAsync")
        if sizes:
            self._copies(dst, src, sizes, False, stream)

    def _dma(self, stage: int, runs: list, to_host: bool, stream):
        """The runs between staging and the tier. Random CPU ids make a run per block: where the driver has
        cudaMemcpyBatchAsync they go in one submission, not one call each."""
        host = [self.swap.host_ptr + cpu_id * self.stride for _, cpu_id, _ in runs]
        dev = [stage + first * self.stride for first, _, _ in runs]
        dst, src = (host, dev) if to_host else (dev, host)
        self._copies(dst, src, [nbytes for _, _, nbytes in runs], to_host, stream)

    def close(self):
        super().close()
        self._kernel.close()
        for _, _, kernel in (self._layer_slices or {}).values():
            kernel.close()


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


def row_copies(infos, pointers, host_ptr, block_bytes, gpu_ids, cpu_ids, to_host, chunk_blocks=0):
    """(dst, src, size) of every (tensor, block) row, tensor by tensor, rows adjacent on both sides merged,
    except across a pinned chunk's edge (chunk_blocks), so that no copy spans two registered ranges (a weight
    group has no slot between its CPU blocks: one tensor's rows of consecutive layers are adjacent)."""
    gpu_ids, cpu_ids = np.asarray(gpu_ids, np.int64), np.asarray(cpu_ids, np.int64)
    gpu, cpu, size, block = [], [], [], []
    for info, ptr in zip(infos, pointers):
        keep = gpu_ids < info.num_blocks
        gpu.append(ptr + gpu_ids[keep] * info.block_bytes)
        cpu.append(host_ptr + cpu_ids[keep] * block_bytes + info.cpu_offset)
        size.append(np.full(int(keep.sum()), info.block_bytes, np.int64))
        block.append(cpu_ids[keep])
    gpu, cpu, size, block = (np.concatenate(parts) for parts in (gpu, cpu, size, block))
    src, dst = (gpu, cpu) if to_host else (cpu, gpu)
    start = np.ones(len(size), bool)
    start[1:] = (src[1:] != src[:-1] + size[:-1]) | (dst[1:] != dst[:-1] + size[:-1])
    if chunk_blocks:
        start[1:] |= (block[1:] != block[:-1]) & (block[1:] % chunk_blocks == 0)
    first = np.flatnonzero(start)
    return dst[first], src[first], np.add.reduceat(size, first)


class MemcpyCopier(_CudaCopier):
    """One cudaMemcpyAsync per merged row (FastDeploy's cache_transfer_manager does this)."""

    def _rows(self, gpu_ids, cpu_ids, to_host):
        return row_copies(self.infos, self.pointers, self.swap.host_ptr, self.stride, gpu_ids, cpu_ids, to_host,
                          self.swap.chunk_blocks)

    def _run(self, lane, gpu_ids, cpu_ids, to_host):
        for dst, src, size in zip(*(a.tolist() for a in self._rows(gpu_ids, cpu_ids, to_host))):
            memcpy_async(dst, src, size, to_host, lane.stream)
        lane.sync()


class BatchCopier(MemcpyCopier):
    """All rows in one cudaMemcpyBatchAsync. CUDA 12.8 has an out-parameter failIdx that CUDA 13 dropped;
    cuda-bindings returns it after the status (12.x) or not at all (13.x), the arguments are the same."""

    def __init__(self, cache, swap, spec):
        batch_attributes(required=True)     # refuse before anything is allocated
        super().__init__(cache, swap, spec)

    def _run(self, lane, gpu_ids, cpu_ids, to_host):
        self._copies(*(a.tolist() for a in self._rows(gpu_ids, cpu_ids, to_host)), to_host, lane.stream)
        lane.sync()


def batch_attributes(required: bool):
    """cudaMemcpyBatchAsync's attributes (stream order, copy engines preferred), or None where the driver or
    cuda-bindings predate it (12.8) and it is not required."""
    driver_version = cuda_check(runtime.cudaDriverGetVersion(), "cudaDriverGetVersion")
    if not hasattr(runtime, "cudaMemcpyBatchAsync") or driver_version < 12080:
        if not required:
            return None
        raise TransferError(f"copy method 'batch' needs cudaMemcpyBatchAsync: a CUDA 12.8+ driver (this one "
                            f"is {driver_version}) and cuda-bindings 12.8+")
    attrs = runtime.cudaMemcpyAttributes()
    attrs.srcAccessOrder = runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    attrs.flags = runtime.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
    return attrs


def make_copier(method: str, cache, swap, spec: CacheSpec) -> Copier:
    """A copier of `method` over plain per-tensor device pointers (`cache.pointers`)."""
    if method == "staged":
        settings = Settings.from_env()
        return StagedCopier(cache, swap, spec, staging_bytes=int(settings.staging_mb * (1 << 20)),
                            blocks=settings.staged_blocks)
    if method == "kernel":
        return KernelCopier(cache, swap, spec, blocks=Settings.from_env().kernel_blocks)
    if method == "batch":
        return BatchCopier(cache, swap, spec)
    if method == "memcpy":
        return MemcpyCopier(cache, swap, spec)
    raise ValueError(f"unknown copy method {method!r}; expected one of {METHODS}")
