"""python -m fastcache.launch.model_worker: a worker process that holds one rank's cache and weights and runs
the small model of model.py on command (docs/design.md §11; the `--offload-weights` run, tests, benchmark).

Commands are JSON lines on stdin, one JSON line answers each on stdout (no pickle):
  {"op": "load", "seed": S}                        draw weight version S and load every layer
  {"op": "forward", "task_id": T, "seed": X, "batch": B, "timeout": s}
                                                   one forward (T: backend.stream_weights()'s task, 0 if none)
  {"op": "quit"}
An answer is {"ok": true, ...} (a forward's output as hex of its float32 bytes, and its seconds) or
{"ok": false, "error": "..."}; the first line, once the weights are registered, is {"ok": true, "ready": R}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from ..config import CacheSpec, Settings
from ..weight_spec import WeightSpec
from ..worker import CacheWorker
from .model import forward, layer_weights, model_input


def serve(worker: CacheWorker, layout: WeightSpec, hidden: int, lines, say):
    for line in lines:
        try:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "quit":
                return
            if op == "load":
                for layer in range(layout.num_layers):
                    worker.weights.load(layer, layer_weights(int(cmd["seed"]), worker.rank, layer, hidden))
                say({"ok": True})
            elif op == "forward":
                x = model_input(int(cmd["seed"]), int(cmd.get("batch", 4)), hidden)
                began = time.perf_counter()
                with worker.weights.forward(int(cmd["task_id"]) or None, timeout=float(cmd["timeout"])) as f:
                    out = forward(x, f.layer, layout.num_layers)
                say({"ok": True, "out": out.tobytes().hex(), "seconds": time.perf_counter() - began})
            else:
                say({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:     # answered, never fatal: the engine decides what a failure means
            say({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastcache.launch.model_worker", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--suffix", required=True)
    p.add_argument("--spec", required=True, help="CacheSpec as JSON")
    p.add_argument("--weights", required=True, help="the placed WeightSpec as JSON (SwapBackend.weight_layout)")
    p.add_argument("--device", default="sim")
    args = p.parse_args(argv)
    spec, layout = CacheSpec.from_json(args.spec), WeightSpec.from_json(args.weights)
    hidden = dict((n, s) for n, s, _ in layout.layer_tensors)["b"][0]
    worker = CacheWorker(spec, rank=args.rank, tp_size=args.tp, device=args.device, suffix=args.suffix,
                         framework="numpy", settings=Settings.from_env())

    def say(answer):
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    try:
        worker.start()
        worker.register_weights(layout)
        say({"ok": True, "ready": args.rank})
        serve(worker, layout, hidden, sys.stdin, say)
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
