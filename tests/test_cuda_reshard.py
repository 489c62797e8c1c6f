"""The cuda device's reshard code (fastcache/ops/cuda_reshard.py) without a GPU: a fake CUDA runtime whose
"device memory" is host memory and whose IPC handles name host buffers. It proves the bookkeeping (IPC
opens once per allocation, offsets inside allocations, one cudaMemcpy2DAsync per run of rows, bounds, the
journal's flushes, the worker's re-view over the same allocations), not CUDA itself: tests/test_gpu.py's
reshard test runs the real thing on a GPU machine.
"""
import ctypes

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.runtime")

import fastcache.ops.cuda_ipc as cuda_ipc  # noqa: E402
import fastcache.ops.cuda_reshard as cr  # noqa: E402
from conftest import MemoryJournal  # noqa: E402
from cuda.bindings import runtime  # noqa: E402
from fastcache.config import CacheSpec  # noqa: E402
from fastcache.reshard_plan import Capacity, Plan, run_chunks  # noqa: E402
from fastcache.errors import TransferError  # noqa: E402
from fastcache.ipc.naming import (manifest_name, new_suffix, reshard_exports_name, reshard_staging_name,  # noqa: E402
                                  swap_space_name)
from fastcache.ipc.shm import SharedSegment  # noqa: E402
from fastcache.ipc.manifest import write_json_segment  # noqa: E402

OK = runtime.cudaError_t.cudaSuccess


class FakeHandle:
    def __init__(self, raw=b"\0" * 64):
        self._buf = ctypes.create_string_buffer(raw, 64)

    def getPtr(self):
        return ctypes.addressof(self._buf)


class FakeRuntime:
    """The calls cuda_reshard makes, on host memory; IPC handles are 64 bytes naming a registered buffer."""
    cudaStreamNonBlocking = 1
    cudaIpcMemLazyEnablePeerAccess = 1
    cudaMemcpyKind = runtime.cudaMemcpyKind
    cudaIpcMemHandle_t = FakeHandle

    def __init__(self):
        self.allocations = {}           # base address -> numpy buffer
        self.opened, self.closed, self.copies, self.syncs = [], [], [], 0

    def allocate(self, nbytes, fill=0xEE):
        buf = np.full(nbytes, fill, np.uint8)
        self.allocations[buf.ctypes.data] = buf
        return buf

    def handle_of(self, base):
        return base.to_bytes(8, "little").hex() + "00" * 56

    def cudaIpcGetMemHandle(self, base):
        return OK, FakeHandle(bytes.fromhex(self.handle_of(base)))

    def cudaIpcOpenMemHandle(self, handle, flags):
        base = int.from_bytes(ctypes.string_at(handle.getPtr(), 8), "little")
        assert base in self.allocations, "unknown IPC handle"
        assert base not in self.opened or base in self.closed, "an allocation opened twice in one process"
        self.opened.append(base)
        return OK, base

    def cudaIpcCloseMemHandle(self, base):
        self.closed.append(base)
        return (OK,)

    def _inside(self, ptr, nbytes):
        for base, buf in self.allocations.items():
            if base <= ptr and ptr + nbytes <= base + buf.nbytes:
                return True
        return False

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        assert kind == runtime.cudaMemcpyKind.cudaMemcpyDefault
        assert self._inside(src, (height - 1) * spitch + width) and self._inside(dst, (height - 1) * dpitch + width)
        for i in range(height):
            ctypes.memmove(dst + i * dpitch, src + i * spitch, width)
        self.copies.append((width, height))
        return (OK,)

    def cudaStreamCreateWithFlags(self, flags):
        return OK, object()

    def cudaStreamSynchronize(self, stream):
        self.syncs += 1
        return (OK,)

    def cudaStreamDestroy(self, stream):
        return (OK,)


class FakeDriver:
    def __init__(self, rt):
        self.rt = rt

    def CUdeviceptr(self, ptr):
        return ptr

    def cuMemGetAddressRange(self, ptr):
        for base, buf in self.rt.allocations.items():
            if base <= ptr < base + buf.nbytes:
                return OK, base, buf.nbytes
        raise AssertionError("not an allocation")


@pytest.fixture
def fake(monkeypatch):
    rt = FakeRuntime()
    for module in (cr, cuda_ipc):
        monkeypatch.setattr(module, "runtime", rt)
        monkeypatch.setattr(module, "set_device", lambda device_id: None)
    monkeypatch.setattr(cuda_ipc, "driver", FakeDriver(rt))
    return rt


class Deployment:
    """Ranks' "device" caches (one allocation per rank, tensors at offsets, like a caching allocator),
    manifests, CPU tiers and staging buffers, as a cuda deployment lays them out for a reshard."""

    def __init__(self, rt, spec, m, n, live, cpu_live, staging):
        self.rt, self.suffix = rt, new_suffix()
        self.plan = Plan(spec, m, n, [Capacity.of(spec)] * m, live, cpu_live, staging)
        self.segments = []
        self.tensors = {}                   # (rank, tensor index) -> numpy view of its region
        rng = np.random.default_rng(0)
        new = self.plan.new_spec
        for r in range(max(m, n)):
            geometry = spec if r < m else new
            sizes = [max(sp.old_bytes(), sp.new_bytes()) for sp in self.plan.spaces[:-1]]
            offsets = np.concatenate([[0], np.cumsum([-(-s // 512) * 512 + 512 for s in sizes])]).tolist()
            arena = rt.allocate(int(offsets[-1]))
            base = arena.ctypes.data
            manifest = []
            for t, (info, size) in enumerate(zip(geometry.tensors(r), sizes)):
                region = arena[offsets[t]:offsets[t] + size]
                if r < m:
                    region[...] = rng.integers(1, 256, size, dtype=np.uint8)
                self.tensors[r, t] = region
                manifest.append({"name": info.name, "handle": rt.handle_of(base), "offset": int(offsets[t]),
                                 "alloc_bytes": int(arena.nbytes), "nbytes": info.nbytes, "device": 0})
            self.segments.append(write_json_segment(manifest_name(self.suffix, r), manifest, self.suffix))
            tier = SharedSegment.create(swap_space_name(self.suffix, r), geometry.cpu_cache_bytes, self.suffix)
            self.segments.append(tier)
            if r < m:
                tier.array(np.uint8, (tier.size,))[:] = rng.integers(1, 256, tier.size, dtype=np.uint8)
            for kind in ("gpu", "cpu"):
                need = self.plan.staging_bytes_for(r, kind)
                if need and kind == "gpu":
                    stage = rt.allocate(need + 4096)
                    desc = {"device": "cuda", "device_id": 0, "nbytes": need, "handle": rt.handle_of(stage.ctypes.data),
                            "offset": 0, "alloc_bytes": int(stage.nbytes)}
                    self.segments.append(write_json_segment(reshard_exports_name(self.suffix, r), desc, self.suffix))
                elif need:
                    self.segments.append(SharedSegment.create(reshard_staging_name(self.suffix, r, "cpu"), need,
                                                              self.suffix))

    def tier(self, r):
        seg = next(s for s in self.segments if s.name == swap_space_name(self.suffix, r))
        return seg.array(np.uint8, (seg.size,))

    def blocks(self, tp, geometry, spec_of):
        """{(space key, block): all heads} as the ranks hold them now."""
        plan, out = self.plan, {}
        for sp in plan.spaces:
            ids = plan._pairs(sp)[0 if tp == plan.old_tp else 1]
            row = sp.old_row if tp == plan.old_tp else sp.new_row
            for b in ids.tolist():
                if sp.key[0] == "gpu":
                    out[sp.key, b] = np.concatenate([self.tensors[r, sp.key[1]][b * row:(b + 1) * row]
                                                     for r in range(tp)])
                else:
                    out[sp.key, b] = np.concatenate([self.tier(r)[b * row + t.cpu_offset:b * row + t.cpu_offset
                                                                  + t.block_bytes]
                                                     for t in geometry.tensors() for r in range(tp)])
        return out

    def close(self):
        for seg in self.segments:
            seg.close()


@pytest.mark.parametrize("m,n", [(1, 2), (2, 4), (4, 2), (2, 1), (1, 4), (4, 1)])
def test_cuda_memory_moves_every_head_slice_through_ipc_and_2d_copies(fake, m, n):
    spec = CacheSpec(num_layers=2, num_gpu_blocks=16 * 4 // (4 // m), num_cpu_blocks=8 * 4 // (4 // m), block_size=2,
                     num_kv_heads=4 // m, head_dim=8, cache_dtype="block_wise_fp8")
    rng = np.random.default_rng(m * 10 + n)
    new_blocks = spec.num_gpu_blocks * n // m
    live = np.sort(rng.choice(spec.num_gpu_blocks, min(new_blocks, spec.num_gpu_blocks) // 2, replace=False))
    cpu = np.sort(rng.choice(spec.num_cpu_blocks, min(spec.num_cpu_blocks * n // m, spec.num_cpu_blocks) // 2,
                             replace=False))
    dep = Deployment(fake, spec, m, n, live, cpu, staging=4096)
    try:
        plan = dep.plan
        want = dep.blocks(m, spec, None)
        want = {(k, nb): v for (k, ob), v in want.items()
                for nb in [dict(zip(*plan._pairs(next(s for s in plan.spaces if s.key == k))))[ob]]}
        for r in range(m):
            mem = cr.CudaMemory(dep.suffix, plan, 0)
            run_chunks(plan.compaction(r), mem.execute, flush=mem.flush)
            mem.close()
        for wave in plan.waves:
            for r in wave:
                mem = cr.CudaMemory(dep.suffix, plan, 0)
                chunks, journaled = plan.program(r)
                run_chunks(chunks, mem.execute, flush=mem.flush)
                mem.close()
        got = dep.blocks(n, plan.new_spec, None)
        assert got.keys() == want.keys()
        for key in want:
            assert np.array_equal(got[key], want[key]), key
        assert fake.copies and all(h >= 1 for _, h in fake.copies)
        assert sorted(fake.opened) == sorted(fake.closed)      # every IPC open closed again
    finally:
        dep.close()


def test_consecutive_rows_go_as_one_2d_copy_and_a_resumed_program_rewrites_only_from_staging(fake):
    spec = CacheSpec(num_layers=1, num_gpu_blocks=32, num_cpu_blocks=4, block_size=2, num_kv_heads=4, head_dim=8,
                     has_value=False, cache_dtype="uint8")
    dep = Deployment(fake, spec, 1, 2, np.arange(32), [], staging=1 << 16)
    try:
        plan = dep.plan
        want = dep.blocks(1, spec, None)
        mem = cr.CudaMemory(dep.suffix, plan, 0)
        chunks, _ = plan.program(1)
        run_chunks(chunks, mem.execute, flush=mem.flush)
        assert fake.copies == [(32, 32)]         # 32 consecutive rows, 2 heads of 16 bytes: one 2-D copy
        journal = MemoryJournal()
        chunks, journaled = plan.program(0)
        assert journaled
        calls = {"n": 0}

        def dying(c):
            if calls["n"] == len(chunks[0].gather):     # staged, then dies before writing
                raise InterruptedError
            calls["n"] += 1
            mem.execute(c)
        with pytest.raises(InterruptedError):
            run_chunks(chunks, dying, journal, flush=mem.flush)
        assert journal.value == 1
        syncs = fake.syncs
        fake.copies.clear()
        run_chunks(chunks, mem.execute, journal, flush=mem.flush)     # a replacement: write from staging
        assert fake.copies[0] == (plan.spaces[0].new_row, 32) and fake.syncs > syncs
        mem.close()
        got = dep.blocks(2, plan.new_spec, None)
        for key in want:
            assert np.array_equal(got[key], want[key])
    finally:
        dep.close()


def test_a_copy_outside_its_allocation_is_refused_before_it_is_issued(fake):
    spec = CacheSpec(num_layers=1, num_gpu_blocks=8, num_cpu_blocks=4, block_size=2, num_kv_heads=2, head_dim=8)
    dep = Deployment(fake, spec, 1, 2, np.arange(8), [], staging=1 << 12)
    try:
        mem = cr.CudaMemory(dep.suffix, dep.plan, 0)
        chunks, _ = dep.plan.program(1)
        c = chunks[0].gather[0]
        bad = type(c)(c.src, c.src_pitch, c.src_off, c.src_rows + 100, c.dst, c.dst_pitch, c.dst_off, c.dst_rows,
                      c.width)
        with pytest.raises(ValueError, match="outside"):
            mem.execute(bad)
        assert fake.copies == []
        mem.close()
    finally:
        dep.close()


class FakeTorch:
    """Just enough of a torch tensor for reshape: view, slicing, data_ptr (numpy underneath)."""

    def __init__(self, array):
        self.array = array

    def view(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        return FakeTorch(self.array.reshape(shape))

    def __getitem__(self, index):
        return FakeTorch(self.array[index])

    def data_ptr(self):
        return self.array.ctypes.data

    @property
    def shape(self):
        return self.array.shape


class FakeLocalCache:
    def __init__(self, spec, rank):
        self.infos = spec.tensors(rank)
        self.tensors = {i.name: FakeTorch(np.zeros(i.shape, np.uint16)) for i in self.infos}
        self.pointers = [self.tensors[i.name].data_ptr() for i in self.infos]
        self.manifest = [{"name": i.name, "handle": "ab" * 64, "offset": 0, "alloc_bytes": 1 << 30, "nbytes": i.nbytes,
                          "device": 0} for i in self.infos]


def test_the_worker_re_views_its_tensors_over_the_same_allocations():
    spec = CacheSpec(num_layers=2, num_gpu_blocks=10, num_cpu_blocks=4, block_size=2, num_kv_heads=3, head_dim=8)
    cache = FakeLocalCache(spec, 0)
    first = dict(cache.tensors)
    two = spec.__class__(**{**spec.__dict__, "num_kv_heads": 2, "num_gpu_blocks": 15, "num_extra_gpu_blocks": 15})
    cr.reshape(cache, two, 0, 0, "torch")
    assert [t.shape for t in cache.tensors.values()] == [(15, 2, 2, 8)] * 4
    assert [t.data_ptr() for t in cache.tensors.values()] == cache.pointers
    assert [e["nbytes"] for e in cache.manifest] == [i.nbytes for i in two.tensors()]
    assert all(e["handle"] == "ab" * 64 for e in cache.manifest)      # the same exports, other byte counts
    six = spec.__class__(**{**spec.__dict__, "num_kv_heads": 6, "num_gpu_blocks": 5, "num_extra_gpu_blocks": 5})
    cr.reshape(cache, six, 0, 0, "torch")                              # views of the first allocation, always
    assert [t.shape for t in cache.tensors.values()] == [(5, 6, 2, 8)] * 4
    np.testing.assert_array_equal(cache.bases[0].array, first[cache.infos[0].name].array)
    too_big = spec.__class__(**{**spec.__dict__, "num_gpu_blocks": 11, "num_extra_gpu_blocks": 11})
    with pytest.raises(ValueError, match="do not fit"):
        cr.reshape(cache, too_big, 0, 0, "torch")


def test_a_framework_that_copies_instead_of_viewing_is_refused():
    spec = CacheSpec(num_layers=1, num_gpu_blocks=4, num_cpu_blocks=4, block_size=2, num_kv_heads=2, head_dim=8)
    cache = FakeLocalCache(spec, 0)

    class Copying(FakeTorch):
        def view(self, *shape):
            return FakeTorch(super().view(*shape).array.copy())
    cache.tensors = {k: Copying(v.array) for k, v in cache.tensors.items()}
    one = spec.__class__(**{**spec.__dict__, "num_kv_heads": 1, "num_gpu_blocks": 8, "num_extra_gpu_blocks": 8})
    with pytest.raises(TransferError, match="copy"):
        cr.reshape(cache, one, 0, 0, "torch")


def test_the_staging_buffer_is_exported_by_ipc_handle_and_offset(fake, monkeypatch):
    arena = fake.allocate(1 << 16)
    monkeypatch.setattr(cr, "empty_device", lambda framework, shape, dtype, device_id:
                        FakeTorch(arena[4096:4096 + shape[0]]))
    monkeypatch.setattr(cr, "free_cached", lambda framework: None)
    staging = cr.CudaStaging("torch", 1000, 0)
    assert staging.descriptor == {"device": "cuda", "device_id": 0, "nbytes": 1000,
                                  "handle": fake.handle_of(arena.ctypes.data), "offset": 4096,
                                  "alloc_bytes": 1 << 16}
    staging.close()
    assert staging.tensor is None
