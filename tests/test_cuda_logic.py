"""The cuda device's copy logic, run without a GPU against a fake CUDA runtime whose "device memory" is
host memory: staging chunks and ring reuse, DMA runs over consecutive CPU blocks, merged rows, draft
layers, odd row sizes and the read/write helpers. It proves the bookkeeping, not CUDA itself: the real
thing runs in the gpu-marked tests (tests/test_gpu.py) on a GPU machine.
"""
import contextlib
import ctypes
import itertools
import mmap
import threading

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.runtime")

import fastcache.ops.cuda as cuda_ops  # noqa: E402
import fastcache.ops.cuda_copiers as copiers  # noqa: E402
import fastcache.ops.cuda_events as cuda_events  # noqa: E402
import fastcache.ops.cuda_swap_space as swap_space  # noqa: E402
import fastcache.ops.cuda_kernels as kernels  # noqa: E402
from cuda.bindings import runtime  # noqa: E402
from fastcache.ipc.naming import new_suffix, segment_name  # noqa: E402
from fastcache.ipc.shm import SharedSegment  # noqa: E402
from fastcache.weight_spec import WeightSpec  # noqa: E402

from conftest import small_spec, wait_for  # noqa: E402

OK = runtime.cudaError_t.cudaSuccess


class FakeRuntime:
    """The cudaXxx calls the copiers make, done synchronously in host memory; it records the copies."""
    cudaStreamNonBlocking, cudaEventDisableTiming, cudaEventInterprocess = 1, 2, 4
    cudaEventWaitExternal = cudaEventRecordExternal = 1
    cudaError_t, cudaIpcEventHandle_t = runtime.cudaError_t, runtime.cudaIpcEventHandle_t
    cudaHostRegisterMapped, cudaHostRegisterPortable = 2, 1
    cudaMemcpyKind, cudaDeviceAttr = runtime.cudaMemcpyKind, runtime.cudaDeviceAttr
    cudaMemcpyAttributes, cudaMemcpyFlags = runtime.cudaMemcpyAttributes, runtime.cudaMemcpyFlags
    cudaMemcpySrcAccessOrder = runtime.cudaMemcpySrcAccessOrder
    cudaStreamCaptureStatus = runtime.cudaStreamCaptureStatus

    cudaHostAllocMapped = 2

    driver_version = 12080

    def __init__(self):
        self.buffers, self.copies, self.registered, self.calls = {}, [], [], []
        self.batches = 0
        self.capturing = set()          # streams a test says are being captured into a CUDA graph

    def cudaMalloc(self, n):
        buf = np.full(n, 0xEE, np.uint8)        # garbage, not zeros: an uncopied byte shows
        self.buffers[buf.ctypes.data] = buf
        return OK, buf.ctypes.data

    def cudaFree(self, ptr):
        self.buffers.pop(ptr, None)
        return (OK,)

    def cudaHostAlloc(self, n, flags):
        return self.cudaMalloc(n)

    def cudaFreeHost(self, ptr):
        return self.cudaFree(ptr)

    def cudaHostRegister(self, ptr, n, flags):
        assert not any(a < ptr + n and ptr < a + m for a, m in self.registered), "registered twice"
        self.registered.append((ptr, n))
        return (OK,)

    def cudaHostUnregister(self, ptr):
        self.registered = [(a, m) for a, m in self.registered if a != ptr]
        return (OK,)

    def check_pinned(self, ptr, n):
        """A copy touching the registered tier must lie inside one registration, or it is no DMA."""
        touched = [(a, m) for a, m in self.registered if a < ptr + n and ptr < a + m]
        assert len(touched) <= 1 and all(a <= ptr and ptr + n <= a + m for a, m in touched), \
            f"host range [{ptr:#x}, +{n}) spans registrations {touched}"

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        self.copies.append(n)
        self.calls.append("memcpy")
        self.check_pinned(dst if kind == self.cudaMemcpyKind.cudaMemcpyDeviceToHost else src, n)
        ctypes.memmove(dst, src, n)
        return (OK,)

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        self.calls.append("memcpy2d")
        to_host = kind == self.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self.check_pinned(dst if to_host else src, (dpitch if to_host else spitch) * (height - 1) + width)
        for row in range(height):
            self.copies.append(width)
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)
        return (OK,)

    def cudaMemcpy(self, dst, src, n, kind):
        ctypes.memmove(dst, src, n)
        return (OK,)

    def cudaMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, indices, num_attrs, stream):
        assert len(dsts) == len(srcs) == len(sizes) == count
        self.batches += 1
        for d, s, n in zip(dsts, srcs, sizes):
            self.copies.append(n)
            self.check_pinned(d, n)
            self.check_pinned(s, n)
            ctypes.memmove(d, s, n)
        return OK, 0

    def cudaDriverGetVersion(self):
        return OK, self.driver_version

    def cudaHostGetDevicePointer(self, ptr, flags):
        return OK, ptr

    def cudaStreamCreateWithFlags(self, flags):
        return OK, object()

    def cudaDeviceGetStreamPriorityRange(self):
        return OK, 0, -5

    def cudaStreamCreateWithPriority(self, flags, priority):
        return OK, object()

    def cudaEventCreateWithFlags(self, flags):
        return OK, object()

    def _ok(self, *args):
        return (OK,)

    def _event(self, *args):
        self.calls.append("event")
        return (OK,)

    def cudaStreamSynchronize(self, stream):
        self.calls.append("sync")
        return (OK,)

    def cudaEventQuery(self, event):        # everything ran at once: every event has completed
        return (OK,)

    def cudaEventSynchronize(self, event):
        self.calls.append("event sync")
        return (OK,)

    def cudaGetDevice(self):
        return OK, 0

    def cudaGetErrorName(self, err):
        return OK, err.name.encode()

    def cudaGetErrorString(self, err):
        return OK, b""

    def cudaStreamIsCapturing(self, stream):
        status = self.cudaStreamCaptureStatus
        return OK, (status.cudaStreamCaptureStatusActive if stream in self.capturing
                    else status.cudaStreamCaptureStatusNone)

    cudaSetDevice = cudaEventDestroy = cudaStreamDestroy = cudaDeviceSynchronize = _ok
    cudaStreamWaitEvent = cudaEventRecord = _event


def longs(ptr, n):
    return np.ctypeslib.as_array((ctypes.c_longlong * n).from_address(ptr)).copy()


def copy_rows(table, num_tensors, gpu_ids, slots, num_ids, tier, tier_block_bytes, to_tier):
    """copy_rows, row by row, as the kernel does it (reading its table and ids when it runs)."""
    rows = longs(table, 4 * num_tensors).reshape(-1, 4)
    ids = longs(gpu_ids, num_ids)
    places = np.arange(num_ids) if slots == 0 else longs(slots, num_ids)
    for ptr, row_bytes, offset, num_blocks in rows.tolist():
        for g, place in zip(ids.tolist(), places.tolist()):
            if g < num_blocks:
                gpu, cpu = ptr + g * row_bytes, tier + place * tier_block_bytes + offset
                ctypes.memmove(*((cpu, gpu) if to_tier else (gpu, cpu)), row_bytes)


def fake_launch(function, stream, grid, *args):
    """The kernel run at its launch."""
    FAKE.calls.append("launch")
    copy_rows(*args)


FAKE = None     # the fixture's runtime, for fake_launch's call log


def install_runtime(monkeypatch, fake):
    """`fake` as the CUDA runtime of every cuda module, on a device that needs no setting."""
    for module in (cuda_ops, copiers, swap_space, kernels, cuda_events):
        monkeypatch.setattr(module, "runtime", fake)
        monkeypatch.setattr(module, "set_device", lambda device_id: None)
    monkeypatch.setattr(copiers, "device_attribute", lambda device_id, name: 2)
    monkeypatch.setattr(kernels, "row_kernel", lambda device_id: "copy_rows")


@pytest.fixture
def fake_cuda(monkeypatch):
    global FAKE
    fake = FAKE = FakeRuntime()
    install_runtime(monkeypatch, fake)
    monkeypatch.setattr(kernels, "launch_rows", fake_launch)
    return fake


LAYOUTS = {
    "kv_bf16": dict(),
    "k_only": dict(has_value=False, cache_dtype="float16"),
    "fp8_scales": dict(cache_dtype="block_wise_fp8", head_dim=16),
    "draft_layers": dict(num_extra_layers=2, num_extra_gpu_blocks=15),
    "odd_rows": dict(cache_dtype="uint8", block_size=5, num_kv_heads=1, head_dim=3),
}


@pytest.mark.parametrize("method,layout,staging_mb", [
    (m, layout, mb) for m, layout, mb in itertools.product(copiers.METHODS, LAYOUTS, (32, 0.001))
    if m == "staged" or mb == 32])          # a tiny staging buffer makes the ring wrap many times
def test_copier_moves_exactly_the_task_rows(fake_cuda, monkeypatch, method, layout, staging_mb):
    monkeypatch.setenv("FASTCACHE_STAGING_MB", str(staging_mb))
    spec = small_spec(num_gpu_blocks=40, num_cpu_blocks=30, **LAYOUTS[layout])
    infos = spec.tensors()
    rng = np.random.default_rng(abs(hash((method, layout, staging_mb))) % 2**32)
    # "device" tensors at odd offsets, so the kernel's alignment fallbacks matter
    arenas = [np.empty(i.nbytes + 32, np.uint8) for i in infos]
    gpu = [a[7 * (k % 3):7 * (k % 3) + i.nbytes].reshape(i.num_blocks, i.block_bytes)
           for k, (a, i) in enumerate(zip(arenas, infos))]
    for rows in gpu:
        rows[...] = rng.integers(1, 256, rows.shape, dtype=np.uint8)
    cache = cuda_ops.DeviceTensors(infos, [rows.ctypes.data for rows in gpu], 0)
    suffix = new_suffix()
    segment = SharedSegment.create(segment_name(suffix, "swap"), spec.cpu_cache_bytes, suffix)
    swap = swap_space.CudaSwapSpace(segment, spec, 0, chunk_bytes=8192)
    copier = copiers.make_copier(method, cache, swap, spec)
    try:
        swap.blocks[...] = rng.integers(1, 256, swap.blocks.shape, dtype=np.uint8)     # blocks and their slots
        # runs of consecutive CPU blocks and scattered ones
        gpu_ids = np.r_[3, 4, 5, rng.choice(np.arange(6, 40), 14, replace=False)]
        cpu_ids = np.r_[10, 11, 12, rng.choice(np.r_[0:10, 13:30], 14, replace=False)]
        want, whole = swap.rows.copy(), swap.blocks.copy()
        for info, rows in zip(infos, gpu):
            has = gpu_ids < info.num_blocks        # draft layers: the other CPU rows keep their bytes
            want[cpu_ids[has], info.cpu_offset:info.cpu_offset + info.block_bytes] = rows[gpu_ids[has]]
        fake_cuda.copies.clear()
        copier.swap_out(gpu_ids, cpu_ids)
        assert np.array_equal(swap.rows, want)
        # nothing outside the task's blocks changes, other blocks' slots included (a store task may use them)
        others = np.setdiff1d(np.arange(spec.num_cpu_blocks), cpu_ids)
        assert np.array_equal(swap.blocks[others], whole[others])
        if method == "staged" and staging_mb == 32 and layout != "draft_layers":
            # a small task: no upload of the ids, one copy per run of adjacent CPU blocks (whole blocks)
            # (a pinned chunk's edge ends a run too)
            ordered = np.sort(cpu_ids)
            runs = 1 + np.count_nonzero((np.diff(ordered) != 1) | (ordered[1:] % swap.chunk_blocks == 0))
            assert len(fake_cuda.copies) == runs
            assert sum(fake_cuda.copies) == len(cpu_ids) * spec.cpu_block_stride  # whole blocks with their slots

        dst = rng.choice(40, len(cpu_ids), replace=False)
        before, tier = [rows.copy() for rows in gpu], swap.blocks.copy()
        copier.swap_in(dst, cpu_ids)
        assert np.array_equal(swap.blocks, tier), "swap_in wrote the CPU tier"
        for info, rows, old in zip(infos, gpu, before):
            has = dst < info.num_blocks
            cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
            assert np.array_equal(rows[dst[has]], swap.rows[cpu_ids[has], cols])
            others = np.setdiff1d(np.arange(info.num_blocks), dst)
            assert np.array_equal(rows[others], old[others])
    finally:
        copier.close()
        swap.close()


def test_read_and_write_of_chosen_blocks(fake_cuda):
    spec = small_spec()
    info = spec.tensors()[1]
    rows = np.random.default_rng(1).integers(1, 256, (info.num_blocks, info.block_bytes), dtype=np.uint8)
    cache = cuda_ops.DeviceTensors(spec.tensors(), [0, rows.ctypes.data] + [0] * 4, 0)
    assert np.array_equal(cache.read(1), rows)
    blocks = [5, 6, 7, 1, 0]
    assert np.array_equal(cache.read(1, blocks), rows[blocks])
    fresh = np.random.default_rng(2).integers(1, 256, (5, info.block_bytes), dtype=np.uint8)
    cache.write(1, fresh, blocks)
    assert np.array_equal(rows[blocks], fresh)
    with pytest.raises(ValueError, match="must lie in"):
        cache.read(1, [info.num_blocks])


@contextlib.contextmanager
def fake_copier(spec, method="staged", seed=0, **swap_kwargs):
    """(random "device" rows per tensor, the pinned tier, a copier) over the fake runtime; closed after."""
    rng = np.random.default_rng(seed)
    gpu = [rng.integers(1, 256, (i.num_blocks, i.block_bytes), dtype=np.uint8) for i in spec.tensors()]
    cache = cuda_ops.DeviceTensors(spec.tensors(), [rows.ctypes.data for rows in gpu], 0)
    suffix = new_suffix()
    segment = SharedSegment.create(segment_name(suffix, "swap"), spec.cpu_cache_bytes, suffix)
    swap = swap_space.CudaSwapSpace(segment, spec, 0, **swap_kwargs)
    copier = copiers.make_copier(method, cache, swap, spec)
    try:
        swap.wait_pinned()
        yield gpu, swap, copier
    finally:
        copier.close()
        swap.close()


@pytest.mark.parametrize("driver", [12080, 12040])
def test_staged_dma_runs_go_in_one_batch_where_the_driver_has_it(fake_cuda, monkeypatch, driver):
    """Random CPU ids make a DMA run per block: one cudaMemcpyBatchAsync per chunk on a 12.8+ driver, one
    cudaMemcpyAsync per run before it; the same bytes either way."""
    fake_cuda.driver_version = driver
    spec = small_spec(num_gpu_blocks=40, num_cpu_blocks=60)
    monkeypatch.setenv("FASTCACHE_STAGING_MB", str(8 * spec.cpu_block_stride / 2**20))     # 8-block chunks
    rng = np.random.default_rng(driver)
    with fake_copier(spec, seed=driver) as (gpu, swap, copier):
        for size in (6, 30):            # the small path, and four chunks through the staging ring
            gpu_ids = rng.choice(40, size, replace=False)
            cpu_ids = 2 * rng.choice(30, len(gpu_ids), replace=False)      # no two adjacent: a run a block
            fake_cuda.batches, fake_cuda.copies = 0, []
            copier.swap_out(gpu_ids, cpu_ids)
            for info, rows in zip(spec.tensors(), gpu):
                cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
                assert np.array_equal(swap.rows[cpu_ids, cols], rows[gpu_ids])
            runs = len(cpu_ids)
            assert (fake_cuda.batches > 0) == (driver >= 12080)
            assert len(fake_cuda.copies) >= runs
            for rows in gpu:
                rows[gpu_ids] = 0xEE
            copier.swap_in(gpu_ids, cpu_ids)
            for info, rows in zip(spec.tensors(), gpu):
                cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
                assert np.array_equal(rows[gpu_ids], swap.rows[cpu_ids, cols])


@pytest.mark.parametrize("blocks", [6, 30])     # the small path, and chunks through the staging ring
def test_staged_copies_adjacent_cpu_blocks_in_one_run_whatever_their_order_in_the_task(fake_cuda, monkeypatch,
                                                                                          blocks):
    """A task's CPU ids, shuffled, covering two ranges of adjacent blocks: two DMA runs a chunk (not one a
    block), and every row where the task's pairing puts it."""
    spec = small_spec(num_gpu_blocks=40, num_cpu_blocks=40)
    monkeypatch.setenv("FASTCACHE_STAGING_MB", str(64 * spec.cpu_block_stride / 2**20))    # one chunk
    rng = np.random.default_rng(blocks)
    with fake_copier(spec, seed=blocks) as (gpu, swap, copier):
        cpu_ids = np.r_[2:2 + blocks // 2, 35 - (blocks - blocks // 2):35]
        order = rng.permutation(blocks)
        gpu_ids, cpu_ids = rng.choice(40, blocks, replace=False), cpu_ids[order]
        assert np.count_nonzero(np.diff(cpu_ids) == 1) < blocks // 2       # the task's own order has few runs
        fake_cuda.copies = []
        copier.swap_out(gpu_ids, cpu_ids)
        assert sorted(fake_cuda.copies) == sorted([blocks // 2 * spec.cpu_block_stride,
                                                    (blocks - blocks // 2) * spec.cpu_block_stride])
        for info, rows in zip(spec.tensors(), gpu):
            cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
            assert np.array_equal(swap.rows[cpu_ids, cols], rows[gpu_ids])
        dst = rng.choice(40, blocks, replace=False)
        before = [rows.copy() for rows in gpu]
        fake_cuda.copies = []
        copier.swap_in(dst, cpu_ids)
        assert len(fake_cuda.copies) == 2
        for info, rows, old in zip(spec.tensors(), gpu, before):
            cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
            assert np.array_equal(rows[dst], swap.rows[cpu_ids, cols])
            others = np.setdiff1d(np.arange(40), dst)
            assert np.array_equal(rows[others], old[others])


def test_copier_refuses_ids_that_would_fault_the_kernel(fake_cuda):
    spec = small_spec()
    with fake_copier(spec) as (_, _, copier):
        with pytest.raises(ValueError, match="gpu block ids"):
            copier.swap_out(np.array([spec.num_gpu_blocks]), np.array([0]))
        with pytest.raises(ValueError, match="cpu block ids"):
            copier.swap_in(np.array([0]), np.array([-1]))


def test_dma_runs_merge_consecutive_blocks_and_stop_at_partial_ones_and_chunk_edges():
    ids = [4, 5, 6, 9, 10, 2]
    full = [100] * 6
    assert copiers.dma_runs(ids, full, 100) == [[0, 4, 300], [3, 9, 200], [5, 2, 100]]
    partial = [100, 60, 100, 100, 100, 100]      # block 5 lacks draft-layer rows
    assert copiers.dma_runs(ids, partial, 100) == [[0, 4, 160], [2, 6, 100], [3, 9, 200], [5, 2, 100]]
    # pinned chunks of 5 blocks: block 5 and block 10 each start a chunk, so a run must stop before them
    assert copiers.dma_runs(ids, full, 100, chunk_blocks=5) == [[0, 4, 100], [1, 5, 200], [3, 9, 100],
                                                                  [4, 10, 100], [5, 2, 100]]


def test_an_attach_pauses_the_pinning_and_a_swap_that_waits_overrides_the_pause(fake_cuda, monkeypatch):
    """The driver serialises cudaHostRegister with the process's other CUDA calls: inside paused() no chunk
    starts registering (the attach's calls run at once), a swap that needs an unpinned block still gets it,
    and the rest is pinned once the pause ends."""
    spec = small_spec(num_cpu_blocks=160)
    first_chunk = threading.Event()
    register = fake_cuda.cudaHostRegister

    def gated(ptr, n, flags):
        first_chunk.wait(10)        # the first chunk stays in progress until the pause has begun
        return register(ptr, n, flags)
    monkeypatch.setattr(fake_cuda, "cudaHostRegister", gated)
    suffix = new_suffix()
    segment = SharedSegment.create(segment_name(suffix, "swap"), spec.cpu_cache_bytes, suffix)
    swap = swap_space.CudaSwapSpace(segment, spec, 0, chunk_bytes=mmap.PAGESIZE)     # the smallest chunks
    try:
        assert swap.blocks.nbytes >= 4 * swap.chunk_blocks * spec.cpu_block_stride
        with swap.paused():
            first_chunk.set()
            wait_for(lambda: len(fake_cuda.registered) == 1, 10, "the chunk in progress")
            with pytest.raises(AssertionError):      # no second chunk starts while paused
                wait_for(lambda: len(fake_cuda.registered) > 1, 0.3, "a chunk during the pause")
            swap.wait_pinned(2 * swap.chunk_blocks)     # a swap's wait overrides the pause
            assert swap.pinned_bytes() >= 2 * swap.chunk_blocks * spec.cpu_block_stride
        swap.wait_pinned()
        assert swap.pinned_bytes() >= swap.blocks.nbytes
    finally:
        swap.close()
    assert fake_cuda.registered == []


@pytest.mark.parametrize("method", copiers.METHODS)
def test_no_copy_spans_two_pinned_chunks(fake_cuda, monkeypatch, method):
    """The tier starts on a page and is registered in chunks of whole pages and whole CPU blocks; a run of
    consecutive CPU blocks across a chunk edge becomes two copies (one copy, one registration)."""
    spec = small_spec(num_gpu_blocks=80, num_cpu_blocks=80)          # 768-byte CPU blocks, 128-byte slots
    with fake_copier(spec, method, seed=5, chunk_bytes=8192) as (gpu, swap, copier):
        assert swap.host_ptr % mmap.PAGESIZE == 0
        sizes = [n for _, n in fake_cuda.registered]
        assert all(n % spec.cpu_block_stride == 0 and n % mmap.PAGESIZE == 0 for n in sizes[:-1]), sizes
        assert swap.chunk_blocks == 32 and len(sizes) == 3     # lcm(4096, 896) = 28672 bytes = 32 blocks
        cpu_ids = np.arange(20, 70)                            # crosses the edges at blocks 32 and 64
        gpu_ids = np.arange(0, 50)
        copier.swap_out(gpu_ids, cpu_ids)                      # check_pinned asserts on every copy
        want = np.concatenate([rows[gpu_ids] for rows in gpu], axis=1)
        assert np.array_equal(swap.rows[cpu_ids], want)
        copier.swap_in(gpu_ids + 16, cpu_ids)
        assert np.array_equal(np.concatenate([rows[gpu_ids + 16] for rows in gpu], axis=1), want)


@pytest.mark.parametrize("method", copiers.METHODS)
def test_no_copy_spans_two_pinned_chunks_of_a_weight_region_either(fake_cuda, method):
    """A weight group has no slot after its CPU blocks: with one tensor per layer, the rows of consecutive
    layers are adjacent in the region and on the device, and merged rows must still stop at a chunk edge
    (a sleep copies every resident layer, blocks 0..R-1 to CPU blocks 0..R-1)."""
    layout = WeightSpec(12, (("w", (8, 96), "float16"),), resident_layers=12, ring_slots=1)
    with fake_copier(layout, method, seed=9, chunk_bytes=8192) as (gpu, swap, copier):
        assert layout.cpu_block_stride == layout.tensors()[0].block_bytes and len(fake_cuda.registered) > 1
        layers = np.arange(12)
        copier.swap_out(layers, layers)                 # check_pinned asserts on every copy
        assert np.array_equal(swap.rows[layers], gpu[0][layers])
        swap.blocks[...] = np.random.default_rng(9).integers(1, 256, swap.blocks.shape, dtype=np.uint8)
        copier.swap_in(layers, layers)
        assert np.array_equal(gpu[0][layers], swap.rows[layers])


def test_a_small_staged_task_takes_one_stream_and_no_events(fake_cuda):
    """One-block tasks: the kernel reads the ids from the lane's pinned buffer (no upload), the copy
    follows on the same stream, one synchronize; events and the second stream only for large tasks."""
    spec = small_spec(num_gpu_blocks=40, num_cpu_blocks=30)
    with fake_copier(spec, seed=6) as (gpu, swap, copier):
        fake_cuda.calls.clear()
        copier.swap_out(np.array([7], np.int32), np.array([3], np.int32))
        assert fake_cuda.calls == ["launch", "memcpy", "sync"]
        assert np.array_equal(swap.rows[3], np.concatenate([rows[7] for rows in gpu]))
        fake_cuda.calls.clear()
        copier.swap_in([9, 10], [3, 4])
        assert fake_cuda.calls == ["memcpy", "launch", "sync"]          # CPU blocks 3, 4: one run
        assert all(np.array_equal(rows[9], rows[7]) for rows in gpu)
        fake_cuda.calls.clear()
        many = np.arange(copiers.SMALL_TASK_IDS + 1) % 30
        copier.swap_out(np.arange(len(many)) % 40, many)                 # too many ids: the ring path
        assert "event" in fake_cuda.calls


def test_kernel_target_is_the_device_or_the_newest_older_ptx():
    assert kernels.kernel_target(90, [80, 86, 90, 100]) == ("sm_90", True)
    assert kernels.kernel_target(99, [80, 90, 100, 120]) == ("compute_90", False)    # never a newer PTX
    with pytest.raises(kernels.TransferError, match="none at or below"):
        kernels.kernel_target(70, [75, 80])


def _nvrtc_usable() -> bool:
    try:
        return kernels.nvrtc.nvrtcVersion()[0] == kernels.nvrtc.nvrtcResult.NVRTC_SUCCESS
    except Exception:          # cuda-pathfinder finds no libnvrtc
        return False


@pytest.mark.skipif(not _nvrtc_usable(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")
def test_the_copy_kernel_compiles_and_a_compile_error_carries_nvrtc_log(monkeypatch):
    """The real NVRTC, no GPU: a cubin for sm_90, PTX for an architecture NVRTC lacks, and the log."""
    cubin = kernels.compile_kernel(9, 0)
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    ptx = kernels.compile_kernel(9, 9).decode(errors="replace")
    assert ".target sm_90" in ptx and ".maxntid 512" in ptx and ".minnctapersm 4" in ptx
    monkeypatch.setattr(kernels, "KERNEL_SOURCE", kernels.KERNEL_SOURCE + "\nthis is not C++;\n")
    with pytest.raises(kernels.TransferError, match=r"(?s)NVRTC_ERROR_COMPILATION.*this is not C\+\+"):
        kernels.compile_kernel(9, 0)


@pytest.mark.skipif(not _nvrtc_usable(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")
@pytest.mark.parametrize("major,minor", [(8, 0), (9, 0), (10, 0)])
def test_the_gather_kernel_compiles_beside_copy_rows_and_a_compile_error_in_it_carries_nvrtc_log(monkeypatch, major,
                                                                                                  minor):
    """The real NVRTC, no GPU: gather_runs is in the cubin and in the PTX NVRTC makes for an architecture it
    lacks, with the launch bounds GatherKernel launches by and the four 8-byte parameters launch_gather passes."""
    cubin = kernels.compile_kernel(major, minor)
    assert cubin[:4] == b"\x7fELF" and kernels.GATHER_NAME in cubin and kernels.KERNEL_NAME in cubin
    if major == 9:
        ptx = kernels.compile_kernel(9, 9).decode(errors="replace")
        entry = ptx[ptx.index(".entry gather_runs("):]
        entry = entry[:entry.index("{")]
        assert entry.count(".param .u64") == 4 and ".param .u32" not in entry
        assert f".maxntid {kernels.GATHER_THREADS}, 1, 1" in entry
        assert f".minnctapersm {kernels.GATHER_BLOCKS_PER_SM}" in entry
    call = "copy_row(dst + t[1], src + t[0], t[2]);"
    broken = kernels.KERNEL_SOURCE.replace(call, "copy_row(dst + t[1], src + t[0]);")
    assert broken != kernels.KERNEL_SOURCE
    monkeypatch.setattr(kernels, "KERNEL_SOURCE", broken)
    with pytest.raises(kernels.TransferError, match=r"(?s)NVRTC_ERROR_COMPILATION.*too few arguments.*"
                                                   r"copy_row\(dst \+ t\[1\], src \+ t\[0\]\)"):
        kernels.compile_kernel(major, minor)


@pytest.mark.parametrize("method", copiers.METHODS)
@pytest.mark.parametrize("driver", [12080, 12040])
def test_a_layer_by_layer_swap_in_publishes_each_layer_only_once_its_rows_are_in_place(fake_cuda, method, driver):
    """Every copy method: layers in order, and when layer l is published its rows (and every earlier
    layer's) are in place and later layers' are not yet; the end state equals a plain swap-in's."""
    if method == "batch" and driver < 12080:
        pytest.skip("the batch method needs a 12.8+ driver")
    fake_cuda.driver_version = driver
    spec = small_spec(num_gpu_blocks=24, num_cpu_blocks=16, num_layers=3, num_extra_layers=1, num_extra_gpu_blocks=8)
    with fake_copier(spec, method=method, seed=driver) as (gpu, swap, copier):
        rng = np.random.default_rng(driver)
        swap.blocks[...] = rng.integers(1, 256, swap.blocks.shape, dtype=np.uint8)
        gpu_ids, cpu_ids = rng.choice(24, 10, replace=False), rng.choice(16, 10, replace=False)
        infos = spec.tensors()

        def rows_in_place(layer):
            ok = []
            for info, rows in zip(infos, gpu):
                if info.layer == layer:
                    has = gpu_ids < info.num_blocks
                    cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
                    ok.append(np.array_equal(rows[gpu_ids[has]], swap.rows[cpu_ids[has], cols]))
            return all(ok)
        seen = []

        def published(layer):
            assert all(rows_in_place(done) for done in range(layer + 1)), f"layer {layer} published early"
            assert not any(rows_in_place(later) for later in range(layer + 1, spec.total_layers))
            seen.append(layer)
        copier.swap_in_layers(gpu_ids, cpu_ids, spec.total_layers, published)
        assert seen == list(range(spec.total_layers))
