"""How far ShadowPolicy's constants go: `shadow` with each constant moved either way, against the best of lru, arc
and probation at each trace and size (the trace model of fastcache.tools.policy_report: a GPU prefix cache above
the CPU tier), in one regime (write-back, or --no-write-back). Then the best of all those settings chosen per point
in hindsight: no online choice among them can do better, so where even that is not strictly above the best of
the three, no tuning of these constants is.

    python benchmarks/policy_variants.py --trace agent.jsonl [--trace ...] [--capacities 2000,4000] [--no-write-back]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastcache.eviction import ShadowPolicy  # noqa: E402
from fastcache.tools.trace_model import load_trace, simulate  # noqa: E402

BASELINES = ("lru", "arc", "probation")
# each constant of ShadowPolicy (and of the policies it builds on) one step either way
VARIANTS = {"shadow": {}, "ghosts 0.35": {"GHOSTS": 0.35}, "ghosts 0.75": {"GHOSTS": 0.75},
            "ghosts 1.0": {"GHOSTS": 1.0}, "step 1/512": {"STEP": 1 / 512}, "step 1/128": {"STEP": 1 / 128},
            "no-write-back step 1/64": {"NWB_STEP": 1 / 64}, "no-write-back step 1/256": {"NWB_STEP": 1 / 256},
            "on 0.05": {"ON": 0.05}, "on 0.2": {"ON": 0.2}, "lap step 1/64": {"LAP_STEP": 1 / 64},
            "lap step 1/1024": {"LAP_STEP": 1 / 1024}}
TIE = 0.0005        # points of hit rate: closer than this is a tie


def policy(name: str, capacity: int):
    return type(f"Shadow({name})", (ShadowPolicy,), VARIANTS[name])(capacity)


def measure(requests, capacities, gpu_blocks: int, write_back: bool) -> dict:
    """{capacity: {name: hit rate in %}} for the baselines and every variant."""
    out = {}
    for capacity in capacities:
        cpu = capacity - gpu_blocks
        rates = {name: simulate(requests, gpu_blocks, cpu, policy=name, write_back=write_back) for name in BASELINES}
        rates.update({name: simulate(requests, gpu_blocks, cpu, policy=policy(name, cpu), write_back=write_back)
                      for name in VARIANTS})
        out[capacity] = {name: 100 * hits.rates()["hit_rate"] for name, hits in rates.items()}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", action="append", required=True)
    parser.add_argument("--capacities", default="2000,4000", help="total blocks, GPU cache included")
    parser.add_argument("--gpu-blocks", type=int, default=1000)
    parser.add_argument("--requests", type=int, help="only the first N requests of each trace")
    parser.add_argument("--no-write-back", dest="write_back", action="store_false")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    capacities = [int(c) for c in args.capacities.split(",")]
    above = dict.fromkeys(list(VARIANTS) + ["best in hindsight"], 0)
    points, results = 0, {}
    for path in args.trace:
        rates = results[os.path.basename(path)] = measure(load_trace(path, args.requests).requests, capacities,
                                                          args.gpu_blocks, args.write_back)
        for capacity, rate in rates.items():
            best = max(rate[name] for name in BASELINES)
            gains = {name: rate[name] - best for name in VARIANTS}
            points += 1
            for name, gain in gains.items():
                above[name] += gain > TIE
            above["best in hindsight"] += max(gains.values()) > TIE
            if not args.json:
                print(f"{os.path.basename(path)} {capacity}: best of {', '.join(BASELINES)} {best:.2f}%; "
                      + ", ".join(f"{name} {gain:+.2f}" for name, gain in gains.items()))
    if args.json:
        print(json.dumps({"write_back": args.write_back, "rates": results, "strictly_above": above,
                          "points": points}))
        return
    print(f"strictly above the best of {', '.join(BASELINES)} ({'write-back' if args.write_back else 'no write-back'}),"
          f" of {points} points: " + ", ".join(f"{name} {n}" for name, n in above.items()))


if __name__ == "__main__":
    main()
