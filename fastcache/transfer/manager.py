"""The cache transfer manager: one process per rank that moves that rank's blocks.

It attaches the rank's exported tensors once cache_ready[r] is set, attaches the engine-owned CPU tier,
executes swap tasks on one thread per direction, reports each task done or failed, follows the engine
through clear/restore, beats transfer_heartbeat[r], and exits (logging once) when its worker or its
engine is gone. It sleeps in zmq's poll when idle.

A task done is reported in the process's completion ring (ipc/done_ring.py), with the engine's doorbell rung
after it; a failure, anything else, and a report the full ring cannot take go over the reply socket.

Small swap tasks come through the process's task ring (ipc/task_ring.py), the rest and every command over the
task pipe, in one numbering: on every wake-up (its doorbell, the pipe, or the bounded wait) it drains the pipe,
then reads the ring, and takes what both hold in number order; a number missing below one it takes is lost
(reported, as a message taken off the pipe), since the engine writes a record only once this process has
read every message numbered below it, and a message is sent only after every record numbered below it. A task
numbered up to the engine's task_abandoned word for this rank was read too late (the engine failed it here) and is
reported failed, not run (docs/design.md §4).
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time

import zmq

from ..config import CacheSpec, Settings
from ..errors import TransferError
from ..ipc import protocol
from ..ipc.barrier import BrokenBarrierError, phase_barrier, transfer_party
from ..ipc.done_ring import RingWriter, ring_name
from ..ipc.heartbeat import Heartbeat, process_alive
from ..ipc.layers import LayerPublisher
from ..ipc.manifest import manifest_worker, read_manifest
from ..ipc.naming import swap_space_name
from ..ipc.protocol import EXIT_ENGINE_GONE, EXIT_REASONS, EXIT_WORKER_GONE, EXIT_WORKER_REPLACED
from ..ipc.queue import SEQ, TO_ENGINE, TO_RANK, connect_client, signed, verified
from ..ipc.shm import SegmentError, SharedSegment
from ..ipc.signal import EVENTS_LAYERS, RESHARDING, DeploymentSignals
from ..ipc.task_ring import TaskRingReader
from ..ipc.task_ring import ring_name as task_ring_name
from ..ops import get_ops
from ..weight_spec import WeightSpec
from .fences import FenceWaits
from .l3 import StoreIO, store_task
from .reshard import ReshardRunner
from .scheduler import Scheduler, Task
from .weights import WeightGroup

log = logging.getLogger("fastcache.transfer")


class TransferManager:
    def __init__(self, spec: CacheSpec, rank: int, tp_size: int, suffix: str, socket_dir: str, incarnation: int,
                 engine_pid: int, device: str = "sim", device_id: int = 0, settings: Settings | None = None,
                 store: str | None = None, token: bytes = b"", weights: WeightSpec | None = None,
                 doorbell: int | None = None, task_doorbell: int | None = None):
        self.spec, self.rank, self.tp_size, self.suffix = spec, rank, tp_size, suffix
        self.engine_pid, self.device_id = engine_pid, device_id
        self.settings = settings or Settings.from_env()
        self.ops = get_ops(device)
        self.infos = spec.tensors(rank, device_id)
        self.signals = DeploymentSignals(suffix, tp_size)
        self.barrier = phase_barrier(suffix, tp_size)
        self.barrier.register(transfer_party(rank))
        self.context = zmq.Context()
        self.tasks, self.sock = connect_client(self.context, socket_dir, rank, incarnation)
        self.token = token                  # the deployment's: every message in and out is signed with it
        self.next_seq = 1                   # the engine numbers its messages to this process from 1
        self.abandoned_logged = 0           # the task_abandoned value last logged
        self.unsigned_dropped = 0
        self.done_pull = self.context.socket(zmq.PULL)
        self.done_pull.bind(f"inproc://done{rank}")
        self.doorbell, self.ring = doorbell, None       # the engine's eventfd, and this process's completion ring
        if doorbell is not None:
            self.ring = RingWriter(SharedSegment.attach(ring_name(suffix, rank, incarnation), suffix), token, rank,
                                   incarnation)
        self.task_doorbell, self.task_ring = task_doorbell, None    # this process's task ring and its doorbell
        if task_doorbell is not None:
            self.task_ring = TaskRingReader(SharedSegment.attach(task_ring_name(suffix, rank, incarnation), suffix),
                                            token, rank, incarnation)
        self.cache = self.swap = self.copier = None
        self.worker = 0                 # the worker_id of the worker whose tensors self.cache maps
        self.layer_events = None        # cuda: interprocess events per (task slot, layer), for workers' streams
        self.fences = FenceWaits(suffix, rank, device_id)       # cuda: swaps wait for the worker's fence events
        self.phase = "running"          # running | clearing | cleared | restoring | reshard_prepare | resharding
        if self.signals.status == RESHARDING:   # started (or restarted) during a reshard: wait for its steps
            self.phase = "resharding"
        self.restore_phase = "restore"  # the barrier "restoring" ends with: restore, reshard_commit or _abort
        self.reshard = ReshardRunner(self)
        self.release_swap = False
        self.scheduler = Scheduler()
        self.ready, self.dispatching = collections.deque(), False      # cleared, not yet handed over (_dispatch)
        self.weights = WeightGroup(weights, self) if weights is not None else None     # docs/design.md §11
        self.queues = {lane: queue.Queue() for lane in LANES}
        self.queued = {lane: 0 for lane in LANES}      # handed to the executor, not reported
        self.executing = {}                                           # task id -> task, for the reports
        self.outcomes = {}                                            # task id -> what an executor's run gave
        self.threads = [threading.Thread(target=self._execute, args=(lane,), daemon=True, name=lane)
                        for lane in LANES]
        self.heartbeat = Heartbeat(self.signals.transfer_heartbeat, rank, self.settings.heartbeat_interval,
                                   check=self._check_peers)
        self.fail_every = self.settings.injected_fault("fail_every", rank)      # fault-injection tests
        self.fail_attach = self.settings.injected_fault("fail_attach", rank)
        self.tasks_seen = self.attaches_tried = 0
        self.attach_error = None        # set when an attach failed; cleared by the next restore
        self.l3 = StoreIO(store, rank) if store else None      # L3 tasks (docs/design.md §8), one thread per direction
        self.stall = os.environ.get(TEST_STALL)        # tests only: a main loop that reads its tasks late

    # -- main loop -------------------------------------------------------------------------------
    def run(self) -> int:
        for t in self.threads:
            t.start()
        self.send("register", rank=self.rank, pid=os.getpid())
        poller = zmq.Poller()
        poller.register(self.tasks, zmq.POLLIN)
        poller.register(self.done_pull, zmq.POLLIN)
        if self.task_ring is not None:
            poller.register(self.task_doorbell, zmq.POLLIN)
        spin = self.settings.spin_us / 1e6 if self.task_ring is not None else 0.0
        self.heartbeat.start()
        busy = False        # the last spin saw work come: the poll below returns at once
        while True:
            if not busy and self.ring is not None:
                self.ring.publish()         # about to sleep: how many completion records were written
            # poll briefly only while something is about to become ready; a cleared cache just sleeps
            waiting = self.phase in ("clearing", "restoring") or \
                (self.phase == "running" and (self.cache is None or self.swap is None))
            events = dict(poller.poll(5 if waiting else IDLE_WAIT))
            if self.done_pull in events:
                self._drain_completions()
            if self.task_ring is not None and self.task_doorbell in events:
                try:
                    os.eventfd_read(self.task_doorbell)
                except BlockingIOError:
                    pass
            if self.tasks in events or self.task_ring is not None:     # the ring is read on every wake-up
                if self._drain_messages(pipe=self.tasks in events) == "stop":
                    return 0
            self._advance()
            busy = bool(spin and events and self.phase == "running" and self.copier is not None   # not when idle
                        and self._spin(spin))

    def _spin(self, seconds) -> bool:
        """Stay awake up to `seconds` for what comes next (a record in the task ring, a message on the pipe, an
        executor's completion), yielding the core between looks: the engine's doorbell then wakes nobody, which on
        a VM costs the engine more than the task's copy. True if something came."""
        ring, tasks, done = self.task_ring, self.tasks, self.done_pull
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            if ring.pending() or tasks.getsockopt(EVENTS) & POLLIN or done.getsockopt(EVENTS) & POLLIN:
                return True
            os.sched_yield()
        return False

    def _check_peers(self):
        """Runs on the heartbeat thread: exit (once, logged) when the engine or the worker is gone.
        The process owns no shared object (the engine and the worker do), so a hard exit leaks nothing."""
        code = 0
        if not process_alive(self.engine_pid):
            code = EXIT_ENGINE_GONE
        elif self.cache is not None and self._worker_replaced():
            # its tensors are no rank's any more (and on cuda this mapping holds the old worker's memory): a new
            # process attaches the new worker's (restart_rank)
            code = EXIT_WORKER_REPLACED
        elif self.cache is not None and self._worker_silent():
            code = EXIT_WORKER_GONE
        if code:
            log.error("rank %d: %s; exiting", self.rank, EXIT_REASONS[code])
            logging.shutdown()
            os._exit(code)

    def _worker_silent(self) -> bool:
        """The rank's worker has not beaten for the worker timeout: it died (a fresh one has not beaten yet: 0), and
        what it exported is no rank's (restart_rank after a worker died must not attach it)."""
        beat = float(self.signals.worker_heartbeat[self.rank])
        return bool(beat) and time.time() - beat > self.settings.worker_timeout

    def _worker_replaced(self) -> bool:
        """Another worker has taken this rank since this process attached the tensors it maps."""
        return int(self.signals.worker_id[self.rank]) != self.worker

    def _advance(self):
        """Attach what became ready, and move clear/restore along once its preconditions hold."""
        if self.reshard.advance():
            return
        if self.phase in ("running", "restoring"):
            self._try_attach()
        if self.phase == "clearing" and not self.scheduler:
            self.detach()
            self.pass_phase_barrier("clear", next_phase="cleared")
        elif self.phase == "restoring" and self.cache is not None and self.swap is not None and \
                (self.weights is None or self.weights.attached):
            self.pass_phase_barrier(self.restore_phase, next_phase="running")

    def pass_phase_barrier(self, phase, next_phase):
        try:
            self.barrier.wait(transfer_party(self.rank), self.settings.phase_timeout)
        except BrokenBarrierError as exc:
            log.error("rank %d: %s barrier broke: %s", self.rank, phase, exc)
            self.phase = {"restore": "running", "clear": "cleared"}.get(phase, "resharding")
            self.send("phase_failed", phase=phase, rank=self.rank, error=str(exc))
            return
        self.phase = next_phase
        self.send("phase_done", phase=phase, rank=self.rank, copy_seconds=0.0, weights_seconds=0.0)
        if phase in ("restore", "reshard_commit", "reshard_abort"):
            self.send("phase_done", phase="attach", rank=self.rank, copy_seconds=0.0, weights_seconds=0.0)

    # -- attach / detach -------------------------------------------------------------------------
    def _try_attach(self):
        """Attach what became ready. A device failure (CUDA IPC open, NVRTC, pinning: TransferError) fails
        the attach, reported to the engine by name, and the process stays up for a restart or a retry."""
        if self.attach_error is not None:
            return
        try:
            self._attach()
        except TransferError as exc:
            self._detach_cache()
            self.attach_error = str(exc)[:protocol.MAX_ERROR_CHARS]
            log.error("rank %d: attach failed: %s", self.rank, self.attach_error)
            self.send("phase_failed", phase="attach", rank=self.rank, error=self.attach_error)
            if self.phase == "restoring":      # break the restore barrier now instead of letting it time out
                self.barrier.abort(transfer_party(self.rank))
                self.phase = "running"

    def _attach(self):
        if self.weights is not None:
            self.weights.attach()
        if self.swap is None:
            try:
                seg = SharedSegment.attach(swap_space_name(self.suffix, self.rank), self.suffix)
            except SegmentError:
                return
            try:
                self.swap = self.ops.attach_swap_space(seg, self.spec, self.device_id)
            except BaseException:
                seg.close()
                raise
            self.signals.swap_space_ready[self.rank] = 1
        if self.cache is None and self.signals.cache_ready[self.rank] == 1 and not self._worker_silent():
            began = time.perf_counter()
            with self.swap.paused():        # cuda: pinning the tier would hold these calls up chunk by chunk
                try:
                    manifest = read_manifest(self.suffix, self.rank)
                    worker = manifest_worker(manifest)
                    if worker != int(self.signals.worker_id[self.rank]):
                        # a worker that left (killed) wrote it, and the one that took the rank has not exported
                        raise ValueError("the manifest is an earlier worker's")
                    self.worker = worker
                    self.cache = self.ops.attach(manifest, self.infos, self.suffix)
                except (SegmentError, ValueError) as exc:
                    log.debug("rank %d: cache not attachable yet: %s", self.rank, exc)
                    return
                self.attaches_tried += 1
                if self.attaches_tried == self.fail_attach:
                    raise TransferError(f"injected attach fault (FASTCACHE_FAIL_ATTACH) on attach {self.attaches_tried}")
                self.copier = self.ops.copier(self.cache, self.swap, self.spec)
                self._export_layer_events()
            log.info("rank %d: attached %d tensors in %.3f s", self.rank, len(self.infos), time.perf_counter() - began)
            if self.phase == "running":
                self.send("phase_done", phase="attach", rank=self.rank, copy_seconds=0.0, weights_seconds=0.0)

    def _export_layer_events(self):
        """cuda: the events layer-by-layer swap-ins record per layer, exported once for this process's life
        (workers open them once). Where the driver refuses interprocess events, workers' stream waits fall
        back to host waits (ipc_events stays 0)."""
        if self.ops.name != "cuda" or (self.layer_events is not None and
                                       self.layer_events.layers == self.spec.total_layers):
            return
        from ..ops.cuda_events import SlotEvents
        self._close_layer_events()
        try:
            self.layer_events = SlotEvents(self.spec.total_layers, self.device_id, self.signals, self.rank,
                                           EVENTS_LAYERS, "layers", self.suffix)
        except TransferError as exc:
            log.warning("rank %d: no interprocess events (%s); workers wait for layers on the host", self.rank, exc)

    def _close_layer_events(self):
        events, self.layer_events = self.layer_events, None
        if events is not None:
            events.close()

    def _detach_cache(self):
        copier, cache, self.copier, self.cache = self.copier, self.cache, None, None
        if copier is not None:
            copier.close()
        if cache is not None:
            cache.close()

    def detach(self):
        self._detach_cache()
        if self.weights is not None and self.signals.sleep_level[0]:     # a sleep: the worker frees its weights
            self.weights.detach()
        if self.release_swap and self.swap is not None:
            if self.l3 is not None:
                self.l3.detach()
            self.swap.close()
            self.swap = None
            self.signals.swap_space_ready[self.rank] = 0

    # -- messages --------------------------------------------------------------------------------
    def _drain_messages(self, pipe: bool = True):
        """Take what the task pipe (if poll said it holds something: an empty pipe's recv costs more than a record)
        and then the task ring hold, in number order (see the module docstring). A message the pipe takes after
        the poll is numbered above every record in the ring (the engine writes one only once this process has
        read every message sent before), so it waits for the next wake-up."""
        if self.stall:
            stalled(self.stall)
        ring = self.task_ring
        head = ring.head() if ring is not None else None       # before the pipe: see _lost_below
        received = []
        while pipe or ring is None:
            try:
                frames = self.tasks.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            message = self._authentic(frames)
            if message is not None:
                received.append(message)
                if ring is None and self._take(message) == "stop":
                    return "stop"
        if ring is None:
            return None
        records, bad, malformed = ring.read(head)
        for first, last in protocol.runs(bad):
            log.warning("rank %d: task ring records %d..%d failed authentication or were destroyed (another process "
                        "wrote to the ring); their tasks are lost", self.rank, first, last)
            self.send("ring_bad", rank=self.rank, first=first, last=last)
        for error in malformed:
            self.send("error", error=error[:protocol.MAX_ERROR_CHARS])
        if records:         # the ring's records are in number order already
            received = sorted(received + records, key=lambda message: message[0]) if received else records
        for message in received:
            if self._take(message) == "stop":
                return "stop"
        self._lost_below(head[1] + 1)
        return None

    def _take(self, message):
        """Act on a message (seq, frames) or a ring record (seq, header, ids) in its turn."""
        seq = message[0]
        if seq < self.next_seq:
            return None                     # replayed: a signed message is read once
        self._lost_below(seq)
        self.next_seq = seq + 1
        # the engine raises task_abandoned before it fails tasks not received, then looks at task_received again:
        # the word is read after this store, so a task is either seen received there or seen abandoned here
        self.signals.task_received[self.rank] = seq
        if len(message) == 3:
            if seq <= self.signals.task_abandoned[self.rank]:
                return self._abandoned(message[1]["task_id"], seq)
            return self._on_task(message[1], message[2])
        try:
            header, ids = protocol.decode(message[1])
        except protocol.ProtocolError as exc:
            log.warning("rank %d: malformed message: %s", self.rank, exc)
            self.send("error", error=str(exc)[:protocol.MAX_ERROR_CHARS])
            return None
        if header["type"] in ("task", "store_task") and seq <= self.signals.task_abandoned[self.rank]:
            return self._abandoned(header["task_id"], seq)
        return self._on_message(header, ids)

    def _abandoned(self, task_id, seq):
        """A task read after the engine gave up waiting for it (this loop was held up past the transfer timeout):
        the engine failed it here, and its blocks may be the user's again, so it is not run. Reported failed, for
        a handle the engine left waiting (it looked at task_received before this process had read the task)."""
        if seq > self.abandoned_logged:
            self.abandoned_logged = int(self.signals.task_abandoned[self.rank])
            log.warning("rank %d: messages up to %d were read after the engine gave up waiting for them "
                        "(FASTCACHE_TRANSFER_TIMEOUT); their tasks are not run", self.rank, self.abandoned_logged)
        self.send("failed", task_id=task_id, rank=self.rank,
                  error=f"the transfer manager read the task only after the engine had given up waiting for it "
                        f"({self.settings.transfer_timeout:g} s): not run")

    def _lost_below(self, seq):
        """Messages from the next expected number to seq - 1 never arrived (another process took them off this
        rank's pipe, or wrote over their records in its ring): the engine is told, and fails their tasks."""
        if seq > self.next_seq:
            log.warning("rank %d: messages %d..%d never arrived: another process is reading this rank's task "
                        "pipe or writing to its task ring", self.rank, self.next_seq, seq - 1)
            self.send("lost", rank=self.rank, first=self.next_seq, last=seq - 1)
            self.next_seq = seq

    def _on_message(self, header, ids):
        """A message from the task pipe, decoded, in its turn."""
        kind = header["type"]
        if kind == "task":
            self._on_task(header, ids)
        elif kind == "clear":
            self.phase, self.release_swap = "clearing", header["release_swap_space"]
        elif kind == "restore":
            self.phase, self.attach_error = "restoring", None     # a retried restore attaches afresh
            self.restore_phase = "restore"
        elif kind == "store_task":
            self._on_store_task(header, ids)
        elif kind == "reshard":
            self.reshard.on_message(header, ids)
        elif kind == "stop":
            return "stop"
        elif kind == "ping":
            pass            # numbered only: its number shows a gap before it (_take)
        elif kind == "resend":
            self._resend(header["first"], header["last"])
        else:
            self.send("error", error=f"unexpected message type {kind!r} for a transfer manager")

    def _authentic(self, frames):
        """(number, frames) of the message if the engine signed and numbered it, else None (dropped)."""
        body = verified(self.token, TO_RANK, frames)
        if body is None or len(body) < 2 or len(body[0]) != SEQ.size:
            self.unsigned_dropped += 1
            if self.unsigned_dropped == 1:
                log.warning("rank %d: a message not signed by this deployment's engine was dropped", self.rank)
            return None
        return SEQ.unpack(body[0])[0], body[1:]

    def _on_task(self, header, ids):
        task_id = header["task_id"]
        try:
            if header["group"] == protocol.WEIGHTS:     # a sleep's or a wake's copy runs outside "running"
                if self.weights is None:
                    raise ValueError(f"rank {self.rank} serves no weights (SwapBackend(weights=...) was not given)")
                self.weights.check(header["kind"], ids[0], ids[1], header["ring"])
            elif self.phase != "running" or self.copier is None:
                raise ValueError(f"rank {self.rank} has no cache attached (phase {self.phase})")
            else:
                protocol.check_ids(ids[0], ids[1], header["kind"], self.spec.num_gpu_blocks, self.spec.num_cpu_blocks)
        except ValueError as exc:
            self.send("failed", task_id=task_id, rank=self.rank, error=str(exc))
            return
        fence = next((f for f in header["fence"] if f.rank == self.rank), None) if header["fence"] else None
        self._dispatch(self.scheduler.add(Task(task_id, header["kind"], ids[0], ids[1], header["layerwise"],
                                               header["group"], header["ring"], fence)))

    def _on_store_task(self, header, ids):
        task_id = header["task_id"]
        try:
            if self.l3 is None:
                raise ValueError(f"rank {self.rank} has no store (SwapBackend(store=...) was not given)")
            if self.phase != "running" or self.swap is None:
                raise ValueError(f"rank {self.rank} has no CPU tier attached (phase {self.phase})")
            protocol.check_ids(ids[1], ids[1], protocol.SWAP_TO_CPU, self.spec.num_cpu_blocks, self.spec.num_cpu_blocks)
        except ValueError as exc:
            self.send("failed", task_id=task_id, rank=self.rank, error=str(exc))
            return
        self._dispatch(self.scheduler.add(store_task(header, *ids)))

    def _dispatch(self, tasks):
        """Hand tasks the scheduler cleared to their lanes, in the order it cleared them: it lets a task follow a
        conflicting one of its direction once that one is cleared, so a task cleared while an earlier one is
        handed over (by a small task's completion, below) waits for it. Small tasks on an idle direction run
        right here: a thread hand-off costs more than their copy."""
        ready = self.ready
        ready.extend(tasks)
        if self.dispatching:
            return
        self.dispatching = True
        try:
            while ready:
                task = ready.popleft()
                lane = lane_of(task)
                if self.queued[lane] == 0 and lane in protocol.TASK_KINDS and \
                        self.spec.task_bytes(task.gpu_ids) <= self.settings.inline_bytes:
                    self._finished(task, self._run(task))
                else:
                    self.queued[lane] += 1
                    self.queues[lane].put(task)
        finally:
            self.dispatching = False

    def _finished(self, task, outcome):
        """Report a task's outcome ((error or None, bytes, puts skipped, seconds)) and start what waited for it."""
        error, nbytes, skipped, seconds = outcome
        if error is not None:
            self.send("failed", task_id=task.task_id, rank=self.rank, error=error)
        elif self.ring is not None and self.ring.write(task.task_id, nbytes, skipped, seconds):
            os.eventfd_write(self.doorbell, 1)
        else:
            self.send("done", task_id=task.task_id, rank=self.rank, nbytes=nbytes, skipped=skipped, seconds=seconds)
        self._dispatch(self.scheduler.complete(task.task_id))

    def _resend(self, first, last):
        """The engine found completion records first..last bad (another process wrote to the ring): the same
        reports again, over the reply socket."""
        log.warning("rank %d: the engine could not read completion records %d..%d (another process wrote to the "
                    "ring); sending them again", self.rank, first, last)
        for task_id, nbytes, skipped, seconds in self.ring.again(first, last) if self.ring is not None else ():
            self.send("done", task_id=task_id, rank=self.rank, nbytes=nbytes, skipped=skipped, seconds=seconds)

    def _drain_completions(self):
        while True:
            try:
                frames = self.done_pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            task_id = int(frames[0])
            task = self.executing.pop(task_id)
            self.queued[lane_of(task)] -= 1
            self._finished(task, self.outcomes.pop(task_id))

    def send(self, type_, **fields):
        self.sock.send_multipart(signed(self.token, TO_ENGINE, protocol.encode(type_, **fields)))

    # -- executors (one thread per direction) ----------------------------------------------------
    def _execute(self, lane):
        push = self.context.socket(zmq.PUSH)
        push.connect(f"inproc://done{self.rank}")
        while True:
            task = self.queues[lane].get()
            if task is None:
                push.close(0)
                return
            self.executing[task.task_id] = task
            self.outcomes[task.task_id] = self._run(task)
            push.send(b"%d" % task.task_id)

    def _run(self, task) -> tuple:
        """Execute one task; returns (error or None, bytes, puts skipped, seconds). A failed copy fails its task,
        never the process."""
        start = time.perf_counter()
        try:
            if task.group != protocol.WEIGHTS and task.kind in protocol.TASK_KINDS and self._worker_replaced():
                # the tensors mapped here are a gone worker's: a copy would be reported done, its bytes lost
                raise TransferError(f"rank {self.rank}: another worker took the rank after this transfer manager "
                                    f"attached its cache (restart_rank attaches the new one's)")
            self._maybe_fail(task)
            if task.group == protocol.WEIGHTS:
                self.weights.run(task)
            elif task.kind == protocol.SWAP_TO_CPU:
                gated()
                self.copier.swap_out(task.gpu_ids, task.cpu_ids, first=self._fenced(task))
            elif task.kind == protocol.SWAP_TO_GPU and task.layerwise:
                self._swap_in_layers(task, first=self._fenced(task))
            elif task.kind == protocol.SWAP_TO_GPU:
                self.copier.swap_in(task.gpu_ids, task.cpu_ids, first=self._fenced(task))
            else:
                nbytes, skipped = self.l3.run(task, self.swap.blocks, self.spec, self.tp_size)
        except Exception as exc:
            log.error("rank %d: task %d failed: %s", self.rank, task.task_id, exc)
            return f"{type(exc).__name__}: {exc}"[:protocol.MAX_ERROR_CHARS], 0, 0, 0.0
        if task.kind in protocol.TASK_KINDS:
            group = self.weights.layout if task.group == protocol.WEIGHTS else self.spec
            nbytes, skipped = group.task_bytes(task.gpu_ids), 0
        return None, nbytes, skipped, time.perf_counter() - start

    def _fenced(self, task):
        """The copier's `first` for a task with a fence on this rank (cuda; docs/design.md §4), else None."""
        return self.fences.first(task.fence) if task.fence is not None and self.ops.name == "cuda" else None

    def _swap_in_layers(self, task, first=None):
        layers = LayerPublisher(self.signals.layer_ready, self.rank, task.task_id)
        try:
            if self.layer_events is None:
                self.copier.swap_in_layers(task.gpu_ids, task.cpu_ids, self.spec.total_layers,
                                           paced(layers.published), first=first)
            else:           # cuda: each layer's event recorded after its copies, for workers' streams
                self.copier.swap_in_layers(task.gpu_ids, task.cpu_ids, self.spec.total_layers,
                                           paced(layers.published), events=self.layer_events.slot(task.task_id),
                                           recorded=layers.recorded, first=first)
        except BaseException:
            layers.failed()         # every waiter on this rank raises at once, host and stream alike
            raise

    def _maybe_fail(self, task):
        self.tasks_seen += 1
        if self.fail_every and self.tasks_seen % self.fail_every == 0:
            raise RuntimeError(f"injected fault (FASTCACHE_FAIL_EVERY) on task {task.task_id}")

    def close(self):
        self.heartbeat.stop()
        for lane, thread in zip(LANES, self.threads):
            self.queues[lane].put(None)
            if thread.ident is not None:        # started (run() was called)
                thread.join(timeout=5)
        self.release_swap = True
        self.detach()
        if self.weights is not None:
            self.weights.detach(region=True)
        self._close_layer_events()
        self.fences.close()
        self.ops.release_device(self.device_id)     # after every CUDA object of this process is gone
        if self.l3 is not None:
            self.l3.close()
        self.sock.close(0)
        self.tasks.close(0)
        self.done_pull.close(0)
        self.context.term()
        if self.ring is not None:
            self.ring.close()
        if self.task_ring is not None:
            self.task_ring.close()
        self.barrier.close()
        self.signals.close()


EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)     # plain ints: the flag enums cost more than the look
IDLE_WAIT = 1000      # ms: an idle process's sleep, the longest a task whose doorbell was lost waits for a wake-up

# one executor thread per direction, and one for the weight group: a stream waits for the forward, and must
# not hold up the cache's swaps meanwhile
WEIGHTS_LANE = "WEIGHTS"
LANES = protocol.ALL_KINDS + (WEIGHTS_LANE,)


def lane_of(task) -> str:
    return WEIGHTS_LANE if task.group == protocol.WEIGHTS else task.kind


TEST_LAYER_PACE = "FASTCACHE_TEST_LAYER_PACE"     # SECONDS, tests only: a pause after each published layer


def paced(published):
    """published, followed by a pause in tests: a layer published before its copy would then be seen early."""
    try:
        seconds = float(os.environ.get(TEST_LAYER_PACE, ""))
    except ValueError:
        return published

    def slow(layer):
        published(layer)
        time.sleep(seconds)
    return slow


TEST_SWAP_OUT_GATE = "FASTCACHE_TEST_SWAP_OUT_GATE"     # PATH, tests only: a swap-out starts once the file exists


def gated():
    """In tests: hold a swap-out until the test opens the gate, so that tasks behind it are held for sure."""
    path = os.environ.get(TEST_SWAP_OUT_GATE)
    while path and not os.path.exists(path):
        time.sleep(0.001)


TEST_STALL = "FASTCACHE_TEST_STALL"     # PATH, tests only: while the file exists, the main loop reads no task


def stalled(path):
    """In tests: a main loop held up (its heartbeat thread beats on) until the test removes the file."""
    while os.path.exists(path):
        time.sleep(0.001)
