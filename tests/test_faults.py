"""Fault tolerance with real processes and random data (docs/design.md §5 "a dead transfer manager or worker ...",
§7 liveness and clean-up).

Every scenario kills or stops a real process: a transfer manager (SIGKILL, SIGSTOP), a worker process
(SIGKILL), the engine itself (SIGKILL), or injects a copy failure (FASTCACHE_FAIL_EVERY). Each checks
that the failure is reported as a TransferError naming the rank and why, within a bounded time, and
that the deployment recovers bit-exactly (the engine owns the CPU tier, so a restarted transfer manager
finds every swapped-out block where it was).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from fastcache import RefusedError, SwapBackend, TransferError
from fastcache.ipc.signal import NORMAL
from fastcache.worker import CacheWorker
from fastcache.ipc.heartbeat import process_alive
from fastcache.ipc.naming import PREFIX
from fastcache.ipc.shm import SHM_DIR
from fastcache.launch.harness import start_worker, start_workers, stop_workers
from fastcache.launch.verify import Checks, Verifier
from fastcache.launch.workload import random_swap_round
from fastcache.ipc.leftovers import find_stale

from conftest import all_tensors, cpu_image, deployment, randomize, round_trip, small_spec, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEARTBEAT = 0.2          # seconds between beats in these tests (workers and transfer managers)


# -- helpers -------------------------------------------------------------------------------------
def deployment_entries(suffix: str) -> set[str]:
    return {e for e in os.listdir(SHM_DIR) if e.startswith(f"{PREFIX}.{suffix}.")}


def fast_liveness(monkeypatch, **extra):
    """Short liveness settings, set before the SwapBackend so its transfer managers inherit them."""
    monkeypatch.setenv("FASTCACHE_HEARTBEAT_INTERVAL", str(HEARTBEAT))
    for name, value in extra.items():
        monkeypatch.setenv(f"FASTCACHE_{name.upper()}", str(value))


class Stopped:
    """SIGSTOP a process; on exit make sure it is neither stopped nor left running (same process only)."""

    def __init__(self, pid):
        self.proc = psutil.Process(pid)
        self.create_time = self.proc.create_time()

    def __enter__(self):
        os.kill(self.proc.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc):
        try:
            if self.proc.create_time() == self.create_time and self.proc.status() != psutil.STATUS_ZOMBIE:
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
        except psutil.Error:
            pass


# -- transfer manager killed -----------------------------------------------------------------------
def test_sigkill_of_a_transfer_manager_fails_pending_and_later_tasks_then_restart_recovers(monkeypatch):
    fast_liveness(monkeypatch, transfer_timeout=30)     # only the process sentinel may detect this one
    rng = np.random.default_rng(11)
    spec = small_spec()
    victim = 1
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        # blocks swapped out before the kill: they must survive it in the engine-owned CPU tier
        kept_gpu = rng.choice(spec.num_gpu_blocks, 6, replace=False)
        kept_cpu = np.arange(6)
        backend.swap_out(kept_gpu, kept_cpu).result(timeout=10)
        kept = [cpu_image(w, kept_gpu) for w in workers]
        for r in range(2):
            np.testing.assert_array_equal(backend.cpu_tier(r)[kept_cpu], kept[r])

        old_pid = backend.transfer_pids[victim]
        with Stopped(old_pid):
            # tasks the victim will never run: they overwrite the kept CPU blocks with other GPU blocks,
            # so a restarted manager that replayed them would corrupt what the checks below expect
            others, spare = np.split(np.setdiff1d(np.arange(spec.num_gpu_blocks), kept_gpu)[:9], [6])
            pending = [backend.swap_out(others[i:i + 2], kept_cpu[i:i + 2]) for i in range(0, 6, 2)]
            pending.append(backend.swap_in(spare, kept_cpu[3:6]))
            time.sleep(0.3)
            assert not any(h.done() for h in pending), "the stopped rank cannot have finished its tasks"
            os.kill(old_pid, signal.SIGKILL)
            killed_at = time.monotonic()
            for h in pending:
                with pytest.raises(TransferError) as err:
                    h.result(timeout=5)
                msg = str(err.value)
                assert f"rank {victim}" in msg and "status -9" in msg and "SIGKILL" in msg, msg
                assert "rank 0" not in msg, msg          # rank 0 did its part
            assert time.monotonic() - killed_at < 3.0
        # rank 0 ran the tasks the victim missed
        want0 = kept[0].copy()
        want0[:6] = cpu_image(workers[0], others)
        np.testing.assert_array_equal(backend.cpu_tier(0)[kept_cpu[:6]], want0[:6])

        with pytest.raises(TransferError) as err:           # later submissions are refused up front
            backend.swap_out([0], [10])
        assert f"rank {victim}" in str(err.value) and "status -9" in str(err.value)

        backend.restart_rank(victim, timeout=20)
        assert backend.transfer_pids[victim] not in (0, old_pid)
        # the victim's CPU blocks hold exactly what was swapped out before the kill (no replay)
        np.testing.assert_array_equal(backend.cpu_tier(victim)[kept_cpu], kept[victim])
        # and swap back in bit-exactly, onto GPU blocks freshly overwritten
        dst = rng.choice(spec.num_gpu_blocks, 6, replace=False)
        for w in workers:
            for rows in all_tensors(w):
                rows[dst] = rng.integers(1, 256, rows[dst].shape, dtype=np.uint8)
        backend.swap_in(dst, kept_cpu).result(timeout=10)
        np.testing.assert_array_equal(cpu_image(workers[victim], dst), kept[victim])
        np.testing.assert_array_equal(cpu_image(workers[0], dst), want0)
        round_trip(backend, workers, rng)


def test_a_death_noticed_after_restart_rank_replaced_the_process_does_not_take_the_new_one_out_of_service():
    """Supervision reads a rank's process, finds it dead and marks the rank failed; if restart_rank has put
    a new process in its place meanwhile, that mark must not stick (every swap would be refused)."""
    rng = np.random.default_rng(17)
    with deployment(small_spec(), tp=2) as (backend, workers):
        old = backend._ranks.process(1)
        backend.restart_rank(1)
        backend.wait_ready(timeout=30)
        assert old.poll() is not None and backend._ranks.process(1) is not old
        backend._ranks.mark_failed(1, f"transfer manager (pid {old.pid}) exited", proc=old)     # the late check
        assert backend.failed_ranks == {}
        round_trip(backend, workers, rng)


def test_sigstop_of_a_transfer_manager_is_detected_by_heartbeat_then_restart_recovers(monkeypatch):
    timeout = 2.0
    fast_liveness(monkeypatch, transfer_timeout=timeout)
    rng = np.random.default_rng(12)
    spec = small_spec()
    victim = 0
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        kept_gpu = rng.choice(spec.num_gpu_blocks, 4, replace=False)
        kept_cpu = np.array([7, 3, 12, 0])
        backend.swap_out(kept_gpu, kept_cpu).result(timeout=10)
        kept = [cpu_image(w, kept_gpu) for w in workers]

        old_pid = backend.transfer_pids[victim]
        with Stopped(old_pid):
            stopped_at = time.monotonic()
            handle = backend.swap_out([1, 2], [1, 2])
            with pytest.raises(TransferError) as err:
                handle.result(timeout=timeout + 5)
            elapsed = time.monotonic() - stopped_at
            msg = str(err.value)
            assert f"rank {victim}" in msg and "stopped answering" in msg and str(old_pid) in msg, msg
            assert timeout - 2 * HEARTBEAT - 0.1 <= elapsed <= timeout + 2.0, elapsed
            # the engine killed the silent process, so it can never wake up and write into the cache, and
            # failed its tasks only once it was gone (a copy it had queued could still have landed before)
            assert not process_alive(old_pid)
            with pytest.raises(TransferError, match="stopped answering"):
                backend.swap_in([1], [1])
        backend.restart_rank(victim, timeout=20)
        assert backend.transfer_pids[victim] != old_pid
        for r in range(2):
            np.testing.assert_array_equal(backend.cpu_tier(r)[kept_cpu], kept[r])
        dst = rng.choice(spec.num_gpu_blocks, 4, replace=False)
        backend.swap_in(dst, kept_cpu).result(timeout=10)
        for r, w in enumerate(workers):
            np.testing.assert_array_equal(cpu_image(w, dst), kept[r])
        round_trip(backend, workers, rng)



@pytest.mark.parametrize("task_ring", [True, False], ids=["ring", "pipe"])
def test_a_task_failed_as_never_received_does_not_run_when_its_transfer_manager_reads_it_late(monkeypatch, tmp_path,
                                                                                              task_ring):
    """A transfer manager whose main loop is held up past the transfer timeout while its heartbeat thread beats on:
    the engine fails the tasks it has not read (as if another process took them). Once the loop goes on it must not
    run them: their blocks are the user's again, so a late swap-in would write stale KV over a reused GPU block and
    a late swap-out over a freed CPU block."""
    from fastcache.transfer.manager import TEST_STALL
    stall = tmp_path / "stall"
    fast_liveness(monkeypatch, transfer_timeout=1, task_ring=int(task_ring))
    monkeypatch.setenv(TEST_STALL, str(stall))
    rng = np.random.default_rng(37)
    spec = small_spec()
    with deployment(spec, tp=1) as (backend, [worker]):
        randomize(worker, rng)
        out_gpu, in_gpu, later_gpu = np.split(rng.choice(spec.num_gpu_blocks, 6, replace=False), 3)
        out_cpu, in_cpu, later_cpu = np.split(rng.choice(spec.num_cpu_blocks, 6, replace=False), 3)
        tier = backend.cpu_tier(0)
        tier[np.concatenate([out_cpu, in_cpu])] = rng.integers(0, 256, (4, spec.cpu_block_bytes), dtype=np.uint8)
        received = int(backend.signals.task_received[0])
        stall.touch()
        late = [backend.swap_out(out_gpu, out_cpu), backend.swap_in(in_gpu, in_cpu)]
        for handle in late:
            with pytest.raises(TransferError, match="did not receive the task"):
                handle.result(timeout=10)
        assert int(backend.signals.task_received[0]) == received, "the held-up loop read a task"
        # the handles failed: the user writes into the blocks again
        for rows in all_tensors(worker):
            rows[in_gpu] = rng.integers(0, 256, rows[in_gpu].shape, dtype=np.uint8)
        tier[out_cpu] = rng.integers(0, 256, (2, spec.cpu_block_bytes), dtype=np.uint8)
        want_gpu, want_cpu = cpu_image(worker, in_gpu), tier[out_cpu].copy()
        stall.unlink()
        # tasks on the same blocks take effect after the late ones (submission order), so a late copy has landed
        # by their end
        backend.swap_out(in_gpu, later_cpu).result(timeout=10)
        backend.swap_in(later_gpu, out_cpu).result(timeout=10)
        np.testing.assert_array_equal(cpu_image(worker, in_gpu), want_gpu, err_msg="a late swap-in wrote the block")
        np.testing.assert_array_equal(tier[out_cpu], want_cpu, err_msg="a late swap-out wrote the block")
        np.testing.assert_array_equal(tier[later_cpu], want_gpu)
        np.testing.assert_array_equal(cpu_image(worker, later_gpu), want_cpu)
        round_trip(backend, [worker], rng)
        backend.restart_rank(0, timeout=20)     # a new process numbers from 1 again: nothing of it is abandoned
        round_trip(backend, [worker], rng)


# -- worker process killed -------------------------------------------------------------------------
def test_sigkill_of_a_worker_process_makes_its_transfer_manager_exit_and_the_engine_report_it(monkeypatch):
    worker_timeout = 1.5
    fast_liveness(monkeypatch, worker_timeout=worker_timeout, transfer_timeout=30)
    rng = np.random.default_rng(13)
    spec = small_spec()
    victim = 1
    procs, verifier = [], None
    backend = SwapBackend(spec, tp_size=2, device="sim").start()
    suffix = backend.suffix
    try:
        procs = start_workers(backend, None, "numpy")
        backend.wait_ready(timeout=30)
        verifier = Verifier(backend, "sim", rng)
        verifier.attach()
        verifier.fill_all()
        checks = Checks()
        random_swap_round(backend, verifier, checks, rng, 6)
        assert not checks.failed, checks.failed
        tm_pid = backend.transfer_pids[victim]

        procs[victim].kill()
        procs[victim].wait()
        killed_at = time.monotonic()
        first = reported = None          # (seconds after the kill, message)
        while reported is None and time.monotonic() - killed_at < worker_timeout + 5:
            try:
                backend.swap_out([3], [3]).result(timeout=5)
                time.sleep(0.02)
            except TransferError as exc:
                now = (time.monotonic() - killed_at, str(exc))
                first = first or now
                if "status" in now[1]:
                    reported = now
        assert first is not None, "the engine never noticed the dead worker's rank"
        assert f"rank {victim}" in first[1] and "rank 0" not in first[1], first
        # the manager waited for the worker timeout (not less), and exited soon after it
        assert worker_timeout - HEARTBEAT - 0.2 <= first[0] <= worker_timeout + 3.0, first
        # within one supervision tick the engine names the manager, its exit status and why
        assert reported is not None and reported[0] - first[0] < 0.5, (first, reported)
        error = reported[1]
        assert f"rank {victim}" in error and str(tm_pid) in error and "status 3" in error, error
        assert "worker stopped beating" in error, error
        assert not process_alive(tm_pid)
        assert backend.transfer_pids[0] and process_alive(backend.transfer_pids[0])
    finally:
        if verifier is not None:
            verifier.detach()
        stop_workers(procs)
        # the only leftovers whose creator is dead are the killed worker's; close() removes them too
        stale = [name for _kind, name, _pid in find_stale(suffix)]
        backend.close()
    assert all(any(f"{what}_rank{victim}" in e for what in ("cache", "exports", "worker")) for e in stale), stale
    assert not deployment_entries(suffix)


def test_a_worker_that_takes_over_a_live_rank_is_never_served_through_the_old_workers_memory(monkeypatch):
    """A worker closes and another takes its rank (§4: a gone worker's claim passes on) while the rank's transfer
    manager still maps the first one's tensors. No swap may be reported done with its bytes written to, or read
    from, that old memory: it fails naming the rank, the manager exits saying why (a new manager maps the new
    tensors), and restart_rank brings the rank back over the new worker, bit-exactly."""
    fast_liveness(monkeypatch, transfer_timeout=30)
    rng = np.random.default_rng(37)
    spec = small_spec()
    victim = 1
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        round_trip(backend, workers, rng)
        tm_pid = backend.transfer_pids[victim]
        workers[victim].close()
        workers[victim] = CacheWorker(spec, rank=victim, tp_size=2, device="sim", suffix=backend.suffix,
                                      framework="numpy").start()
        randomize(workers[victim], rng)
        cpu = np.array(backend.allocate_cpu_blocks(4))
        for r in range(2):
            backend.cpu_tier(r)[cpu] = rng.integers(0, 256, (4, spec.cpu_block_bytes), dtype=np.uint8)
        tier = [backend.cpu_tier(r)[cpu].copy() for r in range(2)]
        gpu_in, gpu_out = np.split(rng.choice(spec.num_gpu_blocks, 8, replace=False), 2)
        untouched = cpu_image(workers[victim], gpu_in)
        try:
            backend.swap_in(gpu_in, cpu).result(timeout=10)
        except TransferError as exc:
            assert f"rank {victim}" in str(exc) and "rank 0" not in str(exc), exc
            np.testing.assert_array_equal(cpu_image(workers[victim], gpu_in), untouched)
        else:           # reported done: the bytes must be in the new worker's tensors
            np.testing.assert_array_equal(cpu_image(workers[victim], gpu_in), tier[victim])
        try:
            backend.swap_out(gpu_out, cpu).result(timeout=10)
        except TransferError as exc:
            assert f"rank {victim}" in str(exc) and "rank 0" not in str(exc), exc
        else:           # reported done: the tier must hold the new worker's bytes
            np.testing.assert_array_equal(backend.cpu_tier(victim)[cpu], cpu_image(workers[victim], gpu_out))
        # the rank goes out of service on its own, naming why
        wait_for(lambda: victim in backend.failed_ranks, 10, "the engine took the rank out of service")
        why = backend.failed_ranks[victim]
        assert str(tm_pid) in why and "another worker took its rank" in why, why
        assert 0 not in backend.failed_ranks
        backend.restart_rank(victim, timeout=20)
        backend.wait_ready(timeout=20)
        round_trip(backend, workers, rng)
        backend.free_cpu_blocks(cpu.tolist())


def test_a_worker_started_for_the_rank_of_a_killed_one_takes_it_over_without_a_cleanup_step(monkeypatch):
    """§4: a dead worker's claim on its rank passes to the next worker. That worker must be able to start: the
    killed one's segments (its cache, its manifest) hold the names it creates, and no process will ever unlink
    them. It serves the rank once restart_rank has replaced the transfer manager that mapped the dead one's
    tensors, bit-exactly."""
    fast_liveness(monkeypatch, transfer_timeout=30)
    spec = small_spec()
    with rank_1_worker_killed(spec) as (backend, workers):
        workers.append(CacheWorker(spec, rank=1, tp_size=2, device="sim", suffix=backend.suffix).start())
        wait_for(lambda: 1 in backend.failed_ranks, 10, "the old worker's transfer manager went")
        backend.restart_rank(1, timeout=20)
        backend.wait_ready(timeout=20)
        random_round_trip(backend, workers, np.random.default_rng(41))


def test_restart_rank_while_the_ranks_worker_is_dead_serves_nothing_until_a_new_worker_comes(monkeypatch):
    """A worker is killed, its transfer manager exits (status 3) and the engine names it; restart_rank is the
    natural answer. The new process must not attach what the dead worker left (on sim its memory is still
    there) and report the rank ready: every swap would be reported done over memory no worker serves. It waits
    for a worker instead; the one that takes the rank is attached without another restart, bit-exactly."""
    fast_liveness(monkeypatch, worker_timeout=1.0, transfer_timeout=30)
    spec = small_spec()
    with rank_1_worker_killed(spec) as (backend, workers):
        wait_for(lambda: "status 3" in (backend.failed_ranks.get(1) or ""), 10,
                 "the dead worker's transfer manager exited")
        with pytest.raises(TransferError, match="restart of rank 1 timed out"):
            backend.restart_rank(1, timeout=3)
        with pytest.raises(RefusedError, match="not ready"):
            backend.swap_out([1], [1])
        workers.append(CacheWorker(spec, rank=1, tp_size=2, device="sim", suffix=backend.suffix).start())
        backend.wait_ready(timeout=20)
        random_round_trip(backend, workers, np.random.default_rng(43))


@contextlib.contextmanager
def rank_1_worker_killed(spec):
    """A tp=2 deployment whose rank 0 worker runs here and whose rank 1 worker, a process of its own, is killed
    once the deployment is ready. Yields (backend, workers): rank 0's, and any the test appends (closed after)."""
    with SwapBackend(spec, tp_size=2, device="sim") as backend:
        workers = [CacheWorker(spec, rank=0, tp_size=2, device="sim", suffix=backend.suffix).start()]
        proc = start_worker(backend, 1, 2, spec, "numpy", 1)
        try:
            backend.wait_ready(timeout=30)
            proc.kill()
            proc.wait()
            yield backend, workers
        finally:
            stop_workers([proc])
            for w in workers:
                w.close()


def random_round_trip(backend, workers, rng):
    """Every worker's cache filled with random bytes, then round_trip: blocks out and back, bit for bit."""
    for w in workers:
        randomize(w, rng)
    round_trip(backend, workers, rng)


def test_task_submitted_right_after_a_transfer_manager_died_names_its_exit_status(monkeypatch):
    """Regression: between a manager's death and the next supervision tick, a submission used to fail with
    a bare 'transfer manager not connected'; send_all now looks at the process (check_exit) itself."""
    with deployment(small_spec(), tp=2) as (backend, workers):
        monkeypatch.setattr(backend._ranks, "watch", lambda: None)    # hold the 100 ms supervision tick
        pid = backend.transfer_pids[1]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not process_alive(pid), 5, "the transfer manager died")
        time.sleep(0.2)                 # zmq has seen the connection go by now
        deadline, message = time.monotonic() + 5, None
        while message is None and time.monotonic() < deadline:
            try:
                backend.swap_out([1], [1]).result(timeout=1)
            except TransferError as exc:
                message = str(exc)
            except TimeoutError:        # sent into the dying pipe: only supervision could fail it
                pass
        monkeypatch.undo()
        assert message is not None and "rank 1" in message
        assert "status -9" in message, message


# -- injected copy failure -------------------------------------------------------------------------
def test_injected_copy_failure_fails_only_that_task_and_the_deployment_keeps_working(monkeypatch):
    monkeypatch.setenv("FASTCACHE_FAIL_EVERY", "1:2")       # every 2nd task of rank 1 fails
    rng = np.random.default_rng(14)
    spec = small_spec()
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        pids = backend.transfer_pids
        outcomes = []
        for k in range(1, 9):
            gpu = rng.choice(spec.num_gpu_blocks, 3, replace=False)
            cpu = rng.choice(spec.num_cpu_blocks, 3, replace=False)
            before = [backend.cpu_tier(r)[cpu].copy() for r in range(2)]
            want = [cpu_image(w, gpu) for w in workers]
            handle = backend.swap_out(gpu, cpu)
            try:
                handle.result(timeout=10)
                outcomes.append("ok")
                for r in range(2):
                    np.testing.assert_array_equal(backend.cpu_tier(r)[cpu], want[r])
            except TransferError as exc:
                outcomes.append("failed")
                msg = str(exc)
                assert "rank 1" in msg and "injected fault" in msg and f"task {handle.task_id}" in msg, msg
                assert "rank 0" not in msg, msg
                np.testing.assert_array_equal(backend.cpu_tier(0)[cpu], want[0])   # rank 0 did its part
                np.testing.assert_array_equal(backend.cpu_tier(1)[cpu], before[1])  # rank 1 wrote nothing
        assert outcomes == ["ok", "failed"] * 4
        assert backend.transfer_pids == pids            # a failed copy fails its task, never the process
        # the deployment keeps working, through a clear/restore cycle too
        backend.clear_caches(timeout=30)
        backend.restore_caches(timeout=30)
        for w in workers:
            randomize(w, rng)
        gpu = rng.choice(spec.num_gpu_blocks, 4, replace=False)
        want = [cpu_image(w, gpu) for w in workers]
        backend.swap_out(gpu, [0, 1, 2, 3]).result(timeout=10)          # task 9 of rank 1: succeeds
        with pytest.raises(TransferError, match="rank 1"):
            backend.swap_out([5], [9]).result(timeout=10)               # task 10: fails
        dst = rng.choice(spec.num_gpu_blocks, 4, replace=False)
        backend.swap_in(dst, [0, 1, 2, 3]).result(timeout=10)           # task 11: succeeds
        for r, w in enumerate(workers):
            np.testing.assert_array_equal(cpu_image(w, dst), want[r])
        assert backend.transfer_pids == pids


# -- engine killed ---------------------------------------------------------------------------------
ENGINE = r"""
import json, os, sys, time
from fastcache import CacheSpec, SwapBackend
from fastcache.launch.harness import start_workers

spec = CacheSpec.from_json(sys.argv[1])
backend = SwapBackend(spec, tp_size=2, device="sim").start()
workers = start_workers(backend, None, "numpy")
backend.wait_ready(timeout=30)
backend.swap_out([0, 1, 2], [4, 5, 6]).result(timeout=10)
info = {"suffix": backend.suffix, "socket_dir": backend.socket_dir,
        "transfer_pids": backend.transfer_pids, "worker_pids": [w.pid for w in workers]}
with open(sys.argv[2] + ".tmp", "w") as f:
    json.dump(info, f)
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
time.sleep(120)
"""


def test_sigkill_of_the_engine_children_exit_on_their_own_and_cleanup_removes_only_the_dead(monkeypatch, tmp_path):
    rng = np.random.default_rng(15)
    spec = small_spec()
    env = dict(os.environ, FASTCACHE_HEARTBEAT_INTERVAL=str(HEARTBEAT),
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    info_path, log_path = tmp_path / "engine.json", tmp_path / "engine.log"
    with open(log_path, "w") as log, deployment(spec, tp=1) as (live, live_workers):
        live_entries = deployment_entries(live.suffix)
        engine = subprocess.Popen([sys.executable, "-c", ENGINE, spec.to_json(), str(info_path)], cwd=ROOT,
                                  env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        children = []
        try:
            wait_for(lambda: info_path.exists() or engine.poll() is not None, 60, "the engine started")
            assert engine.poll() is None, log_path.read_text()
            info = json.loads(info_path.read_text())
            children = info["transfer_pids"] + info["worker_pids"]
            assert all(process_alive(p) for p in children)
            dead_entries = deployment_entries(info["suffix"])
            assert any("swap_rank" in e for e in dead_entries) and any("cache_rank" in e for e in dead_entries)
            engine.kill()
            engine.wait()
            killed_at = time.monotonic()
            # transfer managers check every heartbeat, workers every 0.5 s: all gone within a few seconds
            wait_for(lambda: not any(process_alive(p) for p in children), 5, "every child of the engine exited")
            exited_after = time.monotonic() - killed_at
        finally:
            if engine.poll() is None:
                engine.kill()
                engine.wait()
            for pid in children:            # only if something above failed
                if process_alive(pid):
                    os.kill(pid, signal.SIGKILL)
        text = log_path.read_text()
        assert text.count("its engine exited; exiting") == 2, text       # each manager said why, once
        assert text.count("engine is gone; exiting") == 2, text          # and each worker
        assert exited_after < 5

        # the workers released their own memory; what is left is the dead engine's. (Another program's
        # SwapBackend.start() removes a dead deployment's leftovers too: on a busy machine they may be gone already.)
        left = deployment_entries(info["suffix"])
        assert not any(what in e for e in left for what in ("cache_rank", "exports_rank", "worker_rank")), left

        out = subprocess.run([sys.executable, "-m", "fastcache.tools.cleanup"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        listed = {line.split()[2].lstrip("/") for line in out.stdout.splitlines()
                  if line.startswith("removed segment") and info["suffix"] in line}
        # everything listed was the dead deployment's; (another program's SwapBackend.start() may have
        # removed some of it in the meantime, so "listed" can be smaller than "left" on a busy machine)
        assert listed <= left and (listed or not deployment_entries(info["suffix"])), out.stdout
        assert not deployment_entries(info["suffix"])
        assert not os.path.exists(info["socket_dir"])
        # the live deployment lost nothing and still works
        assert deployment_entries(live.suffix) == live_entries
        assert os.path.isdir(live.socket_dir)
        assert live.suffix not in out.stdout
        for w in live_workers:
            randomize(w, rng)
        round_trip(live, live_workers, rng)


def test_a_dead_transfer_manager_is_logged_once_however_often_it_is_hit(caplog):
    caplog.set_level("WARNING", logger="fastcache.engine")
    with deployment(small_spec(), tp=2) as (backend, _):
        victim = backend.transfer_pids[1]
        os.kill(victim, signal.SIGKILL)
        for i in range(50):                         # submissions racing supervision, then refused
            try:
                backend.swap_out([i % 24], [i % 16]).result(timeout=10)
            except TransferError:
                pass
            time.sleep(0.005)
        lines = [r.getMessage() for r in caplog.records if r.name == "fastcache.engine"]
        assert len([m for m in lines if f"pid {victim}" in m]) == 1, lines


# -- a device error while attaching ----------------------------------------------------------------
def test_a_failed_attach_is_reported_by_name_and_the_process_survives(monkeypatch):
    """A TransferError while attaching (a CUDA IPC open, NVRTC or pinning failing on a real GPU) fails the
    attach: wait_ready raises naming the rank and the error at once, the manager stays up, and
    restart_rank brings the rank back."""
    monkeypatch.setenv("FASTCACHE_FAIL_ATTACH", "1:1")      # rank 1's first attach fails
    rng = np.random.default_rng(21)
    spec = small_spec()
    with SwapBackend(spec, tp_size=2, device="sim") as backend:
        workers = [CacheWorker(spec, rank=r, tp_size=2, device="sim", suffix=backend.suffix,
                               framework="numpy").start() for r in range(2)]
        try:
            began = time.monotonic()
            with pytest.raises(TransferError, match="rank 1.*could not attach.*injected attach fault") as err:
                backend.wait_ready(timeout=20)
            assert time.monotonic() - began < 5, "the failure must be reported, not timed out"
            assert "rank 0" not in str(err.value)
            pid = backend.transfer_pids[1]
            time.sleep(0.3)
            assert process_alive(pid), "a failed attach must not kill the transfer manager"
            with pytest.raises(TransferError, match="rank 1"):
                backend.swap_out([1], [1])
            monkeypatch.delenv("FASTCACHE_FAIL_ATTACH")
            backend.restart_rank(1)
            backend.wait_ready(timeout=20)
            round_trip(backend, workers, rng)
        finally:
            for w in workers:
                w.close()


def test_a_failed_attach_during_restore_breaks_the_restore_at_once_and_a_restart_recovers(monkeypatch):
    monkeypatch.setenv("FASTCACHE_FAIL_ATTACH", "0:2")      # rank 0 attaches at start, fails at restore
    monkeypatch.setenv("FASTCACHE_PHASE_TIMEOUT", "30")
    rng = np.random.default_rng(22)
    with deployment(small_spec(), tp=2) as (backend, workers):
        round_trip(backend, workers, rng)
        backend.clear_caches(timeout=30)
        began = time.monotonic()
        with pytest.raises(TransferError, match="restore failed.*transfer manager rank 0 reported a failure"):
            backend.restore_caches(timeout=30)
        assert time.monotonic() - began < 10, "an aborted barrier must not wait for the phase timeout"
        monkeypatch.delenv("FASTCACHE_FAIL_ATTACH")
        backend.restart_rank(0)
        backend.restore_caches(timeout=30)
        assert backend.status == NORMAL
        round_trip(backend, workers, rng)


def test_after_restart_rank_no_task_reaches_a_pipe_of_the_old_process():
    """restart_rank must not depend on zmq having noticed the old process's death: a pipe to it that is
    still open (under load zmq's I/O thread can be late) would take every other task and never answer.
    A stray peer on the rank's task endpoint stands in for that pipe."""
    import zmq
    rng = np.random.default_rng(23)
    with deployment(small_spec(), tp=2) as (backend, workers):
        context = zmq.Context()
        stray = context.socket(zmq.PULL)
        stray.setsockopt(zmq.LINGER, 0)
        try:
            stray.connect(backend._channel._task_pushes[1].getsockopt_string(zmq.LAST_ENDPOINT))
            time.sleep(0.2)                     # connected, like the old process's pipe
            backend.restart_rank(1)
            backend.wait_ready(timeout=30)
            for _ in range(6):                  # each round trip is two tasks; one of them would go astray
                round_trip(backend, workers, rng, n=3)
            assert stray.poll(100) == 0, "a task reached the old pipe"
        finally:
            stray.close(0)
            context.term()


def test_a_task_failed_by_a_restart_before_it_was_sent_never_runs_on_the_new_process():
    """A handle can be registered, then restart_rank fails it for the rank (its old process is gone), and only
    then be sent. The new process must not get it: the handle is already done, its caller may reuse the
    blocks, and a late copy would overwrite them."""
    rng = np.random.default_rng(29)
    with deployment(small_spec(), tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        cpu = backend.allocate_cpu_blocks(4)
        poison = rng.integers(0, 256, (4, backend.spec.cpu_block_bytes), dtype=np.uint8)
        backend.cpu_tier(1)[cpu] = poison
        send = backend._channel.send_all

        def restart_then_send(message, *args):
            backend._channel.send_all = send
            backend.restart_rank(1)
            backend.wait_ready(timeout=30)
            return send(message, *args)

        backend._channel.send_all = restart_then_send
        handle = backend.swap_out([3, 5, 7, 9], cpu)
        with pytest.raises(TransferError, match="restarted"):
            handle.result(timeout=10)
        # a fence: a swap-in reading the same CPU blocks runs after any task the new process was given on
        # them (tasks on common blocks take effect in submission order), so a late copy has landed by its end
        backend.swap_in([11, 13, 15, 17], cpu).result(timeout=30)
        np.testing.assert_array_equal(backend.cpu_tier(1)[cpu], poison)
        np.testing.assert_array_equal(cpu_image(workers[1], [11, 13, 15, 17]), poison)
        round_trip(backend, workers, rng)


def test_a_phase_command_waits_for_a_registered_process_whose_task_pipe_is_not_up_yet():
    """restart_rank in CLEARED returns once the new process has registered through the reply socket; its
    task pipe may come up a moment later. The restore sent then must reach it, not wait out the barrier."""
    import zmq

    class NotUpYet:         # the rank's task socket, with no pipe for its first sends
        def __init__(self, push, refusals):
            self.push, self.refusals = push, refusals

        def send_multipart(self, message, flags=0):
            if self.refusals:
                self.refusals -= 1
                raise zmq.Again()
            return self.push.send_multipart(message, flags)

        def close(self, linger=None):
            self.push.close(linger)

    rng = np.random.default_rng(31)
    with deployment(small_spec(), tp=2) as (backend, workers):
        backend.clear_caches(timeout=30)
        backend.restart_rank(1)
        backend._channel._task_pushes[1] = NotUpYet(backend._channel._task_pushes[1], refusals=20)
        started = time.monotonic()
        backend.restore_caches(timeout=10)
        assert time.monotonic() - started < 5
        for w in workers:
            randomize(w, rng)
        round_trip(backend, workers, rng)


# -- close against restart_rank and start ----------------------------------------------------------
def test_restart_rank_after_close_is_refused_and_creates_nothing():
    """A supervisor's restart_rank that comes after close must not bind a pipe or make a ring for a new process
    (nothing would remove them while this process lives) nor start one."""
    with deployment(small_spec(), tp=2) as (backend, _workers):
        suffix = backend.suffix
        backend.close()
        with pytest.raises(TransferError, match="not running"):
            backend.restart_rank(1, timeout=5)
        assert not deployment_entries(suffix)


def test_a_restart_rank_racing_close_leaves_no_transfer_manager_running():
    """restart_rank on another thread kills rank 1's process; close runs before it spawns the new one. No process
    may start once close has stopped the ranks (it would run on, unwatched, until this process exits): the
    restart fails instead, and close leaves nothing running."""
    import threading

    from fastcache.engine import backend as backend_module

    with deployment(small_spec(), tp=2) as (backend, workers):
        old = backend.transfer_pids[1]
        paused, closing, outcome = threading.Event(), threading.Event(), {}
        fail_rank_tasks = backend._channel.fail_rank_tasks

        def pause_after_the_kill(rank, why):        # restart: the old process is gone, the new one not spawned
            paused.set()
            closing.wait(30)
            fail_rank_tasks(rank, why)

        def restart():
            try:
                backend.restart_rank(1, timeout=20)
                outcome["restarted"] = backend.transfer_pids[1]
            except TransferError as exc:
                outcome["error"] = str(exc)

        close_local_workers = backend_module.close_local_workers

        def closing_now(suffix):                    # close has stopped the ranks: the restart goes on
            closing.set()
            thread.join(30)
            close_local_workers(suffix)

        backend._channel.fail_rank_tasks = pause_after_the_kill
        thread = threading.Thread(target=restart)
        thread.start()
        try:
            assert paused.wait(30)
            backend_module.close_local_workers = closing_now
            backend.close()
        finally:
            backend_module.close_local_workers = close_local_workers
            closing.set()
            thread.join(30)
        assert not thread.is_alive()
        assert not process_alive(old)
        started = outcome.get("restarted")
        assert started is None or not process_alive(started), outcome
        assert "error" in outcome and "closed" in outcome["error"], outcome
        kids = [p for p in psutil.Process().children(recursive=True) if "fastcache.transfer" in " ".join(p.cmdline())]
        assert not kids, kids


def test_close_right_after_start_does_not_wait_for_processes_it_could_not_tell_to_stop():
    """Transfer managers not yet connected to their task pipes cannot be told to stop: close must not wait for
    them to time out (it took the whole close timeout, 30 s, as does a start that fails and closes)."""
    backend = SwapBackend(small_spec(), tp_size=2, device="sim").start()
    began = time.monotonic()
    backend.close()
    assert time.monotonic() - began < 10
    assert not any(process_alive(p) for p in backend.transfer_pids if p)
