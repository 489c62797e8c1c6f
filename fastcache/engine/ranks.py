"""SwapBackend's supervision of its transfer managers (docs/design.md §7): one process per rank spawned,
watched (exit status and heartbeat), taken out of service with everything it owes failed, and restarted.

A mixin of SwapBackend. The state it owns: `_procs`, `_incarnations`, `_failed`, `_registered`,
`_attached` (all made in SwapBackend.__init__; a reshard resizes them through the backend's _ReshardHost);
it fails handles through the task channel's registry, and restarts a rank of a pending reshard as the
resharder's step says.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from ..config import CacheSpec
from ..errors import TransferError
from ..ipc.protocol import EXIT_REASONS
from ..ipc.queue import bind_tasks
from ..ipc.signal import NORMAL

log = logging.getLogger("fastcache.engine")

REAP_TIMEOUT = 5.0        # seconds supervision waits for a killed transfer manager to exit


class RankSupervision:
    def _spawn(self, rank: int, spec: CacheSpec | None = None, tp: int | None = None, device_id: int | None = None,
               weights=None):
        """Start rank's transfer manager (a reshard starts new ranks with the spec, tp and weight layout they will
        have)."""
        spec, tp = spec or self.spec, tp or self.tp_size
        weights = weights or self.weight_layout
        device_id = self.device_ids[rank] if device_id is None else device_id
        with self._submit_lock:     # from here on nothing sent for rank can reach an earlier process's pipe
            incarnation = self._incarnations[rank]
            self._incarnations[rank] += 1
            old, self._task_pushes[rank] = self._task_pushes[rank], bind_tasks(
                self._context, self.socket_dir, rank, incarnation)
            if old is not None:
                old.close(0)
            self._sent_seq[rank], self._unreceived[rank] = 0, {}      # a new process numbers from 1
            self.signals.task_received[rank] = 0
        cmd = [sys.executable, "-m", "fastcache.transfer", "--rank", str(rank), "--mp_num", str(tp),
               "--device_id", str(device_id), "--ipc_suffix", self.suffix, "--socket_dir", self.socket_dir,
               "--incarnation", str(incarnation), "--engine_pid", str(os.getpid()), "--device", self.device,
               "--spec", spec.to_json()] + (["--store", self.store_url.url] if self.store_url else []) + \
            (["--weights", weights.to_json()] if weights is not None else [])
        self._registered[rank] = self._attached[rank] = False
        self.signals.transfer_heartbeat[rank] = 0
        if rank < len(self.signals.weights_ready):
            self.signals.weights_ready[rank, 1] = 0     # the new process has not attached the weights yet
        proc = self._procs[rank] = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        try:
            proc.stdin.write(self._token.hex().encode() + b"\n")     # the token: not in argv or environ
            proc.stdin.close()
        except OSError:         # it died at once: supervision reports its exit
            pass

    @property
    def transfer_pids(self) -> list[int]:
        return [p.pid if p is not None else 0 for p in self._procs[:self.tp_size]]

    @property
    def failed_ranks(self) -> dict[int, str]:
        """Ranks out of service, with why (restart_rank puts one back)."""
        return dict(self._failed)

    def restart_rank(self, rank: int, timeout: float = 30.0):
        """Replace rank's transfer manager (dead or not); the CPU tier, owned here, keeps every block. During a
        pending reshard, the ranks of both tps can be restarted (a new rank's with the new spec)."""
        step = self._resharder.pending
        ranks = len(self._procs) if step is not None else self.tp_size
        if not 0 <= rank < ranks or self._procs[rank] is None and step is not None:
            raise ValueError(f"rank {rank} out of range for tp_size {self.tp_size}")
        proc = self._procs[rank]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._mark_failed(rank, "its transfer manager was restarted", level=logging.INFO)
        if step is not None and rank >= self.tp_size:      # a rank the pending reshard added
            self._spawn(rank, spec=step.plan.new_spec, tp=step.to_tp, device_id=step.device_ids[rank],
                        weights=step.weights)
        else:
            self._spawn(rank)
        with self._handles_lock:        # only now: supervision must never see the old process in service
            self._failed.pop(rank, None)
        # registered: it holds its barrier slot, so a later phase will not find the dead pid there;
        # attached too when the cache is up (in CLEARED it attaches on restore)
        ready = (lambda: self._attached[rank]) if self.signals.status == NORMAL else (lambda: self._registered[rank])
        self._wait_signals(ready, time.monotonic() + timeout, f"restart of rank {rank}")

    def _raise_if_failed(self):
        if self._failed:
            raise TransferError("; ".join(f"rank {r}: {why}" for r, why in sorted(self._failed.items())))

    def _mark_failed(self, rank: int, why: str, level=logging.ERROR, proc=None):
        """Take a rank out of service and fail everything it still owes (the I/O thread and a submitting
        thread may both notice a death: it is logged once). With proc, the process found dead: a check that
        raced restart_rank, which has put a new process in its place, is ignored."""
        with self._handles_lock:
            if proc is not None and (rank >= len(self._procs) or self._procs[rank] is not proc):
                return
            first = rank not in self._failed
            self._failed[rank] = why
        if first:
            log.log(level, "rank %d: %s", rank, why)
        if rank < len(self._attached):
            self._attached[rank] = False
        with self._handles_lock:
            handles = list(self._handles.values())
        for handle in handles:
            handle.rank_finished(rank, why, lost=True)
        self._forget_done(handles)
        with self._phase_cond:
            self._phase_cond.notify_all()

    def _fail_pending(self, why):
        with self._handles_lock:
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            for rank in handle.pending_ranks():
                handle.rank_finished(rank, why, lost=True)

    def _forget_done(self, handles):
        with self._handles_lock:
            for handle in handles:
                if handle.done():
                    self._handles.pop(handle.task_id, None)

    def _watch_ranks(self):
        if self._closed:
            return
        now = time.time()
        for rank, proc in enumerate(self._procs):
            if proc is None or rank in self._failed or self._check_exit(rank):
                continue
            beat = float(self.signals.transfer_heartbeat[rank])
            if beat and now - beat > self.settings.transfer_timeout:
                # a silent process must not wake up later and write into the cache, and its tasks fail only
                # once it is gone: until its exit has torn its CUDA context down, a copy it queued may land
                proc.kill()
                try:
                    proc.wait(REAP_TIMEOUT)
                    gone = "killed it"
                except subprocess.TimeoutExpired:
                    gone = f"killed it, but it had not exited {REAP_TIMEOUT:.0f} s later"
                self._mark_failed(rank, f"transfer manager (pid {proc.pid}) stopped answering "
                                        f"(no heartbeat for {now - beat:.1f} s); {gone}", proc=proc)
        self._watch_unreceived()        # after the heartbeats: a silent process is named as such

    def _watch_unreceived(self):
        """A task its transfer manager has not read within the transfer timeout fails on that rank (another
        process of the user took it off the pipe, or the pipe is gone); so do tasks the rank reports lost."""
        now, limit = time.monotonic(), self.settings.transfer_timeout
        wall = time.time()
        late = []
        with self._submit_lock:
            for rank, pending in self._unreceived.items():
                if rank >= len(self.signals.task_received):
                    continue
                received = int(self.signals.task_received[rank])
                beating = wall - float(self.signals.transfer_heartbeat[rank]) < limit
                for seq, (handle, sent) in list(pending.items()):
                    if not handle.waits_for(rank):
                        del pending[seq]
                    elif seq > received and now - sent > limit and beating:     # a silent one: heartbeats
                        del pending[seq]
                        late.append((handle, rank))
        for handle, rank in late:
            self._finish(handle, rank, f"its transfer manager did not receive the task within {limit:.0f} s "
                                       f"(another process reading rank {rank}'s task pipe?)")

    def _lost_messages(self, rank, first, last):
        with self._submit_lock:
            pending = self._unreceived.get(rank, {})
            lost = [pending.pop(seq)[0] for seq in range(first, last + 1) if seq in pending]
        self._warn_once(("lost", rank), f"rank {rank}: messages {first}..{last} never reached its transfer manager: "
                                        f"another process is reading its task pipe")
        for handle in lost:
            self._finish(handle, rank, "another process took the task off its task pipe (it never arrived)")

    def _check_exit(self, rank) -> bool:
        """If rank's transfer manager has exited, take the rank out of service naming its exit status."""
        proc = self._procs[rank] if rank < len(self._procs) else None      # a reshard may have retired it
        code = proc.poll() if proc is not None else None
        if code is None:
            return False
        reason = EXIT_REASONS.get(code, "it crashed" if code else "it stopped")
        if code < 0:
            reason = f"killed by {signal.Signals(-code).name}"
        self._mark_failed(rank, f"transfer manager (pid {proc.pid}) exited with status {code}: {reason}", proc=proc)
        return True

    def _stop_processes(self, grace: float = 5.0):
        deadline = time.monotonic() + grace
        for proc in self._procs:
            if proc is None:
                continue
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
