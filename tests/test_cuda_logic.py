"""The cuda device's copy logic, run without a GPU against a fake CUDA runtime whose "device memory" is
host memory: staging chunks and ring reuse, DMA runs over consecutive CPU blocks, merged rows, draft
layers, odd row sizes and the read/write helpers. It proves the bookkeeping, not CUDA itself: the real
thing runs in the gpu-marked tests (tests/test_gpu.py) on a GPU machine.
"""
import ctypes
import itertools

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.runtime")

import fastcache.ops.cuda as cuda_ops  # noqa: E402
import fastcache.ops.cuda_kernels as kernels  # noqa: E402
from cuda.bindings import runtime  # noqa: E402
from fastcache.ipc.naming import new_suffix, segment_name  # noqa: E402
from fastcache.ipc.shm import SharedSegment  # noqa: E402

from conftest import small_spec  # noqa: E402

OK = runtime.cudaError_t.cudaSuccess


class FakeRuntime:
    """The cudaXxx calls the copiers make, done synchronously in host memory; it records the copies."""
    cudaStreamNonBlocking, cudaEventDisableTiming = 1, 2
    cudaHostRegisterMapped, cudaHostRegisterPortable = 2, 1
    cudaMemcpyKind, cudaDeviceAttr = runtime.cudaMemcpyKind, runtime.cudaDeviceAttr
    cudaMemcpyAttributes, cudaMemcpyFlags = runtime.cudaMemcpyAttributes, runtime.cudaMemcpyFlags
    cudaMemcpySrcAccessOrder = runtime.cudaMemcpySrcAccessOrder

    def __init__(self):
        self.buffers, self.copies = {}, []

    def cudaMalloc(self, n):
        buf = np.full(n, 0xEE, np.uint8)        # garbage, not zeros: an uncopied byte shows
        self.buffers[buf.ctypes.data] = buf
        return OK, buf.ctypes.data

    def cudaFree(self, ptr):
        self.buffers.pop(ptr, None)
        return (OK,)

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        self.copies.append(n)
        ctypes.memmove(dst, src, n)
        return (OK,)

    def cudaMemcpy(self, dst, src, n, kind):
        ctypes.memmove(dst, src, n)
        return (OK,)

    def cudaMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, indices, num_attrs, stream):
        assert len(dsts) == len(srcs) == len(sizes) == count
        for d, s, n in zip(dsts, srcs, sizes):
            self.copies.append(n)
            ctypes.memmove(d, s, n)
        return OK, 0

    def cudaDriverGetVersion(self):
        return OK, 12080

    def cudaHostGetDevicePointer(self, ptr, flags):
        return OK, ptr

    def cudaStreamCreateWithFlags(self, flags):
        return OK, object()

    def cudaEventCreateWithFlags(self, flags):
        return OK, object()

    def _ok(self, *args):
        return (OK,)

    cudaSetDevice = cudaStreamWaitEvent = cudaEventRecord = cudaStreamSynchronize = _ok
    cudaEventDestroy = cudaStreamDestroy = cudaHostRegister = cudaHostUnregister = _ok


def fake_launch(function, stream, grid, table, num_tensors, gpu_ids, slots, num_ids, tier, tier_block_bytes,
                to_tier):
    """copy_rows, row by row, as the kernel does it."""
    def longs(ptr, n):
        return np.ctypeslib.as_array((ctypes.c_longlong * n).from_address(ptr)).copy()

    rows = longs(table, 4 * num_tensors).reshape(-1, 4)
    ids = longs(gpu_ids, num_ids)
    places = np.arange(num_ids) if slots == 0 else longs(slots, num_ids)
    for ptr, row_bytes, offset, num_blocks in rows.tolist():
        for g, place in zip(ids.tolist(), places.tolist()):
            if g < num_blocks:
                gpu, cpu = ptr + g * row_bytes, tier + place * tier_block_bytes + offset
                ctypes.memmove(*((cpu, gpu) if to_tier else (gpu, cpu)), row_bytes)


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeRuntime()
    for module in (cuda_ops, kernels):
        monkeypatch.setattr(module, "runtime", fake)
        monkeypatch.setattr(module, "set_device", lambda device_id: None)
    monkeypatch.setattr(cuda_ops, "device_attribute", lambda device_id, name: 2)
    monkeypatch.setattr(kernels, "row_kernel", lambda device_id: "copy_rows")
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
    (m, layout, mb) for m, layout, mb in itertools.product(cuda_ops.METHODS, LAYOUTS, (32, 0.001))
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
    swap = cuda_ops.CudaSwapSpace(segment, spec, 0, chunk_bytes=8192)
    copier = cuda_ops.make_copier(method, cache, swap, spec)
    try:
        swap.rows[...] = rng.integers(1, 256, swap.rows.shape, dtype=np.uint8)
        # runs of consecutive CPU blocks and scattered ones
        gpu_ids = np.r_[3, 4, 5, rng.choice(np.arange(6, 40), 14, replace=False)]
        cpu_ids = np.r_[10, 11, 12, rng.choice(np.r_[0:10, 13:30], 14, replace=False)]
        want = swap.rows.copy()
        for info, rows in zip(infos, gpu):
            has = gpu_ids < info.num_blocks        # draft layers: the other CPU rows keep their bytes
            want[cpu_ids[has], info.cpu_offset:info.cpu_offset + info.block_bytes] = rows[gpu_ids[has]]
        fake_cuda.copies.clear()
        copier.swap_out(gpu_ids, cpu_ids)
        assert np.array_equal(swap.rows, want)
        if method == "staged" and staging_mb == 32 and layout != "draft_layers":
            # one upload of the ids, then one copy per run of consecutive CPU ids (whole blocks each)
            runs = 1 + np.count_nonzero(np.diff(cpu_ids) != 1)
            assert len(fake_cuda.copies) == 1 + runs
            assert sum(fake_cuda.copies[1:]) == len(cpu_ids) * spec.cpu_block_bytes

        dst = rng.choice(40, len(cpu_ids), replace=False)
        before = [rows.copy() for rows in gpu]
        copier.swap_in(dst, cpu_ids)
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


def test_copier_refuses_ids_that_would_fault_the_kernel(fake_cuda):
    spec = small_spec()
    arrays = [np.ones((i.num_blocks, i.block_bytes), np.uint8) for i in spec.tensors()]
    cache = cuda_ops.DeviceTensors(spec.tensors(), [a.ctypes.data for a in arrays], 0)
    suffix = new_suffix()
    segment = SharedSegment.create(segment_name(suffix, "swap"), spec.cpu_cache_bytes, suffix)
    swap = cuda_ops.CudaSwapSpace(segment, spec, 0)
    copier = cuda_ops.make_copier("staged", cache, swap, spec)
    try:
        with pytest.raises(ValueError, match="gpu block ids"):
            copier.swap_out(np.array([spec.num_gpu_blocks]), np.array([0]))
        with pytest.raises(ValueError, match="cpu block ids"):
            copier.swap_in(np.array([0]), np.array([-1]))
    finally:
        copier.close()
        swap.close()


def test_dma_runs_merge_consecutive_blocks_and_stop_at_partial_ones():
    ids = np.array([4, 5, 6, 9, 10, 2])
    full = np.full(6, 100)
    assert list(cuda_ops.dma_runs(ids, full, 100)) == [(0, 4, 300), (3, 9, 200), (5, 2, 100)]
    partial = np.array([100, 60, 100, 100, 100, 100])      # block 5 lacks draft-layer rows
    assert list(cuda_ops.dma_runs(ids, partial, 100)) == [(0, 4, 160), (2, 6, 100), (3, 9, 200), (5, 2, 100)]
