"""SwapBackend: the engine side of fastcache (DESIGN §1, §4-§7).

It creates the deployment's signals, phase barrier, CPU tiers and task queue, spawns one transfer
manager per rank and supervises them, turns swap requests into validated tasks, aggregates the ranks'
reports into one result per task, and drives clear/restore. The submitting thread writes each task to
the ranks' task sockets itself (under a lock); one I/O thread reads the replies and supervises.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import zmq

from ..config import CacheSpec, Settings
from ..errors import RefusedError, TransferError
from ..ipc import protocol
from ..ipc.protocol import EXIT_REASONS
from ..ipc.barrier import ENGINE_PARTY, BrokenBarrierError, phase_barrier
from ..ipc.naming import new_suffix, swap_space_name
from ..ipc.queue import bind_replies, bind_tasks, identity_rank, make_socket_dir, remove_socket_dir
from ..ipc.shm import SHM_DIR, SharedSegment
from ..ipc.signal import CLEARED, CLEARING, NORMAL, STATUS_NAMES, UPDATING, DeploymentSignals
from ..ops import resolve_device
from ..ipc.leftovers import remove_dead
from ..metrics import SwapCounters
from ..worker.cache_worker import close_local_workers
from .allocator import CpuBlockAllocator
from .handle import TransferHandle
from .ids import as_ids, wire_dtype
from .l3 import StoreTasks
from .reshard_phase import ReshardPhase

log = logging.getLogger("fastcache.engine")

MEMORY_HEADROOM = 0.9     # never plan to use more than this share of free RAM / /dev/shm
REAP_TIMEOUT = 5.0        # seconds supervision waits for a killed transfer manager to exit
PIPE_TIMEOUT = 2.0        # seconds a command waits for a registered transfer manager's task pipe


class SwapBackend(StoreTasks, ReshardPhase):
    """The engine's handle on a deployment: `with SwapBackend(spec, tp_size=2, device="sim") as b: ...`"""

    def __init__(self, spec: CacheSpec, tp_size: int = 1, device: str = "auto", suffix: str | None = None,
                 settings: Settings | None = None, device_ids=None, store: str | None = None):
        # Checked first, so that a bad FASTCACHE_* value is refused before anything is created. The
        # environment is checked even when `settings` is given: the transfer managers spawned read it.
        env_settings = Settings.from_env()
        if not isinstance(spec, CacheSpec):
            raise ValueError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
        self.spec, self.tp_size = spec, tp_size
        self.device = resolve_device(device)
        self.suffix = suffix or new_suffix()
        self.settings = settings or env_settings
        self.device_ids = list(device_ids) if device_ids is not None else list(range(tp_size))
        if len(self.device_ids) != tp_size:
            raise ValueError(f"device_ids lists {len(self.device_ids)} devices for tp_size {tp_size}")
        self._check_fits()
        self._init_store_tasks(store)              # L3 (engine/l3.py)
        self.allocator = CpuBlockAllocator(spec.num_cpu_blocks)
        self.counters = SwapCounters()              # exported by fastcache.metrics
        self._handles: dict[int, TransferHandle] = {}
        self._handles_lock = threading.Lock()
        self._submit_lock = threading.Lock()
        self._phase_lock = threading.Lock()
        self._phase_acks: dict[str, dict[int, str | None]] = {}
        self._phase_cond = threading.Condition()
        self._task_ids = itertools.count(1)
        self._incarnations = collections.Counter()  # rank -> processes started for it (names task endpoints)
        self._procs: list[subprocess.Popen | None] = [None] * tp_size
        self._failed: dict[int, str] = {}          # rank -> why it is out of service
        self._registered = [False] * tp_size
        self._attached = [False] * tp_size
        self._swap_segments: list[SharedSegment | None] = [None] * tp_size
        self._warned: set = set()
        self._started = self._closed = False
        self.signals = self.barrier = None
        self._init_reshard()                        # DESIGN §9 (engine/reshard_phase.py)

    # -- start-up --------------------------------------------------------------------------------
    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def start(self):
        if self._started:
            return self
        remove_dead()
        self._started = True
        try:
            # room for every tp a reshard can reach (DESIGN §9): the signals and the barrier stay
            self.signals = DeploymentSignals(self.suffix, self.tp_size, create=True, capacity=self.rank_capacity)
            self.barrier = phase_barrier(self.suffix, self.tp_size, create=True, capacity=self.rank_capacity)
            self.barrier.register(ENGINE_PARTY)
            self._create_swap_spaces()
            self.socket_dir = make_socket_dir(self.suffix)
            self._context = zmq.Context()
            self._router = bind_replies(self._context, self.socket_dir)
            self._task_pushes = [None] * self.tp_size      # bound by _spawn, one socket per process
            self._io_stop = threading.Event()
            self._io_thread = threading.Thread(target=self._serve, name="fastcache-engine-io", daemon=True)
            self._io_thread.start()
            for rank in range(self.tp_size):
                self._spawn(rank)
        except BaseException:
            self.close()
            raise
        return self

    def _check_fits(self):
        """Refuse a spec that cannot fit before allocating anything (psutil / /dev/shm free space)."""
        need = self.tp_size * self.spec.cpu_cache_bytes
        if self.device == "sim":
            need += self.tp_size * self.spec.gpu_cache_bytes
        have = min(psutil.virtual_memory().available, shutil.disk_usage(SHM_DIR).free) * MEMORY_HEADROOM
        if need > have:
            raise ValueError(f"the spec needs {need / 2**30:.2f} GiB of shared memory for {self.tp_size} rank(s) "
                             f"(CPU tier{' and simulated GPU cache' if self.device == 'sim' else ''}), "
                             f"but only {have / 2**30:.2f} GiB can be had; lower num_cpu_blocks or num_gpu_blocks")

    def _create_swap_spaces(self):
        for rank in range(self.tp_size):
            if self._swap_segments[rank] is None:
                self._swap_segments[rank] = SharedSegment.create(
                    swap_space_name(self.suffix, rank), self.spec.cpu_cache_bytes, self.suffix)

    def _release_swap_spaces(self):
        for rank, seg in enumerate(self._swap_segments):
            if seg is not None:
                seg.close()
                self._swap_segments[rank] = None

    def _spawn(self, rank: int, spec: CacheSpec | None = None, tp: int | None = None, device_id: int | None = None):
        """Start rank's transfer manager (a reshard starts new ranks with the spec and tp they will have)."""
        spec, tp = spec or self.spec, tp or self.tp_size
        device_id = self.device_ids[rank] if device_id is None else device_id
        with self._submit_lock:     # from here on nothing sent for rank can reach an earlier process's pipe
            incarnation = self._incarnations[rank]
            self._incarnations[rank] += 1
            old, self._task_pushes[rank] = self._task_pushes[rank], bind_tasks(
                self._context, self.socket_dir, rank, incarnation)
            if old is not None:
                old.close(0)
        cmd = [sys.executable, "-m", "fastcache.transfer", "--rank", str(rank), "--mp_num", str(tp),
               "--device_id", str(device_id), "--ipc_suffix", self.suffix, "--socket_dir", self.socket_dir,
               "--incarnation", str(incarnation), "--engine_pid", str(os.getpid()), "--device", self.device,
               "--spec", spec.to_json()] + (["--store", self.store_url.url] if self.store_url else [])
        self._registered[rank] = self._attached[rank] = False
        self.signals.transfer_heartbeat[rank] = 0
        self._procs[rank] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    @property
    def transfer_pids(self) -> list[int]:
        return [p.pid if p is not None else 0 for p in self._procs[:self.tp_size]]

    @property
    def running(self) -> bool:
        """Started and not closed."""
        return self._started and not self._closed

    @property
    def status(self) -> int:
        return self.signals.status

    def wait_ready(self, timeout: float = 30.0):
        """Wait until every worker has exported its cache and every transfer manager has attached it.
        Raises TransferError as soon as a rank fails, TimeoutError (saying what is missing) at the timeout."""
        deadline = time.monotonic() + timeout
        while not self._all_ready():
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise TimeoutError(f"deployment not ready after {timeout} s: {self._readiness()}")
            time.sleep(0.002)
        return self

    def _all_ready(self) -> bool:
        return (all(self._attached[:self.tp_size]) and bool(self.signals.cache_ready[:self.tp_size].all())
                and bool(self.signals.swap_space_ready[:self.tp_size].all()))

    def _readiness(self) -> str:
        return "; ".join(
            f"rank {r}: cache_ready={int(self.signals.cache_ready[r])} "
            f"swap_space_ready={int(self.signals.swap_space_ready[r])} "
            f"transfer manager {'attached' if self._attached[r] else 'registered' if self._registered[r] else 'not connected'}"
            for r in range(self.tp_size))

    # -- swaps -----------------------------------------------------------------------------------
    def swap_out(self, gpu_block_ids, cpu_block_ids) -> TransferHandle:
        """Copy GPU blocks to CPU blocks on every rank."""
        return self._submit(protocol.SWAP_TO_CPU, gpu_block_ids, cpu_block_ids)

    def swap_in(self, gpu_block_ids, cpu_block_ids) -> TransferHandle:
        """Copy CPU blocks back to GPU blocks on every rank."""
        return self._submit(protocol.SWAP_TO_GPU, gpu_block_ids, cpu_block_ids)

    def _submit(self, kind, gpu_block_ids, cpu_block_ids) -> TransferHandle:
        return self._submit_ids(kind, *self._validate(kind, gpu_block_ids, cpu_block_ids))

    def submit_checked_swap(self, kind, gpu_ids: list[int], cpu_ids: list[int]) -> TransferHandle:
        """A swap of ids the caller has already checked as _validate does. TieredCache checks each request
        before it touches its index and names only CPU blocks it owns, so its swaps skip a second check
        (each transfer manager still checks every task it receives)."""
        wire = wire_dtype(self.spec)
        return self._submit_ids(kind, np.array(gpu_ids, wire), np.array(cpu_ids, wire))

    def _submit_ids(self, kind, gpu_ids, cpu_ids) -> TransferHandle:
        if not self._started or self._closed:
            raise TransferError("the backend is not running")
        status = self.signals.status
        if status != NORMAL:
            raise RefusedError(f"swap refused: kv_cache_status is {STATUS_NAMES.get(status, status)} "
                               f"(the cache is being cleared, restored or resharded)")
        self._raise_if_failed()
        if not self._all_ready():
            raise RefusedError(f"swap refused: deployment not ready ({self._readiness()}); call wait_ready()")
        handle = TransferHandle(next(self._task_ids), kind, range(self.tp_size),
                                self.spec.task_bytes(gpu_ids) * self.tp_size)
        handle.add_done_callback(self.counters.record)
        with self._handles_lock:
            self._handles[handle.task_id] = handle
        self._send_all(protocol.encode_task(handle.task_id, kind, gpu_ids, cpu_ids), handle)
        return handle

    def _validate(self, kind, gpu_block_ids, cpu_block_ids):
        gpu_ids = as_ids(gpu_block_ids, "gpu_block_ids")
        cpu_ids = as_ids(cpu_block_ids, "cpu_block_ids")
        if len(gpu_ids) != len(cpu_ids):
            raise ValueError(f"gpu_block_ids has {len(gpu_ids)} ids but cpu_block_ids has {len(cpu_ids)}")
        if not 0 < len(gpu_ids) <= protocol.MAX_IDS:
            raise ValueError(f"a swap moves 1..{protocol.MAX_IDS} blocks, got {len(gpu_ids)}")
        protocol.check_ids(gpu_ids, cpu_ids, kind, self.spec.num_gpu_blocks, self.spec.num_cpu_blocks)
        wire = wire_dtype(self.spec)
        return gpu_ids.astype(wire), cpu_ids.astype(wire)

    def cpu_tier(self, rank: int) -> np.ndarray:
        """Rank's CPU tier as uint8 [num_cpu_blocks, cpu_block_bytes], a view of its blocks without their slots
        (block-major; for checks and tools)."""
        seg = self._swap_segments[rank]
        if seg is None:
            raise TransferError(f"rank {rank} has no CPU tier (released by clear_caches)")
        spec = self.spec
        return seg.array(np.uint8, (spec.num_cpu_blocks, spec.cpu_block_stride))[:, :spec.cpu_block_bytes]

    def allocate_cpu_blocks(self, n: int) -> list[int]:
        return self.allocator.allocate(n)

    def free_cpu_blocks(self, ids):
        self.allocator.free(ids)

    # -- clear / restore (DESIGN §6) ---------------------------------------------------------------
    def clear_caches(self, timeout: float = 60.0):
        """Release every rank's cache memory; returns once all of it is free (status CLEARED)."""
        with self._phase_lock:
            if self.signals.status == CLEARED:
                return
            if self._pending_reshard is not None:
                raise TransferError("clear refused: a reshard is pending (restart_rank the failed rank, then "
                                    "reshard again)")
            self._raise_if_failed()
            deadline = time.monotonic() + timeout
            self.barrier.reset()
            self.signals.status = CLEARING              # refuses new swaps from here on
            self._drain(deadline)                       # a clear never pulls memory from under a copy
            release = self.settings.clear_swap_space
            self._run_phase("clear", protocol.encode("clear", release_swap_space=release), deadline)
            self._wait_signals(lambda: not self.signals.cache_ready.any() and
                               (not release or not self.signals.swap_space_ready.any()), deadline, "release")
            self._attached = [False] * self.tp_size
            if release:
                self._release_swap_spaces()
            self.allocator.reset()
            self.signals.status = CLEARED

    def restore_caches(self, timeout: float = 60.0):
        """Re-create every rank's cache; returns once all ranks are ready again (status NORMAL)."""
        with self._phase_lock:
            if self.signals.status == NORMAL:
                return
            if self.signals.status not in (CLEARED, UPDATING):      # UPDATING: a failed restore, retried
                raise TransferError(f"restore needs a cleared cache; kv_cache_status is "
                                    f"{STATUS_NAMES.get(self.signals.status)}")
            self._raise_if_failed()
            deadline = time.monotonic() + timeout
            self.barrier.reset()
            self._create_swap_spaces()
            self.signals.status = UPDATING
            self._run_phase("restore", protocol.encode("restore"), deadline)
            self._wait_signals(self._all_ready, deadline, "restore")
            self.signals.status = NORMAL

    def _drain(self, deadline):
        with self._handles_lock:
            pending = list(self._handles.values())
        for handle in pending:
            try:
                handle.result(max(0.0, deadline - time.monotonic()))
            except TransferError:
                pass                                    # its owner sees the failure
            except TimeoutError:
                raise TransferError(f"clear timed out waiting for task {handle.task_id} in flight") from None

    def _run_phase(self, phase, message, deadline):
        """Send a phase to every transfer manager, meet everyone at the barrier, collect the acks."""
        with self._phase_cond:
            self._phase_acks[phase] = {}
        self._send_all(message)
        try:
            self.barrier.wait(ENGINE_PARTY, max(0.0, deadline - time.monotonic()))
        except BrokenBarrierError as exc:
            failed = "".join(f"; rank {r}: {why}" for r, why in sorted(self._failed.items()))
            raise TransferError(f"{phase} failed: {exc}{failed}") from None
        with self._phase_cond:
            ok = self._phase_cond.wait_for(lambda: len(self._phase_acks[phase]) == self.tp_size or self._failed,
                                           max(0.0, deadline - time.monotonic()))
            acks = self._phase_acks.pop(phase)
        self._raise_if_failed()
        errors = {r: e for r, e in acks.items() if e}
        if errors or not ok:
            detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())) or \
                f"no report from ranks {sorted(set(range(self.tp_size)) - set(acks))}"
            raise TransferError(f"{phase} failed: {detail}")

    def _wait_signals(self, condition, deadline, what):
        while not condition():
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise TransferError(f"{what} timed out: {self._readiness()}")
            time.sleep(0.001)

    # -- supervision -----------------------------------------------------------------------------
    def restart_rank(self, rank: int, timeout: float = 30.0):
        """Replace rank's transfer manager (dead or not); the CPU tier, owned here, keeps every block. During a
        pending reshard, the ranks of both tps can be restarted (a new rank's with the new spec)."""
        step = self._pending_reshard
        ranks = len(self._procs) if step is not None else self.tp_size
        if not 0 <= rank < ranks or self._procs[rank] is None and step is not None:
            raise ValueError(f"rank {rank} out of range for tp_size {self.tp_size}")
        proc = self._procs[rank]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._mark_failed(rank, "its transfer manager was restarted", level=logging.INFO)
        if step is not None and rank >= self.tp_size:      # a rank the pending reshard added
            self._spawn(rank, spec=step.plan.new_spec, tp=step.to_tp, device_id=step.device_ids[rank])
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
            handle._rank_finished(rank, why)
        self._forget_done(handles)
        with self._phase_cond:
            self._phase_cond.notify_all()

    def _fail_pending(self, why):
        with self._handles_lock:
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            for rank in handle.pending_ranks():
                handle._rank_finished(rank, why)

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

    # -- the I/O thread --------------------------------------------------------------------------
    def _serve(self):
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        next_watch = 0.0
        while not self._io_stop.is_set():
            events = dict(poller.poll(100))
            if self._router in events:
                while True:
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._on_reply(frames)
                    except Exception as exc:        # no single message may end this thread
                        self._warn_once(("reply",), f"reply dropped: {type(exc).__name__}: {exc}")
            if time.monotonic() >= next_watch:
                self._watch_ranks()
                next_watch = time.monotonic() + 0.1

    def _send_all(self, message, handle=None):
        """Deliver a task (with its handle) or a command (without) to every rank, in submission order. A rank
        the handle no longer waits for is skipped: a restart failed the task there before it was sent, the
        handle may be done and its blocks reused, and a new process must not copy them late. (The check is
        sound under the lock: restart_rank fails the old process's tasks before _spawn takes the lock.)"""
        with self._submit_lock:
            for rank, push in enumerate(self._task_pushes):
                if push is None:        # a rank a reshard is adding or retiring
                    continue
                if handle is not None and not handle.waits_for(rank):
                    continue
                if rank in self._failed:
                    self._finish(handle, rank, self._failed[rank])
                    continue
                if not self._deliver(rank, push, message, command=handle is None):
                    self._check_exit(rank)
                    self._finish(handle, rank, self._failed.get(rank, "transfer manager not connected"))

    def _send_to(self, rank, message) -> bool:
        """Deliver a command to one rank; False if no transfer manager is connected to its pipe."""
        with self._submit_lock:         # zmq sockets are not thread-safe, and _spawn replaces them
            push = self._task_pushes[rank] if rank < len(self._task_pushes) else None
            return push is not None and self._deliver(rank, push, message, command=True)

    def _deliver(self, rank, push, message, command: bool) -> bool:
        """Send on rank's task pipe (under _submit_lock); False if no transfer manager is connected to it.
        A command for a process that has registered (through the reply socket) but whose pipe zmq has not
        set up yet, as right after restart_rank in CLEARED, waits for the pipe instead of being lost (its
        phase would wait out the barrier's timeout). A task never waits: it fails at once instead."""
        try:
            push.send_multipart(message, zmq.NOBLOCK)
            return True
        except zmq.Again:
            pass
        proc = self._procs[rank] if command and rank < len(self._procs) else None
        deadline = time.monotonic() + PIPE_TIMEOUT
        while proc is not None and self._registered[rank] and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
            try:
                push.send_multipart(message, zmq.NOBLOCK)
                return True
            except zmq.Again:
                pass
        return False

    def _finish(self, handle, rank, error=None):
        if handle is None:
            return
        handle._rank_finished(rank, error)
        if handle.done():
            with self._handles_lock:
                self._handles.pop(handle.task_id, None)

    def _reply_for(self, task_id, rank, error=None):
        with self._handles_lock:
            handle = self._handles.get(task_id)
        self._finish(handle, rank, error)

    def _on_reply(self, frames):
        who = identity_rank(frames[0]) if len(frames) > 1 else None      # (rank, pid) or None
        rank = who[0] if who else None
        procs = self._procs        # during a reshard, ranks above tp_size are in service too
        if rank is None or not 0 <= rank < len(procs) or procs[rank] is None or who[1] != procs[rank].pid:
            self._warn_once(("identity",), f"message from unknown peer {frames[0][:32]!r} dropped")
            return
        try:
            header, _ = protocol.decode(frames[1:])
        except protocol.ProtocolError as exc:
            self._warn_once(("malformed", rank), f"rank {rank}: malformed reply dropped: {exc}")
            return
        kind = header["type"]
        if kind == "register":
            self._registered[rank] = True
        elif kind == "done":
            self._reply_for(header["task_id"], rank)
        elif kind == "failed":
            self._reply_for(header["task_id"], rank, header["error"])
        elif kind in ("phase_done", "phase_failed"):
            if header["phase"] == "attach":
                if kind == "phase_failed":      # a device error: out of service until restart_rank
                    self._mark_failed(rank, f"transfer manager (pid {who[1]}) could not attach its cache: "
                                            f"{header.get('error')}")
                self._attached[rank] = kind == "phase_done"
                return
            with self._phase_cond:
                acks = self._phase_acks.get(header["phase"])
                if acks is not None:
                    acks[rank] = header.get("error")
                    self._phase_cond.notify_all()
        elif kind == "error":
            self._warn_once(("error", rank), f"rank {rank} rejected a message: {header['error']}")
        else:
            self._warn_once(("type", rank, kind), f"rank {rank}: unexpected {kind!r} message dropped")

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    # -- shutdown --------------------------------------------------------------------------------
    def close(self):
        """Stop the transfer managers and remove every segment and socket this deployment created."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        if getattr(self, "_io_thread", None) is not None:
            self._send_all(protocol.encode("stop"))
        self._stop_processes()
        # only now: a transfer manager may still map the workers' memory (CUDA IPC) until it has exited
        close_local_workers(self.suffix)
        if getattr(self, "_io_thread", None) is not None:
            self._io_stop.set()
            self._io_thread.join()
        self._fail_pending("the backend was closed")
        for sock in [getattr(self, "_router", None)] + getattr(self, "_task_pushes", []):
            if sock is not None:
                sock.close(0)
        if hasattr(self, "_context"):
            self._context.term()
        self._release_swap_spaces()
        if self._pending_reshard is not None:
            self._drop_step_memory(self._pending_reshard)
        if self.barrier is not None:
            self.barrier.close()
        if self.signals is not None:
            self.signals.close()
        if hasattr(self, "socket_dir"):
            remove_socket_dir(self.socket_dir)
        remove_dead(suffix=self.suffix)      # what killed workers of this deployment could not unlink
        self._close_store()

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
