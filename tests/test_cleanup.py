"""python -m fastcache.tools.cleanup (docs/design.md §7): leftovers of a dead deployment go, live ones stay.

A "dead deployment" here is a real process that created segments and a socket directory and was then
SIGKILLed, so it could not unlink anything.
"""
from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import time

import numpy as np
import posix_ipc
import pytest

from fastcache.ipc.leftovers import remove_dead
from fastcache.ipc.naming import PREFIX, new_suffix, segment_name
from fastcache.ipc.queue import make_socket_dir, remove_socket_dir
from fastcache.ipc.reaper import reap
from fastcache.ipc.shm import HEADER, HEADER_BYTES, MAGIC, SHM_DIR, SharedSegment, unlink

from conftest import all_tensors, deployment, randomize, round_trip, small_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CREATOR = r"""
import json, os, sys, time
import numpy as np
from fastcache.ipc.naming import new_suffix, segment_name
from fastcache.ipc.queue import make_socket_dir
from fastcache.ipc.shm import SharedSegment

suffix = new_suffix()
rng = np.random.default_rng(int(sys.argv[2]))
segments = []
for what in ("signal.cache_ready", "barrier", "swap_rank0", "cache_rank0.gen1", "exports_rank0"):
    seg = SharedSegment.create(segment_name(suffix, what), int(rng.integers(64, 70000)), suffix)
    seg.array(np.uint8, (seg.size,))[:] = rng.integers(1, 256, seg.size, dtype=np.uint8)
    segments.append(seg)
info = {"suffix": suffix, "pid": os.getpid(), "segments": [s.name for s in segments],
        "socket_dir": make_socket_dir(suffix)}
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(info, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


def shm_path(name):
    return os.path.join(SHM_DIR, name.lstrip("/"))


def exists(name):
    return os.path.exists(shm_path(name))


def start_creator(tmp_path, seed):
    info_path = tmp_path / f"creator{seed}.json"
    proc = subprocess.Popen([sys.executable, "-c", CREATOR, str(info_path), str(seed)], cwd=ROOT,
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not info_path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the creator did not start"
        time.sleep(0.02)
    return proc, json.loads(info_path.read_text())


def cleanup(*args):
    out = subprocess.run([sys.executable, "-m", "fastcache.tools.cleanup", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def listed(stdout, verb):
    """{name or path: creator pid} of the lines `<verb> <kind> <name> (creator pid N is gone)`."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith(verb + " "):
            rest = line[len(verb) + 1:]
            kind = "socket dir" if rest.startswith("socket dir ") else rest.split()[0]
            name, _, tail = rest[len(kind) + 1:].partition(" (creator pid ")
            found[name] = int(tail.split()[0])
    return found


def kill(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.fixture
def live_leftovers():
    """A segment and a socket directory whose creator (this process) is alive, removed afterwards."""
    suffix = new_suffix()
    seg = SharedSegment.create(segment_name(suffix, "swap_rank0"), 4096, suffix)
    seg.array(np.uint8, (4096,))[:] = np.random.default_rng(41).integers(1, 256, 4096, dtype=np.uint8)
    path = make_socket_dir(suffix)
    try:
        yield seg, path
    finally:
        seg.close()
        remove_socket_dir(path)


def test_cleanup_removes_a_killed_deployments_leftovers_and_dry_run_only_lists_them(tmp_path, live_leftovers):
    live_seg, live_dir = live_leftovers
    live_bytes = live_seg.array(np.uint8, (4096,)).copy()
    procs = []
    try:
        dead = []
        for seed in (1, 2):                         # two dead deployments
            proc, info = start_creator(tmp_path, seed)
            procs.append(proc)
            dead.append(info)
        names = [n for info in dead for n in info["segments"]]
        dirs = [info["socket_dir"] for info in dead]
        assert all(exists(n) for n in names) and all(os.path.isdir(d) for d in dirs)
        # while the creators run, nothing of theirs is stale
        before = listed(cleanup("--dry-run"), "would remove")
        assert not set(before) & set(names + dirs)
        for proc in procs:
            kill(proc)

        # another program's SwapBackend.start() removes dead deployments' leftovers too: on a busy machine some
        # may go before the tool looks, so what the tool lists is checked against what is still there
        there = lambda: {n for n in names if exists(n)} | {d for d in dirs if os.path.isdir(d)}  # noqa: E731
        dry = cleanup("--dry-run")
        would, still = listed(dry, "would remove"), there()
        pids = {name: info["pid"] for info in dead for name in info["segments"] + [info["socket_dir"]]}
        for name in still:
            assert would.get(name) == pids[name], (name, would)
        assert not listed(dry, "removed"), dry                                       # a dry run removes nothing

        stdout = cleanup()
        removed = listed(stdout, "removed")
        assert set(removed) & set(names + dirs) <= still, stdout
        assert not there()
        assert f"{len(removed)} stale item(s) removed" in stdout
        # the live leftovers are untouched, bytes and all
        assert live_seg.name not in removed and live_dir not in removed
        assert exists(live_seg.name) and os.path.isdir(live_dir)
        np.testing.assert_array_equal(live_seg.array(np.uint8, (4096,)), live_bytes)
        # and a second run finds nothing of ours
        assert not set(listed(cleanup(), "removed")) & set(names + dirs + [live_seg.name, live_dir])
    finally:
        for proc in procs:
            kill(proc)


def test_cleanup_keeps_a_running_deployment_whole_and_working():
    rng = np.random.default_rng(42)
    with deployment(small_spec(), tp=2) as (backend, workers):
        mine = sorted(e for e in os.listdir(SHM_DIR) if e.startswith(f"{PREFIX}.{backend.suffix}."))
        assert len(mine) >= 10
        stdout = cleanup()
        assert backend.suffix not in stdout
        assert sorted(e for e in os.listdir(SHM_DIR) if e.startswith(f"{PREFIX}.{backend.suffix}.")) == mine
        assert os.path.isdir(backend.socket_dir)
        for w in workers:
            randomize(w, rng)
        src, cpu, dst = [3, 17, 5], [0, 9, 15], [20, 1, 11]
        want = [[rows[src].copy() for rows in all_tensors(w)] for w in workers]
        backend.swap_out(src, cpu).result(timeout=10)
        for w in workers:
            for rows in all_tensors(w):
                rows[dst] = rng.integers(1, 256, rows[dst].shape, dtype=np.uint8)
        backend.swap_in(dst, cpu).result(timeout=10)
        for w, expected in zip(workers, want):
            for rows, exp in zip(all_tensors(w), expected):
                np.testing.assert_array_equal(rows[dst], exp)


def raw_segment(name, pid, start, suffix, payload=b""):
    """A segment written by hand (header fields of our choosing), as another process might leave it."""
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=HEADER_BYTES + 64)
    with mmap.mmap(shm.fd, HEADER_BYTES + 64) as buf:
        buf[:HEADER.size] = HEADER.pack(MAGIC, pid, start, 64, suffix.encode())
        buf[HEADER_BYTES:HEADER_BYTES + len(payload)] = payload
    shm.close_fd()


def test_cleanup_treats_a_reused_pid_as_dead_and_leaves_foreign_files_alone():
    suffix = new_suffix()
    reused = segment_name(suffix, "barrier")            # names this (live) pid, with another start time
    foreign = shm_path(segment_name(suffix, "signal.cache_ready"))
    try:
        raw_segment(reused, os.getpid(), 12345.0, suffix)
        with open(foreign, "wb") as f:                  # a fastcache-looking name, not our format
            f.write(np.random.default_rng(43).integers(1, 256, 256, dtype=np.uint8).tobytes())
        os.chmod(foreign, 0o600)
        removed = listed(cleanup(), "removed")
        assert removed.get(reused) == os.getpid()
        assert not exists(reused)
        assert os.path.exists(foreign)                  # cleanup cannot prove it is ours: it stays
    finally:
        for path in (shm_path(reused), foreign):
            if os.path.exists(path):
                os.unlink(path)


def test_cleanup_removes_the_leftovers_of_a_killed_but_unreaped_creator(tmp_path):
    proc, info = start_creator(tmp_path, 3)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while open(f"/proc/{proc.pid}/stat").read().split(") ")[1][0] != "Z":   # dead, not reaped
            assert time.monotonic() < deadline
            time.sleep(0.01)
        removed = listed(cleanup(), "removed")
        assert set(info["segments"]) <= set(removed)
    finally:
        kill(proc)
        listed(cleanup(), "removed")        # whatever the outcome, leave nothing behind


def deployment_entries(suffix):
    return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(f"{PREFIX}.{suffix}."))


def test_a_wall_clock_step_leaves_a_live_deployment_whole(monkeypatch):
    """A step of the wall clock (NTP's makestep, a VM's migration) moves the boot time psutil adds to every
    process's start: the clean-up at start and the reaper still see a live deployment's creators as live,
    remove nothing of it, and the deployment goes on working (a rank restarts); a dead creator's segment,
    under the same step, is still removed."""
    import psutil
    import psutil._pslinux as pslinux       # where psutil reads the boot time it adds

    rng = np.random.default_rng(44)
    with deployment(small_spec(), tp=1) as (backend, workers):
        suffix = backend.suffix
        mine = deployment_entries(suffix)
        assert len(mine) >= 5 and os.path.isdir(backend.socket_dir)
        dead = segment_name(suffix, "left_by_a_dead_process")
        raw_segment(dead, 2 ** 22 + 1, 1.0, suffix)        # above any pid this machine hands out
        pid = backend.transfer_pids[0]
        seen = psutil.Process(pid).create_time()
        real = pslinux.boot_time
        monkeypatch.setattr(pslinux, "boot_time", lambda: real() + 1.0)     # the clock stepped 1 s
        assert psutil.Process(pid).create_time() == pytest.approx(seen + 1.0), "the step is not seen"
        try:
            assert remove_dead(suffix=suffix) == [("segment", dead, 2 ** 22 + 1)]
            reap([suffix], owner_died=False)                    # a closed owner's reaper checks once
            reap([suffix], owner_died=True, grace=0)            # a killed one's, its creators still running
            assert deployment_entries(suffix) == mine
            assert os.path.isdir(backend.socket_dir)
        finally:
            unlink(dead)
        round_trip(backend, workers, rng)
        backend.restart_rank(0)
        backend.wait_ready(timeout=30)
        round_trip(backend, workers, rng)


def test_without_proc_a_creator_is_told_by_psutil_s_start_time(monkeypatch, tmp_path):
    """The fallback where /proc is absent (and for a segment that recorded only the wall-clock start): a live
    process is live, a reused pid or a dead one is not."""
    from fastcache.ipc import shm
    suffix = new_suffix()
    older = segment_name(suffix, "wall_clock_only")
    raw_segment(older, os.getpid(), shm.OWN_START.wall, suffix)      # as a segment without ticks records it
    try:
        assert shm.read_creator(older)[1] == shm.Started(shm.OWN_START.wall, None)
        assert shm.creator_alive(os.getpid(), shm.read_creator(older)[1])
        monkeypatch.setattr(shm, "PROC_DIR", str(tmp_path / "no-proc"))
        start = shm.process_start(os.getpid())
        assert start.ticks is None and start.wall > 1e9         # wall-clock seconds
        assert shm.creator_alive(os.getpid(), start) and shm.creator_alive(os.getpid(), shm.OWN_START)
        assert not shm.creator_alive(os.getpid(), start.wall - 5)
        assert not shm.creator_alive(2 ** 22 + 1, start)
    finally:
        unlink(older)
