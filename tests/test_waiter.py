"""A waiter reads its own completion (docs/design.md §4, engine/doorbells.py): result() takes the completion
rings' doorbells from the engine's I/O thread and reads the rings itself, so a task's reports wake the thread
waiting for it and not the I/O thread too; whatever else completes the handle (a failure over the reply socket,
a rank lost, close) wakes that waiter; two threads waiting at once both finish. A record whose doorbell was
never rung: test_completion_ring.py.

BELL_WAIT_MS, the waiter's bounded sleep, is raised in these tests so that a waiter nobody wakes stays asleep
instead of being rescued by the bound."""
from __future__ import annotations

import contextlib
import os
import signal
import threading

import numpy as np
import pytest

from conftest import cpu_image, deployment, randomize, small_spec, wait_for
from fastcache import TransferError
from fastcache.engine import channel as channel_module
from fastcache.engine import doorbells
from fastcache.engine.doorbells import Doorbells


@pytest.fixture
def long_bell(monkeypatch):
    monkeypatch.setattr(doorbells, "BELL_WAIT_MS", 60_000)


def io_bell_wakeups(monkeypatch) -> list:
    """Count, from now on, the I/O thread's wake-ups for a doorbell (a list that grows by one each)."""
    seen, clear = [], doorbells.clear

    def counted(fd):
        if threading.current_thread().name == "fastcache-engine-io":
            seen.append(fd)
        clear(fd)
    monkeypatch.setattr(channel_module.doorbells, "clear", counted)
    return seen


def test_a_waiter_reads_its_own_completions_and_the_io_thread_is_not_woken_for_them(monkeypatch, long_bell):
    rng = np.random.default_rng(71)
    spec = small_spec(num_gpu_blocks=32, num_cpu_blocks=32)
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        backend.swap_out([0], [0]).result(timeout=10)
        # the oracle sees the I/O thread's wake-ups: handles nobody waits on are completed by the I/O thread
        woken = io_bell_wakeups(monkeypatch)
        handles = [backend.swap_out([i], [i]) for i in range(1, 9)]
        wait_for(lambda: all(h.done() for h in handles), 10, "tasks nobody waits on")
        assert len(woken) >= 1
        for h in handles:
            h.result(timeout=10)
        woken.clear()
        for i in range(40):
            g, c = int(rng.integers(0, 32)), int(rng.integers(0, 32))
            backend.swap_out([g], [c]).result(timeout=10)
            for r, w in enumerate(workers):
                np.testing.assert_array_equal(backend.cpu_tier(r)[c], cpu_image(w, [g])[0])
        # a doorbell a rank rings just after the waiter has given it back may still wake the I/O thread
        assert len(woken) <= 8, f"the I/O thread woke {len(woken)} times for 40 tasks that were waited on"


def waiting_on_a_stopped_rank(backend):
    """Rank 0's transfer manager stopped, a task submitted, and its waiter (result() with no timeout, on a thread)
    holding the doorbells. Returns (the waiter's thread, a list it puts what it raised or None in, the handle, the
    stopped pid); the caller resumes the process."""
    pid = backend.transfer_pids[0]
    os.kill(pid, signal.SIGSTOP)
    handle = backend.swap_out([2], [2])
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(_raised(handle, None)), daemon=True)
    waiter.start()
    wait_for(lambda: backend._channel.doorbells.waiter_thread == waiter.ident, 10, "the waiter to take the doorbells")
    return waiter, outcome, handle, pid


def failed_while_waiting(backend):
    """Rank 0's 2nd task, failing over the reply socket only once its waiter sleeps on the doorbells."""
    backend.swap_out([1], [1]).result(timeout=10)
    waiter, outcome, handle, pid = waiting_on_a_stopped_rank(backend)
    os.kill(pid, signal.SIGCONT)
    wait_for(handle.done, 10, "the task to fail")
    return waiter, outcome, handle


def test_a_task_failed_over_the_reply_socket_wakes_its_waiter(monkeypatch, long_bell):
    monkeypatch.setenv("FASTCACHE_FAIL_EVERY", "0:2")       # rank 0's 2nd task fails: reported over the socket
    with deployment(small_spec(), tp=1) as (backend, _):
        waiter, outcome, _ = failed_while_waiting(backend)
        waiter.join(20)         # woken at once; only the 60 s bound would wake it otherwise
        assert not waiter.is_alive()
        assert isinstance(outcome[0], TransferError) and "rank 0" in str(outcome[0]), outcome
        backend.swap_out([3], [3]).result(timeout=10)


def test_without_the_wake_a_failed_task_leaves_its_waiter_asleep(monkeypatch, long_bell):
    """The control of the test above: the wake left out, the waiter sleeps through the failure (until the
    doorbell rings for another reason)."""
    monkeypatch.setenv("FASTCACHE_FAIL_EVERY", "0:2")
    monkeypatch.setattr(Doorbells, "wake_waiter", lambda self: None)
    with deployment(small_spec(), tp=1) as (backend, _):
        waiter, outcome, handle = failed_while_waiting(backend)
        waiter.join(5)
        assert waiter.is_alive() and not outcome and "rank 0" in handle.error
        os.eventfd_write(backend._channel.doorbells.of(0), 1)
        waiter.join(20)
        assert isinstance(outcome[0], TransferError), outcome


def test_close_wakes_a_waiter_whose_transfer_manager_is_stopped(long_bell):
    with deployment(small_spec(), tp=1) as (backend, _):
        backend.swap_out([1], [1]).result(timeout=10)
        waiter, outcome, _, pid = waiting_on_a_stopped_rank(backend)
        try:
            backend.close(timeout=3)        # the stopped process is killed, its task failed
            waiter.join(30)
            assert not waiter.is_alive()
            assert isinstance(outcome[0], TransferError), outcome
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)



def test_a_task_submitted_as_close_runs_fails_at_once_and_close_does_not_wait_for_it(monkeypatch, long_bell):
    """A submitter that passed the backend's checks before close began, and sends once close has failed the
    tasks in flight (its transfer manager gone): nothing would ever answer that task. It fails at once."""
    failed_all, sent = threading.Event(), threading.Event()
    fail_pending, send_task = channel_module.TaskChannel.fail_pending, channel_module.TaskChannel.send_task

    def failing(self, why):
        fail_pending(self, why)
        failed_all.set()
        sent.wait(30)       # the late task goes out before close closes the sockets

    def late(self, handle, message):
        if threading.current_thread().name == "late-submitter":
            in_send.set()
            failed_all.wait(30)
        try:
            return send_task(self, handle, message)
        finally:
            sent.set()
    in_send, outcome = threading.Event(), []
    monkeypatch.setattr(channel_module.TaskChannel, "fail_pending", failing)
    monkeypatch.setattr(channel_module.TaskChannel, "send_task", late)
    with deployment(small_spec(), tp=1) as (backend, _):
        backend.swap_out([1], [1]).result(timeout=10)
        submitter = threading.Thread(target=lambda: outcome.append(_raised(backend.swap_out([2], [2]), 5)),
                                     name="late-submitter")
        submitter.start()
        assert in_send.wait(10)
        backend.close(timeout=3)
        submitter.join(30)
        assert not submitter.is_alive()
        assert isinstance(outcome[0], TransferError) and "closed" in str(outcome[0]), outcome


def _raised(handle, timeout):
    try:
        handle.result(timeout=timeout)
    except Exception as exc:
        return exc
    return None


def test_two_threads_waiting_at_once_both_finish_every_block_checked(long_bell):
    rng = np.random.default_rng(72)
    spec = small_spec(num_gpu_blocks=32, num_cpu_blocks=32)
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        errors = []

        def run(first):         # blocks first, first + 2, ...: the two threads never share one
            try:
                for i in range(150):
                    block = first + 2 * (i % 16)
                    backend.swap_out([block], [block]).result(timeout=20)
            except Exception as exc:
                errors.append(exc)
        threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and not any(t.is_alive() for t in threads), errors
        for r, w in enumerate(workers):
            np.testing.assert_array_equal(backend.cpu_tier(r)[:32], cpu_image(w, list(range(32))))
