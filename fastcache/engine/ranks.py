"""The supervision of SwapBackend's transfer managers (docs/design.md §7): one process per rank spawned,
watched (exit status and heartbeat), taken out of service with everything it owes failed, and restarted.

RankSupervisor is a part SwapBackend owns, the one owner of the ranks' processes and their state: the
processes, their incarnations, the failed ranks (with why) and the registered/attached flags. It reaches the
rest through what its constructor is given: the deployment's geometry and launch arguments, the signals, and
three callables of the task channel (a new process's task pipe, failing the tasks a rank owes, waking the
phases that wait on the ranks). A reshard grows, shrinks and retires ranks through its public methods (the
BackendReshardHost of reshard_host.py calls them).

A list the I/O thread reads (the processes, the flags) is replaced, never changed in length in place: the
thread may be iterating it.
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from ..errors import TransferError
from ..ipc.protocol import EXIT_REASONS

log = logging.getLogger("fastcache.engine")

REAP_TIMEOUT = 5.0        # seconds supervision waits for a killed transfer manager to exit


class RankSupervisor:
    """The transfer-manager processes of a deployment, one per rank.

    geometry() -> (spec, tp_size, device_ids, weight layout) the deployment has now; launch_args() -> the
    command-line arguments every transfer manager of the deployment shares (suffix, socket directory, device,
    store); signals() -> the DeploymentSignals; open_pipe(rank, incarnation) binds a new process's task pipe
    (nothing sent for rank reaches an earlier process's pipe from then on) and returns the descriptors the
    process inherits, by the option that hands each over (its doorbells); fail_tasks(rank, why) fails
    every task the rank still owes; wake() wakes whoever waits on the ranks (a phase)."""

    def __init__(self, tp_size: int, settings, token: bytes, geometry: Callable[[], tuple],
                 launch_args: Callable[[], list], signals: Callable, open_pipe: Callable[[int, int], dict | None],
                 fail_tasks: Callable[[int, str], None], wake: Callable[[], None]):
        self._settings, self._token = settings, token
        self._geometry, self._launch_args, self._signals = geometry, launch_args, signals
        self._open_pipe, self._fail_tasks, self._wake = open_pipe, fail_tasks, wake
        self._lock = threading.Lock()       # the failed ranks, against a process replaced meanwhile
        self._spawning = threading.Lock()   # a spawn against begin_close: no process starts once close has begun
        self._procs: list[subprocess.Popen | None] = [None] * tp_size
        self._incarnations = collections.Counter()  # rank -> processes started for it (names task endpoints)
        self._failed: dict[int, str] = {}           # rank -> why it is out of service
        self._registered = [False] * tp_size
        self._attached = [False] * tp_size
        self._closing = False

    # -- what a rank is now ------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Ranks with room here (during a reshard, those of both tps)."""
        return len(self._procs)

    def process(self, rank: int) -> subprocess.Popen | None:
        """Rank's transfer manager, None for a rank not started, retired or taken out."""
        procs = self._procs
        return procs[rank] if 0 <= rank < len(procs) else None

    def pid(self, rank: int) -> int:
        return self._procs[rank].pid

    def pids(self, tp: int) -> list[int]:
        return [p.pid if p is not None else 0 for p in self._procs[:tp]]

    def is_current(self, rank: int, pid: int) -> bool:
        """pid is the process spawned for rank (the only one whose replies count)."""
        proc = self.process(rank)
        return proc is not None and proc.pid == pid

    def registered(self, rank: int) -> bool:
        return self._registered[rank]

    def attached(self, rank: int) -> bool:
        return self._attached[rank]

    def all_attached(self, tp: int) -> bool:
        return all(self._attached[:tp])

    def connection(self, rank: int) -> str:
        """How far rank's transfer manager has come: attached, registered or not connected."""
        return "attached" if self._attached[rank] else "registered" if self._registered[rank] else "not connected"

    def awaits_pipe(self, rank: int) -> bool:
        """Rank's process has registered and is alive: its task pipe is worth waiting for."""
        proc = self.process(rank)
        return proc is not None and self._registered[rank] and proc.poll() is None

    def gone(self, rank: int) -> bool:
        """Rank will not report anything: failed, without a process, or its process has exited."""
        proc = self.process(rank)
        return rank in self._failed or proc is None or proc.poll() is not None

    @property
    def failed_ranks(self) -> dict[int, str]:
        """Ranks out of service, with why."""
        return dict(self._failed)

    def why_failed(self, rank: int) -> str | None:
        return self._failed.get(rank)

    def any_failed(self, ranks=None) -> bool:
        failed = self._failed
        return bool(failed) if ranks is None else any(r in failed for r in ranks)

    def raise_if_failed(self):
        failed = self.failed_ranks
        if failed:
            raise TransferError("; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())))

    # -- what the I/O thread reports -----------------------------------------------------------------
    def on_registered(self, rank: int):
        self._registered[rank] = True

    def on_attached(self, rank: int, attached: bool):
        self._attached[rank] = attached

    def detach(self, ranks):
        """These ranks attach their caches again before they are ready (a clear, a reshard)."""
        attached = self._attached
        for r in ranks:
            if r < len(attached):
                attached[r] = False

    # -- processes -----------------------------------------------------------------------------------
    def spawn(self, rank: int, spec=None, tp: int | None = None, device_id: int | None = None, weights=None):
        """Start rank's transfer manager (a reshard starts new ranks with the spec, tp and weight layout they will
        have). TransferError once close has begun: close would not stop the process (restart_rank on another
        thread), nor remove its pipe and rings."""
        with self._spawning:
            if self._closing:
                raise TransferError(f"rank {rank} was not started: the backend was closed")
            self._spawn(rank, spec, tp, device_id, weights)

    def _spawn(self, rank, spec, tp, device_id, weights):
        now_spec, now_tp, device_ids, now_weights = self._geometry()
        spec, tp, weights = spec or now_spec, tp or now_tp, weights or now_weights
        device_id = device_ids[rank] if device_id is None else device_id
        with self._lock:
            incarnation = self._incarnations[rank]
            self._incarnations[rank] += 1
        inherited = self._open_pipe(rank, incarnation) or {}     # option -> descriptor (the doorbells)
        cmd = [sys.executable, "-m", "fastcache.transfer", "--rank", str(rank), "--mp_num", str(tp),
               "--device_id", str(device_id), "--incarnation", str(incarnation), "--engine_pid", str(os.getpid()),
               "--spec", spec.to_json()] + list(self._launch_args()) + \
            (["--weights", weights.to_json()] if weights is not None else []) + \
            [arg for option, fd in inherited.items() for arg in (option, str(fd))]
        self._registered[rank] = self._attached[rank] = False
        signals = self._signals()
        signals.transfer_heartbeat[rank] = 0
        if rank < len(signals.weights_ready):
            signals.weights_ready[rank, 1] = 0      # the new process has not attached the weights yet
        proc = self._procs[rank] = subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                                     **({"pass_fds": tuple(inherited.values())} if inherited else {}))
        try:
            proc.stdin.write(self._token.hex().encode() + b"\n")     # the token: not in argv or environ
            proc.stdin.close()
        except OSError:         # it died at once: supervision reports its exit
            pass

    def restart(self, rank: int, step=None):
        """Replace rank's transfer manager (dead or not), failing what the old one owed. With step (the pending
        ReshardStep), the ranks of both tps can be restarted (a new rank's with the new spec)."""
        tp = self._geometry()[1]
        ranks = len(self._procs) if step is not None else tp
        if not 0 <= rank < ranks or self._procs[rank] is None and step is not None:
            raise ValueError(f"rank {rank} out of range for tp_size {tp}")
        proc = self._procs[rank]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self.mark_failed(rank, "its transfer manager was restarted", level=logging.INFO)
        if step is not None and rank >= tp:      # a rank the pending reshard added
            self.spawn(rank, spec=step.plan.new_spec, tp=step.to_tp, device_id=step.device_ids[rank],
                       weights=step.weights)
        else:
            self.spawn(rank)
        with self._lock:        # only now: supervision must never see the old process in service
            self._failed.pop(rank, None)

    def mark_failed(self, rank: int, why: str, level=logging.ERROR, proc=None):
        """Take a rank out of service and fail everything it still owes (the I/O thread and a submitting
        thread may both notice a death: it is logged once). With proc, the process found dead: a check that
        raced restart, which has put a new process in its place, is ignored."""
        with self._lock:
            if proc is not None and self.process(rank) is not proc:
                return
            first = rank not in self._failed
            self._failed[rank] = why
        if first:
            log.log(level, "rank %d: %s", rank, why)
        if rank < len(self._attached):
            self._attached[rank] = False
        self._fail_tasks(rank, why)
        self._wake()

    def check_exit(self, rank: int) -> bool:
        """If rank's transfer manager has exited, take the rank out of service naming its exit status."""
        proc = self.process(rank)       # a reshard may have retired it
        code = proc.poll() if proc is not None else None
        if code is None:
            return False
        reason = EXIT_REASONS.get(code, "it crashed" if code else "it stopped")
        if code < 0:
            reason = f"killed by {signal.Signals(-code).name}"
        self.mark_failed(rank, f"transfer manager (pid {proc.pid}) exited with status {code}: {reason}", proc=proc)
        return True

    def watch(self):
        """The I/O thread's tick: a rank whose process exited or stopped beating goes out of service."""
        if self._closing:
            return
        now = time.time()
        signals = self._signals()
        for rank, proc in enumerate(self._procs):
            if proc is None or rank in self._failed or self.check_exit(rank):
                continue
            beat = float(signals.transfer_heartbeat[rank])
            if beat and now - beat > self._settings.transfer_timeout:
                # a silent process must not wake up later and write into the cache, and its tasks fail only
                # once it is gone: until its exit has torn its CUDA context down, a copy it queued may land
                proc.kill()
                try:
                    proc.wait(REAP_TIMEOUT)
                    gone = "killed it"
                except subprocess.TimeoutExpired:
                    gone = f"killed it, but it had not exited {REAP_TIMEOUT:.0f} s later"
                self.mark_failed(rank, f"transfer manager (pid {proc.pid}) stopped answering "
                                       f"(no heartbeat for {now - beat:.1f} s); {gone}", proc=proc)

    def begin_close(self):
        """The deployment is closing: the processes' exits from now on are planned, not failures, and no process
        starts (a spawn under way finishes first, so stop sees its process)."""
        with self._spawning:
            self._closing = True

    def stop(self, grace: float = 5.0, told=None):
        """Wait up to grace seconds for every process told to stop to exit; kill what is left. told: the ranks whose
        process was sent the stop (None: all); the others are killed at once: a process not connected to its pipe
        yet, or out of service, would only be waited for until the grace ran out."""
        deadline = time.monotonic() + grace
        for rank, proc in enumerate(self._procs):
            if proc is None:
                continue
            if told is not None and rank not in told:
                proc.kill()
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # -- a reshard's ranks ---------------------------------------------------------------------------
    def take_out(self, rank: int):
        """Rank's process, taken out of service so that supervision does not report its (planned) exit."""
        with self._lock:
            proc, self._procs[rank] = self._procs[rank], None
            self._failed.pop(rank, None)
        self._attached[rank] = self._registered[rank] = False
        return proc

    def grow(self, tp: int):
        """Room for ranks up to tp, none in service yet."""
        grow = tp - len(self._procs)
        if grow > 0:
            self._procs, self._registered = self._procs + [None] * grow, self._registered + [False] * grow
            self._attached = self._attached + [False] * grow

    def keep(self, tp: int):
        """Ranks below tp only: the others are retired (supervision sees None, then no room)."""
        for r in range(tp, len(self._procs)):
            self._procs[r] = None
        self._procs, self._registered, self._attached = self._procs[:tp], self._registered[:tp], self._attached[:tp]
