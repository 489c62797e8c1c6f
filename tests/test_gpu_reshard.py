"""Liquid resharding on a real GPU (docs/design.md §9): ranks sharing the one GPU, worker processes holding torch or
CuPy caches, head slices moved through CUDA IPC; every live block checked bit for bit after every step, and
the reshard's GPU copy rate against one cudaMemcpyAsync device-to-device of the same bytes in the same run
(goal >= 0.8). The gather path (GatherCopies: gather_runs over uploaded run tables) is also checked alone,
between two cudaMalloc'd buffers, with its rate against the 2-D copies and a D2D memcpy. Marked `gpu`;
skipped where no GPU is usable; the tests with worker processes also where neither torch nor CuPy is
installed."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fastcache import SwapBackend
from fastcache.config import CacheSpec
from fastcache.launch.verify import Checks
from fastcache.ops import cuda_usable

GPU = cuda_usable()


def _framework():
    from fastcache.tools.bench import pick_framework
    return pick_framework(None)


FRAMEWORK = _framework() if GPU else None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="no usable CUDA GPU")]
needs_framework = pytest.mark.skipif(GPU and FRAMEWORK is None, reason="needs torch or cupy to allocate the cache")


@needs_framework
def test_ranks_sharing_one_gpu_reshard_1_2_4_2_1_bit_for_bit():
    from fastcache.launch.harness import WorkerProcesses
    from fastcache.launch.liquid import liquid
    spec = CacheSpec(num_layers=4, num_gpu_blocks=256, num_cpu_blocks=64, block_size=16, num_kv_heads=8, head_dim=128)
    rng = np.random.default_rng(1)
    with SwapBackend(spec, tp_size=1, device="cuda", device_ids=[0]) as backend:
        workers = WorkerProcesses(backend, FRAMEWORK)
        try:
            workers.start([0])
            backend.wait_ready(timeout=120)
            checks, report = Checks(), {}
            original = backend.reshard

            def on_one_gpu(tp, **kwargs):           # every new rank on device 0: the ranks share the GPU
                return original(tp, **(kwargs | {"device_ids": [0] * tp}))
            backend.reshard = on_one_gpu
            steps = liquid(backend, workers, [1, 2, 4, 2, 1], 1, rng, checks, report, clear=True)
            assert not checks.failed, checks.failed
            assert len(steps) == 4
        finally:
            workers.close()


def reshard_weights_with_the_kv(device, framework, path, device_ids=None):
    """Weights (column-split, row-split, replicated) and KV resharded along `path` with worker processes, the
    ranks on `device_ids(tp)`; after every step every weight byte of every rank is checked against its slice of
    the full random tensors and every live block against what it held. KV tensors of 16 MiB: under torch's
    caching allocator each is a cudaMalloc of its own, so a process that maps a rank's KV and its weights (the
    transfer manager, this test) never opens one allocation twice (CUDA maps an allocation once per process).
    The weights are never mapped here while the KV is."""
    from fastcache.launch.harness import WorkerProcesses
    from fastcache.launch.liquid import BlockModel
    from fastcache.weight_spec import WeightSpec
    from test_reshard_weights_live import WeightModel
    model = WeightSpec(2, {"qkv": ((2048, 1024), "float16", 0), "o": ((1024, 2048), "float16", 1),
                           "norm": ((1024,), "float32")})
    spec = CacheSpec(num_layers=2, num_gpu_blocks=512, num_cpu_blocks=32, block_size=16, num_kv_heads=8, head_dim=128)
    rng = np.random.default_rng(sum(path))
    device_ids = device_ids or (lambda tp: list(range(tp)))
    with SwapBackend(spec, tp_size=path[0], device=device, device_ids=device_ids(path[0]),
                     weights=model.resharded(path[0])) as backend:
        workers = WorkerProcesses(backend, framework)
        try:
            workers.start(list(range(path[0])))
            backend.wait_ready(timeout=120)
            kv, weights = BlockModel(backend, rng), WeightModel(backend, rng)
            weights.load()
            assert not weights.check()
            kv.attach()
            kv.fill(range(spec.num_gpu_blocks // 2))
            kv.detach()
            allocations = []
            for tp in path[1:]:
                new, block_map = backend.reshard(tp, live_blocks=sorted(kv.gpu), start_workers=workers.start,
                                                 stop_workers=workers.stop, device_ids=device_ids(tp), timeout=300)
                r = backend.last_reshard
                kv.remap(block_map, r["cpu_block_map"])
                assert backend.tp_size == tp and backend.weight_layout == model.resharded(tp)
                assert not weights.check(), (r["from_tp"], tp)
                kv.attach()
                assert not kv.check(), (r["from_tp"], tp)
                kv.fill(rng.choice(new.num_gpu_blocks, 4, replace=False))     # the deployment serves on
                assert not kv.check()
                kv.detach()
                assert r["weights_bytes"] > 0 and r["kv_bytes"] > 0
                if device == "cuda":        # each worker's own view at COMMIT: the driver's and its allocator's
                    for m in r["device_memory"]:
                        assert 0 < m["free_bytes"] < m["total_bytes"], m
                        assert m["reserved_bytes"] >= m["allocated_bytes"] >= new.gpu_cache_bytes, m
                        assert m["fragmented_bytes"] == m["reserved_bytes"] - m["allocated_bytes"], m
                allocations += r["weight_allocations"]
            weights.corrupt(0, 1, 5)                    # the negative control: one byte is seen
            assert weights.check() == [(0, "o")]
            return allocations
        finally:
            workers.close()


@needs_framework
@pytest.mark.parametrize("path", [[1, 2, 1], [1, 4, 2, 1]])
def test_ranks_sharing_one_gpu_reshard_the_weights_with_the_kv_bit_for_bit(path):
    """docs/design.md §9, weights in the live step on cuda. 1-4-2-1: rank 1, born at tp 4 with a quarter of each
    split tensor, needs half at tp 2: its worker allocates new ones, the moves fill them, the commit switches
    to them and frees the old (1-2-1 fits in place everywhere)."""
    allocations = reshard_weights_with_the_kv("cuda", FRAMEWORK, path, lambda tp: [0] * tp)
    assert sorted((a["rank"], a["tensor"]) for a in allocations) == \
        ([(1, "o"), (1, "qkv")] if path == [1, 4, 2, 1] else [])


@needs_framework
def test_the_reshard_copy_rate_against_a_device_to_device_memcpy():
    """A big cache, every block live: GB/s of the moves (the transfer managers' wall time, messaging included)
    over one cudaMemcpyAsync D2D of the same bytes."""
    from fastcache.ops.cuda_reshard import d2d_rate
    from fastcache.launch.harness import WorkerProcesses
    spec = CacheSpec(num_layers=16, num_gpu_blocks=2048, num_cpu_blocks=16, block_size=16, num_kv_heads=8,
                     head_dim=128)      # 2 GiB of cache
    with SwapBackend(spec, tp_size=1, device="cuda", device_ids=[0]) as backend:
        workers = WorkerProcesses(backend, FRAMEWORK)
        try:
            workers.start([0])
            backend.wait_ready(timeout=120)
            backend.reshard(2, start_workers=workers.start, stop_workers=workers.stop, device_ids=[0, 0], timeout=300,
                            staging_bytes=256 << 20)
            r = backend.last_reshard
            gpu_bytes = r["bytes_by_source"]["local"] + r["bytes_by_source"]["remote"]
            reference = d2d_rate(gpu_bytes, 0)
            ratio, copy_ratio = r["gbps"] / reference, r["copy_gbps"] / reference
            out = os.environ.get("OUT")
            if out:
                with open(os.path.join(out, "reshard_rate.json"), "w") as f:
                    json.dump({"report": {k: v for k, v in r.items() if "map" not in k}, "d2d_gbps": reference,
                               "ratio": ratio, "copy_ratio": copy_ratio}, f, indent=2, default=str)
            print(f"reshard {r['gbps']:.1f} GB/s over the moves ({r['copy_gbps']:.1f} GB/s over the copies "
                  f"alone), cudaMemcpyAsync D2D {reference:.1f} GB/s: {ratio:.3f} ({copy_ratio:.3f})")
            assert ratio > 0
        finally:
            workers.close()


def test_gather_copies_move_random_head_slices_between_two_device_buffers_bit_for_bit():
    """GatherCopies alone (no framework, no IPC): 1 KiB head slices of random rows, slices at skewed offsets
    (the kernel's word and byte copies), whole rows joined into runs longer than RUN_SPLIT_BYTES (cut), and
    a copy that is one run (a memcpy); bit for bit against NumPy, then again from the kept tables."""
    from cuda.bindings import runtime
    from fastcache.ops.cuda_kernels import DeviceBuffer, cuda_check, set_device
    from fastcache.ops.cuda_reshard import RUN_SPLIT_BYTES, DeviceRegion, GatherCopies, copy_runs
    from fastcache.reshard_plan import Copy
    set_device(0)
    rng = np.random.default_rng(7)
    pitch, rows = 8192, 4096                  # 8 heads of 1 KiB a row: a 32 MiB source
    src_host = np.frombuffer(rng.bytes(pitch * rows), np.uint8)
    picked = np.sort(rng.choice(rows, 1500, replace=False))
    specs = [  # (src_off, width, src rows, dst pitch, dst_off, dst rows)
        (3 * 1024, 1024, picked, 1024, 0, np.arange(1500)),                      # int4
        (5 * 1024 + 4, 1000, picked[::-1].copy(), 1000, 0, np.arange(1500)),     # words, rows in any order
        (1024 + 5, 999, picked, 1003, 3, np.arange(1500)),                       # bytes
        (0, pitch, np.r_[0:40, 100:140], pitch, 0, np.r_[10:50, 200:240]),        # two 320 KiB runs, cut
        (0, pitch, np.arange(300, 340), pitch, 0, np.arange(0, 40)),              # one run
    ]
    copies = [Copy(("src",), pitch, so, r, ("dst", i), dp, do, d, w) for i, (so, w, r, dp, do, d) in enumerate(specs)]
    assert [len(copy_runs(c)) for c in copies] == [1500, 1500, 1500, 2, 1]
    assert 40 * pitch > RUN_SPLIT_BYTES
    sizes = [-(-(int(c.dst_rows.max()) * c.dst_pitch + c.dst_off + c.width) // 256) * 256 for c in copies]
    src, dst = DeviceBuffer(src_host.nbytes), DeviceBuffer(sum(sizes))
    stream = cuda_check(runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
    gather = GatherCopies(0, stream)
    try:
        cuda_check(runtime.cudaMemcpy(src.ptr, src_host.ctypes.data, src_host.nbytes,
                                      runtime.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy")
        want = np.zeros(dst.nbytes, np.uint8)
        regions, base = [], 0
        for c, size in zip(copies, sizes):
            regions.append(DeviceRegion(dst.ptr + base, size, f"destination of {c.dst}"))
            area = want[base:base + size]
            for s, d in zip(c.src_rows.tolist(), c.dst_rows.tolist()):
                area[d * c.dst_pitch + c.dst_off:d * c.dst_pitch + c.dst_off + c.width] = \
                    src_host[s * pitch + c.src_off:s * pitch + c.src_off + c.width]
            base += size
        source = DeviceRegion(src.ptr, src.nbytes, "source")
        for _ in range(2):                  # the second pass launches from the tables already uploaded
            cuda_check(runtime.cudaMemset(dst.ptr, 0, dst.nbytes), "cudaMemset")
            cuda_check(runtime.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            for c, region in zip(copies, regions):
                gather.copy(c, source, region)
            cuda_check(runtime.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
            got = np.empty(dst.nbytes, np.uint8)
            cuda_check(runtime.cudaMemcpy(got.ctypes.data, dst.ptr, dst.nbytes,
                                          runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy")
            assert np.array_equal(got, want)
    finally:
        cuda_check(runtime.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        gather.close()
        runtime.cudaStreamDestroy(stream)
        src.close()
        dst.close()


def test_the_gather_rate_against_the_2d_copies_and_a_device_to_device_memcpy():
    """gather_rate, small (benchmarks/reshard_gather.py runs it at full size): it checks its own bytes."""
    from fastcache.ops.cuda_reshard import gather_rate
    r = gather_rate(rows=8192, chunk_rows=2048, repeat=1)
    print(f"gather {r['gather_gbps']:.1f} GB/s ({r['gather_ratio']:.3f} of D2D {r['d2d_gbps']:.1f} GB/s), "
          f"2d {r['2d_gbps']:.1f} GB/s")
    assert r["bit_for_bit"]
    assert r["gather_gbps"] > 0 and r["2d_gbps"] > 0
