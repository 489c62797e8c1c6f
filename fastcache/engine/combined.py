"""CombinedHandle: several tasks that answer one request (an L3 fetch and the swap-in behind it) as one
handle, with TransferHandle's interface: done when every part is done, failed if any part failed."""
from __future__ import annotations

import threading
import time

from ..errors import TransferError
from .handle import TransferHandle, _call


class CombinedHandle:
    def __init__(self, parts: list[TransferHandle], kind: str, nbytes: int):
        self.parts, self.kind, self.nbytes = parts, kind, nbytes     # nbytes: what reaches the destination
        self.task_id = parts[-1].task_id
        self.elapsed = None
        self._start = time.perf_counter()
        self._left = len(parts)
        self._callbacks = []
        self._lock = threading.Lock()
        self._event = threading.Event()
        for part in parts:
            part.add_done_callback(self._part_done)

    def _part_done(self, _part):
        with self._lock:
            self._left -= 1
            if self._left:
                return
            self.elapsed = time.perf_counter() - self._start
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _call(fn, self)
        self._event.set()

    def add_done_callback(self, fn):
        """As TransferHandle's: fn(self) once every part is done, before result() returns to a waiter."""
        with self._lock:
            if self._left:
                self._callbacks.append(fn)
                return
        _call(fn, self)

    @property
    def error(self) -> str | None:
        errors = [part.error for part in self.parts if part.error]
        return "; ".join(errors) if errors else None

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None):
        if not self._event.wait(timeout):
            pending = [p.task_id for p in self.parts if not p.done()]
            raise TimeoutError(f"{self.kind} (tasks {[p.task_id for p in self.parts]}) not done after {timeout} s; "
                               f"waiting for tasks {pending}")
        if self.error:
            raise TransferError(self.error)
        return self

    def __repr__(self):
        state = "failed" if self.error else "done" if self.done() else "pending"
        return f"CombinedHandle({', '.join(repr(p) for p in self.parts)}, {state})"
