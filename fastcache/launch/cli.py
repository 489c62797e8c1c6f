"""python -m fastcache.launch: start a whole deployment on this machine and prove it works.

It starts the engine (this process), one worker process and one transfer manager per rank, then runs a
verifying workload: random data in every cache tensor, random block mappings, swap out, overwrite,
swap in elsewhere, and every byte compared with what it must be. Then prefix reuse: multi-turn
conversations through a TieredCache (lookup, load of the cached prefix, store of the rest), every loaded
block compared with the bytes its hash implies. It measures one-block latency and
bulk throughput against a plain memcpy of the same bytes, runs clear/restore cycles (RL weight
updates) and prints a report. Exit status 0 only if every check passed; nothing is left running and
nothing is left in /dev/shm.
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import numpy as np

from ..config import CACHE_DTYPES, CacheSpec, Settings
from ..engine import SwapBackend
from ..ops import resolve_device, round_robin_devices
from ..ops.frameworks import FRAMEWORKS
from ..store import StoreError, parse_store_url
from ..store.service import store_for_run
from .harness import conclude, start_workers, stop_workers, wait_until_ready
from .liquid import liquid_weights, parse_tps, run_liquid
from .model import pick_framework
from .offload import run_offload
from .verify import Checks, Verifier
from .workload import measure, prefix_reuse, rl_cycles, run_workload, store_round

# host-memory frameworks hold the sim device's tensors; GPU frameworks the cuda device's
DEVICE_FRAMEWORKS = {"sim": ("numpy", "paddle", "torch"), "cuda": ("torch", "cupy", "paddle")}


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m fastcache.launch", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("deployment")
    g.add_argument("--tp", type=int, default=2, help="tensor-parallel size: workers and transfer managers")
    g.add_argument("--device", default="auto", choices=("auto", "sim", "cuda"),
                   help="auto = cuda when a GPU is usable, else sim (shared memory)")
    g.add_argument("--framework", default=None, choices=FRAMEWORKS,
                   help="framework the workers allocate with (default: numpy on sim, torch on cuda)")
    g.add_argument("--store", default=None,
                   help="an L3 store below the CPU tier: mooncake (a local master and memory server for the run), "
                        "file (a temporary directory), or a mooncake://HOST:PORT or file:///DIR URL")
    g = p.add_argument_group("cache geometry (per rank)")
    g.add_argument("--num-layers", type=int, default=8)
    g.add_argument("--num-gpu-blocks", type=int, default=512)
    g.add_argument("--num-cpu-blocks", type=int, default=256)
    g.add_argument("--block-size", type=int, default=16, help="tokens per block")
    g.add_argument("--num-kv-heads", type=int, default=4)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--cache-dtype", default="bfloat16", choices=CACHE_DTYPES)
    g = p.add_argument_group("workload")
    g.add_argument("--duration", type=float, default=3.0, help="seconds of random verified swaps")
    g.add_argument("--prefix-requests", type=int, default=200,
                   help="requests of the prefix-reuse workload (multi-turn conversations over a TieredCache)")
    g.add_argument("--rl-cycles", type=int, default=1, help="clear/restore cycles (RL weight updates)")
    g.add_argument("--latency-samples", type=int, default=300, help="one-block round trips timed")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    g.add_argument("--reshard", metavar="TPS", default=None,
                   help="liquid resharding instead of the swap workload: tp sizes to go through, e.g. 1,2,4,2,1 "
                        "(the first is the starting tp; --num-kv-heads is per rank at it); every block verified "
                        "after every step (docs/design.md §9)")
    g.add_argument("--reshard-cycles", type=int, default=2, help="times to go through the --reshard tp sizes")
    g.add_argument("--no-weights", dest="reshard_weights", action="store_false",
                   help="--reshard moves the KV only (by default a model's weights, column-split, row-split and "
                        "replicated tensors, are registered and move with it, every byte verified)")
    g.add_argument("--offload-weights", metavar="FRACTION", type=float, default=None,
                   help="instead of the swap workload: a small model run all resident and with this fraction of its "
                        "layers offloaded and streamed through a ring of 2 slots; outputs compared bit for bit, "
                        "the time of each reported; on cuda the workers compute on the GPU with torch or cupy "
                        "(docs/design.md §11)")
    g.add_argument("--inject-corruption", action="store_true",
                   help="flip one byte behind fastcache's back, to see a check fail (exit status 1)")
    return p


def print_report(report, checks):
    print("\nfastcache launch report")
    print(f"  deployment      tp={report['tp']} device={report['device']} framework={report['framework']}")
    print(f"  cache per rank  {report['gpu_cache_mib']:.1f} MiB GPU, {report['cpu_cache_mib']:.1f} MiB CPU tier, "
          f"{report['tensors']} tensors, {report['cpu_block_kib']:.1f} KiB per block (all layers)")
    if "random_rounds" in report:
        print(f"  verified swaps  {report['random_rounds']} random rounds, {report['random_blocks']} blocks each way")
    if "prefix_requests" in report:
        print(f"  prefix reuse    {report['prefix_requests']} requests, {report['prefix_blocks']} blocks: "
              f"{report['prefix_hits']} hits ({report['prefix_hit_rate']:.1%}) loaded from the CPU tier and "
              f"verified, {report['prefix_stored']} computed and stored, {report['prefix_evicted']} evicted "
              f"(cache of {report['prefix_capacity']} CPU blocks)")
    if "prefix_l3_hits" in report:
        print(f"  store (L3)      {report['store']}: {report['prefix_l3_hits']} prefix hits only the store held, "
              f"{report['prefix_l3_loaded']} blocks fetched and verified, {report['prefix_l3_written']} written back")
    if "l3_put_gbps" in report:
        print(f"  store bulk      put {report['l3_put_gbps']:.2f} GB/s, get {report['l3_get_gbps']:.2f} GB/s of "
              f"{report['l3_bytes'] / 2**20:.0f} MiB (whole CPU blocks, every byte verified)")
    if "latency_p50_ms" in report:
        print(f"  one-block task  p50 {report['latency_p50_ms']:.3f} ms, p99 {report['latency_p99_ms']:.3f} ms "
              f"({report['one_block_bytes'] / 1024:.0f} KiB over all ranks)")
        print(f"  bulk swap       out {report['swap_out_gbps']:.2f} GB/s ({report['swap_out_vs_memcpy']:.2f} x memcpy), "
              f"in {report['swap_in_gbps']:.2f} GB/s ({report['swap_in_vs_memcpy']:.2f} x memcpy); "
              f"memcpy {report['memcpy_gbps']:.2f} GB/s, task {report['bulk_bytes'] / 2**20:.0f} MiB")
    if "clear_ms" in report:
        print(f"  RL cycles       {report['rl_cycles']}: clear {report['clear_ms']:.1f} ms, restore "
              f"{report['restore_ms']:.1f} ms, memory returned {report['memory_returned_mib']:.1f} MiB")
    status = "PASSED" if not checks.failed else "FAILED"
    print(f"  checks          {checks.passed} passed, {len(checks.failed)} failed: {status}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()      # a bad FASTCACHE_* value: refused before anything starts
    except ValueError as exc:
        print(f"fastcache.launch: {exc}", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    framework = args.framework or ("numpy" if device == "sim" else "torch")
    if framework not in DEVICE_FRAMEWORKS[device]:
        print(f"fastcache.launch: framework {framework!r} does not run on device {device!r} "
              f"(choose from {', '.join(DEVICE_FRAMEWORKS[device])})", file=sys.stderr)
        return 2
    try:
        spec = CacheSpec(num_layers=args.num_layers, num_gpu_blocks=args.num_gpu_blocks,
                         num_cpu_blocks=args.num_cpu_blocks, block_size=args.block_size,
                         num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, cache_dtype=args.cache_dtype)
    except ValueError as exc:
        print(f"fastcache.launch: {exc}", file=sys.stderr)
        return 2
    if args.offload_weights is not None:       # the weight path (offload.py)
        if not 0 <= args.offload_weights <= 1:
            print("fastcache.launch: --offload-weights takes a fraction in [0, 1]", file=sys.stderr)
            return 2
        try:        # the model computes with numpy or torch on sim, torch or cupy on cuda (not paddle)
            model_framework = pick_framework(device, args.framework)
            round_robin_devices(device, args.tp)
        except ValueError as exc:
            print(f"fastcache.launch: --offload-weights: {exc}", file=sys.stderr)
            return 2
        return run_offload(args.offload_weights, device, args.tp, framework=model_framework)
    if args.reshard:        # liquid resharding (liquid.py): the first tp size is the start
        try:
            args.reshard = parse_tps(args.reshard, args.reshard_cycles, spec.num_kv_heads)
        except ValueError as exc:
            print(f"fastcache.launch: --reshard: {exc}", file=sys.stderr)
            return 2
        args.tp = args.reshard[0]
    rng = np.random.default_rng(args.seed)
    checks = Checks()
    report = {"tp": args.tp, "device": device, "framework": framework, "tensors": len(spec.tensors()),
              "gpu_cache_mib": spec.gpu_cache_bytes / 2**20, "cpu_cache_mib": spec.cpu_cache_bytes / 2**20,
              "cpu_block_kib": spec.cpu_block_bytes / 1024, "rl_cycles": args.rl_cycles}
    print(f"fastcache: starting tp={args.tp} on {device} ({framework} workers)", flush=True)
    workers = []
    with contextlib.ExitStack() as stack:
        try:
            if args.store not in (None, "mooncake", "file"):
                parse_store_url(args.store)
            store = stack.enter_context(store_for_run(args.store))
            if store:
                report["store"] = store
                print(f"  store {store}", flush=True)
            # on a machine with fewer GPUs than ranks, ranks share them (a one-GPU machine runs tp=2 on GPU 0)
            weights = liquid_weights(spec, args.tp) if args.reshard and args.reshard_weights else None
            backend = SwapBackend(spec, tp_size=args.tp, device=device, settings=settings, store=store,
                                  device_ids=round_robin_devices(device, args.tp), weights=weights)
        except (ValueError, StoreError) as exc:
            print(f"fastcache.launch: {exc}", file=sys.stderr)
            return 2
        if args.reshard:
            return run_liquid(backend, args, framework, rng, checks, report)
        return run(backend, args, spec, device, framework, rng, checks, report, workers)


def run(backend, args, spec, device, framework, rng, checks, report, workers) -> int:
    with backend:
        suffix = backend.suffix
        try:
            workers = start_workers(backend, args, framework)
            wait_until_ready(backend, workers, timeout=120)
            print(f"  ready: transfer managers {backend.transfer_pids}, workers {[w.pid for w in workers]}",
                  flush=True)
            verifier = Verifier(backend, device, rng)
            verifier.attach()
            verifier.fill_all()
            print("  random verified swaps ...", flush=True)
            run_workload(backend, verifier, checks, args, rng, report)
            if args.prefix_requests:
                print("  prefix reuse ...", flush=True)
                prefix_reuse(backend, verifier, checks, args, rng, report)
            print("  latency and throughput ...", flush=True)
            measure(backend, verifier, checks, args, rng, report)
            if backend.store_url is not None:
                store_round(backend, checks, rng, report)
            if args.rl_cycles:
                print(f"  {args.rl_cycles} clear/restore cycle(s) ...", flush=True)
                rl_cycles(backend, verifier, checks, args, rng, report)
            verifier.detach()
        except Exception as exc:     # any failure is a failed check, reported, never a hang
            checks.check(False, f"workload aborted: {type(exc).__name__}: {exc}")
        finally:
            stop_workers(workers)
    return conclude(report, checks, suffix, args.json, print_report)
