"""The deployment harness that the launcher, the operator tools and the tests share: worker
processes started, awaited and stopped, and what a deployment holds in /dev/shm."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from ..ipc.naming import PREFIX
from ..ipc.shm import SHM_DIR


def start_worker(backend, rank: int, tp: int, spec, framework: str, device_id: int, weights=None) -> subprocess.Popen:
    """One `python -m fastcache.worker` for rank of backend's deployment (registering `weights`, a WeightSpec,
    if given)."""
    return subprocess.Popen(
        [sys.executable, "-m", "fastcache.worker", "--rank", str(rank), "--tp", str(tp), "--suffix", backend.suffix,
         "--spec", spec.to_json(), "--engine-pid", str(os.getpid()), "--device", backend.device,
         "--framework", framework, "--device-id", str(device_id)]
        + (["--weights", weights.to_json()] if weights is not None else []), stdin=subprocess.DEVNULL)


def start_workers(backend, args, framework):
    return [start_worker(backend, rank, backend.tp_size, backend.spec, framework, backend.device_ids[rank],
                         backend.weight_layout) for rank in range(backend.tp_size)]


def wait_until_ready(backend, workers, timeout):
    """backend.wait_ready, but a worker process that dies on the way fails it at once."""
    deadline = time.monotonic() + timeout
    while True:
        for rank, proc in enumerate(workers):
            if proc.poll() is not None:
                raise RuntimeError(f"worker rank {rank} (pid {proc.pid}) exited with status {proc.returncode} "
                                   f"before the deployment was ready (its error is above)")
        try:
            backend.wait_ready(timeout=0.05)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


def stop_workers(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class WorkerProcesses:
    """One `python -m fastcache.worker` per rank; start/stop are reshard's start_workers/stop_workers."""

    def __init__(self, backend, framework: str = "numpy"):
        self.backend, self.framework = backend, framework
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, ranks, spec=None):
        b = self.backend
        step = b.resharding
        spec = spec or b.spec
        tp = step.to_tp if step is not None else b.tp_size
        device_ids = step.device_ids if step is not None else b.device_ids
        weights = step.weights if step is not None else b.weight_layout     # a new rank: the new slices
        for r in ranks:
            self.procs[r] = start_worker(b, r, tp, spec, self.framework, device_ids[r], weights)

    def stop(self, ranks):
        stop_workers([self.procs.pop(r) for r in ranks if r in self.procs])

    def close(self):
        self.stop(sorted(self.procs))


def shm_bytes(suffix: str) -> int:
    """Bytes this deployment holds in /dev/shm (allocated blocks, not the nominal size)."""
    total = 0
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(f"{PREFIX}.{suffix}."):
            try:
                total += os.stat(os.path.join(SHM_DIR, entry)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def conclude(report: dict, checks, suffix: str, json_path: str | None, print_report) -> int:
    """The end of a launcher run: nothing of the deployment may be left in /dev/shm; the report printed (and
    written as JSON); exit status 0 only if every check passed."""
    leftovers = [e for e in os.listdir(SHM_DIR) if e.startswith(f"{PREFIX}.{suffix}.")]
    checks.check(not leftovers, f"nothing left in /dev/shm (found {leftovers})")
    report["checks_passed"], report["checks_failed"] = checks.passed, checks.failed
    print_report(report, checks)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if not checks.failed else 1
