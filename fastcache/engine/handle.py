"""TransferHandle: one submitted task, completed when every rank has reported it (the per-task barrier)."""
from __future__ import annotations

import logging
import threading
import time

from ..errors import TransferError
from ..ipc.layers import SlotClaims, wait_layer

log = logging.getLogger("fastcache.engine")
REPORT_WAIT_S = 2.0     # for the failure report of a task a rank has marked failed in its layer slot


class Completion:
    """What every handle shares: completion callbacks that run before result() returns, the event
    result() waits on, and the time from creation to completion. A subclass says when it is still
    waiting (`_waiting`, under the lock), what failed (`error`) and what a timeout names."""

    def __init__(self):
        self.elapsed = None                  # seconds from submission to completion
        self._start = time.perf_counter()
        self._callbacks = []
        self._lock = threading.Lock()
        self._finished = False
        # held until done: a waiter takes it and hands it on at once (one lock, no Event's Condition per task)
        self._gate = threading.Lock()
        self._gate.acquire()
        self.waker = None       # called once done, while a waiter that the gate does not wake waits (TransferHandle's reader)

    def add_done_callback(self, fn):
        """Call fn(handle) once the handle is done, before result() returns to any waiter (so what
        the callback records is visible to whoever waited); at once if that has happened already.
        Callbacks run on the thread that completes the handle (the engine's I/O thread, or the thread waiting
        in result(), which reads the completions itself): keep them short, and never call into the backend
        from them."""
        with self._lock:
            if self._waiting():
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def _mark_done(self):
        """Called under the lock by whoever saw the last part finish; returns the callbacks to _release."""
        self.elapsed = time.perf_counter() - self._start
        callbacks, self._callbacks = self._callbacks, []
        return callbacks

    def _release(self, callbacks):
        for fn in callbacks:
            try:
                fn(self)
            except Exception:   # a broken callback must not break the I/O thread or the other callbacks
                log.exception("callback of task %d raised", self.task_id)
        self._finished = True
        self._gate.release()
        wake = self.waker
        if wake is not None:        # a waiter reading the completion rings itself sleeps on their doorbell
            wake()

    def done(self) -> bool:
        return self._finished

    def _wait(self, timeout: float | None) -> bool:
        """Until done or timeout seconds (None: no limit; 0 or less: no wait, as threading.Event.wait)."""
        if self._finished:
            return True
        gate = self._gate
        if not (gate.acquire() if timeout is None else gate.acquire(True, timeout) if timeout > 0 else
                gate.acquire(False)):
            return False
        gate.release()          # the next waiter's turn
        return True

    def result(self, timeout: float | None = None):
        """Wait until done; raise TransferError naming what failed."""
        if not self._finished and not self._wait(timeout):
            raise TimeoutError(self._timeout_message(timeout))
        error = self.error
        if error:
            raise TransferError(error)
        return self

    def __repr__(self):
        state = "failed" if self.error else "done" if self.done() else "pending"
        return f"{type(self).__name__}({self._describe()}, {state})"


class TransferHandle(Completion):
    def __init__(self, task_id: int, kind: str, ranks, nbytes: int, on_done=None):
        """on_done: a first done callback (as add_done_callback's)."""
        super().__init__()
        if on_done is not None:
            self._callbacks.append(on_done)
        self.task_id = task_id
        self.kind = kind
        self.nbytes = nbytes                 # bytes over all ranks: asked for, then as the ranks reported them
        self.skipped = 0                     # store puts: objects a full store did not take, most on one rank
        self.run_seconds = 0.0               # the slowest rank's own time on the task (its copy and checks)
        self._pending = set(ranks)
        self._errors: dict[int, str] = {}
        self._reported = 0
        self._lost: set[int] = set()         # ranks failed by the engine (dead, restarted, closed), not by a task
        self._layers = None                  # (signals, ranks, layers, table, claims) of a layer-by-layer task
        self.reader = None                   # the engine's channel: result() reads the completions itself
        self._slots = None                   # its SlotClaims, which hold its slot until the handle is done

    @classmethod
    def completed(cls, kind: str) -> "TransferHandle":
        """A handle that is already done, for a request with nothing to move (task_id 0)."""
        handle = cls(0, kind, [None], 0)
        handle.rank_finished(None, nbytes=0)
        return handle

    def _waiting(self) -> bool:
        return bool(self._pending)

    def _wait(self, timeout: float | None) -> bool:
        """The waiting thread reads the ranks' completion rings itself where it can (no hop through the engine's
        I/O thread: docs/design.md §4); else, or while another thread reads them, it waits on the gate."""
        if self._finished:
            return True
        reader = self.reader
        if reader is not None:
            done = reader.wait(self, timeout)
            if done is not None:
                return done
        return super()._wait(timeout)

    def rank_finished(self, rank: int, error: str | None = None, nbytes: int = 0, skipped: int = 0,
                      lost: bool = False, seconds: float = 0.0):
        """Called by the engine's I/O thread with a rank's report, or with lost=True where the engine fails
        the rank itself (its process died or was restarted, or the backend closed)."""
        with self._lock:
            pending = self._pending
            if rank not in pending:
                return
            pending.discard(rank)
            if error is not None:
                self._errors[rank] = error
                if lost:
                    self._lost.add(rank)
            if self._layers is not None:
                self._settle(rank, error is None)
            self._reported += nbytes
            if skipped > self.skipped:
                self.skipped = skipped
            if seconds > self.run_seconds:
                self.run_seconds = seconds
            if pending:
                return
            if not self._errors:
                self.nbytes = self._reported
            callbacks = self._mark_done()
        if self._slots is not None:
            self._slots.release(self.task_id)
        self._release(callbacks)

    def _settle(self, rank, ok: bool):
        """A layer-by-layer task: the rank's waiters (a worker's by task id) learn its outcome at once."""
        if self._layers is None:
            return
        signals, _, _, _, claims = self._layers
        try:
            SlotClaims.settle(getattr(signals, claims), rank, self.task_id, ok)
        except (AttributeError, IndexError, TypeError):
            pass            # the signals are closed (the backend is closing) or resized past the rank

    @property
    def error(self) -> str | None:
        """Why the task failed (every failed rank named), None if it succeeded or is still running."""
        if not self._errors:
            return None
        detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(self._errors.items()))
        return f"task {self.task_id} ({self.kind}) failed on {detail}"

    def publishes_layers(self, signals, ranks, layers: int, slots: SlotClaims, table: str = "layer_ready",
                         claims: str = "layer_claims"):
        """Set by the backend on a layer-by-layer swap-in (or a weight stream, published in the signals named
        `table` and `claims`) whose id `slots` claimed, before it is sent."""
        self._layers = (signals, list(ranks), layers, table, claims)
        self._slots = slots

    def wait_layer(self, layer: int, timeout: float | None = None) -> "TransferHandle":
        """Of a swap_in(..., layerwise=True): wait until `layer`'s rows are in place on every rank (layers
        arrive in order, so every layer below it is too). Raises the task's TransferError as soon as it
        fails (every waiter wakes with it), TimeoutError after `timeout` seconds."""
        if self._layers is None:
            raise ValueError("wait_layer needs a layer-by-layer swap-in: swap_in(..., layerwise=True)")
        signals, ranks, layers, table, claims = self._layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
            raise ValueError(f"layer must be an int in [0, {layers}), got {layer!r}")
        if self.done():
            return self.result()
        try:
            wait_layer(signals, ranks, self.task_id, layer, timeout,
                       failed=lambda: self.error if self.done() else None, slots=getattr(signals, table),
                       claims=getattr(signals, claims))
        except TransferError:
            if self._wait(REPORT_WAIT_S):     # a rank marked the task failed: raise its report, which says why
                self.result()
            raise
        except ValueError:
            # its slot serves a later task: it is freed once every rank has reported (done callbacks may still
            # run), and then the reports are the answer
            with self._lock:
                if self._pending:
                    raise
                error = self.error
            if error:
                raise TransferError(error) from None
        return self

    @property
    def ranks_lost(self) -> bool:
        """Failed only because the engine lost ranks (dead, restarted, closed): no rank's task reported an
        error of its own, so the store (for a store task) is not to blame."""
        return bool(self._errors) and set(self._errors) <= self._lost

    def own_errors(self) -> list[str]:
        """The errors ranks reported for their own task (not the engine's failing of a lost rank)."""
        with self._lock:
            return [error for rank, error in sorted(self._errors.items()) if rank not in self._lost]

    def waits_for(self, rank) -> bool:
        """Is rank's report still outstanding? (A set lookup: safe without the lock under the GIL.)"""
        return rank in self._pending

    def pending_ranks(self):
        with self._lock:
            return set(self._pending)

    def _timeout_message(self, timeout):
        return (f"task {self.task_id} ({self.kind}) not done after {timeout} s; "
                f"waiting for ranks {sorted(self.pending_ranks())}")

    def _describe(self):
        return f"task_id={self.task_id}, kind={self.kind}"


def _call(fn, handle):
    try:
        fn(handle)
    except Exception:       # a broken callback must not break the I/O thread or the other callbacks
        log.exception("callback of task %d raised", handle.task_id)
