"""What streaming offloaded weights costs a forward: the small model of fastcache.launch.model (a stack of
matrix layers, x <- tanh(x @ w + b), float32) run all resident and with 25, 50 and 75% of its layers offloaded,
streamed through a ring of 2 slots by the transfer managers while the worker processes compute.

    python benchmarks/offload_bench.py [--device auto|cuda|sim] [--framework numpy|torch|cupy]
                                       [--layers 16] [--hidden H] [--batch B] [--runs 5] [--tp 1]

--device auto is cuda when a GPU is usable and torch or CuPy is installed (--framework picks one; default
torch), else sim (NumPy in shared memory). On cuda the forward runs on the GPU and is timed after a
synchronize, so the figures are GPU time.

Prints, per fraction, the best forward time of --runs (the slowest rank's) and its ratio to the resident
forward, all in one run; the resident deployment is timed before and after the streamed ones and its best
is the baseline. Every output is compared bit for bit with the resident one. Then per layer: a resident
layer's compute (the resident forward / layers), a layer's copy (its bytes over the host-to-device rate
measured in a worker: pinned memory to the GPU on cuda, a memcpy on sim) and, per fraction, what a streamed
layer adds up to ((forward - resident layers' compute) / streamed layers). Streaming hides when a layer's
compute exceeds its copy: the copy of the next layer runs while this one computes, and a streamed layer
should then cost at most ~1.2x a resident one.

Defaults. sim: hidden 1024, batch 64. cuda: hidden 8192, batch 4096, chosen so compute exceeds copy on an
H100: a layer is 8192 * 8192 * 4 B = 256 MiB, ~5 ms to copy at ~55 GB/s (PCIe Gen5, pinned); its matmul is
2 * 4096 * 8192^2 = 550 GFLOP, ~11 ms at ~50 TFLOPS of float32 (no TF32), so compute is ~2x copy. Compute
grows as batch * hidden^2, the copy as hidden^2: halve --batch and compute roughly meets copy. Memory on
cuda: resident layers + 2 ring slots of 256 MiB on the GPU and --layers * 256 MiB of pinned shared memory
(/dev/shm) per rank; a forward's input and output are 128 MiB each.
"""
import argparse
import importlib.util

import numpy as np

from fastcache.launch.model import pick_framework
from fastcache.launch.offload import SHAPES, timed_run
from fastcache.ops import cuda_usable

FRACTIONS = (0.25, 0.5, 0.75)
# cuda: the shape --offload-weights runs (the arithmetic above); sim: larger than its quick check
DEFAULTS = {"sim": dict(hidden=1024, batch=64), "cuda": {k: SHAPES["cuda"][k] for k in ("hidden", "batch")}}


def pick_device(device: str, framework: str | None) -> str:
    """auto: cuda when a GPU is usable and a GPU framework (the one asked for, else torch or CuPy) is
    installed; else sim."""
    if device != "auto":
        return device
    if framework == "numpy" or not cuda_usable():
        return "sim"
    candidates = [framework] if framework else ["torch", "cupy"]
    return "cuda" if any(importlib.util.find_spec(f) for f in candidates) else "sim"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "sim"))
    p.add_argument("--framework", default=None, choices=("numpy", "torch", "cupy"),
                   help="default: numpy on sim; on cuda torch when importable, else cupy")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=None, help="default: 1024 on sim, 8192 on cuda")
    p.add_argument("--batch", type=int, default=None, help="default: 64 on sim, 4096 on cuda")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args()
    device = pick_device(args.device, args.framework)
    try:
        framework = pick_framework(device, args.framework)
    except ValueError as exc:
        raise SystemExit(f"offload_bench: {exc}")
    hidden = args.hidden or DEFAULTS[device]["hidden"]
    batch = args.batch or DEFAULTS[device]["batch"]
    shape = dict(layers=args.layers, hidden=hidden, batch=batch, repeats=args.runs, tp=args.tp, device=device,
                 framework=framework)
    layer_bytes = (hidden * hidden + hidden) * 4
    print(f"offload_bench: {args.layers} layers of {hidden}x{hidden} float32 ({layer_bytes / 2**20:.1f} MiB each), "
          f"batch {batch}, tp {args.tp}, {device} ({framework}), best of {args.runs}")
    first = timed_run(0.0, measure_copy=True, **shape)
    streamed = {f: timed_run(f, **shape) for f in FRACTIONS}
    again = timed_run(0.0, **shape)
    base = min(first.seconds, again.seconds)
    print(f"  resident           {base * 1e3:8.2f} ms per forward")
    for fraction, run in streamed.items():
        same = all(np.array_equal(a, b) for a, b in zip(run.outputs, first.outputs))
        print(f"  {fraction:4.0%} offloaded      {run.seconds * 1e3:8.2f} ms per forward  {run.seconds / base:5.2f}x "
              f"resident  ({len(run.layout.streamed_layers)} layers streamed, ring of {run.layout.ring_slots}; "
              f"outputs {'bit-identical' if same else 'DIFFER'})")
        if not same:
            raise SystemExit("a streamed forward's output differs from the resident one")

    compute, copy = base / args.layers, first.copy_seconds
    print("  per layer")
    print(f"    resident layer compute  {compute * 1e3:8.3f} ms  ({2 * batch * hidden**2 / compute / 1e12:.2f} TFLOPS)")
    print(f"    layer copy              {copy * 1e3:8.3f} ms  ({layer_bytes / copy / 1e9:.1f} GB/s, measured in a "
          f"worker: {'pinned host to GPU' if device == 'cuda' else 'memcpy'})")
    verdict = "compute exceeds copy: streaming can hide" if compute > copy else "copy exceeds compute: it shows"
    print(f"    compute / copy          {compute / copy:8.2f}   ({verdict})")
    for fraction, run in streamed.items():
        n = len(run.layout.streamed_layers)
        if not n:
            continue
        per = (run.seconds - run.layout.resident_layers * compute) / n
        print(f"    {fraction:4.0%} offloaded: a streamed layer {per * 1e3:8.3f} ms  {per / compute:5.2f}x a resident "
              f"one (target when compute > copy: <= 1.2x)")


if __name__ == "__main__":
    main()
