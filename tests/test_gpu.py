"""The cuda device on a real GPU: bitwise round trips for every copy method and cache layout, tensors that
do not start at their allocation's base, and attaching from other processes through CUDA IPC.

Every check compares against the source bytes (random, never zero), so a wrong copy fails. Marked `gpu`;
skipped where no GPU is usable or neither torch nor CuPy is installed to allocate the cache.
"""
from __future__ import annotations

import json
import multiprocessing
import threading
import time

import numpy as np
import pytest

from fastcache.config import CacheSpec
from fastcache.errors import TransferError
from fastcache.ipc.naming import new_suffix, swap_space_name
from fastcache.ipc.shm import SharedSegment
from fastcache.ops import cuda_usable
from fastcache.tools.bench import pick_framework

METHODS = ("staged", "kernel", "batch", "memcpy")


GPU = cuda_usable()
FRAMEWORK = pick_framework(None) if GPU else None
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU, reason="no usable CUDA GPU"),
              pytest.mark.skipif(GPU and FRAMEWORK is None, reason="needs torch or cupy to allocate the cache")]

BASE = dict(num_gpu_blocks=64, num_cpu_blocks=48, block_size=16, num_kv_heads=2, head_dim=64)
LAYOUTS = {
    "kv_bf16": dict(BASE, num_layers=3),
    "k_only_fp16": dict(BASE, num_layers=2, cache_dtype="float16", has_value=False),
    "fp8_scales": dict(BASE, num_layers=2, cache_dtype="block_wise_fp8"),
    "draft_layers": dict(BASE, num_layers=2, num_extra_layers=2, num_extra_gpu_blocks=20),
    # 15-byte rows: no tensor row and no CPU row is a multiple of 16 (or 4) bytes
    "odd_rows": dict(BASE, num_layers=2, block_size=5, num_kv_heads=1, head_dim=3, cache_dtype="uint8"),
}


def random_bytes(rng, shape):
    return rng.integers(1, 256, shape, dtype=np.uint8)


def task_ids(rng, spec, n, avoid_gpu=(), avoid_cpu=()):
    """n distinct ids per side: a run of 4 consecutive ids on both sides (merged copies), the rest random."""
    def pick(limit, avoid):
        free = np.setdiff1d(np.arange(limit), np.asarray(avoid, np.int64))
        starts = free[:-3][free[3:] - free[:-3] == 3]          # free ids followed by 3 more free ones
        assert len(starts), "test ids need a free run of 4"
        run = np.arange(starts[len(starts) // 2], starts[len(starts) // 2] + 4)
        rest = rng.permutation(np.setdiff1d(free, run))[:n - 4]
        assert len(rest) == n - 4, "not enough free ids"
        return np.r_[run, rest].astype(np.int64)
    return pick(spec.num_gpu_blocks, avoid_gpu), pick(spec.num_cpu_blocks, avoid_cpu)


def expected_tier(rows, tier, infos, gpu_ids, cpu_ids):
    """The CPU tier after swapping gpu_ids out to cpu_ids (draft layers lacking a block keep the old bytes)."""
    tier = tier.copy()
    for tensor, info in zip(rows, infos):
        keep = gpu_ids < info.num_blocks
        tier[cpu_ids[keep], info.cpu_offset:info.cpu_offset + info.block_bytes] = tensor[gpu_ids[keep]]
    return tier


def expected_rows(rows, tier, infos, gpu_ids, cpu_ids):
    """Every tensor's rows after swapping cpu_ids in to gpu_ids."""
    out = [tensor.copy() for tensor in rows]
    for tensor, info in zip(out, infos):
        keep = gpu_ids < info.num_blocks
        tensor[gpu_ids[keep]] = tier[cpu_ids[keep], info.cpu_offset:info.cpu_offset + info.block_bytes]
    return out


class Rig:
    """A cache allocated in this process, its pointer view, and a pinned CPU tier, all filled at random."""

    def __init__(self, spec, seed=0, pin_chunk_bytes=None):
        from fastcache.ops.cuda import CudaOps
        from fastcache.ops.cuda_swap_space import CudaSwapSpace

        self.spec, self.rng = spec, np.random.default_rng(seed)
        self.ops = CudaOps()
        self.suffix = new_suffix()
        self.local = self.ops.allocate(spec, 0, 0, FRAMEWORK, self.suffix, 0)
        self.view = self.local.view()
        self.segment = SharedSegment.create(swap_space_name(self.suffix, 0), spec.cpu_cache_bytes, self.suffix)
        try:
            if pin_chunk_bytes is None:
                self.swap = self.ops.attach_swap_space(self.segment, spec, device_id=0)
            else:
                self.swap = CudaSwapSpace(self.segment, spec, 0, chunk_bytes=pin_chunk_bytes)
        except BaseException:
            self.segment.close()    # unlinks it: no test leaves a segment behind
            raise
        self.swap.rows[...] = random_bytes(self.rng, self.swap.rows.shape)
        self.refill()

    def refill(self):
        for i, info in enumerate(self.view.infos):
            self.view.write(i, random_bytes(self.rng, (info.num_blocks, info.block_bytes)))

    def rows(self):
        return [self.view.read(i) for i in range(len(self.view.infos))]

    def close(self):
        self.swap.close()           # closes (and, as its creator, unlinks) the segment
        self.view.close()
        self.local.release()


@pytest.fixture
def rigs():
    made = []

    def make(spec, **kwargs):
        made.append(Rig(spec, **kwargs))
        return made[-1]
    yield make
    for rig in made:
        rig.close()


def check_round_trip(rig, copier, n):
    """swap_out n blocks, then swap_in n other GPU blocks from partly the same CPU blocks; compare bytes."""
    spec, infos = rig.spec, rig.view.infos
    gpu_ids, cpu_ids = task_ids(rig.rng, spec, n)
    rows, tier = rig.rows(), rig.swap.rows.copy()
    copier.swap_out(gpu_ids, cpu_ids)
    assert np.array_equal(rig.swap.rows, expected_tier(rows, tier, infos, gpu_ids, cpu_ids))
    assert all(np.array_equal(a, b) for a, b in zip(rig.rows(), rows)), "swap_out changed the GPU"

    rig.refill()
    rows, tier = rig.rows(), rig.swap.rows.copy()
    gpu_in, _ = task_ids(rig.rng, spec, n, avoid_gpu=gpu_ids)
    cpu_in = np.r_[cpu_ids[: n // 2], task_ids(rig.rng, spec, n - n // 2, avoid_cpu=cpu_ids[: n // 2])[1]]
    copier.swap_in(gpu_in, cpu_in)
    for got, want in zip(rig.rows(), expected_rows(rows, tier, infos, gpu_in, cpu_in)):
        assert np.array_equal(got, want)
    assert np.array_equal(rig.swap.rows, tier), "swap_in changed the CPU tier"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHODS)
def test_round_trip(method, layout, rigs, monkeypatch):
    monkeypatch.setenv("FASTCACHE_COPY_METHOD", method)
    monkeypatch.setenv("FASTCACHE_STAGING_MB", "0.05")     # a couple of blocks per chunk: the ring wraps
    spec = CacheSpec(**LAYOUTS[layout])
    rig = rigs(spec)
    copier = rig.ops.copier(rig.view, rig.swap, spec)
    try:
        check_round_trip(rig, copier, n=24)
    finally:
        copier.close()


@pytest.mark.parametrize("method", METHODS)
def test_large_task_chunked_pinning(method, rigs, monkeypatch):
    """Real sizes: 32 KiB rows, 75 MiB per swap (three 32 MiB staging chunks), the tier pinned in 4 MiB
    chunks in the background while the first swap waits for the chunks it touches."""
    monkeypatch.setenv("FASTCACHE_COPY_METHOD", method)
    spec = CacheSpec(num_layers=4, num_gpu_blocks=640, num_cpu_blocks=400, block_size=16, num_kv_heads=8,
                     head_dim=128)
    rig = rigs(spec, pin_chunk_bytes=4 << 20)
    copier = rig.ops.copier(rig.view, rig.swap, spec)
    try:
        check_round_trip(rig, copier, n=300)
        rig.swap.wait_pinned()
        assert rig.swap.pin_seconds is not None and rig.swap.pin_seconds > 0
    finally:
        copier.close()


@pytest.mark.parametrize("method", METHODS)
def test_swap_out_and_in_at_once(method, rigs, monkeypatch):
    """The two directions on two threads, on disjoint blocks, each with its own streams and buffers."""
    monkeypatch.setenv("FASTCACHE_COPY_METHOD", method)
    monkeypatch.setenv("FASTCACHE_STAGING_MB", "0.05")
    spec = CacheSpec(**LAYOUTS["kv_bf16"])
    rig = rigs(spec)
    copier = rig.ops.copier(rig.view, rig.swap, spec)
    try:
        out_gpu, out_cpu = task_ids(rig.rng, spec, 20)
        in_gpu, in_cpu = task_ids(rig.rng, spec, 20, avoid_gpu=out_gpu, avoid_cpu=out_cpu)
        rows, tier = rig.rows(), rig.swap.rows.copy()
        for _ in range(5):
            worker = threading.Thread(target=copier.swap_in, args=(in_gpu, in_cpu))
            worker.start()
            copier.swap_out(out_gpu, out_cpu)
            worker.join()
        assert np.array_equal(rig.swap.rows, expected_tier(rows, tier, spec.tensors(), out_gpu, out_cpu))
        for got, want in zip(rig.rows(), expected_rows(rows, tier, spec.tensors(), in_gpu, in_cpu)):
            assert np.array_equal(got, want)
    finally:
        copier.close()


# -- other processes -------------------------------------------------------------------------------
def _attached_swap(request_json: str):
    """Child process: attach the parent's cache by its manifest, swap out, and swap in if asked.
    Exits non-zero (an exception, or 3) if what it reads through its own mapping disagrees."""
    from fastcache.ops.cuda import CudaOps

    req = json.loads(request_json)
    spec = CacheSpec.from_json(req["spec"])
    ops = CudaOps()
    cache = ops.attach(req["manifest"], spec.tensors(0, 0), req["suffix"])
    swap = ops.attach_swap_space(SharedSegment.attach(req["segment"], req["suffix"]), spec, device_id=0)
    copier = ops.copier(cache, swap, spec)
    try:
        gpu_ids, cpu_ids = np.array(req["gpu_out"]), np.array(req["cpu_out"])
        copier.swap_out(gpu_ids, cpu_ids)
        for i, info in enumerate(cache.infos):
            keep = gpu_ids < info.num_blocks
            cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
            if not np.array_equal(cache.read(i, gpu_ids[keep]), swap.rows[cpu_ids[keep], cols]):
                raise SystemExit(3)
        if req.get("gpu_in"):
            copier.swap_in(np.array(req["gpu_in"]), np.array(req["cpu_in"]))
    finally:
        copier.close()
        swap.close()
        cache.close()


def run_children(requests, timeout=100):
    ctx = multiprocessing.get_context("spawn")     # CUDA IPC handles open only in another process
    procs = [ctx.Process(target=_attached_swap, args=(json.dumps(req),)) for req in requests]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def child_request(rig, gpu_out, cpu_out, gpu_in=(), cpu_in=()):
    return {"spec": rig.spec.to_json(), "manifest": rig.local.manifest, "suffix": rig.suffix,
            "segment": rig.segment.name, "gpu_out": [int(i) for i in gpu_out], "cpu_out": [int(i) for i in cpu_out],
            "gpu_in": [int(i) for i in gpu_in], "cpu_in": [int(i) for i in cpu_in]}


@pytest.mark.parametrize("method", ["staged", "kernel"])
def test_attach_in_another_process(method, rigs, monkeypatch):
    monkeypatch.setenv("FASTCACHE_COPY_METHOD", method)         # inherited by the spawned child
    spec = CacheSpec(**LAYOUTS["draft_layers"])
    rig = rigs(spec)
    json.dumps(rig.local.manifest)                               # the manifest travels as JSON
    gpu_out, cpu_out = task_ids(rig.rng, spec, 16)
    gpu_in, cpu_in = task_ids(rig.rng, spec, 16, avoid_gpu=gpu_out, avoid_cpu=cpu_out)
    rows, tier = rig.rows(), rig.swap.rows.copy()
    assert run_children([child_request(rig, gpu_out, cpu_out, gpu_in, cpu_in)]) == [0]
    assert np.array_equal(rig.swap.rows, expected_tier(rows, tier, spec.tensors(), gpu_out, cpu_out))
    for got, want in zip(rig.rows(), expected_rows(rows, tier, spec.tensors(), gpu_in, cpu_in)):
        assert np.array_equal(got, want)


def test_two_processes_attach_one_cache(rigs):
    spec = CacheSpec(**LAYOUTS["kv_bf16"])
    rig = rigs(spec)
    gpu_a, cpu_a = task_ids(rig.rng, spec, 12)
    gpu_b, cpu_b = task_ids(rig.rng, spec, 12, avoid_gpu=gpu_a, avoid_cpu=cpu_a)
    rows, tier = rig.rows(), rig.swap.rows.copy()
    assert run_children([child_request(rig, gpu_a, cpu_a), child_request(rig, gpu_b, cpu_b)]) == [0, 0]
    want = expected_tier(rows, expected_tier(rows, tier, spec.tensors(), gpu_a, cpu_a), spec.tensors(), gpu_b, cpu_b)
    assert np.array_equal(rig.swap.rows, want)


def test_tensor_inside_its_allocation(rigs):
    """Caching allocators sub-allocate: the export names the allocation's base plus an offset, and a
    process that attaches it must land on the tensor, not on the allocation's first byte."""
    if FRAMEWORK != "torch":
        pytest.skip("sub-allocation is arranged through torch's small-block pool")
    import torch

    torch.cuda.empty_cache()                                          # no cached segment to land in
    pad = torch.empty(1000, dtype=torch.uint8, device="cuda:0")      # takes the start of a 2 MiB segment
    spec = CacheSpec(num_layers=1, num_gpu_blocks=16, num_cpu_blocks=16, block_size=4, num_kv_heads=1, head_dim=32)
    rig = rigs(spec)        # K and V, 4 KiB each: sub-allocated behind pad in the same segment
    assert any(entry["offset"] != 0 for entry in rig.local.manifest), rig.local.manifest
    gpu_out, cpu_out = task_ids(rig.rng, spec, 8)
    rows, tier = rig.rows(), rig.swap.rows.copy()
    assert run_children([child_request(rig, gpu_out, cpu_out)]) == [0]
    assert np.array_equal(rig.swap.rows, expected_tier(rows, tier, spec.tensors(), gpu_out, cpu_out))
    del pad


# -- memory and errors -----------------------------------------------------------------------------
def test_release_returns_memory():
    from cuda.bindings import runtime

    from fastcache.ops.cuda import CudaOps

    def free_bytes():
        err, free, _total = runtime.cudaMemGetInfo()
        assert int(err) == 0
        return free

    spec = CacheSpec(num_layers=8, num_gpu_blocks=512, num_cpu_blocks=1, block_size=16, num_kv_heads=8,
                     head_dim=128)          # 512 MiB
    before = free_bytes()
    local = CudaOps().allocate(spec, 0, 0, FRAMEWORK, new_suffix(), 0)
    assert before - free_bytes() >= 0.9 * spec.gpu_cache_bytes
    local.release()
    assert free_bytes() >= before - (64 << 20)


def test_numpy_needs_sim():
    from fastcache.ops.cuda import CudaOps

    with pytest.raises(ValueError, match="sim"):
        CudaOps().allocate(CacheSpec(**LAYOUTS["kv_bf16"]), 0, 0, "numpy", new_suffix(), 0)


def test_bad_handle_is_a_transfer_error(rigs):
    spec = CacheSpec(**LAYOUTS["kv_bf16"])
    rig = rigs(spec)
    manifest = [dict(entry, handle="ab" * 64) for entry in rig.local.manifest]
    with pytest.raises(TransferError, match="cudaIpcOpenMemHandle"):
        rig.ops.attach(manifest, spec.tensors(), rig.suffix)


def test_unknown_method_and_stray_ids(rigs, monkeypatch):
    spec = CacheSpec(**LAYOUTS["kv_bf16"])
    rig = rigs(spec)
    monkeypatch.setenv("FASTCACHE_COPY_METHOD", "teleport")
    with pytest.raises(ValueError, match="teleport"):
        rig.ops.copier(rig.view, rig.swap, spec)
    monkeypatch.setenv("FASTCACHE_COPY_METHOD", "staged")
    copier = rig.ops.copier(rig.view, rig.swap, spec)
    try:
        with pytest.raises(ValueError, match="gpu block ids"):
            copier.swap_out(np.array([spec.num_gpu_blocks]), np.array([0]))
    finally:
        copier.close()


@pytest.mark.parametrize("method", METHODS)
def test_layer_by_layer_swap_in_through_a_deployment(method, monkeypatch):
    """A SwapBackend on the GPU (worker here, transfer manager in its own process): swap_in(layerwise=True),
    every layer's bytes checked as soon as its wait returns; prints when layer 0 and the whole task landed."""
    import torch

    from fastcache import SwapBackend
    from fastcache.worker import CacheWorker
    monkeypatch.setenv("FASTCACHE_COPY_METHOD", method)
    spec = CacheSpec(num_layers=16, num_gpu_blocks=512, num_cpu_blocks=256, block_size=16, num_kv_heads=8,
                     head_dim=128, cache_dtype="bfloat16")
    rng = np.random.default_rng(60)
    with SwapBackend(spec, tp_size=1, device="cuda") as backend:
        worker = CacheWorker(spec, rank=0, tp_size=1, device="cuda", suffix=backend.suffix, framework="torch").start()
        try:
            backend.wait_ready(timeout=120)
            tier = backend.cpu_tier(0)
            tier[...] = rng.integers(1, 256, tier.shape, dtype=np.uint8)
            gpu, cpu = rng.permutation(512)[:256], np.arange(256)
            tensors = [t for pair in zip(worker.key_caches, worker.value_caches) for t in pair]
            infos = spec.tensors()
            for t in tensors:
                t.view(torch.uint8).fill_(0xA5)
            torch.cuda.synchronize()
            began = time.perf_counter()
            handle = backend.swap_in(gpu, cpu, layerwise=True)
            handle.wait_layer(0, timeout=60)
            first = time.perf_counter() - began
            for layer in range(spec.num_layers):
                handle.wait_layer(layer, timeout=60)
                for info, t in zip(infos, tensors):
                    if info.layer == layer:
                        rows = t.view(torch.uint8).reshape(info.num_blocks, info.block_bytes)[torch.as_tensor(gpu)]
                        want = tier[cpu, info.cpu_offset:info.cpu_offset + info.block_bytes]
                        assert np.array_equal(rows.cpu().numpy(), want), f"{info.name} wrong after its wait"
            handle.result(timeout=60)
            whole = time.perf_counter() - began
            print(f"\n{method}: layer 0 after {first * 1e3:.2f} ms, the whole task after {whole * 1e3:.2f} ms")
        finally:
            worker.close()


def test_offloaded_forward_on_the_gpu_is_bit_identical_to_resident_and_to_this_process():
    """The small model (fastcache/launch/model.py) in worker processes computing on the GPU with torch: all
    resident, and with half its layers streamed through the ring while it computes. Both outputs are bit for
    bit the same forward computed here on the GPU, and close to the NumPy forward (the right weights, not
    merely the same wrong ones); prints the times."""
    pytest.importorskip("torch")
    from fastcache.launch.model import arrays, model_input, reference
    from fastcache.launch.offload import timed_run
    layers, hidden, batch = 8, 1024, 512
    resident = timed_run(0.0, layers, hidden, batch, repeats=2, device="cuda", framework="torch")
    streamed = timed_run(0.5, layers, hidden, batch, repeats=3, device="cuda", framework="torch", measure_copy=True)
    assert len(streamed.layout.streamed_layers) == 4 and streamed.copy_seconds > 0
    x = model_input(8, batch, hidden)           # timed_run's input (seed 8) and weights (seed 7)
    want = reference(7, 0, x, layers, hidden, arrays("torch", "cuda", 0))
    assert streamed.outputs[0].tobytes() == resident.outputs[0].tobytes(), "streamed differs from resident"
    assert resident.outputs[0].tobytes() == want.tobytes(), "the workers' forward differs from this process's"
    np.testing.assert_allclose(want, reference(7, 0, x, layers, hidden), rtol=1e-3, atol=1e-4)
    assert np.isfinite(want).all() and np.abs(want).max() > 0.1
    print(f"\nresident {resident.seconds * 1e3:.2f} ms, 50% streamed {streamed.seconds * 1e3:.2f} ms per forward; "
          f"one layer's copy {streamed.copy_seconds * 1e3:.3f} ms")


def test_layer_waits_on_a_torch_stream_order_the_reads_after_each_layers_copy():
    """Per-layer readiness through CUDA IPC events (docs/design.md §11): the worker's host waits only until a
    layer's event is recorded and makes torch's current stream wait on it. A read of the layer's rows queued
    on that stream right after each wait must hold the random bytes swapped out (1..255), never the zeros the
    destination blocks held before the swap-in."""
    import torch

    from fastcache import SwapBackend
    from fastcache.ipc.signal import EVENTS_LAYERS
    from fastcache.worker import CacheWorker
    spec = CacheSpec(num_layers=16, num_gpu_blocks=512, num_cpu_blocks=256, block_size=16, num_kv_heads=8,
                     head_dim=128, cache_dtype="bfloat16")
    with SwapBackend(spec, tp_size=1, device="cuda") as backend:
        worker = CacheWorker(spec, rank=0, tp_size=1, device="cuda", suffix=backend.suffix, framework="torch").start()
        try:
            backend.wait_ready(timeout=120)
            infos = spec.tensors()
            tensors = [t.view(torch.uint8) for pair in zip(worker.key_caches, worker.value_caches) for t in pair]
            order = torch.randperm(512, generator=torch.Generator().manual_seed(61))
            src, dst = order[:256].cuda(), order[256:].cuda()
            for t in tensors:
                t[src] = torch.randint(1, 256, t[src].shape, dtype=torch.uint8, device="cuda")
            want = [t[src].clone() for t in tensors]
            torch.cuda.synchronize()
            cpu = backend.allocate_cpu_blocks(256)
            backend.swap_out(src.cpu().numpy(), cpu).result(timeout=60)
            for t in tensors:
                t[dst] = 0
            torch.cuda.synchronize()
            assert int(worker.signals.ipc_events[0, EVENTS_LAYERS]) != 0, "the transfer manager exported no events"
            stream = torch.cuda.current_stream()
            handle = backend.swap_in(dst.cpu().numpy(), cpu, layerwise=True)
            seen = {}
            for layer in range(spec.num_layers):
                worker.wait_layer(handle.task_id, layer, timeout=60, stream=stream)
                for k, info in enumerate(infos):
                    if info.layer == layer:          # queued on the stream right after the wait, no host sync
                        seen[k] = torch.index_select(tensors[k], 0, dst)
            handle.result(timeout=60)
            torch.cuda.synchronize()
            for k, info in enumerate(infos):
                assert bool((seen[k] != 0).all()), f"{info.name}: read zeros right after its layer's wait"
                assert torch.equal(seen[k], want[k]), f"{info.name}: wrong bytes right after its layer's wait"
        finally:
            worker.close()
