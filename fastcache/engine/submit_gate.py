"""Submissions a phase that changes the geometry (docs/design.md §9) or frees the cache (a clear or sleep, §6)
must wait for.

A swap reads the deployment's status first, then its geometry (to check its ids), then sends.
A submission holds the gate from before it reads the status until its task is sent (so in flight, which a
phase drains). A reshard sets the status first, then waits until no submission holds the gate: one that read
NORMAL is sent (in the old geometry) before the reshard drains the tasks in flight, and one that comes later
reads the new status and is refused, so no task checked against the old geometry reaches the new one.
"""
from __future__ import annotations

import threading
import time
from typing import Callable


class SubmitGate:
    """check(what) raises (RefusedError, TransferError) unless the deployment takes tasks now.

    On every swap's path, so no lock: a holder is an entry in a list, and a list's append and pop are each one
    step under the GIL. The one phase that waits (phases run one at a time) sleeps on an Event that the last
    submission to leave sets."""

    def __init__(self, check: Callable[[str], None]):
        self._check = check
        self._holders: list = []                    # one entry per submission holding the gate
        self._idle: threading.Event | None = None   # the waiting phase's, set when the last holder leaves

    @property
    def held(self) -> bool:
        """Does a submission hold the gate now?"""
        return bool(self._holders)

    def enter(self, what: str):
        """Hold the gate, then check the status (raising, the gate let go, if the deployment takes no task)."""
        self._holders.append(None)
        try:
            self._check(what)
        except BaseException:
            self.leave()
            raise

    def leave(self):
        holders = self._holders
        holders.pop()
        if not holders:
            idle = self._idle
            if idle is not None:
                idle.set()

    def wait_idle(self, timeout: float) -> bool:
        """Until no submission holds the gate; False on timeout. The Event is in place before the list is looked
        at, so the last holder to leave either sees it or left before the look."""
        deadline = time.monotonic() + max(0.0, timeout)
        while self._holders:
            idle = self._idle = threading.Event()
            if self._holders and not idle.wait(max(0.0, deadline - time.monotonic())):
                return not self._holders
        return True
