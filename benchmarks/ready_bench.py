"""Time to a ready cuda deployment with a large CPU tier, and to the whole tier pinned.

    python benchmarks/ready_bench.py [--tier-gib 16] [--layers 32] [--runs 2]

The engine process has torch and its CUDA context up before the clock starts (an engine has them before it
builds its cache), and the worker runs in it, as vLLM's does. Ready: SwapBackend entered to wait_ready()
returned (a transfer manager spawned, the cache attached over CUDA IPC, the CPU tier attached; the tier is
pinned in the background from then on). Then a swap-out to the tier's first block, timed from ready (it
waits for the first pinned chunk only), and one to its last block (it waits for the whole tier), each
swapped back into poisoned GPU blocks and checked bit for bit against the cache's random bytes.
"""
import argparse
import statistics
import time

import numpy as np

from fastcache import CacheSpec, SwapBackend
from fastcache.worker import CacheWorker


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tier-gib", type=float, default=16.0)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--gpu-blocks", type=int, default=64)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    import torch
    torch.zeros(1, device="cuda")                       # the engine's context, before the clock
    spec = CacheSpec(num_layers=args.layers, num_gpu_blocks=args.gpu_blocks, num_cpu_blocks=1, block_size=16,
                     num_kv_heads=4, head_dim=128, cache_dtype="bfloat16")
    blocks = int(args.tier_gib * 2**30 // spec.cpu_block_bytes)
    spec = CacheSpec(num_layers=args.layers, num_gpu_blocks=args.gpu_blocks, num_cpu_blocks=blocks, block_size=16,
                     num_kv_heads=4, head_dim=128, cache_dtype="bfloat16")
    print(f"ready_bench: {blocks} CPU blocks of {spec.cpu_block_bytes / 2**20:.1f} MiB "
          f"({blocks * spec.cpu_block_bytes / 2**30:.1f} GiB tier), {args.layers} layers, cuda", flush=True)
    ready, first, whole = [], [], []
    for _ in range(args.runs):
        began = time.perf_counter()
        with SwapBackend(spec, tp_size=1, device="cuda") as backend:
            worker = CacheWorker(spec, rank=0, tp_size=1, device="cuda", suffix=backend.suffix,
                                 framework="torch").start()
            try:
                backend.wait_ready(timeout=300)
                at_ready = time.perf_counter()
                ready.append(at_ready - began)
                tensors = worker.key_caches + worker.value_caches
                for t in tensors:                   # random, never zeros: a missed byte shows
                    t.view(torch.uint8).copy_(torch.randint(1, 256, t.view(torch.uint8).shape, dtype=torch.uint8,
                                                            device=t.device))
                torch.cuda.synchronize()
                for cpu_id, times in ((0, first), (blocks - 1, whole)):
                    backend.swap_out([1], [cpu_id]).result(timeout=300)
                    times.append(time.perf_counter() - at_ready)
                    check(backend, spec, tensors, torch, cpu_id)
            finally:
                worker.close()
    print(f"  deployment ready        {statistics.median(ready):6.2f} s  (runs: "
          f"{', '.join(f'{r:.2f}' for r in ready)}; target < 2 s)")
    print(f"  first block swappable   {statistics.median(first):6.2f} s after ready")
    print(f"  whole tier pinned       {statistics.median(whole):6.2f} s after ready "
          f"({args.tier_gib / statistics.median(whole):.1f} GiB/s)")
    print("  every swapped block equal bit for bit: yes")


def check(backend, spec, tensors, torch, cpu_id):
    """The tier's block equals GPU block 1 of every tensor; swapped back into poisoned block 2, equal again."""
    tier = backend.cpu_tier(0)
    infos = {i.name.split("_rank")[0]: i for i in spec.tensors()}
    names = [f"key_caches_{layer}" for layer in range(spec.num_layers)] + \
            [f"value_caches_{layer}" for layer in range(spec.num_layers)]
    for t, name in zip(tensors, names):
        info = infos[name]
        want = t[1].view(torch.uint8).flatten().cpu().numpy()
        got = tier[cpu_id, info.cpu_offset:info.cpu_offset + info.block_bytes]
        assert np.array_equal(got, want), f"{name}: CPU block {cpu_id} differs from GPU block 1"
        t[2].view(torch.uint8).fill_(0xEE)
    torch.cuda.synchronize()
    backend.swap_in([2], [cpu_id]).result(timeout=300)
    for t in tensors:       # as bytes: random bf16 bit patterns include NaNs, which never compare equal
        assert torch.equal(t[2].view(torch.uint8), t[1].view(torch.uint8)), "a swapped-in block differs"


if __name__ == "__main__":
    main()
