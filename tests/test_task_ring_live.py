"""The task rings in a deployment (docs/design.md §4, ipc/task_ring.py): a full ring sends the rest by pipe
and loses nothing, tasks on shared blocks take effect in submission order across ring and pipe, a task whose
doorbell was lost is still done, a forged or destroyed record fails only its task, in time and named (the
forgery never runs), a transfer manager that dies with tasks in its ring fails them within seconds, and
restart_rank gives the new process a new ring. Every byte checked on random data."""
from __future__ import annotations

import logging
import os
import signal

import numpy as np
import pytest

from conftest import cpu_image, deployment, randomize, round_trip, small_spec, wait_for
from fastcache import TransferError
from fastcache.ipc import task_ring
from fastcache.ipc.shm import SharedSegment
from fastcache.ipc.task_ring import HEAD_BYTES, INLINE, RECORD_BYTES, RING_BYTES, SLOTS, TaskRingReader, ring_name


@pytest.fixture
def slow_watchdog(monkeypatch):
    """A transfer timeout far past every wait here: what fails, fails for what the ring saw, not the watchdog."""
    monkeypatch.setenv("FASTCACHE_TRANSFER_TIMEOUT", "120")


def ring_view(backend, rank, incarnation=0):
    """Rank's task ring as another process of the user maps it: (segment, its bytes)."""
    segment = SharedSegment.attach(ring_name(backend.suffix, rank, incarnation), backend.suffix)
    return segment, segment.array(np.uint8, (RING_BYTES,))


class Stopped:
    """Rank's transfer manager stopped (SIGSTOP) while the block runs: it reads nothing meanwhile."""

    def __init__(self, backend, rank):
        self.pid = backend.transfer_pids[rank]

    def __enter__(self):
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc):
        os.kill(self.pid, signal.SIGCONT)


def final_cpu(workers, tasks, rank, blocks):
    """What CPU blocks hold after swap-outs [(gpu ids, cpu ids)] taking effect in order."""
    want = {}
    for gpu, cpu in tasks:
        for g, c in zip(gpu, cpu):
            want[c] = cpu_image(workers[rank], [g])[0]
    return np.array([want[c] for c in blocks])


def test_more_tasks_than_a_ring_holds_go_on_by_pipe_in_order_and_none_is_lost(slow_watchdog):
    rng = np.random.default_rng(70)
    spec = small_spec(num_gpu_blocks=64, num_cpu_blocks=64)
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        rings = backend._channel._task_rings
        tasks = [([k % 64], [k % 32]) for k in range(SLOTS + 40)]    # each CPU block written nine times over
        with Stopped(backend, 0):
            handles = [backend.swap_out(*t) for t in tasks]
            assert rings[0].written == SLOTS                # rank 0's ring full: the rest went by its pipe
            assert backend._channel._pipe_seq[0] == SLOTS + 40
        for h in handles:
            h.result(timeout=60)
        assert rings[1].written > SLOTS                     # rank 1 read as it went: its ring took more
        for r in range(2):                                  # the last write of each block won, every rank
            np.testing.assert_array_equal(backend.cpu_tier(r)[:32], final_cpu(workers, tasks, r, range(32)))
        round_trip(backend, workers, rng)


def test_ring_and_pipe_tasks_on_shared_blocks_take_effect_in_submission_order(slow_watchdog):
    rng = np.random.default_rng(71)
    spec = small_spec(num_gpu_blocks=64, num_cpu_blocks=64)
    wide = INLINE + 6                                       # more ids than a record holds: by pipe
    with deployment(spec, tp=2) as (backend, workers):
        channel = backend._channel
        for w in workers:
            randomize(w, rng)
        tasks, handles = [], []
        for k in range(60):
            if k % 5 == 4:
                gpu = rng.choice(64, wide, replace=False)
                cpu = rng.choice(32, wide, replace=False)
            else:
                gpu, cpu = rng.choice(64, 2, replace=False), rng.choice(32, 2, replace=False)
            tasks.append((gpu.tolist(), cpu.tolist()))
            handles.append(backend.swap_out(*tasks[-1]))
        for h in handles:
            h.result(timeout=60)
        for r in range(2):
            assert 0 < channel._task_rings[r].written < 60 and channel._pipe_seq[r] > 0    # both ways were taken
            written = sorted({c for _, cpu in tasks for c in cpu})
            np.testing.assert_array_equal(backend.cpu_tier(r)[written], final_cpu(workers, tasks, r, written))
        # back in, over blocks the swap-outs read: each swap-in after the swap-outs before it, by ring and pipe
        moves = []
        for k in range(30):
            cpu = rng.choice(32, wide if k % 4 == 3 else 1, replace=False).tolist()
            gpu = rng.choice(64, len(cpu), replace=False).tolist()
            moves.append((gpu, cpu))
            backend.swap_in(gpu, cpu)
            backend.swap_out(gpu[:1], [32 + k]).result(timeout=60)   # what the swap-in put there, read back
        for r, w in enumerate(workers):
            for k, (gpu, cpu) in enumerate(moves):
                np.testing.assert_array_equal(backend.cpu_tier(r)[32 + k], backend.cpu_tier(r)[cpu[0]])
        round_trip(backend, workers, rng)


def test_a_task_whose_doorbell_was_lost_is_still_done(slow_watchdog):
    rng = np.random.default_rng(72)
    spec = small_spec(num_gpu_blocks=32, num_cpu_blocks=32)
    with deployment(spec, tp=1) as (backend, workers):
        randomize(workers[0], rng)
        ring = backend._channel._task_rings[0]
        with Stopped(backend, 0):
            handle = backend.swap_out([3], [5])
            assert ring.written == 1
            assert os.eventfd_read(ring.bell) == 1          # another reader took the doorbell
        handle.result(timeout=30)                           # read at the transfer manager's bounded wait
        np.testing.assert_array_equal(backend.cpu_tier(0)[5], cpu_image(workers[0], [3])[0])
        round_trip(backend, workers, rng)


def test_a_forged_and_a_destroyed_record_fail_only_their_tasks_in_time_named_and_the_forgery_never_runs(
        slow_watchdog, caplog):
    caplog.set_level(logging.WARNING, logger="fastcache.engine")
    rng = np.random.default_rng(73)
    spec = small_spec(num_gpu_blocks=32, num_cpu_blocks=32)
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        for r in range(2):
            backend.cpu_tier(r)[...] = rng.integers(0, 256, backend.cpu_tier(r).shape, dtype=np.uint8)
        before = backend.cpu_tier(0).copy()
        segment, raw = ring_view(backend, 0)
        try:
            with Stopped(backend, 0):
                handles = [backend.swap_out([i], [i]) for i in range(4)]
                assert backend._channel._task_rings[0].written == 4
                at = HEAD_BYTES + RECORD_BYTES              # record 1: its CPU id 1 made 20, its MAC kept
                raw[at + task_ring.IDS_AT + 4:at + task_ring.IDS_AT + 8].view(np.int32)[0] = 20
                forged = bytes(raw[at:at + RECORD_BYTES])
                at = HEAD_BYTES + 3 * RECORD_BYTES          # record 3, the last: its commit word destroyed
                raw[at:at + 8].view(np.uint64)[0] = 0
            outcomes = []
            for h in handles:
                try:
                    h.result(timeout=30)                    # well inside the 120 s watchdog
                    outcomes.append(None)
                except TransferError as exc:
                    outcomes.append(str(exc))
            assert outcomes[0] is None and outcomes[2] is None
            for k in (1, 3):
                assert "rank 0:" in outcomes[k] and "task ring" in outcomes[k] and "rank 1" not in outcomes[k]
            assert any("task ring failed authentication or were destroyed" in r.getMessage() for r in caplog.records)
            # negative control: the forged bytes, read without their MAC check, are a task onto CPU block 20
            reader = TaskRingReader(SharedSegment.attach(ring_name(backend.suffix, 0, 0), backend.suffix),
                                    backend._token, 0, 0)
            try:
                assert reader._task(forged).ids[1].tolist() == [20]
            finally:
                reader.close()
        finally:
            del raw
            segment.close()
        np.testing.assert_array_equal(backend.cpu_tier(0)[20], before[20])      # the forgery never ran
        for i in (0, 2):
            np.testing.assert_array_equal(backend.cpu_tier(0)[i], cpu_image(workers[0], [i])[0])
        for i in (1, 3):
            np.testing.assert_array_equal(backend.cpu_tier(0)[i], before[i])    # not done on rank 0
        np.testing.assert_array_equal(backend.cpu_tier(1)[:4], cpu_image(workers[1], np.arange(4)))
        round_trip(backend, workers, rng)


def test_a_transfer_manager_killed_with_tasks_in_its_ring_fails_them_within_seconds_and_its_restart_gets_a_new_ring(
        slow_watchdog):
    rng = np.random.default_rng(74)
    spec = small_spec(num_gpu_blocks=32, num_cpu_blocks=32)
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        channel = backend._channel
        old = channel._task_rings[0]
        victim = backend.transfer_pids[0]
        os.kill(victim, signal.SIGSTOP)
        handles = [backend.swap_out([i], [i]) for i in range(4)]
        assert old.written == 4
        wait_for(lambda: all(h.pending_ranks() == {0} for h in handles), 30, "rank 1's part of every task")
        os.kill(victim, signal.SIGKILL)
        for h in handles:
            with pytest.raises(TransferError, match="rank 0") as err:
                h.result(timeout=10)                       # supervision, well inside the 120 s watchdog
            assert "rank 1" not in str(err.value)
        backend.restart_rank(0, timeout=30)
        assert channel._task_rings[0] is not old and old.buf is None        # the old ring closed ...
        assert not os.path.exists(f"/dev/shm{ring_name(backend.suffix, 0, 0)}")    # ... and removed
        round_trip(backend, workers, rng)
        assert channel._task_rings[0].written > 0          # the new process's ring carried them
        segment, _ = ring_view(backend, 0, incarnation=1)
        segment.close()


def test_without_the_ring_every_task_goes_by_pipe(monkeypatch):
    monkeypatch.setenv("FASTCACHE_TASK_RING", "0")
    rng = np.random.default_rng(75)
    with deployment(small_spec(), tp=2) as (backend, workers):
        assert backend._channel._task_rings == {}
        assert not any(".task_rank" in name for name in os.listdir("/dev/shm") if backend.suffix in name)
        round_trip(backend, workers, rng)
