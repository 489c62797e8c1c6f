"""python -m fastcache.tools.gemm_load: a matrix-product loop in its own process, standing for the model.

In a deployment the transfer manager is a separate process with its own CUDA context. Without MPS the
kernels of two processes are time-sliced, while one process's copy-engine DMA can overlap another's
compute, so a swap method is judged with the model's load in *another* process, as here. The parent
(`GemmLoad`) steers the loop through a small shared-memory table and reads its progress from it:

  command  written by the parent: RUN, PAUSE or STOP
  status   written by the loop: STARTING, RUNNING (warmed up), PAUSED or FAILED
  count    products finished so far, and `stamp` the time.monotonic() at which count was last raised
  flops    floating-point operations of one product

The loop raises count after each synchronized batch, so the rate over a window is
flops * (count1 - count0) / (stamp1 - stamp0), timed by the loop itself. `--backend numpy` runs a float32
product on the CPU (the harness's own tests use it where no GPU is present).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

from ..ipc.heartbeat import process_alive
from ..ipc.naming import new_suffix, segment_name
from ..ipc.shm import SharedSegment

RUN, PAUSE, STOP = 1, 2, 3                       # commands
STARTING, RUNNING, PAUSED, FAILED = 0, 1, 2, -1  # statuses
COMMAND, STATUS, COUNT, STAMP, FLOPS = range(5)  # fields of the table
BATCH = 4                                        # products between synchronizations
WARMUP = 3


class _Products:
    """n x n products, bf16 on a CUDA device through torch, or float32 on the CPU through NumPy."""

    def __init__(self, backend: str, n: int, device_id: int):
        self.backend = backend
        if backend == "torch":
            import torch

            self.torch = torch
            device = torch.device("cuda", device_id)
            torch.cuda.set_device(device)
            self.a, self.b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
            self.c = torch.empty_like(self.a)
        else:
            rng = np.random.default_rng(0)
            self.a, self.b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
            self.c = np.empty_like(self.a)

    def run(self, times: int):
        matmul = self.torch.matmul if self.backend == "torch" else np.matmul
        for _ in range(times):
            matmul(self.a, self.b, out=self.c)
        if self.backend == "torch":
            self.torch.cuda.synchronize()


def serve(table: np.ndarray, products: _Products, parent_pid: int):
    """The loop: run while told to, count finished products, exit on STOP or when the parent is gone."""
    products.run(WARMUP)
    while True:
        command = int(table[COMMAND])
        if command == STOP or not process_alive(parent_pid):
            return
        if command == PAUSE:
            table[STATUS] = PAUSED
            time.sleep(0.001)
            continue
        products.run(BATCH)
        table[STAMP] = time.monotonic()
        table[COUNT] += BATCH
        table[STATUS] = RUNNING


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastcache.tools.gemm_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--segment", required=True, help="the parent's table (a fastcache shared segment)")
    p.add_argument("--suffix", required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--backend", choices=("torch", "numpy"), default="torch")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--device-id", type=int, default=0)
    args = p.parse_args(argv)
    with SharedSegment.attach(args.segment, args.suffix) as segment:
        table = segment.array(np.float64, (5,))
        try:
            products = _Products(args.backend, args.n, args.device_id)
            table[FLOPS] = 2.0 * args.n ** 3
            serve(table, products, args.parent_pid)
        except BaseException:
            table[STATUS] = FAILED
            raise
        finally:
            del table
    return 0


class GemmLoad:
    """The parent's side: start the loop process, pause and resume it, read its rate over a window."""

    def __init__(self, backend: str = "torch", n: int = 8192, device_id: int = 0, timeout: float = 120.0):
        self.timeout = timeout
        suffix = new_suffix()
        self._segment = SharedSegment.create(segment_name(suffix, "gemm"), 8 * 5, suffix)
        self._table = self._segment.array(np.float64, (5,))
        self._table[:] = 0
        self._table[COMMAND] = PAUSE
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fastcache.tools.gemm_load", "--segment", self._segment.name, "--suffix", suffix,
             "--parent-pid", str(os.getpid()), "--backend", backend, "--n", str(n), "--device-id", str(device_id)],
            stdin=subprocess.DEVNULL)
        try:
            self._wait(lambda: self._table[STATUS] == PAUSED, "warm up")
        except BaseException:
            self.close()
            raise

    def run(self):
        """Resume the loop; returns once a batch has finished since (it is running at speed)."""
        count = self._table[COUNT]
        self._table[COMMAND] = RUN
        self._wait(lambda: self._table[COUNT] > count, "resume")

    def pause(self):
        self._table[COMMAND] = PAUSE
        self._wait(lambda: self._table[STATUS] == PAUSED, "pause")

    def mark(self) -> tuple[float, float]:
        """(products finished, when the last one was counted): the ends of a measurement window."""
        return float(self._table[COUNT]), float(self._table[STAMP])

    def tflops(self, start: tuple, end: tuple) -> float:
        """TFLOP/s between two marks (at least one batch apart)."""
        (c0, t0), (c1, t1) = start, end
        if c1 <= c0 or t1 <= t0:
            raise RuntimeError("the GEMM loop finished no batch in the window; lengthen it")
        return self._table[FLOPS] * (c1 - c0) / (t1 - t0) / 1e12

    def _wait(self, condition, what):
        deadline = time.monotonic() + self.timeout
        while not condition():
            if self._table[STATUS] == FAILED or self._proc.poll() is not None:
                raise RuntimeError(f"the GEMM load process failed before it could {what} "
                                   f"(exit status {self._proc.poll()}; its traceback is above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the GEMM load process did not {what} within {self.timeout} s")
            time.sleep(0.001)

    def close(self):
        if self._proc is not None:
            self._table[COMMAND] = STOP
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        self._table = None
        self._segment.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    sys.exit(main())
