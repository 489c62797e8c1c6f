"""What streaming offloaded weights costs a forward: the small model of fastcache.launch.model (a stack of
matrix layers) run all resident and with 25, 50 and 75% of its layers offloaded, streamed through a ring of
2 slots by the transfer managers while the worker processes compute (sim device, a real deployment).

    python benchmarks/offload_bench.py [--layers 16] [--hidden 1024] [--batch 64] [--runs 5] [--tp 1]

Prints, per fraction, the best forward time of --runs (the slowest rank's) and its ratio to the resident
forward, all in one run; the resident deployment is timed before and after the streamed ones and its best
is the baseline. Every output is compared bit for bit with the resident one. A layer's compute should
exceed its copy for the stream to hide (--hidden sets both: compute grows as hidden^2 * batch, the copy as
hidden^2).
"""
import argparse

import numpy as np

from fastcache.launch.offload import timed_run

FRACTIONS = (0.25, 0.5, 0.75)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args()
    shape = dict(layers=args.layers, hidden=args.hidden, batch=args.batch, repeats=args.runs, tp=args.tp)
    layer_mib = (args.hidden * args.hidden + args.hidden) * 4 / 2**20
    print(f"offload_bench: {args.layers} layers of {args.hidden}x{args.hidden} float32 ({layer_mib:.1f} MiB each), "
          f"batch {args.batch}, tp {args.tp}, sim, best of {args.runs}")
    resident, first, _ = timed_run(0.0, **shape)
    streamed = {f: timed_run(f, **shape) for f in FRACTIONS}
    _, again, _ = timed_run(0.0, **shape)
    base = min(first, again)
    print(f"  resident           {base * 1e3:8.2f} ms per forward")
    for fraction, (outs, seconds, layout) in streamed.items():
        same = all(np.array_equal(a, b) for a, b in zip(outs, resident))
        print(f"  {fraction:4.0%} offloaded      {seconds * 1e3:8.2f} ms per forward  {seconds / base:5.2f}x resident  "
              f"({len(layout.streamed_layers)} layers streamed, ring of {layout.ring_slots}; outputs "
              f"{'bit-identical' if same else 'DIFFER'})")
        if not same:
            raise SystemExit("a streamed forward's output differs from the resident one")


if __name__ == "__main__":
    main()
