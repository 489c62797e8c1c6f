"""Liquid resharding on a real GPU (docs/design.md §9): ranks sharing the one GPU, worker processes holding torch or
CuPy caches, head slices moved through CUDA IPC; every live block checked bit for bit after every step, and
the reshard's GPU copy rate against one cudaMemcpyAsync device-to-device of the same bytes in the same run
(goal >= 0.8). Marked `gpu`; skipped where no GPU is usable or neither torch nor CuPy is installed."""
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
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU, reason="no usable CUDA GPU"),
              pytest.mark.skipif(GPU and FRAMEWORK is None, reason="needs torch or cupy to allocate the cache")]


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
