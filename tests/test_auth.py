"""Messages come only from the deployment's own processes (docs/design.md §12): another process of the same
user that reads a transfer manager's task pipe gets tasks it cannot answer for, and they fail on that rank
within the transfer timeout; replies and commands it forges are dropped, also with a rank's identity."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from conftest import cpu_image, deployment, randomize, round_trip, small_spec, wait_for
from fastcache import TransferError
from fastcache.ipc import protocol
from fastcache.ipc.queue import (MAC_BYTES, SEQ, TO_RANK, mac, rank_identity, read_token, reply_endpoint, signed,
                                 task_endpoint, verified)

TIMEOUT = 2.0


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setenv("FASTCACHE_TASK_RING", "0")      # every task over the task pipes, where the thieves read
    monkeypatch.setenv("FASTCACHE_TRANSFER_TIMEOUT", str(TIMEOUT))
    monkeypatch.setenv("FASTCACHE_HEARTBEAT_INTERVAL", "0.2")


def test_a_thief_on_a_task_pipe_makes_its_tasks_fail_in_time_and_cannot_forge_their_replies(short_timeout, caplog):
    caplog.set_level(logging.WARNING, logger="fastcache.engine")
    rng = np.random.default_rng(40)
    spec = small_spec(num_gpu_blocks=32, num_cpu_blocks=32)
    with deployment(spec, tp=2) as (backend, workers), PipeWatch(backend, 0) as pipe:
        for w in workers:
            randomize(w, rng)
        want = [cpu_image(w, np.arange(8)) for w in workers]
        context = zmq.Context()
        thief = context.socket(zmq.PULL)
        thief.connect(task_endpoint(backend.socket_dir, 0, 0))
        forger = context.socket(zmq.DEALER)
        forger.setsockopt(zmq.IDENTITY, rank_identity(0, backend.transfer_pids[0]))    # rank 0's own identity
        forger.connect(reply_endpoint(backend.socket_dir))
        try:
            pipe.wait(zmq.EVENT_HANDSHAKE_SUCCEEDED)     # the thief's pipe is up: the engine's PUSH now alternates
            began = time.monotonic()
            handles = [backend.swap_out([i], [i]) for i in range(8)]
            stolen = []
            wait_for(lambda: _take(thief, stolen) >= 3, 10, "tasks on the thief's pipe")
            # the thief sees MACs, never the token: its "done" replies (as rank 0's identity, with and without a
            # stolen MAC) must not complete the tasks it took
            for frames in stolen:
                assert len(frames[0]) == MAC_BYTES
                header = json.loads(frames[2])
                forged = protocol.encode("done", task_id=header["task_id"], rank=0, nbytes=1, skipped=0, seconds=0.0)
                forger.send_multipart([frames[0]] + forged)
                forger.send_multipart(forged)
            outcomes = []
            for handle in handles:
                try:
                    handle.result(timeout=TIMEOUT + 10)
                    outcomes.append(None)
                except TransferError as exc:
                    outcomes.append(str(exc))
            _take(thief, stolen)                     # a task the pipe dealt after the first three
            failed = [o for o in outcomes if o is not None]
            assert len(failed) == len(stolen), outcomes
            assert all("rank 0:" in o and ("task pipe" in o or "never arrived" in o) for o in failed), failed
            assert time.monotonic() - began < TIMEOUT + 10, "a stolen task did not fail within the transfer timeout"
            assert any("task pipe" in r.getMessage() for r in caplog.records)       # the engine says why
            for rank in range(2):                    # what a rank did, it did right; rank 1 did every task
                for i, outcome in enumerate(outcomes):
                    if outcome is None or rank == 1:
                        np.testing.assert_array_equal(backend.cpu_tier(rank)[i], want[rank][i], f"rank {rank} {i}")
        finally:
            thief.close(0)
            forger.close(0)
            context.term()
        pipe.wait(zmq.EVENT_DISCONNECTED)            # the engine's PUSH deals to the thief no more
        round_trip(backend, workers, rng)            # both ranks still serve, every byte checked
        assert backend.status == 0


def test_a_stolen_layer_by_layer_swap_in_fails_the_worker_s_wait_on_that_rank_in_time(short_timeout):
    """The engine fails a stolen task on the rank it never reached: a worker waiting there by task id raises
    then too, naming the rank, instead of waiting out its own timeout."""
    rng = np.random.default_rng(41)
    spec = small_spec(num_gpu_blocks=32, num_cpu_blocks=32)
    with deployment(spec, tp=2) as (backend, workers), PipeWatch(backend, 0) as pipe:
        for r, w in enumerate(workers):
            randomize(w, rng)
            backend.cpu_tier(r)[...] = rng.integers(0, 256, backend.cpu_tier(r).shape, dtype=np.uint8)
        context = zmq.Context()
        thief = context.socket(zmq.PULL)
        thief.connect(task_endpoint(backend.socket_dir, 0, 0))
        try:
            pipe.wait(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            handles, stolen = {}, []
            for i in range(8):                      # the pipe deals every other one to the thief
                h = backend.swap_in([i], [i], layerwise=True)
                handles[h.task_id] = h
            wait_for(lambda: _take(thief, stolen) >= 1, 10, "a task on the thief's pipe")
            task_id = json.loads(stolen[0][2])["task_id"]
            began = time.monotonic()
            with pytest.raises(TransferError, match="rank 0"):
                workers[0].wait_layer(task_id, spec.num_layers - 1, timeout=TIMEOUT + 30)
            assert time.monotonic() - began < TIMEOUT + 10, "the worker waited out its own timeout"
            workers[1].wait_layer(task_id, spec.num_layers - 1, timeout=30)     # rank 1 got it and did it
            i = sorted(handles).index(task_id)
            np.testing.assert_array_equal(cpu_image(workers[1], [i]), backend.cpu_tier(1)[[i]])
            for h in handles.values():
                try:
                    h.result(timeout=TIMEOUT + 10)
                except TransferError:
                    pass
        finally:
            thief.close(0)
            context.term()
        pipe.wait(zmq.EVENT_DISCONNECTED)
        round_trip(backend, workers, rng)


class PipeWatch:
    """Events of the engine's task socket for a rank (a zmq monitor), to wait for a peer's pipe to come or go."""

    def __init__(self, backend, rank):
        self.backend, self.rank = backend, rank
        with backend._channel._submit_lock:          # the socket's own users hold this lock
            self.events = backend._channel._task_pushes[rank].get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)

    def wait(self, event, timeout=10):
        from zmq.utils.monitor import recv_monitor_message
        deadline = time.monotonic() + timeout
        while self.events.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            if recv_monitor_message(self.events)["event"] == event:
                return
        raise AssertionError(f"no zmq event {event} on rank {self.rank}'s task socket within {timeout} s")

    def close(self):
        with self.backend._channel._submit_lock:
            self.backend._channel._task_pushes[self.rank].disable_monitor()
        self.events.close(0)        # else the engine's context.term() would wait for it forever

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _take(sock, into) -> int:
    while True:
        try:
            into.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return len(into)


def test_the_signature_covers_every_frame_and_its_direction():
    token = bytes(range(16))
    frames = protocol.encode_task(7, protocol.SWAP_TO_CPU, np.arange(3), np.arange(3))
    message = signed(token, TO_RANK, [SEQ.pack(1)] + frames)
    assert verified(token, TO_RANK, message) == [SEQ.pack(1)] + frames
    assert verified(bytes(16), TO_RANK, message) is None                     # another deployment's token
    assert verified(token, b"fastcache>engine", message) is None               # the other direction
    assert verified(token, TO_RANK, message[:1] + [SEQ.pack(2)] + message[2:]) is None     # renumbered
    assert verified(token, TO_RANK, message[:-1] + [message[-1][:-1]]) is None              # a frame cut short
    joined = [message[0], message[1] + message[2]] + message[3:]
    assert verified(token, TO_RANK, joined) is None                          # frame boundaries count
    assert verified(token, TO_RANK, [mac(token, TO_RANK, [])]) is None


def test_a_transfer_manager_without_the_token_refuses_to_start():
    run = subprocess.run([sys.executable, "-m", "fastcache.transfer", "--rank", "0", "--mp_num", "1",
                          "--ipc_suffix", "x", "--socket_dir", "/nonexistent", "--engine_pid", "1",
                          "--spec", small_spec().to_json()], input=b"not a token\n", capture_output=True, timeout=60)
    assert run.returncode == 2 and b"no deployment token on stdin" in run.stderr


def test_read_token_takes_exactly_one_hex_token():
    import io
    assert read_token(io.BytesIO(bytes(range(16)).hex().encode() + b"\n")) == bytes(range(16))
    for bad in (b"", b"\n", b"00" * 15 + b"\n", b"zz" * 16 + b"\n"):
        with pytest.raises(ValueError, match="no deployment token"):
            read_token(io.BytesIO(bad))


def test_an_unsigned_command_on_a_task_pipe_is_dropped_by_the_transfer_manager(capfd):
    """What reaches a transfer manager's pipe without the engine's signature (here a bare "stop", which
    would end it) is dropped with one warning; the process stays in service."""
    rng = np.random.default_rng(41)
    with deployment(small_spec(), tp=1) as (backend, workers):
        pid = backend.transfer_pids[0]
        with backend._channel._submit_lock:
            for _ in range(3):
                backend._channel._task_pushes[0].send_multipart(protocol.encode("stop"), zmq.NOBLOCK)
        round_trip(backend, workers, rng)
        assert backend.transfer_pids == [pid] and backend._ranks.process(0).poll() is None
    err = capfd.readouterr().err
    assert err.count("a message not signed by this deployment's engine was dropped") == 1, err[-2000:]


def test_the_engine_drops_a_reply_without_a_valid_signature(caplog):
    caplog.set_level(logging.WARNING, logger="fastcache.engine")
    with deployment(small_spec(), tp=1) as (backend, workers):
        identity = rank_identity(0, backend.transfer_pids[0])
        backend._channel.on_reply([identity, bytes(MAC_BYTES)] + protocol.encode("register", rank=0, pid=1))
        assert any("not signed" in r.getMessage() for r in caplog.records)
        round_trip(backend, workers, np.random.default_rng(42))
