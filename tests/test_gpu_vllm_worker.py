"""vLLM's worker side (fastcache/integrations/vllm/worker.py, docs/design.md §10) over vLLM-shaped KV tensors,
driven through its own API (submit_store / submit_load / wait / get_finished / shutdown) as vLLM's
OffloadingConnector drives it, without vLLM's engine.

The tensors are what vLLM hands `get_worker`: canonical int8 `(num_blocks, page_bytes)` tensors, here in
FlashAttention's layout (per layer one `(2, num_blocks, page)` allocation split into K and V, so V starts
in the middle of its allocation), filled with seeded random bytes (never zeros). A vLLM block is one
fastcache GPU block (one row of every tensor); a chunk is `blocks_per_chunk` consecutive CPU blocks.

Every load is checked bit for bit against the bytes the GPU blocks held when they were stored, in every
tensor, and every block a load does not name against a snapshot. Negative controls show the oracle can fail:
poisoned destinations differ from the expected bytes before the load, and loads from the wrong chunks or a
chunk never stored are seen as wrong.

The `cuda` variant (marked `gpu`) adopts torch CUDA tensors (the worker picks cuda when tensors[0].is_cuda),
exported to the transfer manager by CUDA IPC; the `cpu` variant runs the same logic on torch CPU tensors (the
worker picks sim and moves their storage into shared memory in place). vLLM need not be installed: see
`_vllm_stubs`.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import os
import sys
import types
import uuid
from abc import ABC, abstractmethod

import numpy as np
import pytest

from fastcache.integrations.vllm.link import ManagerLinks, link_suffix
from fastcache.integrations.vllm.options import VllmOptions
from fastcache.ipc.shm import SHM_DIR
from fastcache.ops import cuda_usable

from conftest import wait_for

try:
    import torch
except ImportError:         # the cpu variant skips; so does the cuda one
    torch = None

GPU = cuda_usable()
TORCH_CUDA = torch is not None and GPU and torch.cuda.is_available()

DEVICES = [
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not GPU, reason="no usable CUDA GPU"),
        pytest.mark.skipif(GPU and not TORCH_CUDA, reason="needs torch with CUDA to allocate vLLM's KV tensors")]),
    pytest.param("cpu", id="cpu",
                 marks=pytest.mark.skipif(torch is None, reason="needs torch (the CPU build will do)")),
]

LAYERS = 4                  # 8 canonical tensors: K and V per layer
NUM_BLOCKS = 32             # vLLM GPU blocks per tensor
PAGE = 20 << 10             # bytes of one block of one tensor (16 tokens x 8 heads x 80 dims x 2 bytes)
NUM_CHUNKS = 64             # CPU chunks of blocks_per_chunk blocks each
TIMEOUT = 60.0              # seconds a job may take (the worker's transfer_timeout too)


# -- vLLM's classes, stubbed where vLLM is not installed ---------------------------------------------
def _vllm_stubs() -> dict[str, types.ModuleType]:
    """The part of `vllm.v1.kv_offload.base` (vLLM 0.25+, 0.32 here) that worker.py and jobs.py import at
    module level (OffloadingWorker, TransferResult, BlockIDsLoadStoreSpec), plus the GPU spec and canonical
    KV cache types vLLM builds and hands them. The GPU machines run this test without vLLM (only torch,
    numpy and cuda-python), and the worker imports nothing else of vLLM, so minimal copies of these
    classes let it run there exactly as vLLM would call it."""
    base = types.ModuleType("vllm.v1.kv_offload.base")

    class LoadStoreSpec(ABC):
        pass

    class BlockIDsLoadStoreSpec(LoadStoreSpec):
        def __init__(self, block_ids):
            self.block_ids = np.array(block_ids, dtype=np.int64)

    class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
        def __init__(self, block_ids, group_sizes, block_indices):
            super().__init__(block_ids)
            assert sum(group_sizes) == len(block_ids)
            assert len(block_indices) == len(group_sizes)
            self.group_sizes, self.block_indices = group_sizes, block_indices

    @dataclasses.dataclass
    class TransferResult:
        job_id: int
        success: bool
        transfer_size: int | None = None
        transfer_time: float | None = None

    class OffloadingWorker(ABC):
        @abstractmethod
        def submit_store(self, job_id, src_spec, dst_spec) -> bool: ...

        @abstractmethod
        def submit_load(self, job_id, src_spec, dst_spec) -> bool: ...

        @abstractmethod
        def get_finished(self) -> list: ...

        @abstractmethod
        def wait(self, job_ids) -> None: ...

    @dataclasses.dataclass
    class CanonicalKVCacheTensor:
        tensor: object
        page_size_bytes: int

    @dataclasses.dataclass
    class CanonicalKVCacheRef:
        tensor_idx: int
        page_size_bytes: int

    @dataclasses.dataclass
    class CanonicalKVCaches:
        tensors: list
        group_data_refs: list

    for cls in (LoadStoreSpec, BlockIDsLoadStoreSpec, GPULoadStoreSpec, TransferResult, OffloadingWorker,
                CanonicalKVCacheTensor, CanonicalKVCacheRef, CanonicalKVCaches):
        cls.__module__ = base.__name__
        setattr(base, cls.__name__, cls)
    modules = {"vllm.v1.kv_offload.base": base}
    for name in ("vllm", "vllm.v1", "vllm.v1.kv_offload"):
        package = types.ModuleType(name)
        package.__path__ = []
        modules[name] = package
    for name, module in modules.items():
        # a __spec__, so that importlib.util.find_spec("vllm") elsewhere would not raise while they are in place
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=hasattr(module, "__path__"))
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules


@pytest.fixture(scope="module")
def vllm_api():
    """(worker.py, jobs.py, vLLM's base module): vLLM's own where it is installed, else imported over the stubs.
    The stubs sit in sys.modules only while worker.py and jobs.py import; then they and the two modules that
    saw them leave again, so no later test finds a fake vLLM (tests/test_vllm.py looks vLLM up to skip)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        return (importlib.import_module("fastcache.integrations.vllm.worker"),
                importlib.import_module("fastcache.integrations.vllm.jobs"),
                importlib.import_module("vllm.v1.kv_offload.base"))
    stubs = _vllm_stubs()
    ours = ("fastcache.integrations.vllm.worker", "fastcache.integrations.vllm.jobs")
    saved = {name: sys.modules.get(name) for name in (*stubs, *ours)}
    sys.modules.update(stubs)
    try:
        worker = importlib.import_module(ours[0])
        jobs = importlib.import_module(ours[1])
    finally:
        package = sys.modules["fastcache.integrations.vllm"]
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        for name in ours:
            if saved[name] is None and hasattr(package, name.rpartition(".")[2]):
                delattr(package, name.rpartition(".")[2])
    return worker, jobs, stubs["vllm.v1.kv_offload.base"]


# -- vLLM's tensors, specs and jobs -------------------------------------------------------------------
def vllm_kv_caches(base, device: str, seed: int):
    """vLLM's CanonicalKVCaches for one KV cache group over LAYERS FlashAttention layers: each layer's
    int8 (2, NUM_BLOCKS, PAGE) allocation split into K and V (num_blocks leading), random bytes."""
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = [torch.randint(-128, 128, (2, NUM_BLOCKS, PAGE), dtype=torch.int8, device=device, generator=gen)
              for _ in range(LAYERS)]
    tensors = [kv[i] for kv in layers for i in (0, 1)]
    assert all(t.shape == (NUM_BLOCKS, PAGE) and t.stride() == (PAGE, 1) for t in tensors)
    assert tensors[1].data_ptr() == tensors[0].data_ptr() + NUM_BLOCKS * PAGE     # V lies inside the allocation
    tensor_cls = getattr(base, "CanonicalKVCacheTensor", None)
    ref_cls = getattr(base, "CanonicalKVCacheRef", None)
    caches_cls = getattr(base, "CanonicalKVCaches", None)
    if None in (tensor_cls, ref_cls, caches_cls):        # an installed vLLM without them: the worker reads only these
        tensor_cls = ref_cls = caches_cls = types.SimpleNamespace
    canonical = [tensor_cls(tensor=t, page_size_bytes=PAGE) for t in tensors]
    refs = [[ref_cls(tensor_idx=i, page_size_bytes=PAGE) for i in range(len(tensors))]]
    return caches_cls(tensors=canonical, group_data_refs=refs), tensors, gen


def gpu_spec(base, block_ids, first: int = 0):
    """vLLM's GPU side of a job: one KV group whose first GPU block is block `first` of its request."""
    ids = [int(b) for b in block_ids]
    cls = getattr(base, "GPULoadStoreSpec", None)
    if cls is None:
        return types.SimpleNamespace(block_ids=np.array(ids, np.int64), group_sizes=[len(ids)], block_indices=[first])
    return cls(ids, group_sizes=[len(ids)], block_indices=[first])


def rows(tensors, block_ids):
    """A copy of these blocks' rows of every tensor (the bytes a later check compares with)."""
    idx = torch.as_tensor(np.asarray(block_ids, np.int64), device=tensors[0].device)
    return [t.index_select(0, idx) for t in tensors]


def differing(tensors, block_ids, want) -> list[tuple[int, int]]:
    """(tensor, block) pairs whose bytes are not `want`'s: the oracle every check goes through."""
    bad = []
    for k, (got, expected) in enumerate(zip(rows(tensors, block_ids), want)):
        for i in torch.nonzero((got != expected).any(dim=1)).flatten().tolist():
            bad.append((k, int(block_ids[i])))
    return bad


def all_pairs(tensors, block_ids):
    return [(k, int(b)) for k in range(len(tensors)) for b in block_ids]


def fill_random(tensors, block_ids, gen, device):
    """Fresh random bytes in these blocks, written in place (the adopted storage stays the one exported), queued
    on torch's current stream with no host wait, as vLLM's forward writes: a store or load submitted next is
    ordered after them by the worker's fence alone (docs/design.md §10)."""
    idx = torch.as_tensor(np.asarray(block_ids, np.int64), device=tensors[0].device)
    for t in tensors:
        t.index_copy_(0, idx, torch.randint(-128, 128, (len(idx), PAGE), dtype=torch.int8, device=device,
                                            generator=gen))


def cpu_blocks(chunks, n, bpc, first=0):
    """The CPU block holding each of n consecutive blocks of a request from block `first` on, when `chunks`
    are its chunks from the one holding `first` (docs/design.md §10)."""
    logical = np.arange(n) + first % bpc
    return np.asarray(chunks, np.int64)[logical // bpc] * bpc + logical % bpc


class Rig:
    """One vLLM worker rank: vLLM-shaped tensors on `device`, a FastcacheWorker over them, and jobs run
    through the worker's API."""

    def __init__(self, api, device, bpc, seed, store=None):
        self.worker_mod, self.jobs, self.base = api
        self.device, self.bpc, self.store_url = device, bpc, store
        self.kv_caches, self.tensors, self.gen = vllm_kv_caches(self.base, device, seed)
        self.rng = np.random.default_rng(seed)
        self.engine_id = f"gpuworker-{uuid.uuid4().hex[:12]}"
        self.worker = None
        self.job_ids = iter(range(1, 1 << 20))
        self.stamps = iter(range(1000, 1 << 40))

    def start(self):
        options = VllmOptions(cpu_bytes_to_use=NUM_CHUNKS * self.bpc * LAYERS * 2 * PAGE, transfer_timeout=TIMEOUT,
                              store=self.store_url)
        self.worker = self.worker_mod.FastcacheWorker(
            self.kv_caches, engine_id=self.engine_id, rank=0, world_size=1, num_chunks=NUM_CHUNKS,
            blocks_per_chunk=self.bpc, options=options, namespace="test/gpu-vllm-worker")
        return self

    @property
    def backend(self):
        return self.worker.backend

    def leftovers(self) -> list[str]:
        """/dev/shm entries named with this worker's deployment suffix or its link's."""
        marks = [f".{link_suffix(self.engine_id)}."]
        if self.worker is not None:
            marks.append(f".{self.backend.suffix}.")
        return sorted(e for e in os.listdir(SHM_DIR) if any(m in e for m in marks))

    def shutdown(self):
        if self.worker is not None:
            self.worker.shutdown()

    # -- jobs --------------------------------------------------------------------------------------
    def store(self, block_ids, chunks, first=0):
        """Submit a store of a request's blocks (from block `first`) into `chunks`: (job id, its stamps)."""
        job_id, stamps = next(self.job_ids), np.array([next(self.stamps) for _ in chunks], np.uint64)
        hashes = self.hashes(job_id, len(chunks))
        dst = self.jobs.FastcacheStoreSpec(list(chunks), stamps, hashes, 0)
        assert self.worker.submit_store(job_id, gpu_spec(self.base, block_ids, first), dst)
        return job_id, stamps

    def hashes(self, job_id, num_chunks):
        """The L3 names of a store job's blocks, chunk by chunk."""
        return np.arange(num_chunks * self.bpc, dtype=np.uint64) + np.uint64(job_id << 20)

    def load(self, block_ids, chunks, first=0):
        job_id = next(self.job_ids)
        n = len(chunks)
        src = self.jobs.FastcacheLoadSpec(list(chunks), np.zeros(n, bool), np.zeros(n, np.uint64),
                                          np.zeros(n * self.bpc, np.uint64), 0)
        assert self.worker.submit_load(job_id, src, gpu_spec(self.base, block_ids, first))
        return job_id

    def wait(self, job_ids) -> dict:
        """vLLM's fence: wait() for the jobs, then get_finished() hands each one's TransferResult."""
        self.worker.wait(set(job_ids))
        results = {r.job_id: r for r in self.worker.get_finished()}
        assert set(results) == set(job_ids), f"finished {sorted(results)}, waited for {sorted(job_ids)}"
        return results

    def poll(self, job_ids) -> dict:
        """vLLM's step loop: get_finished() until every job reported."""
        results = {}

        def finished():
            results.update({r.job_id: r for r in self.worker.get_finished()})
            return set(job_ids) <= set(results)
        wait_for(finished, TIMEOUT, f"jobs {sorted(job_ids)}")
        assert set(results) == set(job_ids)
        return results

    def check_results(self, results, sizes):
        for job_id, n in sizes.items():
            r = results[job_id]
            assert r.success, f"job {job_id} failed"
            assert r.transfer_size == n * LAYERS * 2 * PAGE, (job_id, r.transfer_size)
        assert self.worker.take_load_errors() == set()

    def tier_image(self, cpu_ids) -> np.ndarray:
        """The CPU tier's bytes of these CPU blocks, [n, every tensor's page side by side]."""
        return self.backend.cpu_tier(0)[np.asarray(cpu_ids, np.int64)].copy()

    def gpu_image(self, block_ids) -> np.ndarray:
        """What CPU blocks holding these GPU blocks must hold: every tensor's row, in the tensors' order."""
        return np.concatenate([r.cpu().numpy().view(np.uint8) for r in rows(self.tensors, block_ids)], axis=1)

    def pick_blocks(self, n, avoid=()):
        free = np.setdiff1d(np.arange(NUM_BLOCKS), np.asarray(list(avoid), np.int64))
        return self.rng.permutation(free)[:n].astype(np.int64)

    def pick_chunks(self, n, avoid=()):
        free = np.setdiff1d(np.arange(NUM_CHUNKS), np.asarray(list(avoid), np.int64))
        return self.rng.permutation(free)[:n].astype(np.int64)


@pytest.fixture
def rig(vllm_api):
    """Rig(device, bpc, seed), started; shut down afterwards whatever happened, leaving nothing in /dev/shm."""
    made = []

    def make(device, bpc, seed=0, store=None):
        rig = Rig(vllm_api, device, bpc, seed, store)
        made.append(rig)
        return rig.start()
    yield make
    try:
        for r in made:
            r.shutdown()
    finally:
        for r in made:
            r.shutdown()                                # a second shutdown is harmless
            assert r.leftovers() == [], f"left in {SHM_DIR} after shutdown: {r.leftovers()}"


def chunks_for(n, bpc):
    return -(-n // bpc)


@pytest.mark.parametrize("bpc", [1, 2], ids=["chunk1", "chunk2"])
@pytest.mark.parametrize("device", DEVICES)
def test_store_then_load_into_other_blocks_bit_for_bit(rig, device, bpc):
    r = rig(device, bpc, seed=17 + bpc)
    assert r.backend.device == ("cuda" if device == "cuda" else "sim")
    assert r.tensors[0].is_cuda == (device == "cuda")
    T = r.tensors
    n = 6                                                   # blocks per request
    first = 1                                               # loads start one block into the request

    # -- round 1: two requests stored by two jobs in flight together --------------------------------
    src_a = r.pick_blocks(n)
    src_b = r.pick_blocks(n, avoid=src_a)
    chunks_a = r.pick_chunks(chunks_for(n, bpc))
    chunks_b = r.pick_chunks(chunks_for(n, bpc), avoid=chunks_a)
    want_a, want_b = rows(T, src_a), rows(T, src_b)
    image_a, image_b = r.gpu_image(src_a), r.gpu_image(src_b)
    assert not np.array_equal(image_a, image_b)
    assert all((w != 0).any() for w in want_a + want_b), "random bytes, never zeros"
    (job_a, stamps_a), (job_b, stamps_b) = r.store(src_a, chunks_a), r.store(src_b, chunks_b)
    r.check_results(r.wait([job_a, job_b]), {job_a: n, job_b: n})

    # the CPU tier holds each block's rows of every tensor, in its chunk's place
    assert np.array_equal(r.tier_image(cpu_blocks(chunks_a, n, bpc)), image_a)
    assert np.array_equal(r.tier_image(cpu_blocks(chunks_b, n, bpc)), image_b)
    # and the scheduler's manager sees each chunk stamped by this rank
    links = ManagerLinks(r.engine_id, 1, wait=5)
    try:
        assert links.stamped(chunks_a, stamps_a).all() and links.stamped(chunks_b, stamps_b).all()
        assert not links.stamped(chunks_a, stamps_a + np.uint64(1)).any()
        spec, namespace = links.geometry()
        assert (spec.num_layers, spec.num_gpu_blocks, spec.head_dim) == (2 * LAYERS, NUM_BLOCKS, PAGE)
        assert spec.num_cpu_blocks == NUM_CHUNKS * bpc and namespace == "test/gpu-vllm-worker"
    finally:
        links.close()

    # -- loads into other blocks, entering A's first chunk part-way ---------------------------------
    dst_a = r.pick_blocks(n - first, avoid=[*src_a, *src_b])
    dst_b = r.pick_blocks(n, avoid=[*src_a, *src_b, *dst_a])
    load_chunks_a = chunks_a[first // bpc:]
    want_dst_a = [w[first:] for w in want_a]
    fill_random(T, dst_a, r.gen, device)                 # poison: the destinations hold other bytes now
    fill_random(T, dst_b, r.gen, device)
    assert differing(T, dst_a, want_dst_a) == all_pairs(T, dst_a), "poisoned blocks must differ everywhere"
    assert differing(T, dst_b, want_b) == all_pairs(T, dst_b)

    # negative controls: B's chunks, or chunks never stored, loaded where A's bytes are expected
    wrong = r.load(dst_a, chunks_b[first // bpc:], first)
    r.check_results(r.wait([wrong]), {wrong: n - first})
    assert differing(T, dst_a, want_dst_a) == all_pairs(T, dst_a), "a load from the wrong chunks went unseen"
    assert differing(T, dst_a, [w[first:] for w in want_b]) == [], "the wrong chunks were not loaded either"
    never = r.pick_chunks(chunks_for(n - first + first % bpc, bpc), avoid=[*chunks_a, *chunks_b])
    tier_never = r.tier_image(cpu_blocks(never, n - first, bpc, first))
    empty = r.load(dst_a, never, first)
    r.check_results(r.wait([empty]), {empty: n - first})
    assert differing(T, dst_a, want_dst_a) == all_pairs(T, dst_a), "a load from unstored chunks went unseen"
    assert np.array_equal(r.gpu_image(dst_a), tier_never), "a load must bring whatever its chunks hold"

    fill_random(T, dst_a, r.gen, device)
    before = [t.clone() for t in T]                      # every block, to find any write outside the loads
    job_la = r.load(dst_a, load_chunks_a, first)
    job_lb = r.load(dst_b, chunks_b)
    r.check_results(r.wait([job_la, job_lb]), {job_la: n - first, job_lb: n})
    assert differing(T, dst_a, want_dst_a) == []
    assert differing(T, dst_b, want_b) == []
    untouched = np.setdiff1d(np.arange(NUM_BLOCKS), np.r_[dst_a, dst_b])
    assert differing(T, untouched, rows(before, untouched)) == [], "a load wrote blocks it does not name"
    assert differing(T, src_a, want_a) == [] and differing(T, src_b, want_b) == []

    # -- round 2: the adopted tensors keep working; stores reuse chunks, results come by polling ---
    src_c = r.pick_blocks(2 * n, avoid=[*dst_a, *dst_b])     # may include round 1's sources
    fill_random(T, src_c, r.gen, device)
    want_c = rows(T, src_c)
    chunks_c = np.r_[chunks_a, r.pick_chunks(chunks_for(2 * n, bpc) - len(chunks_a), avoid=[*chunks_a, *chunks_b])]
    job_c, stamps_c = r.store(src_c, chunks_c)
    r.check_results(r.poll([job_c]), {job_c: 2 * n})
    assert np.array_equal(r.tier_image(cpu_blocks(chunks_c, 2 * n, bpc)), r.gpu_image(src_c))
    dst_c = r.pick_blocks(2 * n, avoid=src_c)
    fill_random(T, dst_c, r.gen, device)
    assert differing(T, dst_c, want_c) == all_pairs(T, dst_c)
    before = [t.clone() for t in T]
    job_lc = r.load(dst_c, chunks_c)
    r.check_results(r.poll([job_lc]), {job_lc: 2 * n})
    assert differing(T, dst_c, want_c) == []
    untouched = np.setdiff1d(np.arange(NUM_BLOCKS), dst_c)
    assert differing(T, untouched, rows(before, untouched)) == []
    # B's chunks were not reused: they still load B's bytes
    job_lb2 = r.load(dst_b, chunks_b)
    r.check_results(r.wait([job_lb2]), {job_lb2: n})
    assert differing(T, dst_b, want_b) == []

    r.shutdown()
    assert r.leftovers() == []


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_fetches_from_the_store_only_the_chunks_marked_for_fetch(rig, device, tmp_path):
    """A load of a chunk the CPU tier holds and one only the store holds: the store's objects land in the
    second chunk alone, and the first keeps its bytes; both reach the GPU blocks bit for bit."""
    bpc = 2
    r = rig(device, bpc, seed=31, store=f"file://{tmp_path}/l3")
    T = r.tensors
    n = 2 * bpc                                             # two chunks per request
    src_a = r.pick_blocks(n)
    src_b = r.pick_blocks(n, avoid=src_a)
    chunks_a = r.pick_chunks(2)
    chunks_b = r.pick_chunks(2, avoid=chunks_a)
    want_a, want_b = rows(T, src_a), rows(T, src_b)
    held_a = r.gpu_image(src_a[:bpc])
    (job_a, _), (job_b, _) = r.store(src_a, chunks_a), r.store(src_b, chunks_b)
    r.check_results(r.wait([job_a, job_b]), {job_a: n, job_b: n})
    hashes_b = r.hashes(job_b, 2)
    namespace = r.jobs.rank_namespace("test/gpu-vllm-worker", 0, 0, 1)
    wait_for(lambda: r.worker.get_finished() == [] and r.backend.store_contains(namespace, hashes_b).all(),
             TIMEOUT, "B's write-through puts")
    # B's second chunk is reused meanwhile (other bytes there now): only the store still holds its bytes
    gone = cpu_blocks(chunks_b[1:], bpc, bpc)
    r.backend.cpu_tier(0)[gone] = r.rng.integers(0, 256, r.backend.cpu_tier(0)[gone].shape, dtype=np.uint8)

    dst = r.pick_blocks(n, avoid=[*src_a, *src_b])
    want = [torch.cat([wa[:bpc], wb[bpc:]]) for wa, wb in zip(want_a, want_b)]
    fill_random(T, dst, r.gen, device)
    assert differing(T, dst, want) == all_pairs(T, dst), "poisoned blocks must differ everywhere"
    job = next(r.job_ids)
    src = r.jobs.FastcacheLoadSpec([int(chunks_a[0]), int(chunks_b[1])], np.array([False, True]),
                                   np.zeros(2, np.uint64), hashes_b[bpc:], 0)
    assert r.worker.submit_load(job, src, gpu_spec(r.base, dst))
    r.check_results(r.wait([job]), {job: n})
    assert differing(T, dst, want) == []
    assert np.array_equal(r.tier_image(cpu_blocks(chunks_a[:1], bpc, bpc)), held_a), "a held chunk was fetched over"


SLEEP_CYCLES = 4_000_000_000        # torch.cuda._sleep: about two seconds of a GPU's clock, far longer than the
#                                     host takes to submit a job and the transfer manager to copy its blocks


@pytest.mark.gpu
@pytest.mark.skipif(not TORCH_CUDA, reason="needs a usable CUDA GPU and torch with CUDA")
@pytest.mark.parametrize("fenced", [True, False], ids=["fence", "no_fence"])
def test_a_store_and_a_load_submitted_behind_late_writes_wait_for_them(rig, monkeypatch, fenced):
    """vLLM under async scheduling: the forward that writes a store's blocks, or the zeroing of a load's
    destination blocks, may still be queued on the current stream when the job is submitted. Here the stream
    sleeps, then fills the blocks with fresh random bytes; the store is submitted at once, with no host wait,
    and must copy the fresh bytes. Then the stream sleeps again and poisons other blocks; a load of the store's
    chunks into them, submitted at once, must land after the poison: every byte compared. With the transfer
    manager's wait on the fence removed (FASTCACHE_TEST_NO_FENCE=1) the store copies the stale bytes and the
    poison overwrites the load: asserted, so the test shows it can fail."""
    if not fenced:
        monkeypatch.setenv("FASTCACHE_TEST_NO_FENCE", "1")     # before the transfer manager is spawned
    r = rig("cuda", 1, seed=29)
    T = r.tensors
    n = 8
    src = r.pick_blocks(n)
    dst = r.pick_blocks(n, avoid=src)
    chunks = r.pick_chunks(n)
    stale = r.gpu_image(src)                    # (a host copy: everything queued so far has run)

    torch.cuda._sleep(SLEEP_CYCLES)
    fill_random(T, src, r.gen, "cuda")          # queued behind the sleep
    job, _ = r.store(src, chunks)               # at once
    r.check_results(r.wait([job]), {job: n})
    stored = r.tier_image(cpu_blocks(chunks, n, 1))
    fresh = r.gpu_image(src)                    # waits for the fill
    assert not np.array_equal(fresh, stale), "the fill must change the blocks"
    if fenced:
        assert np.array_equal(stored, fresh), "the store copied blocks the stream had not written yet"
    else:
        assert not np.array_equal(stored, fresh), "without the fence's wait the store must copy stale bytes"
        assert np.array_equal(stored, stale)

    torch.cuda._sleep(SLEEP_CYCLES)
    fill_random(T, dst, r.gen, "cuda")          # the poison (vLLM: the zeroing of newly allocated blocks)
    load = r.load(dst, chunks)                  # at once
    r.check_results(r.wait([load]), {load: n})
    landed = r.gpu_image(dst)                   # waits for the poison
    if fenced:
        assert np.array_equal(landed, stored), "the poison queued before the load overwrote it"
    else:
        assert not np.array_equal(landed, stored), "without the fence's wait the poison must overwrite the load"
    r.shutdown()
    assert r.leftovers() == []


@pytest.mark.skipif(torch is None, reason="needs torch (the CPU build will do)")
def test_each_job_takes_its_fence_on_the_current_stream_at_submit(vllm_api, monkeypatch):
    """The worker's wiring, without a GPU: on cuda a store passes a fence taken on torch's current stream at
    submit; a load takes its fence at submit too, before an L3 fetch, and its swap-in after the fetch carries
    that fence (taking none later, when the stream has moved on); on the CPU build no fence is taken."""
    worker_mod, jobs, base = vllm_api
    calls = []

    class Handle:
        error = None

        def done(self):
            return True

    def call(name):
        def record(*args, **kwargs):
            calls.append((name, kwargs.get("fence")))
            return Handle()
        return record
    fences = iter(range(100, 200))
    backend = types.SimpleNamespace(swap_out=call("swap_out"), swap_in=call("swap_in"),
                                    store_to_cpu=call("store_to_cpu"), spec=types.SimpleNamespace(num_cpu_blocks=8,
                                    task_bytes=lambda gpu: 1))
    cache_worker = types.SimpleNamespace(fence=lambda stream: calls.append(("fence", stream)) or next(fences))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream{device}")
    for device in ("cuda", "sim"):
        calls.clear()
        w = object.__new__(worker_mod.FastcacheWorker)
        w.device, w.device_id, w.bpc, w.rank, w.world_size = device, 3, 2, 0, 1
        w.backend, w.cache_worker, w._wrong_chunk = backend, cache_worker, False
        w._jobs, w._done, w._puts, w._load_errors = {}, [], [], set()
        w.options = types.SimpleNamespace(transfer_timeout=TIMEOUT, store=None)
        w.link = types.SimpleNamespace(stamp=lambda *a: None)
        w.namespace, w.reset_scope = "ns", None
        assert w.submit_store(1, gpu_spec(base, [4, 5]), jobs.FastcacheStoreSpec([1], np.ones(1, np.uint64),
                                                                                 np.zeros(2, np.uint64), 0))
        fetch = jobs.FastcacheLoadSpec([2], np.ones(1, bool), np.ones(1, np.uint64), np.arange(2, dtype=np.uint64), 0)
        assert w.submit_load(2, fetch, gpu_spec(base, [6, 7]))
        taken = len(calls)
        w.get_finished()
        w.get_finished()
        if device == "cuda":
            assert calls[:taken] == [("fence", "stream3"), ("swap_out", 100), ("fence", "stream3"),
                                     ("store_to_cpu", None)]
            assert calls[taken:] == [("swap_in", 101)], "the swap-in after the fetch carries the load's fence"
        else:
            assert calls == [("swap_out", None), ("store_to_cpu", None), ("swap_in", None)]


class PendingHandle:
    """A task handle that finishes when the test says so (result() past its timeout raises TimeoutError, as
    TransferHandle's does); `finish_on_result` finishes it at that many result() calls."""
    error = None

    def __init__(self, finish_on_result: int = 0):
        self.finished, self.calls, self.finish_on_result = False, 0, finish_on_result

    def done(self):
        return self.finished

    def result(self, timeout=None):
        self.calls += 1
        if self.calls == self.finish_on_result:
            self.finished = True
        if not self.finished:
            raise TimeoutError(f"task not done within {timeout} s")
        return self


def fake_worker(worker_mod, backend, stamps):
    """A FastcacheWorker over a fake backend (sim device, one rank, two blocks per chunk) whose link records
    the stamps written."""
    w = object.__new__(worker_mod.FastcacheWorker)
    w.device, w.device_id, w.bpc, w.rank, w.world_size = "sim", 0, 2, 0, 1
    w.backend, w.cache_worker, w._wrong_chunk = backend, None, False
    w._jobs, w._done, w._puts, w._load_errors = {}, [], [], set()
    w.options = types.SimpleNamespace(transfer_timeout=TIMEOUT, store=None)
    w.link = types.SimpleNamespace(stamp=lambda chunks, values: stamps.append((list(chunks), list(values))))
    w.namespace, w.reset_scope, w._restarting = "ns", None, None
    return w


def test_a_load_past_its_timeout_is_reported_only_once_its_swap_in_ended(vllm_api):
    """A swap-in writes vLLM's GPU blocks. Reporting its load (failed: vLLM recomputes, and frees the blocks if
    the request goes) while the copy may still land would let that copy write over KV vLLM computed there
    since, another request's included. So a load past the transfer timeout is reported, by get_finished or
    wait, only once its swap-in ended; a store past it is reported failed at once (its copy only writes its
    own chunk, which the manager drops unstamped and whose next task the transfer manager runs after it)."""
    worker_mod, jobs, base = vllm_api
    handles, stamps = [], []

    def submit(*args, **kwargs):
        handles.append(PendingHandle(finish_on_result=2 if len(handles) == 1 else 0))
        return handles[-1]
    backend = types.SimpleNamespace(swap_in=submit, swap_out=submit, failed_ranks={},
                                    spec=types.SimpleNamespace(num_cpu_blocks=16, task_bytes=lambda gpu: 1))
    w = fake_worker(worker_mod, backend, stamps)
    load = jobs.FastcacheLoadSpec([1], np.zeros(1, bool), np.ones(1, np.uint64), np.zeros(0, np.uint64), 0)
    assert w.submit_load(1, load, gpu_spec(base, [4, 5]))
    assert w.submit_load(2, load, gpu_spec(base, [6, 7]))
    assert w.submit_store(3, gpu_spec(base, [8, 9]), jobs.FastcacheStoreSpec([2], np.full(1, 7, np.uint64),
                                                                             np.zeros(0, np.uint64), 0))
    for job in w._jobs.values():
        job.started -= 2 * TIMEOUT                           # every job is past its timeout
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(3, False)]
    assert w.take_load_errors() == set(), "a load was reported while its swap-in could still write its blocks"
    w.wait({2})                                              # its swap-in ends during the wait
    assert handles[1].done()
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, True)]
    assert w.get_finished() == [] and not handles[0].done()
    handles[0].finished = handles[2].finished = True         # the first load's copy and the store's land
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    assert w.take_load_errors() == set() and stamps == [], "a store reported failed must never be stamped"


def test_the_blocks_of_keys_the_manager_found_no_chunk_for_fail_and_the_rest_load(vllm_api):
    """The manager's NO_CHUNK (-1; manager.py): L3 hits no CPU chunk could take. The worker fetches and loads
    the other chunks, stamps only the fetched ones, and reports the NO_CHUNK keys' GPU blocks as load errors
    (vLLM recomputes from the first of them on); a load of NO_CHUNK keys alone submits nothing."""
    worker_mod, jobs, base = vllm_api
    calls, stamps = [], []
    done = PendingHandle()
    done.finished = True

    def record(name):
        return lambda *args, **kwargs: calls.append((name, *[np.asarray(a).tolist() for a in args])) or done
    backend = types.SimpleNamespace(swap_in=record("swap_in"), store_to_cpu=record("store_to_cpu"),
                                    failed_ranks={},
                                    spec=types.SimpleNamespace(num_cpu_blocks=16, task_bytes=lambda gpu: 1))
    w = fake_worker(worker_mod, backend, stamps)
    load = jobs.FastcacheLoadSpec([5, 3, -1], np.array([False, True, True]), np.arange(1, 4, dtype=np.uint64),
                                  np.arange(10, 14, dtype=np.uint64), 0)
    assert w.submit_load(1, load, gpu_spec(base, [4, 5, 6, 7, 8, 9]))
    assert w.get_finished() == [] and w.take_load_errors() == set()     # the fetch landed: now the swap-in
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, False)]
    assert calls == [("store_to_cpu", "ns/gen0/tp1r0", [10, 11], [6, 7]),
                     ("swap_in", [4, 5, 6, 7], [10, 11, 6, 7])]
    assert stamps == [([3], [2])]                            # the fetched chunk's stamp, nothing for NO_CHUNK
    assert w.take_load_errors() == {8, 9}
    calls.clear()
    alone = jobs.FastcacheLoadSpec([-1, -1], np.ones(2, bool), np.arange(1, 3, dtype=np.uint64),
                                   np.arange(4, dtype=np.uint64), 0)
    assert w.submit_load(2, alone, gpu_spec(base, [4, 5, 6, 7]))
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, False)]
    assert w.take_load_errors() == {4, 5, 6, 7}
    assert calls == [] and stamps == [([3], [2])]
