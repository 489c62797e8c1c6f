"""Clear/restore on a real GPU: cudaMemGetInfo must show the cache's bytes returned and taken again."""
import time

import numpy as np
import pytest

from fastcache import CacheSpec, SwapBackend
from fastcache.ops import cuda_usable
from fastcache.worker import CacheWorker

pytestmark = pytest.mark.gpu
if not cuda_usable():
    pytest.skip("no usable CUDA GPU", allow_module_level=True)
torch = pytest.importorskip("torch")

SLACK = 64 << 20      # docs/design.md §6: within 64 MiB


def free_bytes():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()         # this process's cached temporaries are not the cache
    return torch.cuda.mem_get_info(0)[0]


def test_clear_returns_gpu_memory_and_restore_takes_it_again():
    spec = CacheSpec(num_layers=16, num_gpu_blocks=4096, num_cpu_blocks=64, block_size=64, num_kv_heads=8,
                     head_dim=128, cache_dtype="bfloat16")          # 16 GiB of cache
    torch.cuda.init()
    with SwapBackend(spec, tp_size=1, device="cuda") as backend:
        worker = CacheWorker(spec, rank=0, tp_size=1, device="cuda", suffix=backend.suffix, framework="torch").start()
        backend.wait_ready(timeout=60)
        rng = np.random.default_rng(0)
        k = worker.key_caches[3]
        k.copy_(torch.from_numpy(rng.standard_normal(k.shape, dtype=np.float32)).to(k.device, k.dtype))
        want = k[[7, 9]].clone()
        torch.cuda.synchronize()     # the engine contract (docs/design.md §4): the writing step has finished
        backend.swap_out([7, 9], [0, 1]).result(timeout=30)
        del k
        held = free_bytes()          # cache allocated, every process's CUDA context up
        timings = {}
        for cycle in range(3):
            t0 = time.perf_counter()
            backend.clear_caches(timeout=120)
            timings.setdefault("clear", []).append(time.perf_counter() - t0)
            returned = free_bytes() - held
            assert returned >= spec.gpu_cache_bytes - SLACK, f"only {returned / 2**20:.0f} MiB returned"
            t0 = time.perf_counter()
            backend.restore_caches(timeout=120)
            timings.setdefault("restore", []).append(time.perf_counter() - t0)
            assert free_bytes() <= held + SLACK, "restore did not take the cache's memory again"
        # the CPU tier survived the cycles (not released by default): swap the blocks back in
        backend.swap_in([1, 2], [0, 1]).result(timeout=30)
        assert torch.equal(worker.key_caches[3][[1, 2]], want)
        print(f"\nclear {np.median(timings['clear']) * 1e3:.1f} ms, restore {np.median(timings['restore']) * 1e3:.1f} ms "
              f"for {spec.gpu_cache_bytes / 2**30:.1f} GiB")
