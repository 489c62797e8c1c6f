"""The cuda device moves the weights with the KV in a reshard (docs/design.md §9), without a GPU: the fake CUDA
runtime and driver of tests/test_cuda_reshard.py, and the real worker-side code (CudaOps allocating and exporting
the caches, weights, staging buffers and new weight allocations, re-viewing and switching at commit) over fake
device memory, each rank a "process" whose caching allocator puts its tensors side by side in shared segments,
so a transfer manager must open each allocation once. The transfer managers' part runs through CudaMemory.
After every step every weight byte of every rank equals its slice of random full tensors and every live KV
block and used CPU block holds its bytes."""
import ctypes
import weakref

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.runtime")

import fastcache.ops.cuda as cuda_ops  # noqa: E402
import fastcache.ops.cuda_reshard as cr  # noqa: E402
from fastcache.config import CacheSpec  # noqa: E402
from fastcache.ipc.manifest import write_json_segment  # noqa: E402
from fastcache.ipc.naming import (manifest_name, new_suffix, reshard_exports_name, reshard_staging_name,  # noqa: E402
                                  swap_space_name, weights_name)
from fastcache.ipc.shm import SharedSegment  # noqa: E402
from fastcache.ops.frameworks import NUMPY_STORAGE  # noqa: E402
from fastcache.reshard_plan import Capacity, Plan  # noqa: E402
from fastcache.weight_spec import WeightSpec  # noqa: E402
from test_cuda_reshard import Deployment, FakeTorch, fake, mismatches, reshard, wanted  # noqa: E402,F401

# column-split (dim 0), row-split (dim 1) and replicated tensors; every split dim divides over 4 ranks
MODEL = WeightSpec(3, {"qkv": ((8, 6), "float16", 0), "o": ((6, 8), "float16", 1), "norm": ((6,), "float32")})
SEGMENT = 8192      # a caching allocator's segment: small tensors share one, and so share an IPC handle


class Allocator:
    """empty_device of the worker processes over fake device memory: per rank (the "process" allocating now),
    tensors at 512-byte aligned offsets of its current segment, a new segment when it is full. Freed memory
    is not reused."""

    def __init__(self, rt):
        self.rt, self.rank = rt, 0
        self.segments = {}          # rank -> [buffer, bytes used]

    def empty(self, framework, shape, dtype, device_id):
        storage = np.dtype(NUMPY_STORAGE[dtype])
        nbytes = int(np.prod(shape)) * storage.itemsize
        seg = self.segments.get(self.rank)
        if seg is None or seg[1] + nbytes > seg[0].nbytes:
            seg = self.segments[self.rank] = [self.rt.allocate(max(SEGMENT, nbytes)), 0]
        buf, used = seg
        seg[1] = used + -(-nbytes // 512) * 512
        return FakeTorch(buf[used:used + nbytes].view(storage).reshape(shape))


@pytest.fixture
def alloc(fake, monkeypatch):
    allocator = Allocator(fake)
    freed = []
    for module in (cuda_ops, cr):
        monkeypatch.setattr(module, "empty_device", allocator.empty)
        monkeypatch.setattr(module, "free_cached", freed.append)
    monkeypatch.setattr(cuda_ops, "set_device", lambda device_id: None)
    allocator.freed = freed
    return allocator


def device_bytes(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(ptr))


def slice_bytes(layout) -> list:
    return [t.num_blocks * t.block_bytes for t in layout.tensors()]


class Ranks:
    """A cuda deployment with weights, step after step: what the engine and the workers do around the transfer
    managers' moves (exports, staging, new weight allocations, fresh and retired ranks, the commit), with the
    real CudaOps worker side. `plan` and `suffix` make it a deployment for test_cuda_reshard's `reshard`."""

    blocks = Deployment.blocks          # {(space key, block): all heads} as the ranks hold them now

    def __init__(self, rt, alloc, tp, seed=0):
        self.rt, self.alloc, self.suffix = rt, alloc, new_suffix()
        self.ops = cuda_ops.CudaOps()
        self.rng = np.random.default_rng(seed)
        self.tp, self.plan = tp, None
        self.spec = CacheSpec(num_layers=2, num_gpu_blocks=16 * tp, num_cpu_blocks=8 * tp, block_size=2,
                              num_kv_heads=4 // tp, head_dim=8, cache_dtype="block_wise_fp8")
        self.layout = MODEL.resharded(tp)
        self.capacities = [Capacity.of(self.spec)] * tp
        self.weight_capacities = [slice_bytes(self.layout)] * tp
        self.caches, self.weights, self.segments = {}, {}, {}
        self.full = {}
        for name, _, dtype in self.layout.layer_tensors:
            shape = (self.layout.num_gpu_blocks, *self.layout.full_shape(name))
            storage = np.dtype(NUMPY_STORAGE[dtype])
            raw = self.rng.integers(1, 256, int(np.prod(shape)) * storage.itemsize, dtype=np.uint8)
            self.full[name] = raw.view(storage).reshape(shape)
        for r in range(tp):
            self.start(r, self.spec, self.layout)
            for t, info in enumerate(self.spec.tensors(r)):
                device_bytes(self.caches[r].pointers[t], info.nbytes)[:] = self.rng.integers(1, 256, info.nbytes,
                                                                                             dtype=np.uint8)
            tier = self.tier(r)
            tier[:] = self.rng.integers(1, 256, tier.size, dtype=np.uint8)
            for i, info in enumerate(self.layout.tensors(r)):
                device_bytes(self.weights[r].pointers[i], info.nbytes)[:] = self.want_weight(self.layout, r, i)

    # -- what the workers and the engine hold --------------------------------------------------------
    def publish(self, name, payload):
        old = self.segments.pop(name, None)
        if old is not None:
            old.close()
        self.segments[name] = write_json_segment(name, payload, self.suffix)

    def drop(self, name):
        seg = self.segments.pop(name, None)
        if seg is not None:
            seg.close()

    def start(self, r, spec, layout):
        """A worker's start: its cache and weights allocated and exported; the engine's CPU tier."""
        self.alloc.rank = r
        self.caches[r] = self.ops.allocate(spec, r, 0, "torch", self.suffix, 1)
        self.publish(manifest_name(self.suffix, r), self.caches[r].manifest)
        self.weights[r] = self.ops.allocate_group(layout, r, 0, "torch", self.suffix, 1, "weights")
        self.publish(weights_name(self.suffix, r, "exports"), self.weights[r].manifest)
        self.segments[swap_space_name(self.suffix, r)] = SharedSegment.create(swap_space_name(self.suffix, r),
                                                                              spec.cpu_cache_bytes, self.suffix)

    def tier(self, r):
        seg = self.segments[swap_space_name(self.suffix, r)]
        return seg.array(np.uint8, (seg.size,))

    @property
    def tensors(self):
        """{(rank, KV tensor): its bytes, as far as its allocation goes}, for Deployment.blocks."""
        out = {}
        for r, cache in self.caches.items():
            sizes = cache.base_bytes if getattr(cache, "base_bytes", None) else [i.nbytes for i in cache.infos]
            out.update({(r, t): device_bytes(p, n) for t, (p, n) in enumerate(zip(cache.pointers, sizes))})
        return out

    def want_weight(self, layout, r, i) -> np.ndarray:
        name = layout.layer_tensors[i][0]
        part = self.full[name][(slice(None), *layout.rank_slice(name, r))]
        return np.ascontiguousarray(part).view(np.uint8).reshape(-1)

    def weight_mismatches(self) -> list:
        """(rank, tensor name) whose bytes differ from its slice of the full tensor."""
        bad = []
        for r in range(self.tp):
            for i, info in enumerate(self.layout.tensors(r)):
                if not np.array_equal(device_bytes(self.weights[r].pointers[i], info.nbytes),
                                      self.want_weight(self.layout, r, i)):
                    bad.append((r, self.layout.layer_tensors[i][0]))
        return bad

    # -- a step ----------------------------------------------------------------------------------------
    def step(self, new_tp, method="gather", before_moves=lambda: None):
        """Reshard to new_tp; (plan, device copies) with the KV checked, the weights to be checked by the caller."""
        spec = self.spec
        new_blocks = spec.num_gpu_blocks * self.tp // new_tp
        live = np.sort(self.rng.choice(spec.num_gpu_blocks, min(new_blocks, spec.num_gpu_blocks) // 2, replace=False))
        cpu_blocks = spec.num_cpu_blocks * self.tp // new_tp
        cpu = np.sort(self.rng.choice(spec.num_cpu_blocks, min(cpu_blocks, spec.num_cpu_blocks) // 2, replace=False))
        plan = self.plan = Plan(spec, self.tp, new_tp, self.capacities, live, cpu, 4096, weights=self.layout,
                                weight_capacities=self.weight_capacities)
        want = wanted(self)
        # PREPARE: kept workers' staging and new weight allocations, exported; the engine's CPU staging
        staging, new_weights = {}, {}
        for r in plan.kept:
            self.alloc.rank = r
            need = plan.staging_bytes_for(r, "gpu")
            if need:
                staging[r] = self.ops.reshard_staging(need, self.suffix, r, "torch", 0)
                self.publish(reshard_exports_name(self.suffix, r), staging[r].descriptor)
            need = plan.staging_bytes_for(r, "cpu")
            if need:
                self.segments[reshard_staging_name(self.suffix, r, "cpu")] = SharedSegment.create(
                    reshard_staging_name(self.suffix, r, "cpu"), need, self.suffix)
            mine = {i: n for (rank, i), n in plan.weight_allocations().items() if rank == r}
            new_weights[r] = {i: self.ops.weight_allocation(n, self.suffix, r, i, 1, "torch", 0,
                                                            plan.new_weights.layer_tensors[i][2])
                              for i, n in mine.items()}
            if mine:
                self.publish(weights_name(self.suffix, r, "reshard_exports"),
                             {str(i): a.descriptor for i, a in new_weights[r].items()})
        for r in plan.fresh:            # start_workers: the new ranks in the new geometry
            self.start(r, plan.new_spec, plan.new_weights)
        before_moves()
        device = reshard(self, method)
        # COMMIT: kept workers re-view (KV) and re-view or switch (weights), and re-export
        for r in plan.kept:
            self.ops.reshape(self.caches[r], plan.new_spec, r, 0, "torch")
            self.publish(manifest_name(self.suffix, r), self.caches[r].manifest)
            self.ops.reshape_group(self.weights[r], plan.new_weights, r, 0, "torch", new_weights.pop(r))
            self.publish(weights_name(self.suffix, r, "exports"), self.weights[r].manifest)
            for name in (reshard_exports_name(self.suffix, r), weights_name(self.suffix, r, "reshard_exports"),
                         reshard_staging_name(self.suffix, r, "cpu")):
                self.drop(name)
            if r in staging:
                staging.pop(r).close()
        for r in plan.retired:
            self.caches.pop(r).release()
            self.weights.pop(r).release()
            for name in (manifest_name(self.suffix, r), weights_name(self.suffix, r, "exports"),
                         swap_space_name(self.suffix, r)):
                self.drop(name)
        moved = plan.weight_allocations()
        self.weight_capacities = [[moved.get((r, i), c) for i, c in enumerate(self.weight_capacities[r])]
                                  for r in plan.kept] + [slice_bytes(plan.new_weights)] * len(plan.fresh)
        self.capacities = [self.capacities[r] for r in plan.kept] + [Capacity.of(plan.new_spec)] * len(plan.fresh)
        self.spec, self.tp, self.layout = plan.new_spec, new_tp, plan.new_weights
        assert not mismatches(self, want), (plan.old_tp, new_tp)
        return plan, device

    def close(self):
        for seg in self.segments.values():
            seg.close()
        self.segments = {}


@pytest.mark.parametrize("method", cr.COPY_METHODS)
@pytest.mark.parametrize("path", [[1, 2], [2, 4], [4, 2], [2, 1], [1, 4, 2], [1, 2, 4, 2, 1]])
def test_weights_and_kv_move_through_cuda_memory_bit_for_bit(fake, alloc, path, method):
    ranks = Ranks(fake, alloc, path[0], seed=sum(path))
    try:
        assert not ranks.weight_mismatches()
        for tp in path[1:]:
            old = {r: list(ranks.weights[r].pointers) for r in ranks.weights}
            plan, device = ranks.step(tp, method)
            assert not ranks.weight_mismatches(), (plan.old_tp, tp)
            assert ranks.layout == MODEL.resharded(tp)
            moved = plan.weight_allocations()
            for r in plan.kept:         # re-viewed in place, or switched to the new allocation
                for i, ptr in enumerate(ranks.weights[r].pointers):
                    assert (ptr != old[r][i]) == ((r, i) in moved)
            sources = {c.src[0] for c, _, _ in device}
            assert "weights" in sources and ("weights_new" in {c.dst[0] for c, _, _ in device}) == bool(moved)
            assert sorted(fake.opened) == sorted(fake.closed)      # every IPC open closed again
        # a rank born at a larger tp outgrows its allocation on the way back: 2 -> 1 (rank 0 needs all of it),
        # 4 -> 2 (ranks 0 and 1 need half), and 1 -> 4 -> 2 (rank 1 was born with a quarter)
        assert len(fake.driver.launches) > 0 or method == "2d"
    finally:
        ranks.close()


def test_a_rank_born_at_tp_4_moves_into_a_new_allocation_at_tp_2_and_the_old_one_is_freed(fake, alloc):
    ranks = Ranks(fake, alloc, 1, seed=3)
    first = [weakref.ref(t) for t in ranks.weights[0].tensors.values()]       # rank 0's, never replaced
    try:
        ranks.step(4)
        old = [weakref.ref(t) for t in ranks.weights[1].tensors.values()]     # rank 1's first allocations
        plan, _ = ranks.step(2)
        assert sorted(plan.weight_allocations()) == [(1, 0), (1, 1)]        # qkv and o; norm is replicated
        assert not ranks.weight_mismatches()
        entries = ranks.weights[1].manifest
        for i, ptr in enumerate(ranks.weights[1].pointers):     # the export names the allocation holding it
            base = int.from_bytes(bytes.fromhex(entries[i]["handle"])[:8], "little")
            assert base + entries[i]["offset"] == ptr and entries[i]["nbytes"] == plan.weight_spaces[i].new_bytes()
        assert [ref() is None for ref in old] == [True, True, False]       # old qkv and o freed, norm kept
        assert alloc.freed                  # and the framework's cache handed back
        ranks.step(1)               # rank 0 was born at tp 1: its allocations hold the whole tensors again
        assert not ranks.weight_mismatches()
        ranks.weights[0].release()      # a sleep frees the weights, the bases a reshard kept too
        assert [ref() is None for ref in first] == [True] * 3
    finally:
        ranks.close()


@pytest.mark.parametrize("control", ["swapped exports", "corrupted table"])
def test_a_wrong_export_or_a_corrupted_table_fails_the_weight_check(fake, alloc, control, monkeypatch):
    """Negative controls: two weight tensors' export entries swapped (same sizes: every copy stays in bounds),
    or one run of a weight copy's table reading another run's source; the check above sees the wrong bytes
    (and the KV's, which step() checks, are untouched)."""
    ranks = Ranks(fake, alloc, 2, seed=11)
    tampered = []

    def swap_exports():
        entries = list(ranks.weights[0].manifest)
        assert entries[0]["nbytes"] == entries[1]["nbytes"]
        entries[0], entries[1] = ({**entries[1], "name": entries[0]["name"]},
                                  {**entries[0], "name": entries[1]["name"]})
        ranks.publish(weights_name(ranks.suffix, 0, "exports"), entries)
        tampered.append(entries)

    def tamper(runs):
        if not tampered and len(runs) > 1 and runs[0, 0] != runs[1, 0]:
            runs[0, 0] = runs[1, 0]          # run 0 reads run 1's source: in bounds, other bytes
            tampered.append(runs[0].tolist())
    real = fake.driver.gather_runs

    def gather_runs(grid, table, num_runs, src, dst):      # tamper with launches that read weights only
        sources = {p for w in ranks.weights.values() for p in w.pointers}
        fake.driver.tamper = tamper if src in sources else None
        real(grid, table, num_runs, src, dst)
    if control == "corrupted table":
        monkeypatch.setattr(fake.driver, "gather_runs", gather_runs)
    try:
        assert not ranks.weight_mismatches()
        ranks.step(4, before_moves=swap_exports if control == "swapped exports" else lambda: None)
        assert tampered
        assert ranks.weight_mismatches()
    finally:
        ranks.close()


def test_the_worker_switches_outgrown_weight_tensors_to_their_new_allocations_and_re_views_the_rest(fake, alloc):
    """CudaOps' worker side alone: a rank born at tp 4 goes to tp 2. Its new allocations are the tensors' dtype,
    exported by IPC handle and offset; reshape_group takes them as the tensors' bases (views, their exports),
    re-views the replicated tensor where it is, frees the old bases, and changes nothing unless all fits."""
    ops, four, two = cuda_ops.CudaOps(), MODEL.resharded(4), MODEL.resharded(2)
    cache = ops.allocate_group(four, 1, 0, "torch", "t", 1, "weights")
    first, pointers, manifest = [weakref.ref(t) for t in cache.tensors.values()], list(cache.pointers), cache.manifest
    need = slice_bytes(two)
    qkv = ops.weight_allocation(need[0], "t", 1, 0, 1, "torch", 0, "float16")
    base = fake.driver.cuMemGetAddressRange(qkv.tensor.data_ptr())[1]
    assert qkv.tensor.array.dtype == np.float16 and qkv.tensor.array.nbytes == need[0]
    assert qkv.descriptor == {"device": "cuda", "device_id": 0, "nbytes": need[0], "handle": fake.handle_of(base),
                              "offset": qkv.tensor.data_ptr() - base, "alloc_bytes": SEGMENT}
    with pytest.raises(ValueError, match="do not fit"):        # o outgrows its allocation too, and is not replaced
        ops.reshape_group(cache, two, 1, 0, "torch", {0: qkv})
    assert cache.pointers == pointers and cache.manifest is manifest and not alloc.freed
    o = ops.weight_allocation(need[1], "t", 1, 0, 1, "torch", 0, "float16")
    ops.reshape_group(cache, two, 1, 0, "torch", {0: qkv, 1: o})
    assert cache.pointers == [qkv.tensor.data_ptr(), o.tensor.data_ptr(), pointers[2]]
    assert [t.data_ptr() for t in cache.tensors.values()] == cache.pointers         # views, no copies
    assert [t.shape for t in cache.tensors.values()] == [i.shape for i in two.tensors(1)]
    for entry, alloc_ in zip(cache.manifest, (qkv, o)):
        assert {k: entry[k] for k in ("handle", "offset", "alloc_bytes")} == \
            {k: alloc_.descriptor[k] for k in ("handle", "offset", "alloc_bytes")}
    assert cache.manifest[2] == {**manifest[2], "nbytes": two.tensors(1)[2].nbytes}
    assert [e["nbytes"] for e in cache.manifest] == need
    assert [ref() is None for ref in first] == [True, True, False] and alloc.freed == ["torch"]
    spare = ops.weight_allocation(need[0], "t", 1, 0, 2, "torch", 0, "float16")   # an aborted step's: close frees it
    ref = weakref.ref(spare.tensor)
    spare.close()
    assert ref() is None and alloc.freed == ["torch", "torch"]
