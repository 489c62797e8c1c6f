"""python -m fastcache.launch.model_worker: a worker process that holds one rank's cache and weights and runs
the small model of model.py on command (docs/design.md §11; the `--offload-weights` run, tests, benchmark).

--framework picks what the weights and the forward are: numpy on sim (torch CPU tensors too), torch or CuPy
device tensors on cuda (default: torch when importable). On cuda the forward runs on the rank's GPU, on the
current stream, and its time is taken after a synchronize, so it is the GPU's time, not the enqueueing.

Commands are JSON lines on stdin, one JSON line answers each on stdout (no pickle):
  {"op": "load", "seed": S}                        draw weight version S and load every layer
  {"op": "forward", "task_id": T, "seed": X, "batch": B, "timeout": s, "out": true}
                                                   one forward (T: backend.stream_weights()'s task, 0 if none;
                                                   out false: the time only, not the output)
  {"op": "copy"}                                   the best time of copying one layer's bytes to the device
  {"op": "quit"}
An answer is {"ok": true, ...} (a forward's output as hex of its float32 bytes, copied to the host, and its
seconds) or {"ok": false, "error": "..."}; the first line, once the weights are registered, is
{"ok": true, "ready": R, "framework": F}.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import time

from ..config import CacheSpec, Settings
from ..weight_spec import WeightSpec
from ..worker import CacheWorker
from .model import arrays, forward, layer_weights, model_input, pick_framework


def stream_ordered(weights, xp) -> bool:
    """True when the forward's per-layer waits can be put on the GPU stream: a GPU framework, and a
    weights.forward that takes the stream (older ones wait on the host only)."""
    return xp.on_gpu and "stream" in inspect.signature(weights.forward).parameters


def layer_reader(f, layout: WeightSpec, xp, ordered: bool):
    """f.layer, for a forward on `xp`. Reading streamed layer l tells the transfer manager the ring slots of
    the layers before it are free; with host-side waits on a GPU the kernels that read them may still be
    queued, so they are waited for first (with stream-ordered waits the stream itself holds the slot)."""
    if not xp.on_gpu or ordered or not layout.streamed_layers:
        return f.layer
    first = layout.resident_layers

    def layer(index):
        if index > first:
            xp.synchronize()
        return f.layer(index)
    return layer


def serve(worker: CacheWorker, layout: WeightSpec, hidden: int, lines, say, xp):
    ordered = stream_ordered(worker.weights, xp)
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
                x = xp.to_device(model_input(int(cmd["seed"]), int(cmd.get("batch", 4)), hidden))
                wait_on = {"stream": xp.stream()} if ordered else {}
                xp.synchronize()            # the input's upload is not the forward's time
                began = time.perf_counter()
                with worker.weights.forward(int(cmd["task_id"]) or None, timeout=float(cmd["timeout"]),
                                            **wait_on) as f:
                    try:
                        out = forward(x, layer_reader(f, layout, xp, ordered), layout.num_layers, xp)
                    finally:                # inside: leaving frees the ring, which queued kernels may still read
                        xp.synchronize()
                answer = {"ok": True, "seconds": time.perf_counter() - began}
                if cmd.get("out", True):
                    answer["out"] = xp.to_host(out).tobytes().hex()
                say(answer)
            elif op == "copy":
                say({"ok": True, "seconds": xp.copy_seconds(layout.layer_bytes), "bytes": layout.layer_bytes})
            else:
                say({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:     # answered, never fatal: the engine decides what a failure means
            say({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastcache.launch.model_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--suffix", required=True)
    p.add_argument("--spec", required=True, help="CacheSpec as JSON")
    p.add_argument("--weights", required=True, help="the placed WeightSpec as JSON (SwapBackend.weight_layout)")
    p.add_argument("--device", default="sim", choices=("sim", "cuda"))
    p.add_argument("--device-id", type=int, default=None, help="the rank's GPU (default: the rank)")
    p.add_argument("--framework", default=None, choices=("numpy", "torch", "cupy"),
                   help="default: numpy on sim; on cuda torch when importable, else cupy")
    args = p.parse_args(argv)
    spec, layout = CacheSpec.from_json(args.spec), WeightSpec.from_json(args.weights)
    hidden = dict((n, s) for n, s, _ in layout.layer_tensors)["b"][0]
    framework = pick_framework(args.device, args.framework)
    device_id = args.rank if args.device_id is None else args.device_id
    xp = arrays(framework, args.device, device_id)
    worker = CacheWorker(spec, rank=args.rank, tp_size=args.tp, device=args.device, suffix=args.suffix,
                         framework=framework, device_id=device_id, settings=Settings.from_env())

    def say(answer):
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    try:
        worker.start()
        worker.register_weights(layout)
        say({"ok": True, "ready": args.rank, "framework": framework})
        serve(worker, layout, hidden, sys.stdin, say, xp)
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
