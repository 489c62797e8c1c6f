"""SwapBackend's task channel (docs/design.md §4): the submitting thread writes each task or command to the
ranks' task pipes (under a lock, in submission order); one I/O thread reads the replies, completes the
handles rank by rank, records phase acknowledgements, and calls supervision every 100 ms.

The reports of tasks done come through each process's completion ring (ipc/done_ring.py), which the channel
creates beside its task pipe; each process rings its rank's doorbell (engine/doorbells.py: an eventfd inherited
at spawn). The I/O thread sleeps on the doorbells in an epoll set beside the reply socket; a thread waiting in a
handle's result() takes them out of that set and reads the rings itself (wait), so a waited-for task wakes the
thread that needs it and not the I/O thread too. Whoever reads, reads on every wake-up (a lost doorbell costs at
most the 100 ms bound), one thread at a time, and the I/O thread again before each reply it takes off the
socket, so that a report a rank put in its ring before a reply is taken before that reply (a task's done before
its rank's phase report). Records the rings show bad (another process wrote to the segment) are asked for again
over the rank's pipe (`resend`).

A small swap task goes to each rank through its process's task ring instead (ipc/task_ring.py: a record in
shared memory and that process's doorbell, written by the submitting thread), numbered with the pipe's
messages; what does not fit, and whatever comes while the ring is full or the rank has not read its pipe's
messages yet, goes by pipe. The I/O thread publishes the rings' signed counts on its 100 ms tick.

TaskChannel is a part SwapBackend owns, the one owner of the pipes and what travels on them: the zmq context,
the reply socket and each rank's task socket, the submit lock, the numbers sent and the tasks not yet received,
the handles in flight, the ranks' phase reports and the phase command being watched, and the I/O thread. The
ranks' processes are the rank supervisor's (engine/ranks.py), reached through its public methods: replies are
accepted only from the process it spawned for a rank; it asks the channel for a new process's task pipe
(open_pipe), to fail a rank's tasks (fail_rank_tasks) and to wake the phases (wake). A reshard grows, shrinks
and retires the task pipes through add_pipes, drop_pipe and keep_pipes (BackendReshardHost, reshard_host.py).

A phase command that another process takes off a rank's task pipe would leave the phase waiting for its
whole timeout: until each rank has read it, the I/O thread sends that rank a numbered no-op (`ping`) every
PING_AFTER seconds, so the rank soon sees the gap in the numbers and reports it (`lost`), and the engine
breaks the phase barrier at once, naming the pipe (docs/design.md §12).
"""
from __future__ import annotations

import logging
import select
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq

from ..ipc import protocol
from ..ipc.barrier import transfer_party
from ..ipc.done_ring import RING_BYTES, RingReader, ring_name
from ..ipc.shm import SharedSegment
from ..ipc.task_ring import TaskRingWriter, inline
from ..ipc.queue import SEQ, TO_ENGINE, TO_RANK, bind_replies, bind_tasks, identity_rank, signed, verified
from . import doorbells
from .doorbells import Doorbells

log = logging.getLogger("fastcache.engine")

PIPE_TIMEOUT = 2.0        # seconds a command waits for a registered transfer manager's task pipe
PING_AFTER = 0.1          # seconds a phase command may stay unread before its rank is sent a no-op behind it
MAX_PINGS = 100           # per phase command: the phase's own timeout covers a rank that reads nothing at all
EXIT_LOOK = 0.001         # seconds between send_all's looks at a process that has not read its tasks
# seconds between raising a rank's task_abandoned and looking again at what it read: its store of task_received,
# made before it looks at the word, is visible by then (a store buffer drains in nanoseconds); failure path only
ABANDON_PAUSE = 0.002


@dataclass
class PhaseCommand:
    """A phase command on its way: the number it carries on each rank's pipe, and what became of it."""
    phase: str
    seqs: dict                          # rank -> the command's message number
    sent: float
    read: set = field(default_factory=set)
    lost: list = field(default_factory=list)    # ranks that reported it taken off their pipe
    pings: int = 0
    last_ping: float = 0.0


class TaskChannel:
    """The engine's pipes to its transfer managers and the I/O thread that reads their replies.

    token signs every message; settings gives the transfer timeout; signals() and barrier() are the deployment's
    (made at start); ranks is the RankSupervisor; closed() says the deployment is closing (supervision stops)."""

    def __init__(self, token: bytes, settings, signals: Callable, barrier: Callable, ranks, closed: Callable[[], bool]):
        self._token, self._settings = token, settings
        self._signals, self._barrier, self._ranks, self._closed = signals, barrier, ranks, closed
        self.replies_read = 0       # messages the I/O thread has taken off the reply socket, dropped ones included
        self._submit_lock = threading.Lock()        # the task sockets (zmq's are not thread-safe), numbers, order
        self._handles: dict = {}                    # task id -> TransferHandle of the tasks in flight
        self._handles_lock = threading.Lock()
        self._failed_all: str | None = None         # why fail_pending failed every task (close): later ones fail too
        self._phase_cond = threading.Condition()    # the phase reports; woken by each and by a rank's failure
        self._phase_acks: dict[str, dict[int, str | None]] = {}
        self._copy_seconds: dict[int, tuple] = {}   # rank -> its last reshard move's (copy, weights) seconds
        self._phase_command: PhaseCommand | None = None     # the phase command being watched
        self._sent_seq: dict[int, int] = {}         # rank -> number of the last message sent to its process
        self._unreceived: dict[int, dict[int, tuple]] = {}    # rank -> seq -> (handle, sent at) of tasks
        self._warned: set = set()
        self._context = self._router = self._io_thread = None
        self._task_pushes: list = []                # bound by open_pipe, one socket per process
        self._rings: dict[int, RingReader] = {}     # rank -> its process's completion ring (made by open_pipe)
        self._rings_lock = threading.Lock()         # open_pipe and the retiring calls against the I/O thread's reads
        self._epoll = None                          # the I/O thread's: the reply socket, the doorbells (unless a waiter has them)
        self.doorbells = None                       # the completion rings' (engine/doorbells.py)
        self._reading = threading.RLock()           # one thread at a time reads the completion rings and completes
        self._task_rings: dict[int, TaskRingWriter] = {}    # rank -> its process's task ring (open_pipe), if on
        self._pipe_seq: dict[int, int] = {}         # rank -> number of the last message sent on its task pipe
        self._exit_looked: dict[int, float] = {}    # rank -> when send_all last looked whether its process exited
        self._io_stop = threading.Event()

    # -- start and close ---------------------------------------------------------------------------
    def start(self, socket_dir: str, tp: int, suffix: str):
        """Bind the reply socket in socket_dir, room for tp task pipes, the doorbell, and start the I/O thread;
        suffix names the completion rings."""
        self._socket_dir, self._suffix = socket_dir, suffix
        self._context = zmq.Context()
        self._router = bind_replies(self._context, socket_dir)
        self._epoll = select.epoll()
        self._epoll.register(self._router.getsockopt(zmq.FD), select.EPOLLIN)
        self.doorbells = Doorbells(self._epoll)
        self._task_pushes = [None] * tp
        self._io_thread = threading.Thread(target=self._serve, name="fastcache-engine-io", daemon=True)
        self._io_thread.start()

    @property
    def serving(self) -> bool:
        """The I/O thread was started (close stops it)."""
        return self._io_thread is not None

    def close(self, why: str):
        """Stop the I/O thread, fail every task still in flight with why, close the sockets."""
        if self._io_thread is not None:
            self._io_stop.set()
            self._io_thread.join()
        self.fail_pending(why)
        if self.doorbells is not None:
            with self.doorbells.owner:      # a waiter reading the rings has left (fail_pending woke it)
                epoll, self._epoll = self._epoll, None
            self.doorbells.close()
            epoll.close()
        with self._submit_lock:     # a thread submitting (a task or a phase's command) may be sending on them
            pushes, self._task_pushes = self._task_pushes, [None] * len(self._task_pushes)
        for sock in [self._router] + pushes:
            if sock is not None:
                sock.close(0)
        if self._context is not None:
            self._context.term()
        with self._rings_lock:
            rings, self._rings = list(self._rings.values()), {}
        for ring in rings:
            ring.close()
        with self._submit_lock:
            task_rings, self._task_rings = list(self._task_rings.values()), {}
        for ring in task_rings:
            ring.close()

    # -- the task pipes ----------------------------------------------------------------------------
    def open_pipe(self, rank, incarnation) -> dict:
        """A new process for rank (the rank supervisor's spawn): its own task socket, bound here, its own
        completion ring and (unless FASTCACHE_TASK_RING=0) its own task ring; from now on nothing sent for rank
        can reach an earlier process's pipe or ring, nothing an earlier process writes is read, and the numbers
        start again from 1. Returns the descriptors the process inherits, by the option that names each (the
        doorbells)."""
        segment = SharedSegment.create(ring_name(self._suffix, rank, incarnation), RING_BYTES, self._suffix)
        self._replace_ring(rank, RingReader(segment, self._token, rank, incarnation))
        task_ring = TaskRingWriter.create(self._suffix, self._token, rank, incarnation) \
            if getattr(self._settings, "task_ring", True) else None
        with self._submit_lock:
            old, self._task_pushes[rank] = self._task_pushes[rank], bind_tasks(
                self._context, self._socket_dir, rank, incarnation)
            if old is not None:
                old.close(0)
            old_ring = self._task_rings.pop(rank, None)
            if task_ring is not None:
                self._task_rings[rank] = task_ring
            self._sent_seq[rank], self._pipe_seq[rank], self._unreceived[rank] = 0, 0, {}
            signals = self._signals()
            signals.task_received[rank] = signals.task_abandoned[rank] = 0
        if old_ring is not None:
            old_ring.close()
        inherited = {"--doorbell_fd": self.doorbells.of(rank)}
        if task_ring is not None:
            inherited["--task_doorbell_fd"] = task_ring.bell
        return inherited

    def _replace_ring(self, rank, ring):
        with self._rings_lock:
            old = self._rings.pop(rank, None)
            if ring is not None:
                self._rings[rank] = ring
        if old is not None:
            old.close()

    def add_pipes(self, tp):
        """Room for the task pipes of ranks up to tp (a scale-out's new ones, bound by open_pipe)."""
        with self._submit_lock:
            self._task_pushes = self._task_pushes + [None] * (tp - len(self._task_pushes))

    def has_pipe(self, rank) -> bool:
        pushes = self._task_pushes
        return rank < len(pushes) and pushes[rank] is not None

    def drop_pipe(self, rank):
        """A retired rank's task pipe, task ring and completion ring go."""
        with self._submit_lock:
            push, self._task_pushes[rank] = self._task_pushes[rank], None
            if push is not None:
                push.close(0)
            task_ring = self._task_rings.pop(rank, None)
        if task_ring is not None:
            task_ring.close()
        self._replace_ring(rank, None)

    def keep_pipes(self, tp):
        """The pipes of ranks below tp only (the others were dropped)."""
        with self._submit_lock:
            self._task_pushes = self._task_pushes[:tp]
            task_rings = [self._task_rings.pop(r) for r in list(self._task_rings) if r >= tp]
        for ring in task_rings:
            ring.close()
        for rank in [r for r in list(self._rings) if r >= tp]:
            self._replace_ring(rank, None)

    # -- tasks in flight ---------------------------------------------------------------------------
    def send_task(self, handle, message):
        """Send a task to every rank its handle waits for, the handle in flight until every rank has answered."""
        handle.reader = self
        with self._handles_lock:
            why = self._failed_all
            if why is None:
                self._handles[handle.task_id] = handle
        if why is not None:     # submitted as close ran: nothing would answer it, nor wake its waiter
            for rank in handle.pending_ranks():
                handle.rank_finished(rank, why, lost=True)
            return handle
        self.send_all(message, handle)
        return handle

    def pending_handles(self) -> list:
        with self._handles_lock:
            return list(self._handles.values())

    def fail_rank_tasks(self, rank, why):
        """Every task still waiting for rank fails there (the rank supervisor took it out of service)."""
        handles = self.pending_handles()
        for handle in handles:
            handle.rank_finished(rank, why, lost=True)
        self._forget_done(handles)

    def fail_pending(self, why):
        """Fail every task in flight, and every task sent from now on, with why (close)."""
        with self._handles_lock:
            handles, self._handles = list(self._handles.values()), {}
            self._failed_all = why
        for handle in handles:
            for rank in handle.pending_ranks():
                handle.rank_finished(rank, why, lost=True)

    def _forget_done(self, handles):
        with self._handles_lock:
            for handle in handles:
                if handle.done():
                    self._handles.pop(handle.task_id, None)

    # -- phase reports ------------------------------------------------------------------------------
    def wake(self):
        """Whoever waits on the ranks' reports looks again (a rank failed)."""
        with self._phase_cond:
            self._phase_cond.notify_all()

    def expect_reports(self, phase, copies: bool = False):
        """Collect the ranks' reports of `phase` from now on (before it is sent: a fast report is kept); copies:
        forget the copy seconds of earlier moves too."""
        with self._phase_cond:
            self._phase_acks[phase] = {}
            if copies:
                self._copy_seconds.clear()

    def collect_reports(self, phase, done: Callable[[dict], bool], timeout: float) -> tuple[bool, dict, dict]:
        """Until done(reports so far) or the timeout: whether done held, the reports ({rank: error or None})
        and the ranks' copy seconds; stops collecting `phase`."""
        with self._phase_cond:
            acks = self._phase_acks.get(phase, {})
            ok = self._phase_cond.wait_for(lambda: done(acks), max(0.0, timeout))
            got, copies = dict(acks), dict(self._copy_seconds)
            self._phase_acks.pop(phase, None)
        return ok, got, copies

    def _watch_unreceived(self):
        """A task its transfer manager has not read within the transfer timeout fails on that rank (another
        process of the user took it off the pipe, the pipe is gone, or the manager's loop is held up while its
        heartbeat thread beats on); so do tasks the rank reports lost. A held-up manager may read such a task
        later, when its blocks are the user's again: the rank's task_abandoned word, raised first, tells it not to
        run it. A task the manager reads before it can see the word is its own to run or refuse (it reports
        either way): so after ABANDON_PAUSE, only the tasks still unread fail."""
        now, limit = time.monotonic(), self._settings.transfer_timeout
        wall = time.time()
        late = []
        signals = self._signals()
        with self._submit_lock:
            for ring in self._task_rings.values():      # what a reader needs to tell a destroyed record
                ring.publish()
            for rank, pending in self._unreceived.items():
                if rank >= len(signals.task_received):
                    continue
                received = int(signals.task_received[rank])
                beating = wall - float(signals.transfer_heartbeat[rank]) < limit
                seqs = []
                for seq, (handle, sent) in list(pending.items()):
                    if not handle.waits_for(rank):
                        del pending[seq]
                    elif seq > received and now - sent > limit and beating:     # a silent one: heartbeats
                        seqs.append(seq)
                if seqs:        # under the lock: open_pipe sets the word back to 0 for a new process
                    signals.task_abandoned[rank] = max(int(signals.task_abandoned[rank]), max(seqs))
                    late.append((rank, pending, seqs))
        if not late:
            return
        time.sleep(ABANDON_PAUSE)
        failed = []
        with self._submit_lock:
            for rank, pending, seqs in late:
                if self._unreceived.get(rank) is not pending:   # a new process: restart_rank failed these
                    continue
                received = int(signals.task_received[rank])
                failed += [(pending.pop(seq)[0], rank) for seq in seqs if seq > received and seq in pending]
        for handle, rank in failed:
            self._finish(handle, rank, f"its transfer manager did not receive the task within {limit:g} s "
                                       f"(another process reading rank {rank}'s task pipe, or its loop held up?); "
                                       f"it will not run it if it reads it later")

    def _lost_messages(self, rank, first, last):
        with self._submit_lock:
            pending = self._unreceived.get(rank, {})
            lost = [(seq, pending.pop(seq)[0]) for seq in range(first, last + 1) if seq in pending]
            ring = self._task_rings.get(rank)
            in_ring = ring.holds(first, last) if ring is not None else set()
        if len(in_ring) < len(lost):
            self._warn_once(("lost", rank), f"rank {rank}: messages {first}..{last} never reached its transfer "
                                            f"manager: another process is reading its task pipe")
        for seq, handle in lost:
            self._finish(handle, rank, f"another process wrote over the task in rank {rank}'s task ring (it never "
                                       f"arrived)" if seq in in_ring else
                                       "another process took the task off its task pipe (it never arrived)")

    def _serve(self):
        """The I/O thread: wake on the reply socket or the doorbell (or every 100 ms), read the completion rings,
        then the replies, and supervise. It sleeps in epoll so that a waiter can take the doorbell out of its set
        without waking it (wait)."""
        router, epoll = self._router, self._epoll
        next_watch = 0.0
        while not self._io_stop.is_set():
            bells = self.doorbells
            for fd, _ in epoll.poll(0.1):   # a lost doorbell costs this at most
                if fd == bells.fileno():
                    bells.clear_rung()
            self.read_rings()
            # zmq's descriptor only says that the socket's state may have changed: its events say what changed
            while router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                while True:
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self.read_rings()           # what a rank put in its ring before this reply comes first
                        self.on_reply(frames)
                    except Exception as exc:        # no single message may end this thread
                        self._warn_once(("reply",), f"reply dropped: {type(exc).__name__}: {exc}")
                    self.replies_read += 1
            if time.monotonic() >= next_watch:
                if not self._closed():
                    self._ranks.watch()
                    self._watch_unreceived()        # after the heartbeats: a silent process is named as such
                self._watch_phase_command()
                next_watch = time.monotonic() + 0.1

    def wait(self, handle, timeout: float | None) -> bool | None:
        """A handle's result(): this thread takes the doorbells from the I/O thread and reads the completion rings
        itself until the handle is done (True) or the timeout (False), so a task's reports wake the thread waiting
        for them and not the I/O thread too (engine/doorbells.py). None if another thread has the doorbells (the
        caller waits on the handle's gate)."""
        bells = self.doorbells
        if bells is None or not bells.owner.acquire(False):
            return None
        try:
            if self._epoll is None:         # closed
                return None
            handle.waker = bells.wake_waiter   # before the first look at done(): nothing completes it unseen
            bells.take()
            try:
                return self._read_until(handle, timeout)
            finally:
                handle.waker = None
                bells.give_back(self.read_rings)
        finally:
            bells.owner.release()

    def _read_until(self, handle, timeout) -> bool:
        """Sleep on a doorbell, then read, until the handle is done. No read before the first sleep: a record that
        came before the doorbells were taken has its doorbell still rung (the sleep returns at once), or the
        I/O thread took the ring and reads the record itself, completing the handle through its waker."""
        deadline = None if timeout is None else time.monotonic() + timeout
        bells = self.doorbells
        pending = handle.pending_ranks()
        while not handle.done():
            wait_ms = doorbells.BELL_WAIT_MS
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                wait_ms = min(wait_ms, max(1, int(left * 1000)))
            bells.sleep(pending, wait_ms)
            self.read_rings()
            before, pending = pending, handle.pending_ranks()
            if not pending and len(before) == 1:
                bells.last_rank = next(iter(before))    # the rank that reported last
        return True

    def read_rings(self):
        """Complete the handles of every record the ranks' completion rings hold; ask again for bad ones. One
        thread at a time, completions included: a rank's records are taken in order, before its later replies."""
        with self._reading:
            self._read_rings()

    def _read_rings(self):
        read = []
        with self._rings_lock:          # open_pipe and the retiring calls close rings
            for rank, ring in self._rings.items():
                if ring.hold_seq is not None:   # bad records asked for again: has the process read the request?
                    received = self._signals().task_received
                    if rank < len(received):
                        ring.served(int(received[rank]))
                if not ring.unread():
                    continue
                records, bad = ring.read()
                if records or bad:
                    read.append((rank, ring, records, bad))
        handles = self._handles
        for rank, ring, records, bad in read:
            for task_id, nbytes, skipped, seconds in records:
                # one dict read, atomic: a task's handle is added before it is sent
                self._finish(handles.get(task_id), rank, nbytes=nbytes, skipped=skipped, seconds=seconds)
            if bad:
                self._warn_once(("ring", rank), f"rank {rank}: completion records {bad[0]}..{bad[-1]} of its ring "
                                                f"failed authentication (another process wrote to it); asked for "
                                                f"again over its task pipe")
                asked = True
                for first, last in protocol.runs(bad):
                    asked = self.send_to(rank, protocol.encode("resend", first=first, last=last)) and asked
                if asked:       # the ring's count passes the bad records once the process has read the request
                    with self._submit_lock:
                        ring.asked(self._sent_seq.get(rank, 0))

    def send_all(self, message, handle=None, sent: dict | None = None):
        """Deliver a task (with its handle) or a command (without) to every rank, in submission order. A rank
        the handle no longer waits for is skipped: a restart failed the task there before it was sent, the
        handle may be done and its blocks reused, and a new process must not copy them late. (The check is
        sound under the lock: restart_rank fails the old process's tasks before open_pipe takes the lock.)
        A task that fits a record goes through the rank's task ring where it can (_ring_send)."""
        record = inline(*message.task) if handle is not None and self._task_rings and \
            getattr(message, "task", None) else None
        with self._submit_lock:
            if record is not None:
                received = self._signals().task_received
            for rank, push in enumerate(self._task_pushes):
                if push is None:        # a rank a reshard is adding or retiring
                    continue
                if handle is not None and not handle.waits_for(rank):
                    continue
                why = self._ranks.why_failed(rank)
                if why is not None:
                    self._finish(handle, rank, why, lost=True)
                    continue
                if record is not None and rank in self._task_rings:
                    # a ring takes records for a dead process, unlike a pipe: while the process has not read
                    # what was sent before, look at it (a waitpid) before writing one more, once a millisecond
                    # at most (a waitpid lets the I/O thread take the GIL: per record, it costs pipelined
                    # tasks a tenth of their rate)
                    if received[rank] < self._sent_seq[rank] and self._exit_due(rank) and \
                            self._ranks.check_exit(rank):
                        self._finish(handle, rank, self._ranks.why_failed(rank), lost=True)
                        continue
                    if self._ring_send(rank, record, handle, received):
                        continue
                if not self.deliver(rank, push, message, command=handle is None, handle=handle):
                    self._ranks.check_exit(rank)
                    self._finish(handle, rank, self._ranks.why_failed(rank) or "transfer manager not connected",
                                 lost=True)
                elif sent is not None:      # the number the message went with on this rank's pipe
                    sent[rank] = self._sent_seq[rank]

    def _exit_due(self, rank) -> bool:
        """Whether send_all should look at rank's process now (under _submit_lock): not within EXIT_LOOK of the
        last look."""
        now = time.monotonic()
        if now - self._exit_looked.get(rank, 0.0) < EXIT_LOOK:
            return False
        self._exit_looked[rank] = now
        return True

    def _ring_send(self, rank, record, handle, received) -> bool:
        """Write the task in rank's task ring, numbered next on the rank's pipe (under _submit_lock). Only once
        the transfer manager has read every message sent on its pipe (its task_received): so it never sees a
        record before a message numbered below it is there to read, and a number missing below a record it
        reads is lost, not late. False (the task goes by pipe) without a ring, before that, or when it is full."""
        ring = self._task_rings.get(rank)
        if ring is None or received[rank] < self._pipe_seq[rank]:
            return False
        seq = self._sent_seq[rank] + 1
        if not ring.put(seq, record):
            return False
        self._sent_seq[rank] = seq
        self._unreceived[rank][seq] = (handle, time.monotonic())
        return True

    def send_phase_command(self, phase: str, message):
        """Send a phase command to every rank (as send_all) and watch that each reads it."""
        seqs = {}       # taken as each rank's message goes: a ping of the I/O thread's may go just before it
        self.send_all(message, sent=seqs)
        self._phase_command = PhaseCommand(phase, seqs, time.monotonic())

    def end_phase_command(self) -> str | None:
        """The phase is over: stop watching its command. Returns why the phase broke if a rank's command was
        taken off its pipe, else None."""
        command, self._phase_command = self._phase_command, None
        if command is None or not command.lost:
            return None
        ranks = ", ".join(str(r) for r in sorted(command.lost))
        return (f"rank {ranks} never received the {command.phase} command: another process took it off the "
                f"rank's task pipe (a process of this user reading it); once that reader is gone, the same call "
                f"again finishes the phase")

    def lost_phase_ranks(self) -> set:
        """The ranks whose phase command another process took off their pipe (they will not report the phase)."""
        command = self._phase_command
        return set(command.lost) if command is not None else set()

    def _watch_phase_command(self):
        """I/O thread: ping each rank that has not read the phase command yet (see the module docstring)."""
        command = self._phase_command
        if command is None or command.lost:
            return
        now = time.monotonic()
        received = self._signals().task_received
        for rank, seq in command.seqs.items():
            if rank not in command.read and rank < len(received) and int(received[rank]) >= seq:
                command.read.add(rank)
        unread = [r for r in command.seqs if r not in command.read]
        if not unread or now - max(command.sent, command.last_ping) < PING_AFTER or command.pings >= MAX_PINGS:
            return
        command.pings, command.last_ping = command.pings + 1, now
        for rank in unread:
            self.ping(rank)

    def ping(self, rank):
        """A numbered no-op for rank's pipe, sent only if the pipe takes it at once (the I/O thread never waits)."""
        with self._submit_lock:
            push = self._task_pushes[rank] if rank < len(self._task_pushes) else None
            seq = self._sent_seq.get(rank, 0) + 1
            if push is not None and self._try_send(push, signed(self._token, TO_RANK,
                                                                [SEQ.pack(seq)] + protocol.encode("ping"))):
                self._sent(rank, seq, None)

    def _phase_command_lost(self, rank, first, last):
        """A rank reported messages first..last lost: if the phase command was one, the phase breaks now."""
        command = self._phase_command
        seq = command.seqs.get(rank) if command is not None else None
        if seq is None or not first <= seq <= last or rank in command.lost:
            return
        command.lost.append(rank)
        log.warning("rank %d: the %s command was taken off its task pipe by another process; the phase fails now",
                    rank, command.phase)
        self._barrier().abort(transfer_party(rank))
        with self._phase_cond:
            self._phase_cond.notify_all()

    def send_to(self, rank, message) -> bool:
        """Deliver a command to one rank; False if no transfer manager is connected to its pipe."""
        with self._submit_lock:         # zmq sockets are not thread-safe, and open_pipe replaces them
            push = self._task_pushes[rank] if rank < len(self._task_pushes) else None
            return push is not None and self.deliver(rank, push, message, command=True)

    def deliver(self, rank, push, message, command: bool, handle=None) -> bool:
        """Send on rank's task pipe (under _submit_lock), numbered and signed; False if no transfer manager is
        connected to it.
        A command for a process that has registered (through the reply socket) but whose pipe zmq has not
        set up yet, as right after restart_rank in CLEARED, waits for the pipe instead of being lost (its
        phase would wait out the barrier's timeout). A task never waits: it fails at once instead."""
        seq = self._sent_seq.get(rank, 0) + 1
        message = signed(self._token, TO_RANK, [SEQ.pack(seq)] + list(message))
        if self._try_send(push, message):
            self._sent(rank, seq, handle)
            return True
        deadline = time.monotonic() + PIPE_TIMEOUT
        while command and self._ranks.awaits_pipe(rank) and time.monotonic() < deadline:
            time.sleep(0.001)
            if self._try_send(push, message):
                self._sent(rank, seq, handle)
                return True
        return False

    @staticmethod
    def _try_send(push, message) -> bool:
        try:
            push.send_multipart(message, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _sent(self, rank, seq, handle):
        """Message seq went on rank's task pipe."""
        self._sent_seq[rank] = self._pipe_seq[rank] = seq
        if handle is not None:          # until its transfer manager has read it (_watch_unreceived)
            self._unreceived.setdefault(rank, {})[seq] = (handle, time.monotonic())

    def _finish(self, handle, rank, error=None, **report):
        if handle is None:
            return
        handle.rank_finished(rank, error, **report)
        if handle.done():
            with self._handles_lock:
                self._handles.pop(handle.task_id, None)

    def _reply_for(self, task_id, rank, error=None, **report):
        with self._handles_lock:
            handle = self._handles.get(task_id)
        self._finish(handle, rank, error, **report)

    def on_reply(self, frames):
        who = identity_rank(frames[0]) if len(frames) > 1 else None      # (rank, pid) or None
        rank = who[0] if who else None
        if rank is None or not self._ranks.is_current(rank, who[1]):    # in a reshard, ranks of both tps
            self._warn_once(("identity",), f"message from unknown peer {frames[0][:32]!r} dropped")
            return
        body = verified(self._token, TO_ENGINE, frames[1:])
        if body is None:
            self._warn_once(("unsigned",), f"a reply not signed by this deployment's transfer managers was dropped "
                                           f"(claimed identity {frames[0][:32]!r})")
            return
        try:
            header, _ = protocol.decode(body)
        except protocol.ProtocolError as exc:
            self._warn_once(("malformed", rank), f"rank {rank}: malformed reply dropped: {exc}")
            return
        kind = header["type"]
        if kind == "register":
            self._ranks.on_registered(rank)
        elif kind == "done":
            self._reply_for(header["task_id"], rank, nbytes=header["nbytes"], skipped=header["skipped"],
                            seconds=header["seconds"])
        elif kind == "failed":
            self._reply_for(header["task_id"], rank, header["error"])
        elif kind in ("phase_done", "phase_failed"):
            if header["phase"] == "attach":
                if kind == "phase_failed":      # a device error: out of service until restart_rank
                    self._ranks.mark_failed(rank, f"transfer manager (pid {who[1]}) could not attach its cache: "
                                            f"{header.get('error')}")
                self._ranks.on_attached(rank, kind == "phase_done")
                return
            with self._phase_cond:
                acks = self._phase_acks.get(header["phase"])
                if acks is not None:
                    acks[rank] = header.get("error")
                    self._copy_seconds[rank] = (header.get("copy_seconds", 0.0), header.get("weights_seconds", 0.0))
                    self._phase_cond.notify_all()
        elif kind == "ring_bad":
            self._warn_once(("task ring", rank), f"rank {rank}: records {header['first']}..{header['last']} of its "
                                                 f"task ring failed authentication or were destroyed (another "
                                                 f"process wrote to it); their tasks fail on rank {rank}")
        elif kind == "lost":
            self._lost_messages(rank, header["first"], header["last"])
            self._phase_command_lost(rank, header["first"], header["last"])
        elif kind == "error":
            self._warn_once(("error", rank), f"rank {rank} rejected a message: {header['error']}")
        else:
            self._warn_once(("type", rank, kind), f"rank {rank}: unexpected {kind!r} message dropped")

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)
