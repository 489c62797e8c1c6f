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
from fastcache.ipc.naming import PREFIX, new_suffix, segment_name
from fastcache.ipc.reaper import reap
from fastcache.ipc.shm import SHM_DIR, unlink

from conftest import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A deployment that is ready (a transfer manager attached to an in-process worker), with one more
# segment under a second suffix given to the reaper, as the vLLM integration's link is; then it waits.
OWNER = r"""
import json, os, sys
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


def reapers(owner: int):
    """The reapers of one owner process (its pid is the reaper's first argument): another copy of these tests,
    or another deployment on the machine, has reapers of its own."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if len(cmdline) >= 4 and cmdline[1] == "-c" and "fastcache.ipc.reaper" in cmdline[2] \
                and cmdline[3] == str(owner):
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
    proc, info = start_owner(tmp_path, {"FASTCACHE_REAPER": "1" if reaper else "0"})
    suffixes = info["suffixes"]
    try:
        assert len(reapers(proc.pid)) == (1 if reaper else 0)
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
            wait_for(lambda: not reapers(proc.pid), 30, "the reaper to exit")
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
    proc, info = start_owner(tmp_path, {"FASTCACHE_REAPER": "1"})
    try:
        assert len(reapers(proc.pid)) == 1, "the deployment has no reaper"
        proc.stdin.write("close\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "closed\n"
        wait_for(lambda: not reapers(proc.pid), 30, "the reaper to exit")
        assert proc.poll() is None, "the owner should still run"
        assert not any(entries(s) for s in info["suffixes"])
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
        for s in info["suffixes"]:
            remove_dead(suffix=s)


# An owner with a reaper and one segment of its own, which forks a multiprocessing worker (the fork start
# method, as a Pool's workers are made): the worker inherits the pipe's write end and outlives the owner.
FORKING_OWNER = r"""
import json, multiprocessing, os, sys
from fastcache.ipc.naming import new_suffix, segment_name
from fastcache.ipc.reaper import Reaper
from fastcache.ipc.shm import SharedSegment

suffix = new_suffix()
reaper = Reaper()
reaper.watch(suffix)
seg = SharedSegment.create(segment_name(suffix, "owned"), 4096, suffix)
gate = multiprocessing.get_context("fork").Event()
child = multiprocessing.get_context("fork").Process(target=gate.wait, daemon=False)
child.start()
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({"suffix": suffix, "child": child.pid}, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
sys.stdin.read()
"""

# A process that creates one segment under a given suffix and holds it until its stdin closes.
CREATOR = r"""
import sys
from fastcache.ipc.naming import segment_name
from fastcache.ipc.shm import SharedSegment
seg = SharedSegment.create(segment_name(sys.argv[1], sys.argv[2]), 4096, sys.argv[1])
print("created", flush=True)
sys.stdin.read()
"""


def start_creator(suffix, what):
    proc = subprocess.Popen([sys.executable, "-c", CREATOR, suffix, what], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "created\n"
    return proc


def test_a_forked_child_that_outlives_a_killed_owner_does_not_hold_its_reaper(tmp_path):
    info_path = tmp_path / "owner.json"
    proc = subprocess.Popen([sys.executable, "-c", FORKING_OWNER, str(info_path)], cwd=ROOT,
                            stdin=subprocess.PIPE, text=True)
    child = None
    try:
        wait_for(lambda: proc.poll() is None and info_path.exists() or proc.poll() is not None, 60, "the owner")
        assert proc.poll() is None, "the owner died while starting"
        info = json.loads(info_path.read_text())
        child = psutil.Process(info["child"])
        # the precondition: the child holds the pipe's write end (the reaper's end of file cannot come)
        reaper, = reapers(proc.pid)
        pipe = os.readlink(f"/proc/{reaper.pid}/fd/0")
        assert pipe.startswith("pipe:")
        assert any(os.readlink(f"/proc/{child.pid}/fd/{fd}") == pipe for fd in os.listdir(f"/proc/{child.pid}/fd")
                   if os.path.islink(f"/proc/{child.pid}/fd/{fd}")), "the forked child holds no write end"
        assert entries(info["suffix"])
        os.kill(proc.pid, signal.SIGKILL)       # the owner alone: its child lives on
        proc.wait()
        wait_for(lambda: not entries(info["suffix"]), 60, "the reaper to remove the killed owner's segment")
        wait_for(lambda: not reapers(proc.pid), 30, "the reaper to exit")
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE, "the child should still run"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None and child.is_running():        # the same process (psutil checks its start)
            child.kill()
            wait_for(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 30, "the child")
        if info_path.exists():
            remove_dead(suffix=json.loads(info_path.read_text())["suffix"])


def test_the_reaper_of_a_dead_owner_waits_for_a_creator_that_outlives_it(monkeypatch):
    """The owner is gone, one of its deployment's creators still runs: the reaper leaves that creator's
    segment while it runs, waits for it to exit, then removes what it left."""
    suffix = new_suffix()
    creator = start_creator(suffix, "outlives_the_owner")
    name = segment_name(suffix, "outlives_the_owner")
    waited = []
    real_wait = psutil.wait_procs

    def wait_procs(procs, timeout=None):
        waited.append(sorted(p.pid for p in procs))
        assert entries(suffix), "the reaper removed a live creator's segment"
        creator.kill()          # it exits while the reaper waits (killed: it cannot unlink its own segment)
        creator.wait()
        return real_wait(procs, timeout=timeout)

    monkeypatch.setattr(psutil, "wait_procs", wait_procs)
    try:
        reap([suffix], owner_died=True, grace=30)
        assert waited == [[creator.pid]], "the reaper did not wait for the live creator"
        assert not entries(suffix), "the reaper left what the creator left once it exited"
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.wait()
        unlink(name)


def test_a_closed_owner_s_reaper_leaves_a_live_creator_s_entries_alone(tmp_path):
    """A normal close with another creator of the deployment still running: the reaper checks once, removes
    what a dead creator left (the control) and nothing of the live one's, and exits."""
    proc, info = start_owner(tmp_path, {"FASTCACHE_REAPER": "1"})
    suffix = info["suffixes"][0]
    live = start_creator(suffix, "a_live_creator_s")
    dead = start_creator(suffix, "a_dead_creator_s")
    try:
        dead.kill()
        dead.wait()
        assert len(entries(suffix)) > 2
        proc.stdin.write("close\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "closed\n"
        wait_for(lambda: not reapers(proc.pid), 30, "the reaper to exit")
        assert entries(suffix) == [f"{PREFIX}.{suffix}.a_live_creator_s"]
    finally:
        for p in (live, dead):
            if p.poll() is None:
                p.stdin.close()
                p.wait()
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
        for s in info["suffixes"]:
            remove_dead(suffix=s)
