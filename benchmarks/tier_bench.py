"""What the tiered cache costs on this machine, and how fast the sim device swaps at random ids.

    python benchmarks/tier_bench.py [--tp 2] [--samples 400] [--json out.json] [--device cuda [--device-id 0]]
                                    [--policy lru,arc,probation,adaptive,laps]

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

--policy NAME (repeatable, or a comma list; default: fastcache.eviction.DEFAULT_POLICY) picks the caches'
eviction policy. With several, each is measured in the same run, its calls interleaved with the others' (one
cache per policy over the same deployment, and one stub per policy), and each figure is also printed as a
ratio to lru's (lru is measured too when not named).
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
from fastcache.eviction import DEFAULT_POLICY, POLICIES
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


def tier_costs(tp, samples, rng, size, device="sim", device_id=0, policies=(DEFAULT_POLICY,)):
    """The figures of one cache per policy over one deployment, each policy's calls interleaved with the
    others'; {policy: figures}."""
    cpu_blocks = max(512, 4 * size * len(policies) + size)
    spec = CacheSpec(num_layers=8, num_gpu_blocks=512, num_cpu_blocks=cpu_blocks, block_size=16, num_kv_heads=4,
                     head_dim=64)                      # the launcher's geometry: 128 KiB per block and rank
    backend, workers = deployment(spec, tp, device, device_id)
    try:
        raw = rng.permutation(backend.allocate_cpu_blocks(size)).tolist()   # scattered, like the cache's
        caches = {p: TieredCache(backend, f"bench-{p}", capacity=4 * size, policy=p)   # full after 3 rounds:
                  for p in policies}                                                    # stores evict
        src, dst = list(range(size)), list(range(size, 2 * size))
        held = [int(x) for x in rng.integers(0, 2**63, size)]
        for cache in caches.values():
            cache.store(held, src).result(30)
        lookups = {p: [] for p in policies}
        for _ in range(5):
            for p, cache in caches.items():
                lookups[p].append(per_call(lambda: cache.lookup(held), 2000))
        outs = {p: {"blocks": size, "policy": p, "lookup_us": min(lookups[p]) * 1e6} for p in policies}
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

        def rounds():
            """One sample's calls: a bare swap-out, each policy's store, a bare swap-in, each policy's load."""
            yield "swap_out", None, lambda: backend.swap_out(src, raw)
            for p, cache in caches.items():
                yield "store", p, lambda c=cache, k=new_prompt(): c.store(k, src)
            yield "swap_in", None, lambda: backend.swap_in(dst, raw)
            for p, cache in caches.items():
                yield "load", p, lambda c=cache: c.load(held, dst)
        times = {(k, p): [] for k in ("store", "load") for p in policies}
        times.update({("swap_out", None): [], ("swap_in", None): []})
        own = {(k, p): [] for k in ("store", "load") for p in policies}
        for _ in range(samples):
            for name, p, call in rounds():
                inner.clear()
                t0 = time.perf_counter()
                handle = call()
                times[name, p].append(time.perf_counter() - t0)
                if (name, p) in own:
                    own[name, p].append(times[name, p][-1] - sum(inner))
                handle.result(30)
        del backend.submit_checked_swap
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        for p, out in outs.items():
            out["store_call_us"], out["swap_out_call_us"] = med["store", p], med["swap_out", None]
            out["load_call_us"], out["swap_in_call_us"] = med["load", p], med["swap_in", None]
            out["store_adds_call_us"] = med["store", p] - med["swap_out", None]
            out["load_adds_call_us"] = med["load", p] - med["swap_in", None]
            out["store_own_call_us"] = statistics.median(own["store", p]) * 1e6
            out["load_own_call_us"] = statistics.median(own["load", p]) * 1e6
        # submit to every rank done, interleaved so that drift hits both alike
        done = {k: [] for k in times}
        for _ in range(samples):
            for name, p, call in rounds():
                t0 = time.perf_counter()
                call().result(30)
                done[name, p].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e6 for k, v in done.items()}
        for p, out in outs.items():
            out.update({f"{k}_done_us": med[k, p if k in ("store", "load") else None]
                        for k in ("swap_out", "store", "swap_in", "load")})
            out["store_adds_done_us"] = med["store", p] - med["swap_out", None]
            out["load_adds_done_us"] = med["load", p] - med["swap_in", None]
        for p, figures in after_swap_costs(backend, src, raw, size, samples, policies).items():
            outs[p].update(figures)
        for p, cache in caches.items():
            stats = cache.stats()
            outs[p]["evicted"], outs[p]["stored_blocks"] = stats["evicted"], stats["stored_blocks"]
            cache.close()
        backend.free_cpu_blocks(raw)
        return outs
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

    def checked_fences(self, fence):
        return []

    def submit_checked_swap(self, kind, gpu, cpu, fences=()):
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


def warm_costs(size, policies=(DEFAULT_POLICY,)):
    """The stub-backed figures per policy ({policy: figures}), the policies' rounds interleaved."""
    backends = {p: StubBackend(size) for p in policies}
    caches = {p: TieredCache(backends[p], "bench", policy=p) for p in policies}
    src, dst = list(range(size)), list(range(size, 2 * size))
    some = backends[policies[0]]
    bare = min(per_call(lambda: some.submit_checked_swap("SWAP_TO_CPU", src, src), 1000) for _ in range(5))
    prompts = {p: iter([[k * size + i for i in range(size)] for k in range(5 * 500)]) for p in policies}
    stores, loads = {p: [] for p in policies}, {p: [] for p in policies}
    for _ in range(5):
        for p, cache in caches.items():
            stores[p].append(per_call(lambda: cache.store(next(prompts[p]), src), 500))
    held = [(5 * 500 - 1) * size + i for i in range(size)]
    for _ in range(5):
        for p, cache in caches.items():
            loads[p].append(per_call(lambda: cache.load(held, dst), 500))
    reference = Reference(size)
    warm = min(per_call(reference, 500) for _ in range(5))
    after_sleep = []                    # no copy anywhere: the machine left alone for a moment
    for _ in range(200):
        time.sleep(0.004)
        t0 = time.perf_counter()
        reference()
        after_sleep.append(time.perf_counter() - t0)
    return {p: {"blocks": size, "policy": p, "store_us": (min(stores[p]) - bare) * 1e6,
                "load_us": (min(loads[p]) - bare) * 1e6, "reference_us": warm * 1e6,
                "reference_after_sleep_us": statistics.median(after_sleep) * 1e6,
                "evicted": caches[p].stats()["evicted"]} for p in policies}


def after_swap_costs(backend, src, raw, size, samples, policies=(DEFAULT_POLICY,)):
    """The cache's own work (a stub-backed cache, no swap inside) timed right after each of a run of real
    swaps completes: the same code as the warm figure, in the state the real store/load calls meet; and the
    Reference work timed the same way. With the warm figures it splits what a store adds into the cache's
    work and the state of the machine."""
    stubs = {p: StubBackend(size) for p in policies}
    caches = {p: TieredCache(stubs[p], "after-swap", policy=p) for p in policies}
    gpu = list(range(size))
    prompts = {p: iter([[k * size + i for i in range(size)] for k in range(5 * size + samples + 1)]) for p in policies}
    for p, cache in caches.items():
        for _ in range(5):
            cache.store(next(prompts[p]), gpu)      # full: each timed store evicts as many as it places
    held = [(5 - 1) * size + i for i in range(size)]
    times = {(k, p): [] for k in ("store", "load") for p in policies}
    times["reference", None] = []
    reference = Reference(size)
    for _ in range(samples):
        calls = [(("store", p), lambda c=c, p=p: c.store(next(prompts[p]), gpu)) for p, c in caches.items()]
        calls += [(("load", p), lambda c=c: c.load(held, gpu)) for p, c in caches.items()]
        for name, call in calls + [(("reference", None), reference)]:
            backend.swap_out(src, raw).result(30)
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    stub = stubs[policies[0]]
    bare = per_call(lambda: stub.submit_checked_swap("SWAP_TO_CPU", gpu, gpu), 1000)   # the stub's, inside store and load
    median = {k: statistics.median(v) for k, v in times.items()}
    return {p: {"store_own_after_swap_us": (median["store", p] - bare) * 1e6,
                "load_own_after_swap_us": (median["load", p] - bare) * 1e6,
                "reference_after_swap_us": median["reference", None] * 1e6} for p in policies}


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


# the figures compared across policies: (label, where, key); where is "tier" (real deployment) or "warm" (stub)
COMPARED = (("lookup", "tier", "lookup_us"),
            ("store, own work warm", "warm", "store_us"), ("load, own work warm", "warm", "load_us"),
            ("store, own work after a swap", "tier", "store_own_after_swap_us"),
            ("load, own work after a swap", "tier", "load_own_after_swap_us"),
            ("store, own work in the real call", "tier", "store_own_call_us"),
            ("load, own work in the real call", "tier", "load_own_call_us"),
            ("store adds to the call", "tier", "store_adds_call_us"),
            ("load adds to the call", "tier", "load_adds_call_us"))


def ratios(tiers, warms, policies):
    """{size: {policy: {key: figure / lru's figure}}}, every figure of COMPARED."""
    out = {}
    for t, w in zip(tiers, warms):
        size = t["lru"]["blocks"]
        out[str(size)] = {q: {key: (t if where == "tier" else w)[q][key] / (t if where == "tier" else w)["lru"][key]
                              for _, where, key in COMPARED} for q in policies}
    return out


def print_policies(tiers, warms, policies, ratio):
    for t, w in zip(tiers, warms):
        size = t["lru"]["blocks"]
        print(f"policies, {size}-block prompt (us; x lru's in the same run, calls interleaved):")
        print(f"  {'':34}" + "".join(f"{q:>18}" for q in policies))
        for label, where, key in COMPARED:
            figures = (t if where == "tier" else w)
            print(f"  {label:34}" + "".join(f"{figures[q][key]:9.1f} (x{ratio[str(size)][q][key]:4.2f})"
                                              for q in policies))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--device", choices=("sim", "cuda"), default="sim")
    p.add_argument("--device-id", type=int, default=0, help="the GPU every rank uses with --device cuda")
    p.add_argument("--policy", action="append", metavar="NAME",
                   help=f"eviction policy of the caches: {', '.join(sorted(POLICIES))} (repeatable or a comma "
                        f"list; default {DEFAULT_POLICY}); with several, lru too, and ratios to lru's figures")
    args = p.parse_args(argv)
    policies = list(dict.fromkeys(n.strip() for v in (args.policy or [DEFAULT_POLICY]) for n in v.split(",")))
    unknown = [n for n in policies if n not in POLICIES]
    if unknown:
        p.error(f"unknown policy {unknown[0]!r}: choose one of {', '.join(sorted(POLICIES))}")
    if len(policies) > 1 and "lru" not in policies:
        policies.insert(0, "lru")
    rng = np.random.default_rng(0)
    tiers = [tier_costs(args.tp, args.samples, rng, size, args.device, args.device_id, policies)
             for size in (PROMPT, TYPICAL)]
    warms = [warm_costs(size, policies) for size in (PROMPT, TYPICAL)]
    first = policies[0]
    report = {"device": args.device, "policies": policies,
              "tier": [t[first] for t in tiers], "warm": [w[first] for w in warms]}
    if len(policies) > 1:
        report["per_policy"] = {q: {"tier": [t[q] for t in tiers], "warm": [w[q] for w in warms]} for q in policies}
        report["ratio_to_lru"] = ratios(tiers, warms, policies)
    if args.device == "sim":
        report["sim_random_ids"] = sim_random_ids(rng)
    if len(policies) == 1 and first != DEFAULT_POLICY:
        print(f"policy {first}")
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
    if len(policies) > 1:
        print_policies(tiers, warms, policies, report["ratio_to_lru"])
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
