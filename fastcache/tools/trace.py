"""python -m fastcache.tools.trace: replay a request trace through a deployment with a TieredCache.

An engine model with a GPU prefix cache of --gpu-blocks (its own LRU over GPU block ids) runs over a
real deployment (--tp transfer managers and worker processes on the sim or cuda device) and a
TieredCache of --cpu-blocks below it. Per request: GPU hits; GPU blocks for the rest (the GPU's least
recently used are stored to the CPU tier first); lookup and load of the CPU tier's hits; "compute" of
the rest (bytes derived from each block's hash written into its GPU block); store of the request's
chain. Every loaded block, and every GPU hit, is compared with the bytes its hash implies, on every rank.

With --store, an L3 store sits below the CPU tier (TieredCache writes back what it evicts, and loads
store hits through the CPU tier): `mooncake` starts a local Mooncake master and memory server for the
run (sized to hold every distinct block), `file` a temporary directory; a mooncake:// or file:/// URL
uses that store (under a namespace of this run's own).

The report gives the hit rate per tier next to the in-process model of the same capacities (they must be
equal), the infinite-cache limit, blocks and bytes moved, and the wall time; --json writes it, --plot
draws the hit rate over the trace and against the CPU tier's capacity. Exit status 0 only if the hit
rates equal the model's and no block failed its check.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import OrderedDict

import numpy as np

from ..config import CACHE_DTYPES, CacheSpec, Settings
from ..eviction import DEFAULT_POLICY, POLICIES
from ..engine import SwapBackend, TieredCache
from ..ipc.naming import PREFIX
from ..ipc.shm import SHM_DIR
from ..ops import get_ops, resolve_device
from ..ipc.manifest import read_manifest
from ..launch.harness import start_workers, stop_workers, wait_until_ready
from ..launch.verify import HashBytes, mismatched, write_blocks
from .trace_model import Hits, infinite, load_trace, simulate

BLOCK_TOKENS = 512      # the trace's blocks: hash_ids name 512-token blocks
SWEEP = (1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m fastcache.tools.trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="JSONL trace (Mooncake's format)")
    p.add_argument("--requests", type=int, help="replay only the first N requests")
    p.add_argument("--gpu-blocks", type=int, default=1000, help="the engine's GPU prefix cache, blocks")
    p.add_argument("--cpu-blocks", type=int, default=16000, help="the CPU tier (TieredCache), blocks")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                   help="the CPU tier's eviction policy (fastcache/eviction.py); the model uses the same one")
    p.add_argument("--store", help="an L3 store below the CPU tier: mooncake (a local one for the run), file "
                                   "(a temporary directory), mooncake://HOST:PORT or file:///DIR")
    p.add_argument("--store-mb", type=int, help="memory of the local Mooncake store (default: every distinct "
                                                "block fits)")
    p.add_argument("--device", default="sim", choices=("sim", "cuda", "auto"))
    g = p.add_argument_group("geometry per rank (small per token, so the whole trace runs on a laptop)")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--num-kv-heads", type=int, default=1)
    g.add_argument("--head-dim", type=int, default=8)
    g.add_argument("--cache-dtype", default="bfloat16", choices=CACHE_DTYPES)
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="PNG", help="draw hit rates over the trace and against capacity")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT meanwhile")
    p.add_argument("--inject-corruption", action="store_true",
                   help="corrupt the first computed block, to see the check fail (exit status 1)")
    return p


class Engine:
    """The engine model: a GPU prefix cache (hash -> GPU block, least recently used first) over the
    deployment, with the TieredCache below it; every block it reads back is checked."""

    def __init__(self, backend, cache, views, data, gpu_blocks):
        self.backend, self.cache, self.views, self.data = backend, cache, views, data
        self.gpu = OrderedDict()
        self.free = list(range(gpu_blocks))[::-1]
        self.hits = Hits()
        self.verified = self.failures = self.gpu_evictions = 0
        self.failed = []            # (request, hash, rank) of the first few failures
        self.lookup_seconds = 0.0

    def request(self, number, h, corrupt=False):
        gpu, cache = self.gpu, self.cache
        k = 0
        for key in h:
            if key not in gpu:
                break
            k += 1
        for key in reversed(h[:k]):
            gpu.move_to_end(key)
        hit_blocks = [gpu[key] for key in h[:k]]
        self._check(number, h[:k], hit_blocks)
        for key in h[k:]:                   # resident past a miss: only in a trace that is not a chain
            if key in gpu:
                self.free.append(gpu.pop(key))
        blocks, victims = self._take(len(h) - k)
        if victims:                         # their bytes go to the CPU tier before the blocks are reused
            cache.store([key for key, _ in reversed(victims)], [b for _, b in reversed(victims)]).result(60)
        t0 = time.perf_counter()
        m, from_l3 = cache.lookup_tiers(h[k:])
        self.lookup_seconds += time.perf_counter() - t0
        if m:
            cache.load(h[k:k + m], blocks[:m]).result(60)
            self._check(number, h[k:k + m], blocks[:m])
        computed = blocks[m:]
        if computed:
            for rank, view in enumerate(self.views):
                write_blocks(view, computed, self.data.images(h[k + m:], rank))
            if corrupt:
                self.views[0].write(0, self.views[0].read(0, computed[:1]) ^ np.uint8(1), computed[:1])
        cache.store(h, hit_blocks + blocks).result(60)
        for key, block in zip(reversed(h), reversed(hit_blocks + blocks)):
            gpu[key] = block
            gpu.move_to_end(key)
        self.hits.add(k, m - from_l3, len(h), from_l3)

    def _take(self, n):
        blocks = [self.free.pop() for _ in range(min(n, len(self.free)))]
        victims = [self.gpu.popitem(last=False) for _ in range(n - len(blocks))]
        self.gpu_evictions += len(victims)
        return blocks + [b for _, b in victims], victims

    def _check(self, number, hashes, blocks):
        if not blocks:
            return
        for rank, view in enumerate(self.views):
            bad = mismatched(view, blocks, self.data.images(hashes, rank))
            self.failures += len(bad)
            self.failed += [(number, hashes[i], rank) for i in bad[:max(0, 5 - len(self.failed))]]
        self.verified += len(blocks)


def replay(args, trace, spec, settings, report):
    """Run the trace through a deployment; fills report, returns the engine model."""
    from .. import metrics

    backend = SwapBackend(spec, tp_size=args.tp, device=args.device, settings=settings, store=args.store_url)
    report["suffix"] = backend.suffix
    workers, views, server = [], [], None
    with backend:
        try:
            workers = start_workers(backend, args, "numpy" if backend.device == "sim" else "torch")
            wait_until_ready(backend, workers, timeout=120)
            ops = get_ops(backend.device)
            views = [ops.attach(read_manifest(backend.suffix, r), spec.tensors(r, backend.device_ids[r]),
                                backend.suffix) for r in range(args.tp)]
            # a namespace of this run's own: a store that outlives runs must not answer from an earlier one
            cache = TieredCache(backend, namespace=f"trace/{os.path.basename(args.trace)}/{backend.suffix}",
                                policy=args.policy)
            if args.metrics_port is not None:
                server = metrics.serve(args.metrics_port, backend=backend, caches=[cache])
                print(f"  metrics on {server.url}", flush=True)
            engine = Engine(backend, cache, views, HashBytes(spec), args.gpu_blocks)
            t0 = last = time.perf_counter()
            for number, h in enumerate(trace.requests):
                engine.request(number, h, corrupt=args.inject_corruption and number == 0)
                if time.perf_counter() - last > 10:
                    last = time.perf_counter()
                    print(f"  ... {number + 1}/{len(trace.requests)} requests, "
                          f"{engine.failures} verification failures", flush=True)
            report["replay_seconds"] = time.perf_counter() - t0
            report["tier"] = {k: v for k, v in cache.stats().items() if not k.endswith("latency")}
            report["swap_tasks"] = {f"{d}/{o}": n for (d, o), n in backend.counters.snapshot()["tasks"].items()}
            report["lookup_us_mean"] = engine.lookup_seconds / max(1, len(trace.requests)) * 1e6
            cache.close()
            return engine
        finally:
            if server is not None:
                server.close()
            for view in views:
                view.close()
            stop_workers(workers)


@contextlib.contextmanager
def store_for_run(args, report, spec):
    """Start the store --store asks for (a local Mooncake, a temporary directory), or use the URL given;
    sets args.store_url for the replay."""
    args.store_url = None
    if not args.store:
        yield
        return
    with contextlib.ExitStack() as stack:
        if args.store == "mooncake":
            from ..store.keys import HEADER_BYTES
            from ..store.service import MooncakeService
            need = report["distinct_blocks"] * (spec.cpu_block_bytes + HEADER_BYTES) * args.tp    # every object
            mb = args.store_mb or int(need * 1.3 / 2**20) + 64      # Mooncake evicts above 90% full
            args.store_url = stack.enter_context(MooncakeService(segment_mb=mb)).url
            report["store_mb"] = mb
        elif args.store == "file":
            args.store_url = "file://" + stack.enter_context(tempfile.TemporaryDirectory(prefix="fastcache-trace-"))
        else:
            args.store_url = args.store
        report["store"] = args.store_url
        print(f"  store {args.store_url}", flush=True)
        yield


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        settings = Settings.from_env()
        for name in ("gpu_blocks", "cpu_blocks", "tp"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if args.requests is not None and args.requests < 1:
            raise ValueError("--requests must be >= 1")
        if args.store not in (None, "mooncake", "file"):
            from ..store import parse_store_url
            parse_store_url(args.store)
        trace = load_trace(args.trace, args.requests)
        longest = max(map(len, trace.requests))
        if longest > args.gpu_blocks:
            raise ValueError(f"a request of the trace has {longest} blocks: --gpu-blocks must hold it")
        args.device = resolve_device(args.device)
        spec = CacheSpec(num_layers=args.num_layers, num_gpu_blocks=args.gpu_blocks,
                         num_cpu_blocks=args.cpu_blocks, block_size=BLOCK_TOKENS,
                         num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, cache_dtype=args.cache_dtype)
        if args.plot:
            import matplotlib  # noqa: F401  (refused now, not after the replay)
    except (OSError, ValueError, ImportError) as exc:
        print(f"fastcache.tools.trace: {exc}", file=sys.stderr)
        return 2
    report = {"trace": args.trace, "requests": len(trace.requests), "blocks": trace.blocks,
              "distinct_blocks": len({x for h in trace.requests for x in h}), "tp": args.tp,
              "device": args.device, "gpu_blocks": args.gpu_blocks, "cpu_blocks": args.cpu_blocks,
              "block_bytes_per_rank": spec.cpu_block_bytes, "tensors_per_rank": len(spec.tensors())}
    print(f"fastcache trace: {report['requests']} requests, {report['blocks']} blocks; GPU {args.gpu_blocks} "
          f"blocks, CPU tier {args.cpu_blocks} blocks of {spec.cpu_block_bytes // 1024} KiB per rank, "
          f"tp={args.tp} on {args.device}", flush=True)
    t0 = time.perf_counter()
    model = simulate(trace.requests, args.gpu_blocks, args.cpu_blocks, l3=bool(args.store), policy=args.policy)
    report["model_seconds"] = time.perf_counter() - t0
    limit = infinite(trace.requests)
    try:
        with store_for_run(args, report, spec):
            engine = replay(args, trace, spec, settings, report)
    except ValueError as exc:           # the deployment refused the geometry (e.g. too big for memory)
        print(f"fastcache.tools.trace: {exc}", file=sys.stderr)
        return 2
    report["replay"], report["model"] = engine.hits.rates(), model.rates()
    report["infinite_hit_rate"] = limit.rates()["hit_rate"]
    report["policy"] = args.policy
    report["belady_hit_rate"] = simulate(trace.requests, args.gpu_blocks, args.cpu_blocks,
                                         policy="belady").rates()["hit_rate"]
    report["equal_to_model"] = (engine.hits.gpu, engine.hits.cpu, engine.hits.l3) == (model.gpu, model.cpu, model.l3)
    report["verified_blocks"], report["verification_failures"] = engine.verified, engine.failures
    report["first_failures"] = [{"request": r, "hash": h, "rank": k} for r, h, k in engine.failed]
    report["gpu_evictions"] = engine.gpu_evictions
    leftovers = [e for e in os.listdir(SHM_DIR) if e.startswith(f"{PREFIX}.{report['suffix']}.")]
    report["shm_leftovers"] = leftovers
    if args.plot:
        from .trace_plot import plot
        sweep = {c: simulate(trace.requests, args.gpu_blocks, c, policy=args.policy).rates() for c in SWEEP}
        plot(args.plot, trace, engine.hits, model, limit, sweep, args)
        report["plot"] = args.plot
    report["wall_seconds"] = time.perf_counter() - start
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    ok = report["equal_to_model"] and not engine.failures and not leftovers
    return 0 if ok else 1


def print_report(r):
    rep, mod = r["replay"], r["model"]
    tier = r["tier"]
    l3 = (lambda x: f", store {x['l3_hit_rate']:.2%}") if r.get("store") else (lambda x: "")
    print("\nfastcache trace report")
    print(f"  trace           {r['trace']}: {r['requests']} requests, {r['blocks']} blocks "
          f"({r['distinct_blocks']} distinct)")
    print(f"  hit rate        GPU {rep['gpu_hit_rate']:.2%}, CPU tier {rep['cpu_hit_rate']:.2%}{l3(rep)}, "
          f"total {rep['hit_rate']:.2%} (infinite cache: {r['infinite_hit_rate']:.2%}; Belady's offline "
          f"choice at this capacity: {r['belady_hit_rate']:.2%})")
    print(f"  model ({r['policy']:>6}) GPU {mod['gpu_hit_rate']:.2%}, CPU tier {mod['cpu_hit_rate']:.2%}{l3(mod)}, "
          f"total {mod['hit_rate']:.2%}: {'equal' if r['equal_to_model'] else 'DIFFERENT'}")
    if r.get("store"):
        print(f"  store           {r['store']}: {tier['l3_written_blocks']} blocks written back "
              f"({tier['l3_written_bytes'] / 2**30:.2f} GiB), {tier['l3_loaded_blocks']} fetched "
              f"({tier['l3_loaded_bytes'] / 2**30:.2f} GiB), {tier['l3_errors']} errors")
    print(f"  moved           {tier['loaded_blocks']} blocks loaded ({tier['loaded_bytes'] / 2**30:.2f} GiB), "
          f"{tier['stored_blocks']} stored ({tier['stored_bytes'] / 2**30:.2f} GiB), {tier['evicted']} evicted "
          f"from the CPU tier, {r['gpu_evictions']} from the GPU")
    print(f"  verified        {r['verified_blocks']} blocks read back (every rank), "
          f"{r['verification_failures']} failures")
    print(f"  time            replay {r['replay_seconds']:.1f} s ({r['requests'] / r['replay_seconds']:.0f} "
          f"requests/s), lookup {r['lookup_us_mean']:.1f} us per request, wall {r['wall_seconds']:.1f} s")
    if r.get("plot"):
        print(f"  plot            {r['plot']}")
    ok = r["equal_to_model"] and not r["verification_failures"] and not r["shm_leftovers"]
    print(f"  result          {'PASSED' if ok else 'FAILED'}")


if __name__ == "__main__":
    sys.exit(main())
