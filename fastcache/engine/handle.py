"""TransferHandle: one submitted task, completed when every rank has reported it (the per-task barrier)."""
from __future__ import annotations

import threading
import time

from ..errors import TransferError


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

    def _rank_finished(self, rank: int, error: str | None = None):
        """Called by the engine's I/O thread (or on a rank's death) once per rank."""
        with self._lock:
            if rank not in self._pending:
                return
            self._pending.discard(rank)
            if error is not None:
                self._errors[rank] = error
            if not self._pending:
                self.elapsed = time.perf_counter() - self._start
                self._event.set()

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
            detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(self._errors.items()))
            raise TransferError(f"task {self.task_id} ({self.kind}) failed on {detail}")
        return self

    def __repr__(self):
        state = "failed" if self._errors else "done" if self.done() else "pending"
        return f"TransferHandle(task_id={self.task_id}, kind={self.kind}, {state})"
