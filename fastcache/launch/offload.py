"""Weights through the deployment (docs/design.md §11): the model worker processes driven from the engine,
and `python -m fastcache.launch --offload-weights F`: the small model of model.py run all resident and with
a fraction F of its layers offloaded (streamed through the ring), outputs compared bit for bit, the time of
each reported. ModelWorkers is shared with the tests and benchmarks/offload_bench.py."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import numpy as np

from .. import SwapBackend
from ..config import CacheSpec
from .model import model_spec


# one BLAS thread per worker: ranks share the machine's cores, as they would share nothing on GPUs
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class ModelWorkers:
    """One `python -m fastcache.launch.model_worker` per rank of `backend`; JSON lines both ways."""

    def __init__(self, backend, timeout: float = 30.0):
        self.backend = backend
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "fastcache.launch.model_worker", "--rank", str(r), "--tp", str(backend.tp_size),
             "--suffix", backend.suffix, "--spec", backend.spec.to_json(), "--weights", backend.weight_layout.to_json(),
             "--device", backend.device], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, **ONE_THREAD})
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

    def load(self, seed: int, timeout: float = 30.0):
        self.ask(range(len(self.procs)), {"op": "load", "seed": seed})
        self.answers(range(len(self.procs)), timeout)

    def forward(self, seed: int, task_id: int = 0, batch: int = 4, timeout: float = 30.0) -> list[tuple]:
        """One forward on every rank: [(output float32 array, seconds)] in rank order."""
        ranks = range(len(self.procs))
        self.ask(ranks, {"op": "forward", "task_id": task_id, "seed": seed, "batch": batch, "timeout": timeout})
        return [(np.frombuffer(bytes.fromhex(a["out"]), np.float32).reshape(batch, -1), a["seconds"])
                for a in self.answers(ranks, timeout + 5)]

    def streamed_forward(self, seed: int, batch: int = 4, timeout: float = 30.0):
        """A forward whose offloaded layers the backend streams meanwhile."""
        handle = self.backend.stream_weights()
        outs = self.forward(seed, handle.task_id, batch, timeout)
        handle.result(timeout)
        return outs

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


def timed_run(fraction: float, layers: int, hidden: int, batch: int, repeats: int, device: str = "sim",
              tp: int = 1, seed: int = 7):
    """Outputs and the best forward time of a deployment with `fraction` of its layers offloaded."""
    spec = CacheSpec(num_layers=2, num_gpu_blocks=8, num_cpu_blocks=8, block_size=4, num_kv_heads=1, head_dim=8)
    with SwapBackend(spec, tp_size=tp, device=device, weights=model_spec(layers, hidden),
                     offload_fraction=fraction) as backend:
        with ModelWorkers(backend) as workers:
            backend.wait_ready(timeout=30)
            workers.load(seed)
            best, outs = float("inf"), None
            streamed = bool(backend.weight_layout.streamed_layers)
            for i in range(repeats):
                outs = workers.streamed_forward(seed + 1, batch) if streamed else workers.forward(seed + 1, 0, batch)
                best = min(best, max(seconds for _, seconds in outs))
            return [o for o, _ in outs], best, backend.weight_layout


def run_offload(fraction: float, device: str, tp: int, layers: int = 8, hidden: int = 512, batch: int = 64,
                repeats: int = 5) -> int:
    """--offload-weights: resident and streamed forwards, compared bit for bit; 0 when they match."""
    resident, t_resident, _ = timed_run(0.0, layers, hidden, batch, repeats, device, tp)
    streamed, t_streamed, layout = timed_run(fraction, layers, hidden, batch, repeats, device, tp)
    same = all(np.array_equal(a, b) for a, b in zip(resident, streamed))
    print(f"fastcache.launch --offload-weights {fraction}: {layers} layers of {hidden}x{hidden} float32, batch {batch}, "
          f"tp {tp}, {device}, pid {os.getpid()}")
    print(f"  resident: {t_resident * 1e3:8.2f} ms per forward (all {layers} layers on the device)")
    print(f"  streamed: {t_streamed * 1e3:8.2f} ms per forward ({len(layout.streamed_layers)} layers offloaded, "
          f"ring of {layout.ring_slots} slots), {t_streamed / t_resident:.2f}x resident")
    print(f"  outputs bit-identical on every rank: {'yes' if same else 'NO'}")
    return 0 if same else 1
