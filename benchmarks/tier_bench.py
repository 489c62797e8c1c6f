"""What the tiered cache costs on this machine, and how fast the sim device swaps at random ids.

    python benchmarks/tier_bench.py [--tp 2] [--samples 400] [--json out.json] [--device cuda [--device-id 0]]

- lookup: one TieredCache.lookup of a prompt whose blocks are all held (the engine's cost), best of 5
  loops of 2,000 calls.
- store / load overhead: what TieredCache.store and .load add to a swap of as many blocks that the engine
  submits itself (swap_out / swap_in), interleaved, medians, two ways: the calling thread's time, and
  submit-to-done (store(...).result() vs swap_out(...).result()). Beside it, the cache's own work in the
  call: the call less the swap submission inside it (which skips checking the ids a second time). Each store
  is of new hashes into a full cache, so it evicts as many entries as it places (the dearest case).
  At 64 blocks and at 24 (the conversation trace's mean request).
- the cache's own work warm: the same calls back to back over a stub backend whose swaps cost nothing,
  and the same stub-backed calls timed right after a real swap (the state the real calls meet). Beside
  them, both ways, a reference workload with no fastcache code in it (an OrderedDict churn of as many
  entries as a store places): how much slower this machine runs any Python right after a swap, and
  right after a 4 ms sleep (no copy anywhere).
- sim random ids: one 512-block task of 32 KiB rows over 16 tensors (8 layers, K and V) at random GPU and
  CPU ids, against one memcpy of the same bytes in the same run (best of 5 each way).
Every figure comes from a real deployment (engine, in-process workers, transfer-manager processes), on the
sim device or, with --device cuda, on one GPU (every rank on --device-id; the sim figure is then skipped).
"""
import argparse
import itertools
import json
import statistics
import sys
import time
from collections import OrderedDict

import numpy as np

from fastcache import CacheSpec, SwapBackend, TieredCache, TransferHandle
from fastcache.engine.allocator import CpuBlockAllocator
from fastcache.ipc.signal import NORMAL
from fastcache.worker import CacheWorker

PROMPT = 64            # the lookup target's prompt; store/load are measured at PROMPT and at a typical request
TYPICAL = 24           # the conversation trace's mean request (288,500 blocks / 12,031 requests)


def deployment(spec, tp, device="sim", device_id=0):
    on_gpu = device == "cuda"
    backend = SwapBackend(spec, tp_size=tp, device=device, device_ids=[device_id] * tp if on_gpu else None).start()
    workers = [CacheWorker(spec, rank=r, tp_size=tp, device=device, suffix=backend.suffix,
                           framework="torch" if on_gpu else "numpy", device_id=backend.device_ids[r]).start()
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


def tier_costs(tp, samples, rng, size, device="sim", device_id=0):
    spec = CacheSpec(num_layers=8, num_gpu_blocks=512, num_cpu_blocks=512, block_size=16, num_kv_heads=4,
                     head_dim=64)                      # the launcher's geometry: 128 KiB per block and rank
    backend, workers = deployment(spec, tp, device, device_id)
    try:
        raw = rng.permutation(backend.allocate_cpu_blocks(size)).tolist()   # scattered, like the cache's
        cache = TieredCache(backend, "bench", capacity=4 * size)      # full after 3 rounds: stores evict
        src, dst = list(range(size)), list(range(size, 2 * size))
        held = [int(x) for x in rng.integers(0, 2**63, size)]
        cache.store(held, src).result(30)
        out = {"blocks": size, "lookup_us": min(per_call(lambda: cache.lookup(held), 2000) for _ in range(5)) * 1e6}
        fresh = iter(range(10**9))

        def new_prompt():
            base = next(fresh) * size
            return list(range(base, base + size))
        # calling thread: each call's time, and each cache call less the swap submission inside it (timed by
        # a wrapper) for the cache's own work; the handle is waited for outside the timed region
        inner = []

        def timed(*a, _call=backend.submit_checked_swap):
            t0 = time.perf_counter()
            try:
                return _call(*a)
            finally:
                inner.append(time.perf_counter() - t0)
        backend.submit_checked_swap = timed
        times = {"swap_out": [], "store": [], "swap_in": [], "load": []}
        own = {"store": [], "load": []}
        for _ in range(samples):
            for name, call in (("swap_out", lambda: backend.swap_out(src, raw)),
                               ("store", lambda p=new_prompt(): cache.store(p, src)),
                               ("swap_in", lambda: backend.swap_in(dst, raw)),
                               ("load", lambda: cache.load(held, dst))):
                inner.clear()
                t0 = time.perf_counter()
                handle = call()
                times[name].append(time.perf_counter() - t0)
                if name in own:
                    own[name].append(times[name][-1] - sum(inner))
                handle.result(30)
        del backend.submit_checked_swap
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        out["store_call_us"], out["swap_out_call_us"] = med["store"], med["swap_out"]
        out["load_call_us"], out["swap_in_call_us"] = med["load"], med["swap_in"]
        out["store_adds_call_us"] = med["store"] - med["swap_out"]
        out["load_adds_call_us"] = med["load"] - med["swap_in"]
        out["store_own_call_us"] = statistics.median(own["store"]) * 1e6
        out["load_own_call_us"] = statistics.median(own["load"]) * 1e6
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
        out.update(after_swap_costs(backend, src, raw, size, samples))
        stats = cache.stats()
        out["evicted"], out["stored_blocks"] = stats["evicted"], stats["stored_blocks"]
        cache.close()
        backend.free_cpu_blocks(raw)
        return out
    finally:
        close(backend, workers)


class StubBackend:
    """What TieredCache uses of a SwapBackend, with swaps that complete at once and cost ~nothing: the
    cache's own work, measured warm (back to back), without the deployment around it."""
    store_url = None

    def __init__(self, size):
        self.spec = CacheSpec(num_layers=1, num_gpu_blocks=2 * size, num_cpu_blocks=4 * size, block_size=1,
                              num_kv_heads=1, head_dim=1)
        self.allocator = CpuBlockAllocator(self.spec.num_cpu_blocks)
        self.signals = type("Signals", (), {"status": NORMAL})()
        self.running = True

    def submit_checked_swap(self, kind, gpu, cpu):
        return TransferHandle.completed(kind)


class Reference:
    """Python work of a store's shape and no fastcache code: `size` entries inserted into an OrderedDict of
    4 * size and as many evicted. Its slowdown after a swap is the machine's, whatever the cache does."""

    def __init__(self, size):
        self.size, self.keys = size, itertools.count()
        self.index = OrderedDict((k, [k, 0, 0, 0]) for k in itertools.islice(self.keys, 4 * size))

    def __call__(self):
        index = self.index
        for key in itertools.islice(self.keys, self.size):
            index[key] = [key, 0, 0, 0]
            index.popitem(last=False)


def warm_costs(size):
    backend = StubBackend(size)
    cache = TieredCache(backend, "bench")
    src, dst = list(range(size)), list(range(size, 2 * size))
    bare = min(per_call(lambda: backend.submit_checked_swap("SWAP_TO_CPU", src, src), 1000) for _ in range(5))
    prompts = iter([[k * size + i for i in range(size)] for k in range(5 * 500)])
    store = min(per_call(lambda: cache.store(next(prompts), src), 500) for _ in range(5)) - bare
    held = [(5 * 500 - 1) * size + i for i in range(size)]
    load = min(per_call(lambda: cache.load(held, dst), 500) for _ in range(5)) - bare
    reference = Reference(size)
    warm = min(per_call(reference, 500) for _ in range(5))
    after_sleep = []                    # no copy anywhere: the machine left alone for a moment
    for _ in range(200):
        time.sleep(0.004)
        t0 = time.perf_counter()
        reference()
        after_sleep.append(time.perf_counter() - t0)
    return {"blocks": size, "store_us": store * 1e6, "load_us": load * 1e6, "reference_us": warm * 1e6,
            "reference_after_sleep_us": statistics.median(after_sleep) * 1e6, "evicted": cache.stats()["evicted"]}


def after_swap_costs(backend, src, raw, size, samples):
    """The cache's own work (a stub-backed cache, no swap inside) timed right after each of a run of real
    swaps completes: the same code as the warm figure, in the state the real store/load calls meet; and the
    Reference work timed the same way. With the warm figures it splits what a store adds into the cache's
    work and the state of the machine."""
    stub = StubBackend(size)
    cache = TieredCache(stub, "after-swap")
    gpu = list(range(size))
    prompts = iter([[k * size + i for i in range(size)] for k in range(5 * size + samples + 1)])
    for _ in range(5):
        cache.store(next(prompts), gpu)             # full: each timed store evicts as many as it places
    held = [(5 - 1) * size + i for i in range(size)]
    times = {"store": [], "load": [], "reference": []}
    reference = Reference(size)
    for _ in range(samples):
        for name, call in (("store", lambda: cache.store(next(prompts), gpu)), ("load", lambda: cache.load(held, gpu)),
                           ("reference", reference)):
            backend.swap_out(src, raw).result(30)
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    bare = per_call(lambda: stub.submit_checked_swap("SWAP_TO_CPU", gpu, gpu), 1000)   # the stub's, inside store and load
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"store_own_after_swap_us": (median["store"] - bare) * 1e6,
            "load_own_after_swap_us": (median["load"] - bare) * 1e6,
            "reference_after_swap_us": median["reference"] * 1e6}


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
    p.add_argument("--device", choices=("sim", "cuda"), default="sim")
    p.add_argument("--device-id", type=int, default=0, help="the GPU every rank uses with --device cuda")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    report = {"device": args.device,
              "tier": [tier_costs(args.tp, args.samples, rng, size, args.device, args.device_id)
                       for size in (PROMPT, TYPICAL)],
              "warm": [warm_costs(size) for size in (PROMPT, TYPICAL)]}
    if args.device == "sim":
        report["sim_random_ids"] = sim_random_ids(rng)
    for t, w in zip(report["tier"], report["warm"]):
        print(f"{t['blocks']}-block prompt: lookup {t['lookup_us']:.1f} us")
        print(f"  the cache's own work, warm (stub backend): store {w['store_us']:.1f} us (placing {t['blocks']} new "
              f"hashes, evicting as many), load {w['load_us']:.1f} us")
        print(f"  the same work right after a real swap: store {t['store_own_after_swap_us']:.1f} us, "
              f"load {t['load_own_after_swap_us']:.1f} us "
              f"(x{t['store_own_after_swap_us'] / w['store_us']:.1f} "
              f"and x{t['load_own_after_swap_us'] / w['load_us']:.1f})")
        print(f"  reference work, no fastcache code: {w['reference_us']:.1f} us warm "
              f"(the store x{w['store_us'] / w['reference_us']:.1f} of it, "
              f"the load x{w['load_us'] / w['reference_us']:.1f}), "
              f"{t['reference_after_swap_us']:.1f} us right after a real swap "
              f"(x{t['reference_after_swap_us'] / w['reference_us']:.1f}: this machine's slowdown), "
              f"{w['reference_after_sleep_us']:.1f} us after a 4 ms sleep "
              f"(x{w['reference_after_sleep_us'] / w['reference_us']:.1f})")
        for op, swap in (("store", "swap_out"), ("load", "swap_in")):
            print(f"  {op} adds {t[f'{op}_adds_call_us']:.1f} us to the submitting call (whole call "
                  f"{t[f'{op}_call_us']:.1f}, a bare {swap} {t[f'{swap}_call_us']:.1f}; the cache's own work in it "
                  f"{t[f'{op}_own_call_us']:.1f}), {t[f'{op}_adds_done_us']:.1f} us submit-to-done "
                  f"({t[f'{op}_done_us']:.0f} vs {t[f'{swap}_done_us']:.0f})")
    if "sim_random_ids" in report:
        s = report["sim_random_ids"]
        for kind in ("out", "in"):
            print(f"sim swap-{kind}, {s['task_mib']:.0f} MiB at random ids: {s[f'swap_{kind}_gbps']:.2f} GB/s, "
                  f"{s[f'swap_{kind}_vs_memcpy']:.2f} x memcpy ({s[f'memcpy_{kind}_gbps']:.2f} GB/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
