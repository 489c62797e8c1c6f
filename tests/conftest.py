"""Shared fixtures. Every test runs under `no_leaks`: a test that leaves a /dev/shm entry, a socket
directory or a child process behind fails (and its leftovers are removed so the next test starts clean).
It looks only at what the test's own processes created: other programs' entries are never its business."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
import threading
import time

import numpy as np
import psutil
import pytest

from fastcache import CacheSpec, SwapBackend
from fastcache.ipc.shm import SHM_DIR, SegmentError, read_creator, unlink
from fastcache.ipc.queue import OWNER_FILE
from fastcache.worker import CacheWorker


class OwnPids:
    """This process and every descendant it had while a test ran (sampled on a thread of its own: a child
    killed before the test ends still counts). Only what these processes created is the test's own: other
    programs and other copies of the suite, on this machine at the same time, are never looked at."""

    def __init__(self):
        self.pids = {os.getpid()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="own-pids", daemon=True)
        self._thread.start()

    def _sample(self):
        while True:
            self.update()
            if self._stop.wait(0.05):
                return

    def update(self):
        try:
            self.pids.update(p.pid for p in psutil.Process().children(recursive=True))
        except psutil.Error:
            pass

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.update()

    def made(self, suffix: str, creator: int) -> bool:
        """A suffix starts with the pid of the process that made it (ipc/naming.py)."""
        head = suffix.split("-", 1)[0]
        return creator in self.pids or (head.isdigit() and int(head) in self.pids)


def _shm_entries(own: OwnPids):
    """fastcache segments this test's processes created (by the segment's creator or its suffix)."""
    entries = set()
    for entry in os.listdir(SHM_DIR):
        if not entry.startswith("fastcache."):
            continue
        try:
            pid, _start, _suffix = read_creator(entry)
        except (OSError, SegmentError):
            pid = 0
        if own.made(entry[len("fastcache."):], pid):
            entries.add(entry)
    return entries


def _socket_dirs(own: OwnPids):
    """Socket directories this test's processes created."""
    dirs = set()
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "fastcache.*")):
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                pid = int(json.load(f)["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            pid = 0
        if own.made(os.path.basename(path)[len("fastcache."):], pid):
            dirs.add(path)
    return dirs


def _children():
    """Child processes, less multiprocessing's own long-lived helper (the resource tracker)."""
    kids = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing.resource_tracker" not in " ".join(p.cmdline()):
                kids[p.pid] = p
        except psutil.Error:
            pass
    return kids


def _running(proc):
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture(autouse=True, scope="session")
def vllm_rpc_dir():
    """vLLM binds its engine's ZeroMQ sockets under VLLM_RPC_BASE_PATH (the temp dir by default) and leaves
    them there when an engine process ends: every vLLM engine of the run, in this process or a child, binds
    them in one directory that goes at the end."""
    path = tempfile.mkdtemp(prefix="fastcache-tests-vllm-rpc-")
    before = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = path
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = before
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leaks():
    own = OwnPids()
    shm_before, dirs_before, kids_before = _shm_entries(own), _socket_dirs(own), set(_children())
    try:
        yield
    finally:
        own.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        own.update()
        kids = {pid: p for pid, p in _children().items() if pid not in kids_before and _running(p)}
        if not kids and not (_shm_entries(own) - shm_before) and not (_socket_dirs(own) - dirs_before):
            return
        time.sleep(0.05)
    shm, dirs = _shm_entries(own) - shm_before, _socket_dirs(own) - dirs_before
    for p in kids.values():
        p.kill()
    for entry in shm:           # only what this test's own processes created
        unlink("/" + entry)
    pytest.fail(f"test leaked: /dev/shm {sorted(shm)}, socket dirs {sorted(dirs)}, "
                f"processes {sorted(kids)}")


def small_spec(**overrides) -> CacheSpec:
    base = dict(num_layers=3, num_gpu_blocks=24, num_cpu_blocks=16, block_size=4, num_kv_heads=2, head_dim=8,
                cache_dtype="bfloat16")
    base.update(overrides)
    return CacheSpec(**base)


@contextlib.contextmanager
def deployment(spec: CacheSpec, tp: int = 1, framework: str = "numpy", **backend_kwargs):
    """A running SwapBackend with in-process workers, ready for swaps."""
    with SwapBackend(spec, tp_size=tp, device="sim", **backend_kwargs) as backend:
        workers = [CacheWorker(spec, rank=r, tp_size=tp, device="sim", suffix=backend.suffix,
                               framework=framework).start() for r in range(tp)]
        backend.wait_ready(timeout=30)
        try:
            yield backend, workers
        finally:
            for w in workers:
                w.close()


def all_tensors(worker):
    """Every tensor of a worker, in CacheSpec.tensors() order, as NumPy uint8 rows [blocks, block_bytes]."""
    tensors = []
    for info, tensor in zip(worker.spec.tensors(worker.rank, worker.device_id), worker._cache.tensors.values()):
        array = np.asarray(tensor) if isinstance(tensor, np.ndarray) else tensor.numpy()
        tensors.append(array.view(np.uint8).reshape(info.num_blocks, info.block_bytes))
    return tensors


def randomize(worker, rng):
    for rows in all_tensors(worker):
        rows[...] = rng.integers(0, 256, rows.shape, dtype=np.uint8)


def cpu_image(worker, gpu_ids) -> np.ndarray:
    """What CPU blocks holding these GPU blocks of the worker must contain: [n, cpu_block_bytes]."""
    spec = worker.spec
    gpu_ids = np.asarray(gpu_ids)
    out = np.empty((len(gpu_ids), spec.cpu_block_bytes), np.uint8)
    for info, rows in zip(spec.tensors(worker.rank, worker.device_id), all_tensors(worker)):
        out[:, info.cpu_offset:info.cpu_offset + info.block_bytes] = rows[gpu_ids]
    return out


def round_trip(backend, workers, rng, n=5):
    """Fresh random bytes in n random blocks, swapped out, overwritten at the destination, swapped back in
    elsewhere: every byte checked in the CPU tier and on the GPU of every rank."""
    spec = backend.spec
    src = rng.choice(spec.num_gpu_blocks, n, replace=False)
    cpu = np.array(backend.allocate_cpu_blocks(n))
    try:
        for w in workers:
            for rows in all_tensors(w):
                rows[src] = rng.integers(1, 256, rows[src].shape, dtype=np.uint8)
        want = [cpu_image(w, src) for w in workers]
        backend.swap_out(src, cpu).result(timeout=10)
        for r in range(len(workers)):
            np.testing.assert_array_equal(backend.cpu_tier(r)[cpu], want[r])
        dst = rng.choice(spec.num_gpu_blocks, n, replace=False)
        for w in workers:       # fresh bytes at the destination: a missed copy must show
            for rows in all_tensors(w):
                rows[dst] = rng.integers(1, 256, rows[dst].shape, dtype=np.uint8)
        backend.swap_in(dst, cpu).result(timeout=10)
        for r, w in enumerate(workers):
            np.testing.assert_array_equal(cpu_image(w, dst), want[r])
    finally:
        backend.free_cpu_blocks(cpu.tolist())


def wait_for(predicate, timeout, what):
    """Poll until predicate() holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout} s")
        time.sleep(0.01)


class MemoryJournal:
    """A reshard program's journal kept in a Python int (the real one is a shared-memory counter): the one
    instance is handed to the interrupted run and to the run that resumes it."""

    def __init__(self):
        self.value = 0

    def get(self):
        return self.value

    def set(self, value):
        self.value = value
