"""python -m fastcache.tools.soak: run a deployment for a long time and prove it neither breaks nor leaks.

It starts a tp-N deployment on the sim device with one worker PROCESS and one transfer manager per rank
(as python -m fastcache.launch does), then until the time is up:
  - random verified swaps: random blocks out, overwritten, swapped back in elsewhere, every byte compared;
  - a clear/restore cycle (an RL weight update) every --clear-every seconds, checking that clear returns
    the cache's memory;
  - a restart of a random rank's transfer manager every --restart-every seconds, with blocks swapped out
    before the restart verified in the CPU tier after it and swapped back in bit-exactly.
Every --report-every seconds it prints elapsed time, operations, errors, the engine's and the transfer
managers' RSS and the deployment's bytes in /dev/shm; at the end a summary. Exit status 0 only if no
operation failed, the engine's and the transfer managers' RSS grew by less than --max-rss-growth-mib
over the run (first sample after a warm-up that runs every kind of operation once), and nothing of the
deployment is left in /dev/shm or the temp directory. Ctrl-C ends the run early with the summary.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import psutil

from ..config import CACHE_DTYPES, CacheSpec
from ..engine import SwapBackend
from ..ipc.naming import PREFIX
from ..ipc.shm import SHM_DIR
from ..launch.harness import shm_bytes, start_workers, stop_workers, wait_until_ready
from ..launch.verify import Checks, Verifier
from ..launch.workload import random_swap_round, rl_cycles

MIB = 2**20


def build_parser():
    p = argparse.ArgumentParser(prog="python -m fastcache.tools.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--minutes", type=float, default=10.0, help="how long to run")
    g.add_argument("--seconds", type=float, help="how long to run, in seconds (overrides --minutes)")
    g.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", metavar="PATH", help="also write the summary (and every report line) as JSON")
    g.add_argument("--report-every", type=float, default=10.0, metavar="S", help="seconds between report lines")
    g.add_argument("--clear-every", type=float, default=20.0, metavar="S",
                   help="seconds between clear/restore cycles (0: none)")
    g.add_argument("--restart-every", type=float, default=30.0, metavar="S",
                   help="seconds between transfer-manager restarts (0: none)")
    g.add_argument("--max-rss-growth-mib", type=float, default=20.0,
                   help="largest RSS growth (engine, and transfer managers together) that still passes")
    g = p.add_argument_group("cache geometry (per rank)")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--num-gpu-blocks", type=int, default=128)
    g.add_argument("--num-cpu-blocks", type=int, default=64)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--cache-dtype", default="bfloat16", choices=CACHE_DTYPES)
    return p


def rss(pid: int) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


class Soak:
    def __init__(self, backend: SwapBackend, args, rng, errors: list[str]):
        self.backend, self.args, self.rng = backend, args, rng
        self.spec = backend.spec
        self.checks = Checks()
        self.errors = errors            # exceptions, appended by the caller
        self.counts = {"swap_rounds": 0, "clears": 0, "restarts": 0, "blocks": 0}
        self.samples: list[dict] = []
        self.verifier = Verifier(backend, "sim", rng)
        self.max_blocks = max(1, min(self.spec.num_cpu_blocks // 2, self.spec.num_gpu_blocks // 2, 64))
        self.report: dict = {}

    @property
    def ops(self) -> int:
        return self.counts["swap_rounds"] + self.counts["clears"] + self.counts["restarts"]

    @property
    def error_count(self) -> int:
        return len(self.errors) + len(self.checks.failed)

    # -- operations ------------------------------------------------------------------------------
    def swap_round(self):
        self.counts["blocks"] += random_swap_round(self.backend, self.verifier, self.checks, self.rng,
                                                   self.max_blocks)
        self.counts["swap_rounds"] += 1

    def clear_restore(self):
        """One RL weight update (launch's rl_cycles: detach, clear, memory check, restore, re-fill, a round)."""
        rl_cycles(self.backend, self.verifier, self.checks, SimpleNamespace(rl_cycles=1), self.rng, self.report)
        self.counts["clears"] += 1

    def restart(self):
        """Restart a random rank's transfer manager with blocks in the CPU tier; they must survive it."""
        backend, verifier, checks, rng = self.backend, self.verifier, self.checks, self.rng
        n = int(rng.integers(1, self.max_blocks + 1))
        src = rng.choice(self.spec.num_gpu_blocks, n, replace=False)
        cpu = np.array(backend.allocate_cpu_blocks(n))
        try:
            backend.swap_out(src, cpu).result(timeout=60)
            verifier.swapped_out(src, cpu)
            checks.check(verifier.cpu_matches(cpu), f"CPU tier holds {n} blocks before a restart")
            rank = int(rng.integers(self.backend.tp_size))
            old = backend.transfer_pids[rank]
            backend.restart_rank(rank, timeout=60)
            checks.check(backend.transfer_pids[rank] not in (0, old), f"rank {rank} has a new transfer manager")
            checks.check(verifier.cpu_matches(cpu), f"CPU tier kept {n} blocks across the restart of rank {rank}")
            verifier.overwrite(src)
            dst = rng.choice(self.spec.num_gpu_blocks, n, replace=False)
            backend.swap_in(dst, cpu).result(timeout=60)
            verifier.swapped_in(dst, cpu)
            checks.check(verifier.gpu_matches(dst),
                         f"{n} blocks swapped in bit-exactly after the restart of rank {rank}")
        finally:
            backend.free_cpu_blocks(cpu.tolist())
        self.counts["restarts"] += 1

    # -- measurements ----------------------------------------------------------------------------
    def sample(self, elapsed: float) -> dict:
        s = {"elapsed_s": round(elapsed, 2), "ops": self.ops, "errors": self.error_count, **self.counts,
             "engine_rss": rss(os.getpid()),
             "transfer_rss": sum(rss(p) for p in self.backend.transfer_pids if p),
             "shm_bytes": shm_bytes(self.backend.suffix)}
        self.samples.append(s)
        return s

    def print_sample(self, s):
        print(f"[{s['elapsed_s']:8.1f} s] ops {s['ops']:7d} (swap rounds {s['swap_rounds']}, clears {s['clears']}, "
              f"restarts {s['restarts']})  errors {s['errors']}  |  RSS engine {s['engine_rss'] / MIB:7.1f} MiB, "
              f"transfer managers {s['transfer_rss'] / MIB:7.1f} MiB  |  /dev/shm {s['shm_bytes'] / MIB:7.1f} MiB",
              flush=True)

    # -- the run ---------------------------------------------------------------------------------
    def run(self, duration: float):
        args = self.args
        start = time.monotonic()
        self.verifier.attach()
        self.verifier.fill_all()
        # warm-up: every kind of operation once, so first-touch allocations are behind the baseline
        self.swap_round()
        if args.clear_every > 0:
            self.clear_restore()
        if args.restart_every > 0:
            self.restart()
        self.swap_round()
        now = time.monotonic()
        self.print_sample(self.sample(now - start))
        next_report = now + args.report_every
        next_clear = now + args.clear_every if args.clear_every > 0 else float("inf")
        next_restart = now + args.restart_every if args.restart_every > 0 else float("inf")
        while time.monotonic() - start < duration and not self.error_count:
            self.swap_round()
            now = time.monotonic()
            if now >= next_clear:
                self.clear_restore()
                next_clear = time.monotonic() + args.clear_every
            if now >= next_restart:
                self.restart()
                next_restart = time.monotonic() + args.restart_every
            if now >= next_report:
                self.print_sample(self.sample(now - start))
                next_report = now + args.report_every
        self.print_sample(self.sample(time.monotonic() - start))


def summarize(soak: Soak | None, errors: list[str], leftovers, args, interrupted: bool) -> dict:
    samples = soak.samples if soak else []
    errors = errors + (soak.checks.failed if soak else [])

    def series(key):
        values = [s[key] for s in samples]
        return {"first": values[0], "last": values[-1], "max": max(values)} if values else \
            {"first": 0, "last": 0, "max": 0}

    summary = {"tp": args.tp, "seed": args.seed, "interrupted": interrupted,
               "elapsed_s": samples[-1]["elapsed_s"] if samples else 0.0,
               "ops": soak.ops if soak else 0, **(soak.counts if soak else {}),
               "errors": len(errors), "error_messages": errors[:20],
               "checks_passed": soak.checks.passed if soak else 0,
               "engine_rss": series("engine_rss"), "transfer_rss": series("transfer_rss"),
               "shm_bytes": series("shm_bytes"), "leftovers": leftovers,
               "max_rss_growth_mib": args.max_rss_growth_mib,
               "samples": samples}
    growth = {k: (summary[k]["last"] - summary[k]["first"]) / MIB for k in ("engine_rss", "transfer_rss")}
    summary["rss_growth_mib"] = growth
    failures = []
    if summary["errors"]:
        failures.append(f"{summary['errors']} error(s)")
    if not summary["ops"]:
        failures.append("no operation ran")
    for key, grew in growth.items():
        if grew >= args.max_rss_growth_mib:
            failures.append(f"{key.replace('_', ' ')} grew by {grew:.1f} MiB")
    if leftovers:
        failures.append(f"left behind: {leftovers}")
    summary["failures"] = failures
    summary["passed"] = not failures
    return summary


def print_summary(summary):
    def mib(key):
        s = summary[key]
        return f"first {s['first'] / MIB:.1f}, last {s['last'] / MIB:.1f}, max {s['max'] / MIB:.1f} MiB"

    print("\nfastcache soak summary")
    print(f"  ran             {summary['elapsed_s']:.1f} s, tp={summary['tp']}, seed={summary['seed']}"
          f"{' (interrupted)' if summary['interrupted'] else ''}")
    print(f"  operations      {summary['ops']} (swap rounds {summary.get('swap_rounds', 0)}, "
          f"blocks {summary.get('blocks', 0)} each way, clears {summary.get('clears', 0)}, "
          f"restarts {summary.get('restarts', 0)}), {summary['checks_passed']} checks passed")
    print(f"  errors          {summary['errors']}")
    for message in summary["error_messages"]:
        print(f"    {message}")
    print(f"  engine RSS      {mib('engine_rss')} (growth {summary['rss_growth_mib']['engine_rss']:+.1f} MiB)")
    print(f"  transfer RSS    {mib('transfer_rss')} (growth {summary['rss_growth_mib']['transfer_rss']:+.1f} MiB)")
    print(f"  /dev/shm        {mib('shm_bytes')}; left after exit: {len(summary['leftovers'])} item(s)")
    print(f"  result          {'PASSED' if summary['passed'] else 'FAILED: ' + '; '.join(summary['failures'])}",
          flush=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s [engine] %(levelname)s %(message)s")
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    if duration <= 0 or args.tp < 1 or args.report_every <= 0:
        print("fastcache.tools.soak: --minutes/--seconds, --tp and --report-every must be positive", file=sys.stderr)
        return 2
    try:
        spec = CacheSpec(num_layers=args.num_layers, num_gpu_blocks=args.num_gpu_blocks,
                         num_cpu_blocks=args.num_cpu_blocks, block_size=args.block_size,
                         num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, cache_dtype=args.cache_dtype)
        backend = SwapBackend(spec, tp_size=args.tp, device="sim")
    except ValueError as exc:
        print(f"fastcache.tools.soak: {exc}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    print(f"fastcache soak: tp={args.tp} on sim with worker processes, {duration:g} s, seed {args.seed}; "
          f"{spec.gpu_cache_bytes / MIB:.1f} MiB cache and {spec.cpu_cache_bytes / MIB:.1f} MiB CPU tier per rank",
          flush=True)
    soak, interrupted, workers, errors = None, False, [], []
    with backend:
        suffix, socket_dir = backend.suffix, backend.socket_dir
        try:
            workers = start_workers(backend, args, "numpy")
            wait_until_ready(backend, workers, timeout=120)
            print(f"  ready: transfer managers {backend.transfer_pids}, workers {[w.pid for w in workers]}",
                  flush=True)
            soak = Soak(backend, args, rng, errors)
            soak.run(duration)
        except KeyboardInterrupt:
            interrupted = True
        except Exception as exc:        # any failure is an error, reported, never a hang or a traceback
            errors.append(f"{type(exc).__name__}: {exc}")
            print(f"  ERROR: {type(exc).__name__}: {exc}", flush=True)
        finally:
            if soak is not None:
                soak.verifier.detach()
            stop_workers(workers)
    leftovers = sorted(e for e in os.listdir(SHM_DIR) if e.startswith(f"{PREFIX}.{suffix}."))
    if os.path.exists(socket_dir):
        leftovers.append(socket_dir)
    summary = summarize(soak, errors, leftovers, args, interrupted)
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
