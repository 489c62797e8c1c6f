"""CombinedHandle: several tasks that answer one request (an L3 fetch and the swap-in behind it) as one
handle, with TransferHandle's interface: done when every part is done, failed if any part failed."""
from __future__ import annotations

from .handle import Completion, TransferHandle


class CombinedHandle(Completion):
    def __init__(self, parts: list[TransferHandle], kind: str, nbytes: int):
        super().__init__()
        self.parts, self.kind, self.nbytes = parts, kind, nbytes     # nbytes: what reaches the destination
        self.task_id = parts[-1].task_id
        self._left = len(parts)
        for part in parts:
            part.add_done_callback(self._part_done)

    def _waiting(self) -> bool:
        return self._left > 0

    def _part_done(self, _part):
        with self._lock:
            self._left -= 1
            if self._left:
                return
            callbacks = self._mark_done()
        self._release(callbacks)

    @property
    def error(self) -> str | None:
        errors = [part.error for part in self.parts if part.error]
        return "; ".join(errors) if errors else None

    def _timeout_message(self, timeout):
        pending = [p.task_id for p in self.parts if not p.done()]
        return f"{self.kind} (tasks {[p.task_id for p in self.parts]}) not done after {timeout} s; waiting for tasks {pending}"

    def _describe(self):
        return ", ".join(repr(p) for p in self.parts)
