"""A phase command another process takes off a task pipe (docs/design.md §12): the phase fails at once
naming the pipe, instead of waiting out its timeout, and once the reader is gone the same call again
finishes it."""
from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from conftest import deployment, round_trip, small_spec, wait_for
from fastcache import TransferError
from fastcache.ipc.queue import SEQ, task_endpoint
from fastcache.ipc.signal import CLEARED, CLEARING, NORMAL, UPDATING

PHASE_TIMEOUT = 20.0


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setenv("FASTCACHE_TASK_RING", "0")      # every task over the task pipes, where the thief reads
    monkeypatch.setenv("FASTCACHE_TRANSFER_TIMEOUT", "2")
    monkeypatch.setenv("FASTCACHE_HEARTBEAT_INTERVAL", "0.2")


class Thief:
    """A process of the same user reading rank 0's task pipe: zmq's PUSH deals it every other message."""

    def __init__(self, backend):
        self.backend, self.taken = backend, []
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.PULL)
        self.sock.connect(task_endpoint(backend.socket_dir, 0, 0))

    def take(self) -> list[int]:
        while True:
            try:
                self.taken.append(SEQ.unpack(self.sock.recv_multipart(zmq.NOBLOCK)[1])[0])
            except zmq.Again:
                return self.taken

    def holds(self, seq) -> bool:
        return seq in self.take()

    def connected(self, rng):
        """Swaps until one reaches the thief: its pipe is up (the task it took fails, as it must)."""
        for i in range(64):
            handle = self.backend.swap_out([i % 8], [i % 8])
            seq = self.backend._channel._sent_seq[0]
            wait_for(lambda: self.holds(seq) or handle.done(), 10, "the swap on the transfer manager or the thief")
            if self.holds(seq):
                return
            handle.result(timeout=10)
        raise AssertionError("the thief's pipe never came up")

    def next_message_is_mine(self):
        """Steer the pipe's round robin so that the next message goes to the thief: if the last one did, one
        more goes to the transfer manager first."""
        backend, seq = self.backend, self.backend._channel._sent_seq[0]
        wait_for(lambda: self.holds(seq) or int(backend.signals.task_received[0]) >= seq, 10, "the last message")
        if self.holds(seq):
            self._one_more()
            wait_for(lambda: int(backend.signals.task_received[0]) == seq + 1, 10,
                     "the next one on the transfer manager")

    def next_message_is_theirs(self):
        backend, seq = self.backend, self.backend._channel._sent_seq[0]
        wait_for(lambda: self.holds(seq) or int(backend.signals.task_received[0]) >= seq, 10, "the last message")
        if not self.holds(seq):
            self._one_more()
            wait_for(lambda: self.holds(seq + 1), 10, "the next one on the thief")

    def _one_more(self):
        """A swap while the deployment serves (the thief's fails, as it must), else a numbered no-op."""
        if self.backend.status == NORMAL:
            self.backend.swap_out([0], [0])
        else:
            self.backend._channel.ping(0)

    def close(self):
        """Close the thief's end, then wait until the engine's socket has dropped its pipe: zmq learns of the
        disconnect on its own I/O thread, and until then the round robin may deal a message to the dead pipe.
        Gone once two numbered no-ops in a row each reach the transfer manager (the round robin alternates, so
        a pipe still in it would take one of them)."""
        self.sock.close(0)
        self.context.term()
        backend = self.backend

        def reaches_the_transfer_manager():
            backend._channel.ping(0)
            seq = backend._channel._sent_seq[0]
            try:
                wait_for(lambda: int(backend.signals.task_received[0]) >= seq, 1, "a no-op")
            except AssertionError:
                return False
            return True
        wait_for(lambda: reaches_the_transfer_manager() and reaches_the_transfer_manager(), 10,
                 "the thief's pipe dropped by the engine's socket")


def _stolen_phase_fails_at_once(call, phase):
    began = time.monotonic()
    with pytest.raises(TransferError) as err:
        call(timeout=PHASE_TIMEOUT)
    took = time.monotonic() - began
    print(f"{phase} with its command stolen failed after {took:.2f} s: {err.value}")
    assert f"never received the {phase} command" in str(err.value) and "task pipe" in str(err.value)
    assert took < 5, f"a stolen {phase} command cost {took:.1f} s (the phase timeout is {PHASE_TIMEOUT} s)"


def test_a_stolen_clear_command_fails_the_clear_at_once_and_clear_again_finishes_it(short_timeout):
    rng = np.random.default_rng(70)
    with deployment(small_spec(), tp=1) as (backend, workers):
        thief = Thief(backend)
        try:
            thief.connected(rng)
            thief.next_message_is_mine()
            _stolen_phase_fails_at_once(backend.clear_caches, "clear")
            assert backend.status == CLEARING
        finally:
            thief.close()
        backend.clear_caches(timeout=PHASE_TIMEOUT)         # the one call that recovers
        assert backend.status == CLEARED
        backend.restore_caches(timeout=PHASE_TIMEOUT)
        assert backend.status == NORMAL
        round_trip(backend, workers, rng)


def test_a_stolen_restore_command_fails_the_restore_at_once_and_restore_again_finishes_it(short_timeout):
    rng = np.random.default_rng(71)
    with deployment(small_spec(), tp=1) as (backend, workers):
        thief = Thief(backend)
        try:
            thief.connected(rng)
            thief.next_message_is_theirs()
            backend.clear_caches(timeout=PHASE_TIMEOUT)
            assert backend.status == CLEARED
            thief.next_message_is_mine()
            _stolen_phase_fails_at_once(backend.restore_caches, "restore")
            assert backend.status == UPDATING
        finally:
            thief.close()
        backend.restore_caches(timeout=PHASE_TIMEOUT)       # the one call that recovers
        assert backend.status == NORMAL
        round_trip(backend, workers, rng)
