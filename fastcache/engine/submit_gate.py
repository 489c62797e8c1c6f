"""Submissions a phase that changes the geometry must wait for (docs/design.md §9).

A swap reads the deployment's status first, then its geometry (to check its ids), then sends.
A submission holds the gate from before it reads the status until its task is sent (so in flight, which a
phase drains). A reshard sets the status first, then waits until no submission holds the gate: one that read
NORMAL is sent (in the old geometry) before the reshard drains the tasks in flight, and one that comes later
reads the new status and is refused, so no task checked against the old geometry reaches the new one.
"""
from __future__ import annotations

import threading
from typing import Callable


class SubmitGate:
    """check(what) raises (RefusedError, TransferError) unless the deployment takes tasks now."""

    def __init__(self, check: Callable[[str], None]):
        self._check = check
        self._cond = threading.Condition(threading.Lock())
        self._held = 0

    def enter(self, what: str):
        """Hold the gate, then check the status (raising, the gate let go, if the deployment takes no task)."""
        with self._cond:
            self._held += 1
        try:
            self._check(what)
        except BaseException:
            self.leave()
            raise

    def leave(self):
        with self._cond:
            self._held -= 1
            if not self._held:
                self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Until no submission holds the gate; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._held, max(0.0, timeout))
