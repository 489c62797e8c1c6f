"""TransferHandle: one submitted task, completed when every rank has reported it (the per-task barrier)."""
from __future__ import annotations

import logging
import threading
import time

from ..errors import TransferError

log = logging.getLogger("fastcache.engine")


class TransferHandle:
    def __init__(self, task_id: int, kind: str, ranks, nbytes: int):
        self.task_id = task_id
        self.kind = kind
        self.nbytes = nbytes                 # bytes moved over all ranks
        self.elapsed = None                  # seconds from submission to the last rank's report
        self._start = time.perf_counter()
        self._pending = set(ranks)
        self._errors: dict[int, str] = {}
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks = []

    @classmethod
    def completed(cls, kind: str) -> "TransferHandle":
        """A handle that is already done, for a request with nothing to move (task_id 0)."""
        handle = cls(0, kind, [None], 0)
        handle._rank_finished(None)
        return handle

    def add_done_callback(self, fn):
        """Call fn(handle) once every rank has reported, before result() returns to any waiter (so what
        the callback records is visible to whoever waited); at once if that has happened already.
        Callbacks run on the thread that completes the handle (usually the engine's I/O thread): keep
        them short, and never call into the backend from them."""
        with self._lock:
            if self._pending:
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def _rank_finished(self, rank: int, error: str | None = None):
        """Called by the engine's I/O thread (or on a rank's death) once per rank."""
        with self._lock:
            if rank not in self._pending:
                return
            self._pending.discard(rank)
            if error is not None:
                self._errors[rank] = error
            if self._pending:
                return
            self.elapsed = time.perf_counter() - self._start
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _call(fn, self)
        self._event.set()

    @property
    def error(self) -> str | None:
        """Why the task failed (every failed rank named), None if it succeeded or is still running."""
        if not self._errors:
            return None
        detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(self._errors.items()))
        return f"task {self.task_id} ({self.kind}) failed on {detail}"

    def pending_ranks(self):
        with self._lock:
            return set(self._pending)

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None):
        """Wait until every rank is done; raise TransferError naming each failed rank."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"task {self.task_id} ({self.kind}) not done after {timeout} s; "
                               f"waiting for ranks {sorted(self.pending_ranks())}")
        if self._errors:
            raise TransferError(self.error)
        return self

    def __repr__(self):
        state = "failed" if self._errors else "done" if self.done() else "pending"
        return f"TransferHandle(task_id={self.task_id}, kind={self.kind}, {state})"


def _call(fn, handle):
    try:
        fn(handle)
    except Exception:       # a broken callback must not break the I/O thread or the other callbacks
        log.exception("callback of task %d raised", handle.task_id)
