"""The cuda device's reshard code (fastcache/ops/cuda_reshard.py) without a GPU: a fake CUDA runtime whose
"device memory" is host memory and whose IPC handles name host buffers. It proves the bookkeeping (IPC
opens once per allocation, offsets inside allocations, one gather launch per plan copy over an uploaded
table of runs or one cudaMemcpy2DAsync per run of rows, bounds, the journal's flushes, the worker's re-view
over the same allocations), not CUDA itself: tests/test_gpu_reshard.py runs the real thing on a GPU machine.

The fake streams are lazy: work queued on a stream runs only when something waits for it (a synchronize,
or another stream's wait on an event recorded there), and then all of it. A launch that does not wait for
its table's upload reads stale device memory, and an upload that overwrites a table before the launches
that read it have run is seen by them: both show as wrong bytes. The fake driver runs gather_runs in
Python, block by block over the grid, reading its run table from the fake device memory.
"""
import ctypes

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.runtime")

import fastcache.ops.cuda_ipc as cuda_ipc  # noqa: E402
import fastcache.ops.cuda_kernels as kernels  # noqa: E402
import fastcache.ops.cuda_reshard as cr  # noqa: E402
from conftest import MemoryJournal  # noqa: E402
from cuda.bindings import runtime  # noqa: E402
from fastcache.config import CacheSpec  # noqa: E402
from fastcache.reshard_plan import Capacity, Copy, Plan, run_chunks  # noqa: E402
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


class FakeStream:
    """Queued work, run when waited for (all of it: a copy engine runs ahead as far as it can)."""

    def __init__(self):
        self.queue = []

    def run(self):
        while self.queue:
            self.queue.pop(0)()


class FakeEvent:
    stream = None


class FakeRuntime:
    """The calls cuda_reshard makes, on host memory; IPC handles are 64 bytes naming a registered buffer."""
    cudaStreamNonBlocking = 1
    cudaEventDisableTiming = 2
    cudaIpcMemLazyEnablePeerAccess = 1
    cudaMemcpyKind = runtime.cudaMemcpyKind
    cudaDeviceAttr = runtime.cudaDeviceAttr
    cudaIpcMemHandle_t = FakeHandle
    SMS = 2             # a small GPU: max grid 64, so gathers stride over their runs

    def __init__(self):
        self.allocations = {}           # base address -> numpy buffer
        self.opened, self.closed, self.copies, self.syncs = [], [], [], 0
        self.uploads, self.memcpys = [], []      # (dst, nbytes) of host-to-device and device copies
        self.streams, self.destroyed, self.events = [], [], 0

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

    def inside(self, ptr, nbytes):
        for base, buf in self.allocations.items():
            if base <= ptr and ptr + nbytes <= base + buf.nbytes:
                return True
        return False

    def cudaMalloc(self, nbytes):
        return OK, self.allocate(nbytes).ctypes.data

    def cudaFree(self, ptr):
        assert self.allocations.pop(ptr, None) is not None, "cudaFree of an unknown pointer"
        return (OK,)

    def cudaMemcpyAsync(self, dst, src, nbytes, kind, stream):
        assert self.inside(dst, nbytes)
        if kind == runtime.cudaMemcpyKind.cudaMemcpyHostToDevice:
            data = ctypes.string_at(src, nbytes)        # pageable: staged when the call returns
            self.uploads.append((dst, nbytes))
            stream.queue.append(lambda: ctypes.memmove(dst, data, nbytes))
        else:
            assert kind == runtime.cudaMemcpyKind.cudaMemcpyDefault and self.inside(src, nbytes)
            self.memcpys.append((dst, nbytes))
            stream.queue.append(lambda: ctypes.memmove(dst, src, nbytes))
        return (OK,)

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        assert kind == runtime.cudaMemcpyKind.cudaMemcpyDefault
        assert self.inside(src, (height - 1) * spitch + width) and self.inside(dst, (height - 1) * dpitch + width)

        def copy():
            for i in range(height):
                ctypes.memmove(dst + i * dpitch, src + i * spitch, width)
        stream.queue.append(copy)
        self.copies.append((width, height))
        return (OK,)

    def cudaStreamCreateWithFlags(self, flags):
        self.streams.append(FakeStream())
        return OK, self.streams[-1]

    def cudaStreamSynchronize(self, stream):
        self.syncs += 1
        stream.run()
        return (OK,)

    def cudaStreamDestroy(self, stream):
        assert not stream.queue, "a stream destroyed before its work was waited for"
        self.destroyed.append(stream)
        return (OK,)

    def cudaEventCreateWithFlags(self, flags):
        self.events += 1
        return OK, FakeEvent()

    def cudaEventRecord(self, event, stream):
        event.stream = stream
        return (OK,)

    def cudaStreamWaitEvent(self, stream, event, flags):
        stream.queue.append(event.stream.run)
        return (OK,)

    def cudaEventDestroy(self, event):
        self.events -= 1
        return (OK,)

    def cudaDeviceGetAttribute(self, attr, device):
        values = {runtime.cudaDeviceAttr.cudaDevAttrMultiProcessorCount: self.SMS,
                  runtime.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor: 9,
                  runtime.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor: 0}
        return OK, values[attr]


IMAGE = b"fake cubin of the kernel source"


class FakeDriver:
    """IPC address ranges, and the gather kernel: its module and its launches, run in Python when the stream
    gets to them (`tamper(table)`, if set, may change the table the launch reads, in device memory)."""

    def __init__(self, rt):
        self.rt = rt
        self.loaded, self.unloaded, self.launches = [], [], []
        self.tamper = None

    def CUdeviceptr(self, ptr):
        return ptr

    def cuMemGetAddressRange(self, ptr):
        for base, buf in self.rt.allocations.items():
            if base <= ptr < base + buf.nbytes:
                return OK, base, buf.nbytes
        raise AssertionError("not an allocation")

    def cuModuleLoadData(self, image):
        assert image == IMAGE
        self.loaded.append(object())
        return OK, self.loaded[-1]

    def cuModuleGetFunction(self, module, name):
        assert module in self.loaded and module not in self.unloaded
        return OK, (module, name)

    def cuModuleUnload(self, module):
        assert module in self.loaded and module not in self.unloaded
        self.unloaded.append(module)
        return (OK,)

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, args, extra):
        module, name = function
        assert name == kernels.GATHER_NAME and module not in self.unloaded
        assert (gy, gz, bx, by, bz, shared) == (1, 1, kernels.GATHER_THREADS, 1, 1, 0)
        assert 1 <= gx <= kernels.GATHER_BLOCKS_PER_SM * self.rt.SMS
        (table, num_runs, src, dst), types = args
        assert types == (ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p)
        self.launches.append((src, dst, num_runs, table))
        stream.queue.append(lambda: self.gather_runs(gx, table, num_runs, src, dst))
        return (OK,)

    def gather_runs(self, grid, table, num_runs, src, dst):
        """gather_runs as the kernel runs it: block b takes runs b, b + grid, ... of the device table."""
        assert self.rt.inside(table, 24 * num_runs), "the run table is not in device memory"
        runs = np.ctypeslib.as_array((ctypes.c_longlong * (3 * num_runs)).from_address(table)).reshape(-1, 3)
        if self.tamper is not None:
            self.tamper(runs)
        for block in range(grid):
            for s, d, n in runs[block::grid].tolist():
                assert self.rt.inside(src + s, n) and self.rt.inside(dst + d, n), "a run outside its allocation"
                ctypes.memmove(dst + d, src + s, n)


@pytest.fixture
def fake(monkeypatch):
    rt = FakeRuntime()
    drv = FakeDriver(rt)
    rt.driver = drv
    for module in (cr, cuda_ipc, kernels):
        monkeypatch.setattr(module, "runtime", rt)
        monkeypatch.setattr(module, "set_device", lambda device_id: None)
    for module in (cuda_ipc, kernels):
        monkeypatch.setattr(module, "driver", drv)
    monkeypatch.setattr(kernels, "kernel_image", lambda major, minor: IMAGE)
    monkeypatch.delenv(cr.COPY_METHOD_ENV, raising=False)
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


def deployment(fake, m, n, staging=4096):
    spec = CacheSpec(num_layers=2, num_gpu_blocks=16 * 4 // (4 // m), num_cpu_blocks=8 * 4 // (4 // m), block_size=2,
                     num_kv_heads=4 // m, head_dim=8, cache_dtype="block_wise_fp8")
    rng = np.random.default_rng(m * 10 + n)
    new_blocks = spec.num_gpu_blocks * n // m
    live = np.sort(rng.choice(spec.num_gpu_blocks, min(new_blocks, spec.num_gpu_blocks) // 2, replace=False))
    cpu = np.sort(rng.choice(spec.num_cpu_blocks, min(spec.num_cpu_blocks * n // m, spec.num_cpu_blocks) // 2,
                             replace=False))
    return Deployment(fake, spec, m, n, live, cpu, staging=staging)


def wanted(dep):
    """{(space key, new block id): all heads} that every live block must hold after the reshard."""
    plan = dep.plan
    maps = {sp.key: dict(zip(*(ids.tolist() for ids in plan._pairs(sp)))) for sp in plan.spaces}
    return {(k, maps[k][b]): v for (k, b), v in dep.blocks(plan.old_tp, plan.old_spec, None).items()}


def mismatches(dep, want):
    got = dep.blocks(dep.plan.new_tp, dep.plan.new_spec, None)
    assert got.keys() == want.keys()
    return [key for key in want if not np.array_equal(got[key], want[key])]


def reshard(dep, method):
    """Every rank's compaction, then the programs wave by wave, each in a CudaMemory of its own (as transfer
    managers run them); (copy, src address, dst address) of every copy between device regions, in order."""
    plan, device = dep.plan, []

    def run(chunks):
        mem = cr.CudaMemory(dep.suffix, plan, 0, copy_method=method)

        def execute(c):
            src, dst = mem.resolve(c.src), mem.resolve(c.dst)
            if isinstance(src, cr.DeviceRegion) and isinstance(dst, cr.DeviceRegion) and len(c.src_rows):
                device.append((c, src.ptr, dst.ptr))
            mem.execute(c)
        try:
            run_chunks(chunks, execute, flush=mem.flush)
        finally:
            mem.close()
    for r in range(plan.old_tp):
        run(plan.compaction(r))
    for wave in plan.waves:
        for r in wave:
            run(plan.program(r)[0])
    return device


@pytest.mark.parametrize("method", cr.COPY_METHODS)
@pytest.mark.parametrize("m,n", [(1, 2), (2, 4), (4, 2), (2, 1), (1, 4), (4, 1)])
def test_cuda_memory_moves_every_head_slice_bit_for_bit(fake, m, n, method):
    dep = deployment(fake, m, n)
    try:
        want, allocations = wanted(dep), set(fake.allocations)
        device = reshard(dep, method)
        assert not mismatches(dep, want)
        assert sorted(fake.opened) == sorted(fake.closed)      # every IPC open closed again
        assert len(fake.destroyed) == len(fake.streams) and fake.events == 0
        assert set(fake.allocations) == allocations              # the table arenas freed
        if method == "2d":
            assert fake.copies and all(h >= 1 for _, h in fake.copies)
            assert not fake.driver.launches and not fake.memcpys and not fake.uploads
            return
        # one gather launch per plan copy (a source and a destination region) of more than one run, in order;
        # a copy that is one run is one cudaMemcpyAsync; nothing goes as a 2-D copy
        tables = [cr.split_runs(cr.copy_runs(c)) for c, _, _ in device]
        launched = [(s, d, len(t)) for (c, s, d), t in zip(device, tables) if len(t) > 1]
        assert launched and [launch[:3] for launch in fake.driver.launches] == launched
        assert fake.memcpys == [(d + int(t[0, 1]), int(t[0, 2])) for (c, s, d), t in zip(device, tables) if len(t) == 1]
        assert not fake.copies
        assert len(fake.uploads) == len(launched)                 # each table uploaded once
        assert fake.driver.loaded and sorted(map(id, fake.driver.loaded)) == sorted(map(id, fake.driver.unloaded))
    finally:
        dep.close()


def test_a_corrupted_run_table_fails_the_bit_for_bit_check(fake):
    """The negative control: the check above sees one run that reads the wrong source."""
    dep = deployment(fake, 1, 2)
    try:
        want, tampered = wanted(dep), []

        def tamper(runs):
            if not tampered and len(runs) > 1 and runs[0, 0] != runs[1, 0]:
                runs[0, 0] = runs[1, 0]          # run 0 reads run 1's source: in bounds, other bytes
                tampered.append(runs[0].tolist())
        fake.driver.tamper = tamper
        reshard(dep, "gather")
        assert tampered
        assert len(mismatches(dep, want)) >= 1
    finally:
        dep.close()


def test_gather_tables_are_built_and_uploaded_once_per_copy_across_a_resumed_program(fake, monkeypatch):
    spec = CacheSpec(num_layers=1, num_gpu_blocks=32, num_cpu_blocks=4, block_size=2, num_kv_heads=4, head_dim=8,
                     has_value=False, cache_dtype="uint8")
    # every other block live: no two rows are consecutive, so every copy is a gather of single rows
    dep = Deployment(fake, spec, 1, 2, np.arange(0, 32, 2), [], staging=256)
    built, real = [], cr.copy_runs
    monkeypatch.setattr(cr, "copy_runs", lambda c, out=None: built.append(c) or real(c, out))
    try:
        plan = dep.plan
        want = wanted(dep)
        assert plan.waves == [[1], [0]]
        mem = cr.CudaMemory(dep.suffix, plan, 0)
        run_chunks(plan.program(1)[0], mem.execute, flush=mem.flush)        # the fresh rank reads rank 0 first
        mem.close()
        built.clear(), fake.uploads.clear(), fake.driver.launches.clear()

        chunks, journaled = plan.program(0)
        assert journaled and len(chunks) >= 2
        mem = cr.CudaMemory(dep.suffix, plan, 0)
        journal, flushes = MemoryJournal(), []

        def dying_flush():
            mem.flush()
            flushes.append(1)
            if len(flushes) == 2:            # chunk 0 staged and written back, the journal not told yet
                raise InterruptedError
        with pytest.raises(InterruptedError):
            run_chunks(chunks, mem.execute, journal, flush=dying_flush)
        assert journal.value == 1
        run_chunks(chunks, mem.execute, journal, flush=mem.flush)      # resumes: chunk 0's write once more
        mem.close()
        copies = [c for chunk in chunks for c in (*chunk.gather, *chunk.write)]
        assert sorted(map(id, built)) == sorted(map(id, copies))      # each table built once
        assert len(fake.uploads) == len(copies)                          # and uploaded once
        launches = fake.driver.launches
        assert len(launches) == len(copies) + 1
        write = len(chunks[0].gather)          # chunk 0's write, launched again from the table already there
        assert launches[write] == launches[write + 1]
        assert not mismatches(dep, want)
    finally:
        dep.close()


def test_a_full_table_arena_is_reused_only_once_its_launches_ran(fake, monkeypatch):
    """A tiny arena: tables are uploaded again and again into the same bytes. The lazy fake streams turn a
    reuse that does not wait for the launches that read the old tables into wrong bytes."""
    monkeypatch.setattr(cr, "MIN_ARENA_BYTES", 256)
    monkeypatch.setattr(cr, "TABLE_ARENA_BYTES", 512)
    dep = deployment(fake, 1, 4)
    try:
        want = wanted(dep)
        reshard(dep, "gather")
        assert not mismatches(dep, want)
        places = [dst for dst, _ in fake.uploads]
        assert len(set(places)) < len(places)           # the arena's bytes were reused
    finally:
        dep.close()


def test_a_kept_table_is_uploaded_again_once_the_arena_has_started_over(fake, monkeypatch):
    """GatherCopies alone, over two "device" buffers: an arena of one table; a, b, then a again (its old
    place in the arena now holds b's table: a is built and uploaded again, not launched from there)."""
    monkeypatch.setattr(cr, "MIN_ARENA_BYTES", 256)
    monkeypatch.setattr(cr, "TABLE_ARENA_BYTES", 256)
    rng = np.random.default_rng(3)
    src, dst = fake.allocate(1024), fake.allocate(1024, fill=0)
    src[:] = rng.integers(1, 256, src.size, dtype=np.uint8)
    regions = cr.DeviceRegion(src.ctypes.data, src.size, "source"), cr.DeviceRegion(dst.ctypes.data, dst.size, "dest")
    stream = fake.cudaStreamCreateWithFlags(1)[1]
    gather = cr.GatherCopies(0, stream)
    a = Copy(("s",), 64, 0, np.array([0, 2, 4]), ("d",), 16, 0, np.array([0, 1, 2]), 16)
    b = Copy(("s",), 64, 32, np.array([1, 3, 5, 7]), ("d",), 16, 0, np.array([10, 11, 12, 13]), 16)

    def expect(*copies):
        out = np.zeros_like(dst)
        for c in copies:
            for s, d in zip(c.src_rows.tolist(), c.dst_rows.tolist()):
                out[d * 16:d * 16 + 16] = src[s * 64 + c.src_off:s * 64 + c.src_off + 16]
        return out
    try:
        gather.copy(a, *regions)
        gather.copy(b, *regions)
        fake.cudaStreamSynchronize(stream)
        assert np.array_equal(dst, expect(a, b))
        dst[:] = 0
        gather.copy(a, *regions)
        fake.cudaStreamSynchronize(stream)
        assert np.array_equal(dst, expect(a))
        assert len({place for place, _ in fake.uploads}) == 1 and len(fake.uploads) == 3
    finally:
        gather.close()
        fake.cudaStreamDestroy(stream)


def test_runs_join_where_rows_fill_their_pitch_on_both_sides_and_long_runs_are_cut():
    def copy(src_pitch, src_off, src_rows, dst_pitch, dst_off, dst_rows, width):
        return Copy(("gpu", 0, 0), src_pitch, src_off, np.array(src_rows), ("staging", 0, "gpu"), dst_pitch, dst_off,
                    np.array(dst_rows), width)
    # whole rows consecutive on both sides join; a break on either side ends a run
    assert cr.copy_runs(copy(64, 0, [0, 1, 2, 5, 6, 9], 64, 0, [10, 11, 12, 13, 14, 20], 64)).tolist() == \
        [[0, 640, 192], [320, 832, 128], [576, 1280, 64]]
    # a head slice narrower than its row, or a row that fills one side only: a run per row
    assert cr.copy_runs(copy(64, 16, [0, 1, 2], 16, 0, [0, 1, 2], 16)).tolist() == \
        [[16, 0, 16], [80, 16, 16], [144, 32, 16]]
    assert len(cr.copy_runs(copy(64, 0, [0, 1, 2], 128, 0, [0, 1, 2], 64))) == 3
    assert cr.split_runs(np.array([[0, 1000, 100], [7, 3, 30]]), 40).tolist() == \
        [[0, 1000, 40], [40, 1040, 40], [80, 1080, 20], [7, 3, 30]]
    # cut or not, a table moves the same bytes
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 1 << 14, dtype=np.uint8)
    runs = np.stack([rng.integers(0, 4096, 20), np.arange(20) * 600, rng.integers(1, 600, 20)], 1)

    def apply(table):
        out = np.zeros(12000, np.uint8)
        for s, d, n in table.tolist():
            out[d:d + n] = src[s:s + n]
        return out
    assert np.array_equal(apply(cr.split_runs(runs, 48)), apply(runs))


def test_one_run_is_one_memcpy_and_a_resumed_2d_program_rewrites_only_from_staging(fake):
    spec = CacheSpec(num_layers=1, num_gpu_blocks=32, num_cpu_blocks=4, block_size=2, num_kv_heads=4, head_dim=8,
                     has_value=False, cache_dtype="uint8")
    dep = Deployment(fake, spec, 1, 2, np.arange(32), [], staging=1 << 16)
    try:
        plan = dep.plan
        want = wanted(dep)
        mem = cr.CudaMemory(dep.suffix, plan, 0, copy_method="2d")
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
        assert not mismatches(dep, want)
    finally:
        dep.close()
    # the same reshard gathering: each rank's head slices in one launch, rank 0's staging written back (all
    # rows, consecutive) in one cudaMemcpyAsync
    fake.copies.clear()
    dep = Deployment(fake, spec, 1, 2, np.arange(32), [], staging=1 << 16)
    try:
        want = wanted(dep)
        reshard(dep, "gather")
        assert not fake.copies and [n for *_, n, _ in fake.driver.launches] == [32, 32]
        assert [n for _, n in fake.memcpys] == [32 * dep.plan.spaces[0].new_row]
        assert not mismatches(dep, want)
    finally:
        dep.close()


@pytest.mark.parametrize("method", cr.COPY_METHODS)
def test_a_copy_outside_its_allocation_is_refused_before_it_is_issued(fake, method):
    spec = CacheSpec(num_layers=1, num_gpu_blocks=8, num_cpu_blocks=4, block_size=2, num_kv_heads=2, head_dim=8)
    dep = Deployment(fake, spec, 1, 2, np.arange(8), [], staging=1 << 12)
    try:
        mem = cr.CudaMemory(dep.suffix, dep.plan, 0, copy_method=method)
        chunks, _ = dep.plan.program(1)
        c = chunks[0].gather[0]
        bad = type(c)(c.src, c.src_pitch, c.src_off, c.src_rows + 100, c.dst, c.dst_pitch, c.dst_off, c.dst_rows,
                      c.width)
        with pytest.raises(ValueError, match=r"outside .*key_cache.* bytes\)"):
            mem.execute(bad)
        assert fake.copies == [] and fake.memcpys == [] and fake.uploads == [] and fake.driver.launches == []
        mem.close()
    finally:
        dep.close()


def test_the_copy_method_is_the_argument_else_the_environment_else_gather(fake, monkeypatch):
    spec = CacheSpec(num_layers=1, num_gpu_blocks=8, num_cpu_blocks=4, block_size=2, num_kv_heads=2, head_dim=8)
    dep = Deployment(fake, spec, 1, 2, np.arange(8), [], staging=1 << 12)
    try:
        def method(arg=None):
            mem = cr.CudaMemory(dep.suffix, dep.plan, 0, copy_method=arg)
            mem.close()
            return mem.copy_method
        assert method() == "gather"
        monkeypatch.setenv(cr.COPY_METHOD_ENV, "2d")
        assert method() == "2d" and method("gather") == "gather"
        monkeypatch.setenv(cr.COPY_METHOD_ENV, "dma")
        streams = len(fake.streams)
        with pytest.raises(ValueError, match="FASTCACHE_RESHARD_COPY"):
            method()
        assert len(fake.streams) == streams         # refused before anything was made
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
