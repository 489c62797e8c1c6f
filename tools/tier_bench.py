"""What the tiered cache costs on this machine, and how fast the sim device swaps at random ids.

    python tools/tier_bench.py [--tp 2] [--samples 400] [--json out.json]

- lookup: one TieredCache.lookup of a 64-block prompt whose blocks are all held (the engine's cost).
- store / load overhead: what TieredCache.store and .load add to the swap they submit, two ways:
  the calling thread's time (cache call vs bare swap_out/swap_in call, no waiting), and submit-to-done
  (median of store(...).result() vs swap_out(...).result() of the same 64 blocks, interleaved).
- sim random ids: one 512-block task of 32 KiB rows over 16 tensors (8 layers, K and V) at random GPU and
  CPU ids, against one memcpy of the same bytes in the same run (best of 5 each way).
Every figure comes from a real deployment (engine, in-process workers, transfer-manager processes).
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np

from fastcache import CacheSpec, SwapBackend, TieredCache
from fastcache.worker import CacheWorker

PROMPT = 64


def deployment(spec, tp):
    backend = SwapBackend(spec, tp_size=tp, device="sim").start()
    workers = [CacheWorker(spec, rank=r, tp_size=tp, device="sim", suffix=backend.suffix).start()
               for r in range(tp)]
    backend.wait_ready(timeout=60)
    return backend, workers


def close(backend, workers):
    for w in workers:
        w.close()
    backend.close()


def per_call(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def tier_costs(tp, samples, rng):
    spec = CacheSpec(num_layers=8, num_gpu_blocks=512, num_cpu_blocks=512, block_size=16, num_kv_heads=4,
                     head_dim=64)                      # the launcher's geometry: 128 KiB per block and rank
    backend, workers = deployment(spec, tp)
    try:
        raw = backend.allocate_cpu_blocks(PROMPT)
        cache = TieredCache(backend, "bench", capacity=4 * PROMPT)
        src, dst = list(range(PROMPT)), list(range(PROMPT, 2 * PROMPT))
        held = [int(x) for x in rng.integers(0, 2**63, PROMPT)]
        cache.store(held, src).result(30)
        out = {"lookup_us": min(per_call(lambda: cache.lookup(held), 2000) for _ in range(5)) * 1e6}
        fresh = iter(range(10**9))

        def new_prompt():
            base = next(fresh) * PROMPT
            return list(range(base, base + PROMPT))
        # calling thread: submission only, each call waited for outside the timed region
        times = {"swap_out": [], "store": [], "swap_in": [], "load": []}
        for _ in range(samples):
            for name, call in (("swap_out", lambda: backend.swap_out(src, raw)),
                               ("store", lambda p=new_prompt(): cache.store(p, src)),
                               ("swap_in", lambda: backend.swap_in(dst, raw)),
                               ("load", lambda: cache.load(held, dst))):
                t0 = time.perf_counter()
                handle = call()
                times[name].append(time.perf_counter() - t0)
                handle.result(30)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        out["store_call_us"], out["swap_out_call_us"] = med["store"], med["swap_out"]
        out["load_call_us"], out["swap_in_call_us"] = med["load"], med["swap_in"]
        out["store_adds_call_us"] = med["store"] - med["swap_out"]
        out["load_adds_call_us"] = med["load"] - med["swap_in"]
        # submit to every rank done, interleaved so that drift hits both alike
        done = {"swap_out": [], "store": [], "swap_in": [], "load": []}
        for _ in range(samples):
            for name, call in (("swap_out", lambda: backend.swap_out(src, raw)),
                               ("store", lambda p=new_prompt(): cache.store(p, src)),
                               ("swap_in", lambda: backend.swap_in(dst, raw)),
                               ("load", lambda: cache.load(held, dst))):
                t0 = time.perf_counter()
                call().result(30)
                done[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e6 for k, v in done.items()}
        out.update({f"{k}_done_us": v for k, v in med.items()})
        out["store_adds_done_us"] = med["store"] - med["swap_out"]
        out["load_adds_done_us"] = med["load"] - med["swap_in"]
        stats = cache.stats()
        out["evicted"], out["stored_blocks"] = stats["evicted"], stats["stored_blocks"]
        cache.close()
        backend.free_cpu_blocks(raw)
        return out
    finally:
        close(backend, workers)


def sim_random_ids(rng):
    spec = CacheSpec(num_layers=8, num_gpu_blocks=1024, num_cpu_blocks=512, block_size=16, num_kv_heads=4,
                     head_dim=256)                     # 32 KiB rows, 16 tensors: 512 KiB per block
    backend, workers = deployment(spec, 1)
    try:
        gpu, cpu = rng.permutation(spec.num_gpu_blocks)[:512], rng.permutation(spec.num_cpu_blocks)
        nbytes = spec.task_bytes(gpu)
        src, dst = np.full(nbytes, 7, np.uint8), np.empty(nbytes, np.uint8)
        out = {"task_mib": nbytes / 2**20}
        for kind, submit in (("out", backend.swap_out), ("in", backend.swap_in)):
            swap = min(submit(gpu, cpu).result(60).elapsed for _ in range(5))
            copy = min(per_call(lambda: np.copyto(dst, src), 1) for _ in range(5))
            out[f"swap_{kind}_gbps"] = nbytes / swap / 1e9
            out[f"memcpy_{kind}_gbps"] = nbytes / copy / 1e9
            out[f"swap_{kind}_vs_memcpy"] = copy / swap
        return out
    finally:
        close(backend, workers)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    report = {"tier": tier_costs(args.tp, args.samples, rng), "sim_random_ids": sim_random_ids(rng)}
    t, s = report["tier"], report["sim_random_ids"]
    print(f"lookup of a {PROMPT}-block prompt: {t['lookup_us']:.1f} us")
    print(f"store adds {t['store_adds_call_us']:.1f} us to the submitting call ({t['store_call_us']:.1f} vs "
          f"{t['swap_out_call_us']:.1f}), {t['store_adds_done_us']:.1f} us submit-to-done "
          f"({t['store_done_us']:.0f} vs {t['swap_out_done_us']:.0f})")
    print(f"load adds {t['load_adds_call_us']:.1f} us to the submitting call ({t['load_call_us']:.1f} vs "
          f"{t['swap_in_call_us']:.1f}), {t['load_adds_done_us']:.1f} us submit-to-done "
          f"({t['load_done_us']:.0f} vs {t['swap_in_done_us']:.0f})")
    for kind in ("out", "in"):
        print(f"sim swap-{kind}, {s['task_mib']:.0f} MiB at random ids: {s[f'swap_{kind}_gbps']:.2f} GB/s, "
              f"{s[f'swap_{kind}_vs_memcpy']:.2f} x memcpy ({s[f'memcpy_{kind}_gbps']:.2f} GB/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
