"""The task channel on its own (engine/channel.py): it reaches the ranks only through the rank supervisor's
public methods and the deployment through the callables its constructor is given, so stand-ins for them, and
for the task sockets, exercise it without a deployment."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import zmq

from fastcache.engine import channel as channel_module
from fastcache.engine.channel import TaskChannel
from fastcache.engine.handle import TransferHandle
from fastcache.ipc import protocol
from fastcache.ipc.queue import SEQ, TO_ENGINE, TO_RANK, rank_identity, signed, verified

TOKEN = bytes(range(16))


class Ranks:
    """The rank supervisor as the channel sees it: rank r's process has pid 100 + r."""

    def __init__(self):
        self.failed, self.registered, self.attached, self.exit_checks = {}, set(), {}, []

    def why_failed(self, rank):
        return self.failed.get(rank)

    def check_exit(self, rank):
        self.exit_checks.append(rank)
        return False

    def is_current(self, rank, pid):
        return pid == 100 + rank

    def awaits_pipe(self, rank):
        return False

    def on_registered(self, rank):
        self.registered.add(rank)

    def on_attached(self, rank, attached):
        self.attached[rank] = attached

    def mark_failed(self, rank, why, **_):
        self.failed[rank] = why


class Push:
    """A rank's task socket: takes every message, or refuses them all (no transfer manager connected)."""

    def __init__(self, refuses=False):
        self.sent, self.refuses = [], refuses

    def send_multipart(self, message, flags=0):
        if self.refuses:
            raise zmq.Again()
        self.sent.append(message)


def channel_of(pushes, barrier=None):
    ranks = Ranks()
    tp = len(pushes)
    signals = SimpleNamespace(task_received=np.zeros(tp, np.int64), task_abandoned=np.zeros(tp, np.int64),
                              transfer_heartbeat=np.zeros(tp))
    channel = TaskChannel(TOKEN, SimpleNamespace(transfer_timeout=1.0), lambda: signals, lambda: barrier, ranks,
                          lambda: False)
    channel._task_pushes = list(pushes)     # as open_pipe binds them
    return channel, ranks


def reply(rank, kind, **fields):
    return [rank_identity(rank, 100 + rank)] + signed(TOKEN, TO_ENGINE, protocol.encode(kind, rank=rank, **fields))


def test_a_task_goes_to_every_rank_numbered_and_signed_and_its_handle_completes_on_their_replies():
    pushes = [Push(), Push()]
    channel, _ = channel_of(pushes)
    handle = channel.send_task(TransferHandle(7, protocol.SWAP_TO_CPU, range(2), 0), protocol.encode("ping"))
    for push in pushes:
        [message] = push.sent
        body = verified(TOKEN, TO_RANK, message)
        assert body is not None and SEQ.unpack(body[0]) == (1,)
    assert channel.pending_handles() == [handle]
    for rank in range(2):
        channel.on_reply(reply(rank, "done", task_id=7, nbytes=0, skipped=0, seconds=0.0))
    assert handle.done() and handle.error is None and channel.pending_handles() == []
    assert channel.replies_read == 0        # counted by the I/O thread, not by on_reply


def test_a_failed_rank_or_a_pipe_without_a_process_fails_the_task_there_without_sending_it():
    pushes = [Push(), Push(refuses=True)]
    channel, ranks = channel_of(pushes)
    ranks.failed[0] = "rank 0 is gone"
    handle = channel.send_task(TransferHandle(3, protocol.SWAP_TO_CPU, range(2), 0), protocol.encode("ping"))
    assert pushes[0].sent == [] and ranks.exit_checks == [1]
    assert handle.done() and "rank 0 is gone" in handle.error and "not connected" in handle.error
    assert channel.pending_handles() == []


def test_replies_from_a_process_not_spawned_for_the_rank_or_unsigned_are_dropped():
    channel, ranks = channel_of([Push()])
    channel.on_reply([rank_identity(0, 999)] + signed(TOKEN, TO_ENGINE, protocol.encode("register", rank=0, pid=999)))
    channel.on_reply([rank_identity(0, 100)] + signed(bytes(16), TO_ENGINE, protocol.encode("register", rank=0,
                                                                                           pid=100)))
    assert ranks.registered == set()
    channel.on_reply(reply(0, "register", pid=100))
    assert ranks.registered == {0}


def test_phase_reports_are_collected_until_done_and_a_failing_rank_wakes_the_waiter():
    channel, _ = channel_of([Push(), Push()])
    channel.expect_reports("clear")
    channel.on_reply(reply(0, "phase_done", phase="clear", copy_seconds=1.5, weights_seconds=0.5))
    channel.on_reply(reply(1, "phase_done", phase="other", copy_seconds=0.0, weights_seconds=0.0))   # not expected
    failed = threading.Event()
    waker = threading.Timer(0.2, lambda: (failed.set(), channel.wake()))
    waker.start()
    ok, acks, copies = channel.collect_reports("clear", lambda acks: len(acks) == 2 or failed.is_set(), 10.0)
    waker.join()
    assert ok and acks == {0: None} and copies == {0: (1.5, 0.5)}
    ok, acks, _ = channel.collect_reports("clear", lambda acks: False, 0.0)     # no longer collected
    assert not ok and acks == {}


def test_fail_rank_tasks_fails_each_task_on_that_rank_only():
    channel, _ = channel_of([Push(), Push()])
    one = channel.send_task(TransferHandle(1, protocol.SWAP_TO_CPU, range(2), 0), protocol.encode("ping"))
    channel.fail_rank_tasks(1, "restarted")
    assert not one.done() and list(one.pending_ranks()) == [0] and channel.pending_handles() == [one]
    channel.fail_pending("closed")
    assert one.done() and "closed" in one.error and channel.pending_handles() == []


def test_a_phase_command_is_watched_under_its_own_number_when_a_ping_goes_just_before_it():
    """The I/O thread pings ranks that have not read the last phase command; one that goes between a new
    command's numbering and its send must not make the channel watch the ping's number instead: a report that
    the command's message was lost then breaks the phase at once."""
    pushes, aborted = [Push(), Push()], []
    channel, _ = channel_of(pushes, barrier=SimpleNamespace(abort=aborted.append))
    send_all = channel.send_all

    def pinged_first(message, handle=None, **kwargs):
        for rank in range(2):
            channel.ping(rank)
        return send_all(message, handle, **kwargs)
    channel.send_all = pinged_first
    channel.send_phase_command("clear", protocol.encode("clear"))
    for push in pushes:
        assert [SEQ.unpack(verified(TOKEN, TO_RANK, m)[0]) for m in push.sent] == [(1,), (2,)]
    channel.on_reply(reply(1, "lost", first=2, last=2))
    why = channel.end_phase_command()
    assert len(aborted) == 1 and why is not None and "1" in why


def test_tasks_not_read_in_time_are_abandoned_first_and_fail_only_where_still_unread_after_the_pause(monkeypatch):
    """A transfer manager that beats but has not read its tasks within the transfer timeout: the channel raises the
    rank's task_abandoned to the highest such number (a manager that reads them later does not run them), then
    fails only the tasks the rank has still not read. One the rank reads meanwhile (here during the pause) is left
    to it: it may have run it before it could see the word, and reports either way."""
    channel, _ = channel_of([Push(), Push()])
    signals = channel._signals()
    signals.transfer_heartbeat[:] = time.time()         # both ranks beat
    handles = [channel.send_task(TransferHandle(task_id, protocol.SWAP_TO_CPU, range(2), 0), protocol.encode("ping"))
               for task_id in (4, 5)]                   # numbers 1 and 2 on each rank
    later = time.monotonic() + 2.0                      # past the 1 s transfer timeout

    def rank_0_reads_the_first_meanwhile(seconds):
        assert list(signals.task_abandoned) == [2, 2], "the word goes up before anything fails"
        assert not any(h.done() or set(h.pending_ranks()) != {0, 1} for h in handles)
        signals.task_received[0] = 1
    monkeypatch.setattr(channel_module, "time", SimpleNamespace(monotonic=lambda: later, time=time.time,
                                                                sleep=rank_0_reads_the_first_meanwhile))
    channel._watch_unreceived()
    first, second = handles
    assert list(signals.task_abandoned) == [2, 2]
    assert second.done() and "did not receive the task" in second.error
    assert set(first.pending_ranks()) == {0}, "a task rank 0 read is its own to report"
    channel._watch_unreceived()                         # nothing fails twice, nor the task left to rank 0
    assert set(first.pending_ranks()) == {0}
    channel.on_reply(reply(0, "failed", task_id=4, error="read after the engine had given up waiting for it"))
    assert first.done() and "given up" in first.error and "did not receive" in first.error
    assert channel.pending_handles() == []
