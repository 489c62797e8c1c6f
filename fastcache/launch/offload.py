"""Weights through the deployment (docs/design.md §11): the model worker processes driven from the engine,
and `python -m fastcache.launch --offload-weights F`: the small model of model.py run all resident and with
a fraction F of its layers offloaded (streamed through the ring), outputs compared bit for bit, the time of
each reported. On sim the workers compute in NumPy, on cuda with torch or CuPy on their GPU (model.py's
pick_framework); the times are the slowest rank's, taken after a synchronize. ModelWorkers and timed_run are
shared with the tests and benchmarks/offload_bench.py."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np

from .. import SwapBackend
from ..config import CacheSpec
from ..ops import resolve_device, round_robin_devices
from ..weight_spec import WeightSpec
from .model import model_spec, pick_framework


# one BLAS thread per worker: ranks share the machine's cores, as they would share nothing on GPUs
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# run_offload's model per device. cuda: 256 MiB float32 layers whose matmul (batch 4096) outlasts their copy
# (see benchmarks/offload_bench.py for the arithmetic); sim: small enough for a quick check
SHAPES = {"sim": dict(layers=8, hidden=512, batch=64), "cuda": dict(layers=8, hidden=8192, batch=4096)}


class ModelWorkers:
    """One `python -m fastcache.launch.model_worker` per rank of `backend` (on the rank's GPU of
    backend.device_ids on cuda), computing with `framework` (None: model.py's pick_framework); JSON lines both
    ways."""

    def __init__(self, backend, timeout: float | None = None, framework: str | None = None):
        self.backend = backend
        self.framework = pick_framework(backend.device, framework)
        if timeout is None:         # a GPU framework's import and CUDA start take a while
            timeout = 30.0 if backend.device == "sim" else 120.0
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "fastcache.launch.model_worker", "--rank", str(r), "--tp", str(backend.tp_size),
             "--suffix", backend.suffix, "--spec", backend.spec.to_json(), "--weights", backend.weight_layout.to_json(),
             "--device", backend.device, "--device-id", str(backend.device_ids[r]), "--framework", self.framework],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **ONE_THREAD})
            for r in range(backend.tp_size)]
        try:
            self.answers(range(backend.tp_size), timeout)       # each one's "ready"
        except BaseException:
            self.close()
            raise

    def ask(self, ranks, command: dict):
        for r in ranks:
            self.procs[r].stdin.write(json.dumps(command) + "\n")
            self.procs[r].stdin.flush()

    def answers(self, ranks, timeout: float) -> list[dict]:
        """One answer from each rank; RuntimeError naming a rank that fails, exits or stays silent."""
        deadline, out = time.monotonic() + timeout, []
        for r in ranks:
            proc = self.procs[r]
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline() if ready else ""
            if not line:
                raise RuntimeError(f"model worker rank {r} gave no answer ({'exited' if proc.poll() is not None else 'silent'})")
            answer = json.loads(line)
            if not answer["ok"]:
                raise RuntimeError(f"model worker rank {r}: {answer['error']}")
            out.append(answer)
        return out

    def load(self, seed: int, timeout: float | None = None):
        if timeout is None:         # drawing and placing the weights: about 2 s per GiB of them, per rank
            layout = self.backend.weight_layout
            timeout = 30.0 + 2.0 * layout.num_layers * layout.layer_bytes / 2**30
        self.ask(range(len(self.procs)), {"op": "load", "seed": seed})
        self.answers(range(len(self.procs)), timeout)

    def forward(self, seed: int, task_id: int = 0, batch: int = 4, timeout: float = 30.0,
                out: bool = True) -> list[tuple]:
        """One forward on every rank: [(output float32 array, or None without `out`, seconds)] in rank order."""
        ranks = range(len(self.procs))
        self.ask(ranks, {"op": "forward", "task_id": task_id, "seed": seed, "batch": batch, "timeout": timeout,
                         "out": out})
        return [(np.frombuffer(bytes.fromhex(a["out"]), np.float32).reshape(batch, -1) if out else None,
                 a["seconds"]) for a in self.answers(ranks, timeout + 30)]

    def streamed_forward(self, seed: int, batch: int = 4, timeout: float = 30.0, out: bool = True):
        """A forward whose offloaded layers the backend streams meanwhile."""
        handle = self.backend.stream_weights()
        outs = self.forward(seed, handle.task_id, batch, timeout, out)
        handle.result(timeout)
        return outs

    def copy_seconds(self, rank: int = 0, timeout: float = 60.0) -> float:
        """The best time of copying one layer's bytes to `rank`'s device (host to GPU from pinned memory on
        cuda, a memcpy on sim), measured in its worker process."""
        self.ask([rank], {"op": "copy"})
        return self.answers([rank], timeout)[0]["seconds"]

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                    proc.stdin.close()
                except OSError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class OffloadRun(NamedTuple):
    outputs: list          # each rank's output of the last forward (float32, host)
    seconds: float         # the best forward of the repeats (the slowest rank's)
    layout: WeightSpec     # the placement: resident layers, ring slots
    copy_seconds: float | None    # one layer's copy to the device (rank 0), when asked for


def timed_run(fraction: float, layers: int, hidden: int, batch: int, repeats: int, device: str = "sim",
              tp: int = 1, seed: int = 7, framework: str | None = None, measure_copy: bool = False) -> OffloadRun:
    """Outputs and the best forward time of a deployment with `fraction` of its layers offloaded; on cuda
    rank r runs on GPU r modulo the GPUs there are."""
    device = resolve_device(device)
    spec = CacheSpec(num_layers=2, num_gpu_blocks=8, num_cpu_blocks=8, block_size=4, num_kv_heads=1, head_dim=8)
    with SwapBackend(spec, tp_size=tp, device=device, weights=model_spec(layers, hidden), offload_fraction=fraction,
                     device_ids=round_robin_devices(device, tp)) as backend:
        with ModelWorkers(backend, framework=framework) as workers:
            backend.wait_ready(timeout=30 if device == "sim" else 120)
            workers.load(seed)
            copy = workers.copy_seconds() if measure_copy else None
            best, outs = float("inf"), None
            streamed = bool(backend.weight_layout.streamed_layers)
            for i in range(repeats):
                last = i == repeats - 1         # the output crosses the pipe once: on cuda it is 100s of MiB
                outs = (workers.streamed_forward(seed + 1, batch, out=last) if streamed
                        else workers.forward(seed + 1, 0, batch, out=last))
                best = min(best, max(seconds for _, seconds in outs))
            return OffloadRun([o for o, _ in outs], best, backend.weight_layout, copy)


def run_offload(fraction: float, device: str, tp: int, layers: int | None = None, hidden: int | None = None,
                batch: int | None = None, repeats: int = 5, framework: str | None = None) -> int:
    """--offload-weights: resident and streamed forwards, compared bit for bit; 0 when they match. The model's
    shape defaults to SHAPES[device]."""
    device = resolve_device(device)
    framework = pick_framework(device, framework)
    shape = dict(SHAPES[device])
    shape.update({k: v for k, v in dict(layers=layers, hidden=hidden, batch=batch).items() if v is not None})
    layers, hidden, batch = shape["layers"], shape["hidden"], shape["batch"]
    resident = timed_run(0.0, layers, hidden, batch, repeats, device, tp, framework=framework)
    streamed = timed_run(fraction, layers, hidden, batch, repeats, device, tp, framework=framework)
    t_resident, t_streamed, layout = resident.seconds, streamed.seconds, streamed.layout
    same = all(np.array_equal(a, b) for a, b in zip(resident.outputs, streamed.outputs))
    print(f"fastcache.launch --offload-weights {fraction}: {layers} layers of {hidden}x{hidden} float32, "
          f"batch {batch}, tp {tp}, {device} ({framework}), pid {os.getpid()}")
    print(f"  resident: {t_resident * 1e3:8.2f} ms per forward (all {layers} layers on the device)")
    print(f"  streamed: {t_streamed * 1e3:8.2f} ms per forward ({len(layout.streamed_layers)} layers offloaded, "
          f"ring of {layout.ring_slots} slots), {t_streamed / t_resident:.2f}x resident")
    print(f"  outputs bit-identical on every rank: {'yes' if same else 'NO'}")
    return 0 if same else 1
