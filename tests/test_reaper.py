"""An engine killed with its whole process tree (as vLLM's server stops its workers: SIGKILL to every
descendant, then to the engine) leaves nothing in /dev/shm and nothing running, with no cleanup step: the
deployment's reaper, outside that tree, removes what the dead processes left (fastcache/ipc/reaper.py).
With the reaper off, the same kill leaves the deployment behind: the test can see a leak."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import psutil
import pytest

from fastcache.ipc.leftovers import find_stale, remove_dead
from fastcache.ipc.naming import PREFIX
from fastcache.ipc.shm import SHM_DIR

from conftest import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A deployment that is ready (a transfer manager attached to an in-process worker), with one more
# segment under a second suffix given to the reaper, as the vLLM integration's link is; then it waits.
OWNER = r"""
import json, os, sys
import numpy as np
from fastcache import CacheSpec, SwapBackend
from fastcache.ipc.naming import new_suffix, segment_name
from fastcache.ipc.shm import SharedSegment
from fastcache.worker.cache_worker import CacheWorker

spec = CacheSpec(num_layers=2, num_gpu_blocks=8, num_cpu_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
backend = SwapBackend(spec, device="sim").start()
worker = CacheWorker(spec, rank=0, tp_size=1, device="sim", suffix=backend.suffix).start()
backend.wait_ready(timeout=60)
extra = new_suffix()
backend.also_reap(extra)
link = SharedSegment.create(segment_name(extra, "link_rank0"), 4096, extra)
info = {"suffixes": [backend.suffix, extra], "transfer_pids": backend.transfer_pids}
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(info, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
if sys.stdin.readline() == "close\n":
    link.close()
    worker.close()
    backend.close()
    print("closed", flush=True)
sys.stdin.read()
"""


def entries(suffix):
    """Every /dev/shm entry and socket dir of a deployment, dead creator or not."""
    prefix = f"{PREFIX}.{suffix}."
    shm = [e for e in os.listdir(SHM_DIR) if e.startswith(prefix)]
    dirs = [e for e in os.listdir(tempfile.gettempdir()) if e.startswith(prefix)]
    return shm + dirs


def reapers():
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if len(cmdline) >= 3 and cmdline[1] == "-c" and "fastcache.ipc.reaper" in cmdline[2]:
            found.append(proc)
    return found


def kill_tree(pid):
    """vLLM's kill_process_tree: SIGKILL to every descendant, then to the process."""
    parent = psutil.Process(pid)
    for child in parent.children(recursive=True):
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    parent.send_signal(signal.SIGKILL)


def start_owner(tmp_path, env):
    info_path = tmp_path / "owner.json"
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(info_path)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **env})

    def started():
        assert proc.poll() is None, "the owner died while starting"
        return info_path.exists()
    wait_for(started, 60, "the owner's deployment")
    return proc, json.loads(info_path.read_text())


@pytest.mark.parametrize("reaper", [True, False], ids=["reaper", "no-reaper"])
def test_a_tree_killed_engine_leaves_nothing(tmp_path, reaper):
    before = {p.pid for p in reapers()}
    proc, info = start_owner(tmp_path, {"FASTCACHE_REAPER": "1" if reaper else "0"})
    suffixes = info["suffixes"]
    try:
        # the precondition: the deployment and the extra suffix are there, with live creators
        assert all(entries(s) for s in suffixes), [entries(s) for s in suffixes]
        assert not any(find_stale(s) for s in suffixes)
        assert psutil.Process(info["transfer_pids"][0]).is_running()
        kill_tree(proc.pid)
        proc.wait()
        wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                 for p in info["transfer_pids"]), 30, "the killed transfer manager to exit")
        if reaper:
            wait_for(lambda: not any(entries(s) for s in suffixes), 60,
                     "the reaper to remove the killed deployment's /dev/shm entries and socket dirs")
            wait_for(lambda: not {p.pid for p in reapers()} - before, 30, "the reaper to exit")
        else:
            # the negative control: nobody removes them; every entry is stale, and the cleanup tool's rule
            # finds them all (then removes them, so that this test leaks nothing)
            assert all(entries(s) for s in suffixes)
            stale = [s for s in suffixes if find_stale(s)]
            assert stale == suffixes
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
        for s in suffixes:
            remove_dead(suffix=s)


def test_a_closed_deployment_stops_its_reaper_at_once(tmp_path):
    """A normal close: the deployment removed its own entries, so the reaper checks once and exits while
    the owner lives on (it does not wait for live processes, and touches nothing of theirs)."""
    before = {p.pid for p in reapers()}
    proc, info = start_owner(tmp_path, {"FASTCACHE_REAPER": "1"})
    try:
        assert len({p.pid for p in reapers()} - before) == 1, "the deployment has no reaper"
        proc.stdin.write("close\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "closed\n"
        wait_for(lambda: not {p.pid for p in reapers()} - before, 30, "the reaper to exit")
        assert proc.poll() is None, "the owner should still run"
        assert not any(entries(s) for s in info["suffixes"])
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
        for s in info["suffixes"]:
            remove_dead(suffix=s)
