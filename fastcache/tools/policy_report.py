"""python -m fastcache.tools.policy_report: every eviction policy against Belady's ceiling, per trace and size.

For each trace and each total capacity C (the engine's GPU prefix cache of --gpu-blocks plus a CPU tier of
C - gpu blocks), the trace model (fastcache.tools.trace_model.simulate, which the trace tool's replay
matches block for block) gives the hit rate of each policy in fastcache/eviction.py and of Belady's offline
choice (the CPU tier evicts what is used farthest ahead). Printed as a table with each policy's share of
Belady's; --json writes the figures, --plot draws hit rate against capacity, one panel per trace.

    python -m fastcache.tools.policy_report --trace conversation_trace.jsonl --trace agent.jsonl \\
        [--capacities 2000,4000,8000,16000,32000] [--gpu-blocks 1000] [--no-write-back] [--plot policies.png]
        [--json out.json]

--no-write-back models an engine whose GPU cache drops what it evicts (vLLM's offloading connector stores a
block only when it is computed) instead of storing it in the CPU tier.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..eviction import POLICIES
from .trace_model import infinite, load_trace, simulate

CAPACITIES = (2000, 4000, 8000, 16000, 32000)


def compare(requests, capacities, gpu_blocks: int, write_back: bool = True) -> dict:
    """{capacity: {policy or "belady": hit rate}} and the infinite cache's, for one trace."""
    rows = {}
    for capacity in capacities:
        rows[capacity] = {name: simulate(requests, gpu_blocks, capacity - gpu_blocks, policy=name,
                                         write_back=write_back).rates()["hit_rate"]
                          for name in (*sorted(POLICIES), "belady")}
    return {"capacities": rows, "infinite": infinite(requests).rates()["hit_rate"]}


def print_table(name, result):
    policies = sorted(POLICIES)
    print(f"\n{name} (a cache that never evicts: {result['infinite']:.1%})")
    print("  blocks  " + "  ".join(f"{p:>15}" for p in policies) + "   belady")
    for capacity, rates in result["capacities"].items():
        ceiling = rates["belady"]
        cells = [f"{rates[p]:6.1%} ({rates[p] / ceiling:4.0%})" if ceiling else f"{rates[p]:6.1%}" for p in policies]
        print(f"  {capacity:6d}  " + "  ".join(f"{c:>15}" for c in cells) + f"   {ceiling:6.1%}")


def plot(path, results):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (name, result) in zip(axes[0], results.items()):
        caps = list(result["capacities"])
        for policy in (*sorted(POLICIES), "belady"):
            ax.plot(caps, [result["capacities"][c][policy] * 100 for c in caps], marker="o", label=policy,
                    linestyle="--" if policy == "belady" else "-")
        ax.axhline(result["infinite"] * 100, color="grey", linewidth=0.8, label="never evicts")
        ax.set_xscale("log", base=2)
        ax.set_xticks(caps, [f"{c // 1000}k" for c in caps])
        ax.set_title(name)
        ax.set_xlabel("blocks (GPU + CPU tier)")
        ax.set_ylabel("hit rate, %")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastcache.tools.policy_report", description=__doc__.split("\n")[0])
    p.add_argument("--trace", action="append", required=True, help="a JSONL trace (repeat for several)")
    p.add_argument("--capacities", default=",".join(map(str, CAPACITIES)),
                   help="total blocks, GPU cache included (comma-separated)")
    p.add_argument("--gpu-blocks", type=int, default=1000)
    p.add_argument("--requests", type=int, help="only the first N requests of each trace")
    p.add_argument("--no-write-back", dest="write_back", action="store_false",
                   help="the GPU drops its victims instead of storing them in the CPU tier (vLLM's connector)")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    try:
        capacities = [int(c) for c in args.capacities.split(",")]
    except ValueError:
        p.error(f"--capacities must be whole numbers separated by commas, got {args.capacities!r}")
    if args.gpu_blocks < 1 or any(c <= args.gpu_blocks for c in capacities):
        p.error("every capacity must exceed --gpu-blocks (which must be positive)")
    results = {}
    for path in args.trace:
        try:
            trace = load_trace(path, args.requests)
        except (OSError, ValueError) as exc:
            print(f"fastcache.tools.policy_report: {exc}", file=sys.stderr)
            return 2
        if max(map(len, trace.requests)) > args.gpu_blocks:
            p.error(f"{path}: a request of {max(map(len, trace.requests))} blocks does not fit --gpu-blocks")
        results[os.path.basename(path)] = result = compare(trace.requests, capacities, args.gpu_blocks, args.write_back)
        print_table(os.path.basename(path), result)
    if args.plot:
        plot(args.plot, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
