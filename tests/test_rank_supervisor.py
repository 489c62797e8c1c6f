"""The rank supervisor on its own (engine/ranks.py): it reaches the deployment only through what its constructor
is given, so stand-ins for the processes, the signals and the task channel's callables exercise it whole."""
from __future__ import annotations

import logging
import subprocess
import time
from types import SimpleNamespace

import numpy as np
import pytest

from fastcache.engine import ranks as ranks_module
from fastcache.engine.ranks import RankSupervisor
from fastcache.errors import TransferError

TOKEN = bytes(range(16))


class FakeProc:
    """A transfer manager that never runs: its exit status is set by the test (or by kill)."""
    pids = iter(range(10_000, 20_000))

    def __init__(self, cmd, stdin=None):
        self.cmd, self.pid, self.code, self.killed = cmd, next(FakeProc.pids), None, False
        self.stdin = SimpleNamespace(written=[], write=lambda data: self.stdin.written.append(data), close=lambda: None)

    def poll(self):
        return self.code

    def kill(self):
        self.killed = True
        if self.code is None:
            self.code = -9

    def wait(self, timeout=None):
        return self.code


class Channel:
    """What the task channel is asked by the supervisor, recorded."""

    def __init__(self):
        self.pipes, self.failed, self.wakes = [], [], 0

    def open_pipe(self, rank, incarnation):
        self.pipes.append((rank, incarnation))

    def fail_tasks(self, rank, why):
        self.failed.append((rank, why))

    def wake(self):
        self.wakes += 1


@pytest.fixture
def supervisor(monkeypatch):
    monkeypatch.setattr(ranks_module.subprocess, "Popen", FakeProc)
    channel = Channel()
    spec = SimpleNamespace(to_json=lambda: '{"spec": 1}')
    signals = SimpleNamespace(transfer_heartbeat=np.zeros(4), weights_ready=np.zeros((4, 2)))
    sup = RankSupervisor(2, SimpleNamespace(transfer_timeout=1.0), TOKEN, lambda: (spec, 2, [5, 6], None),
                         lambda: ["--ipc_suffix", "sfx"], lambda: signals, channel.open_pipe, channel.fail_tasks,
                         channel.wake)
    for rank in range(2):
        sup.spawn(rank)
    return sup, channel, signals


def test_spawn_opens_a_new_pipe_per_process_and_hands_the_token_over_stdin_only(supervisor):
    sup, channel, _ = supervisor
    proc = sup.process(1)
    assert channel.pipes == [(0, 0), (1, 0)]
    assert proc.stdin.written == [TOKEN.hex().encode() + b"\n"]
    assert TOKEN.hex() not in " ".join(proc.cmd)
    args = proc.cmd[proc.cmd.index("-m"):]
    assert args[:3] == ["-m", "fastcache.transfer", "--rank"] and "--ipc_suffix" in args
    assert args[args.index("--device_id") + 1] == "6" and args[args.index("--incarnation") + 1] == "0"
    assert sup.pids(2) == [sup.process(0).pid, proc.pid] and sup.connection(1) == "not connected"
    sup.on_registered(1)
    assert sup.connection(1) == "registered" and sup.awaits_pipe(1)
    sup.on_attached(1, True)
    assert sup.connection(1) == "attached" and not sup.all_attached(2)


def test_restart_fails_what_the_old_process_owed_and_a_late_death_report_of_it_is_ignored(supervisor):
    sup, channel, _ = supervisor
    old = sup.process(1)
    sup.restart(1)
    assert old.killed and sup.process(1) is not old and sup.failed_ranks == {}
    assert channel.failed == [(1, "its transfer manager was restarted")] and channel.pipes[-1] == (1, 1)
    sup.mark_failed(1, "exited", proc=old)          # supervision's check of the old process, late
    assert sup.failed_ranks == {} and len(channel.failed) == 1
    with pytest.raises(ValueError, match="rank 2 out of range"):
        sup.restart(2)


def test_an_exit_takes_the_rank_out_of_service_naming_its_status_logged_once(supervisor, caplog):
    sup, channel, _ = supervisor
    sup.on_attached(0, True)
    sup.process(0).code = -15
    with caplog.at_level(logging.ERROR, logger="fastcache.engine"):
        assert sup.check_exit(0) and sup.check_exit(0)
        assert not sup.check_exit(1)
    why = sup.failed_ranks[0]
    assert "exited with status -15: killed by SIGTERM" in why
    assert [r.getMessage() for r in caplog.records] == [f"rank 0: {why}"]
    assert channel.failed == [(0, why), (0, why)] and channel.wakes == 2
    assert not sup.attached(0) and sup.gone(0) and sup.why_failed(0) == why
    assert sup.any_failed() and sup.any_failed([0]) and not sup.any_failed([1])
    with pytest.raises(TransferError, match="rank 0: transfer manager"):
        sup.raise_if_failed()


def test_watch_kills_a_silent_process_and_is_quiet_once_the_deployment_closes(supervisor):
    sup, channel, signals = supervisor
    signals.transfer_heartbeat[:2] = time.time()
    signals.transfer_heartbeat[1] -= 5.0            # past the 1 s transfer timeout
    sup.watch()
    assert sup.process(1).killed and not sup.process(0).killed
    assert "stopped answering" in sup.failed_ranks[1] and list(sup.failed_ranks) == [1]
    sup.begin_close()
    sup.process(0).code = 0
    sup.watch()
    assert list(sup.failed_ranks) == [1]


def test_a_reshard_grows_and_shrinks_the_ranks_by_new_lists(supervisor):
    sup, _, _ = supervisor
    procs = sup._procs
    sup.grow(4)
    assert sup.size == 4 and sup._procs is not procs and sup.process(3) is None and not sup.registered(3)
    sup.spawn(3, spec=SimpleNamespace(to_json=lambda: "{}"), tp=4, device_id=9)
    assert sup.process(3).cmd[sup.process(3).cmd.index("--mp_num") + 1] == "4"
    taken = sup.process(3)
    assert sup.take_out(3) is taken and sup.process(3) is None and not sup.gone(0)
    grown = sup._procs
    sup.keep(2)
    assert sup.size == 2 and sup._procs is not grown and grown[3] is None


def test_stop_kills_only_what_did_not_exit(supervisor, monkeypatch):
    sup, _, _ = supervisor
    sup.process(0).code = 0

    def hangs(timeout=None):
        if sup.process(1).code is None:
            raise subprocess.TimeoutExpired("fastcache.transfer", timeout)
        return sup.process(1).code
    monkeypatch.setattr(sup.process(1), "wait", hangs)
    sup.stop(grace=0.01)
    assert not sup.process(0).killed and sup.process(1).killed
