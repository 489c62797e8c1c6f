"""The completion rings in a deployment (docs/design.md §4, ipc/done_ring.py): a full ring loses no report, a
record the engine finds forged is asked for again and says so, a record whose doorbell was lost is still
read, and a transfer manager that dies in the middle of a record fails its tasks within seconds."""
from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import cpu_image, deployment, randomize, round_trip, small_spec, wait_for
from fastcache import TransferError
from fastcache.engine.channel import TaskChannel
from fastcache.engine.handle import TransferHandle
from fastcache.ipc import protocol
from fastcache.ipc.done_ring import HEAD_BYTES, RECORD_BYTES, RING_BYTES, SLOTS, RingWriter, ring_name
from fastcache.ipc.queue import remove_socket_dir
from fastcache.ipc.shm import SharedSegment


def ring_view(backend, rank, incarnation=0):
    """Rank's completion ring as another process of the user maps it: (segment, its bytes, its 8-byte words)."""
    segment = SharedSegment.attach(ring_name(backend.suffix, rank, incarnation), backend.suffix)
    return segment, segment.array(np.uint8, (RING_BYTES,)), segment.array(np.uint64, (RING_BYTES // 8,))


def test_more_reports_than_a_ring_holds_while_the_engine_reads_none_lose_none_every_byte_checked():
    rng = np.random.default_rng(50)
    spec = small_spec(num_gpu_blocks=64, num_cpu_blocks=64)
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        views = [ring_view(backend, r) for r in range(2)]
        tasks = SLOTS + 40
        try:
            before = backend._channel.replies_read
            with backend._channel._rings_lock:         # the engine reads no ring meanwhile
                handles = [backend.swap_out([i % 64], [i % 64]) for i in range(tasks - 1)]
                handles.append(backend.swap_out([5], [63]))     # the last: its copy shows every rank ran them all
                want = [cpu_image(w, np.r_[np.arange(63), 5]) for w in workers]
                wait_for(lambda: all(np.array_equal(backend.cpu_tier(r)[63], want[r][63]) for r in range(2)), 60,
                         "every task run")
                # each ring is full (its count at SLOTS): the reports past it went over the reply socket
                assert all(int(words[0]) == SLOTS for _, _, words in views)
            for h in handles:
                h.result(timeout=60)
            assert backend._channel.replies_read - before >= 2 * (tasks - SLOTS - 1)
        finally:
            for segment, _, _ in views:
                segment.close()
        for r in range(2):
            np.testing.assert_array_equal(backend.cpu_tier(r)[:64], want[r])
        round_trip(backend, workers, rng)


def test_a_forged_completion_record_fails_authentication_says_so_and_its_report_comes_again(caplog):
    caplog.set_level(logging.WARNING, logger="fastcache.engine")
    rng = np.random.default_rng(51)
    spec = small_spec(num_gpu_blocks=32, num_cpu_blocks=32)
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        segment, raw, words = ring_view(backend, 0)
        reader, held = backend._channel._rings[0], []
        asked = reader.asked
        reader.asked = lambda seq: (held.append((reader.hold, seq)), asked(seq))
        try:
            with backend._channel._rings_lock:
                handles = [backend.swap_out([i], [i]) for i in range(4)]
                wait_for(lambda: int(words[0]) == 4, 30, "rank 0's four records")
                at = HEAD_BYTES + 2 * RECORD_BYTES      # record 2: a byte of its body changed
                raw[at + 30] ^= 0xFF
                at = HEAD_BYTES + 3 * RECORD_BYTES      # record 3, the last written: its commit word destroyed
                words[at // 8] = 0
            for h in handles:
                h.result(timeout=30)                  # nothing failed: the reports came again over the socket
            assert any("failed authentication" in r.getMessage() and "rank 0" in r.getMessage()
                       for r in caplog.records)
            assert not any(h.error for h in handles)
            # the engine's count stayed at record 2 until the process had read the request, then passes it
            assert held and held[0][0] == 2
            wait_for(lambda: reader.hold is None, 30, "the count to pass the bad records")
        finally:
            del raw, words
            segment.close()
        for r, w in enumerate(workers):
            np.testing.assert_array_equal(backend.cpu_tier(r)[:4], cpu_image(w, np.arange(4)))
        round_trip(backend, workers, rng)


class Ranks:
    """The rank supervisor as the channel sees it (rank 0's process is current)."""

    def is_current(self, rank, pid):
        return True

    def why_failed(self, rank):
        return None

    def awaits_pipe(self, rank):
        return False


@pytest.mark.parametrize("reader", ["io thread", "waiter"])
def test_a_record_whose_doorbell_was_never_rung_is_still_read(reader):
    suffix = f"test{os.getpid()}-{threading.get_ident() % 10_000}"
    socket_dir = tempfile.mkdtemp(prefix="fastcache-test-ring.")
    signals = SimpleNamespace(task_received=np.zeros(1), task_abandoned=np.zeros(1), transfer_heartbeat=np.zeros(1))
    channel = TaskChannel(bytes(range(16)), SimpleNamespace(transfer_timeout=1.0), lambda: signals, lambda: None,
                          Ranks(), lambda: True)
    channel.start(socket_dir, 1, suffix)
    try:
        channel.open_pipe(0, 0)
        handle = TransferHandle(9, protocol.SWAP_TO_CPU, range(1), 0)
        if reader == "waiter":
            handle.reader = channel                   # result() reads the rings itself (as send_task sets it)
        with channel._handles_lock:
            channel._handles[9] = handle
        writer = RingWriter(SharedSegment.attach(ring_name(suffix, 0, 0), suffix), bytes(range(16)), 0, 0)
        assert writer.write(9, 4096, 0, 0.001)        # and no doorbell rung
        handle.result(timeout=10)                     # found on the next bounded wait
        assert handle.nbytes == 4096
        with pytest.raises(BlockingIOError):
            os.eventfd_read(channel.doorbells.of(0))   # it was never rung
        writer.close()
    finally:
        channel.close("test over")
        remove_socket_dir(socket_dir)
    assert not any(name.startswith(f"fastcache.{suffix}.") for name in os.listdir("/dev/shm"))


def test_a_transfer_manager_killed_in_the_middle_of_a_record_fails_its_tasks_within_seconds():
    rng = np.random.default_rng(52)
    spec = small_spec(num_gpu_blocks=32, num_cpu_blocks=32)
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        victim = backend.transfer_pids[0]
        segment, raw, words = ring_view(backend, 0)
        try:
            os.kill(victim, signal.SIGSTOP)
            handles = [backend.swap_out([i], [i]) for i in range(4)]
            wait_for(lambda: all(h.pending_ranks() == {0} for h in handles), 30, "rank 1's part of every task")
            # what a process writing record 0 leaves when it dies before its commit word: body and MAC
            raw[HEAD_BYTES + 8:HEAD_BYTES + RECORD_BYTES] = rng.integers(0, 256, RECORD_BYTES - 8, dtype=np.uint8)
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            for h in handles:
                with pytest.raises(TransferError, match="rank 0") as err:
                    h.result(timeout=10)
                assert "rank 1" not in str(err.value)
            assert time.monotonic() - killed < 5
        finally:
            del raw, words
            segment.close()
        for i in range(4):                               # rank 1 did its part
            np.testing.assert_array_equal(backend.cpu_tier(1)[i], cpu_image(workers[1], [i])[0])
        backend.restart_rank(0, timeout=30)
        round_trip(backend, workers, rng)
