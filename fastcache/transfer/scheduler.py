"""Orders a rank's tasks: tasks that share a GPU or CPU block take effect in submission order, and
tasks on disjoint blocks in opposite directions run at the same time.

Each direction has one FIFO executor, so a task may follow a conflicting earlier task of its own
direction as soon as that one is dispatched; behind a conflicting task of the other direction it waits
until that task completes.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass
class Task:
    task_id: int
    kind: str
    gpu_ids: np.ndarray
    cpu_ids: np.ndarray
    layerwise: bool = False             # a swap-in that publishes each layer as it lands (ipc/layers.py)
    group: str = "kv"                   # the tensor group whose blocks the ids name (kv, weights)
    ring: int = 0                       # a weight stream: slots of the ring it fills (ipc/ring.py)
    fence: object = None                # cuda: the protocol.Fence the copy waits for first (transfer/fences.py)
    dispatched: bool = False

    # made on first use: a task alone in the scheduler (the latency path) is compared with none
    @cached_property
    def gpu_set(self) -> frozenset:
        return frozenset(self.gpu_ids.tolist())

    @cached_property
    def cpu_set(self) -> frozenset:
        return frozenset(self.cpu_ids.tolist())

    def conflicts(self, other: "Task") -> bool:
        if self.group != other.group:       # ids of two groups name different memory
            return False
        return not (self.gpu_set.isdisjoint(other.gpu_set) and self.cpu_set.isdisjoint(other.cpu_set))


class Scheduler:
    def __init__(self):
        self._pending: list[Task] = []     # submitted, not completed, in submission order

    def __len__(self):
        return len(self._pending)

    def add(self, task: Task) -> list[Task]:
        """Queue a task; returns the tasks that may start now."""
        self._pending.append(task)
        return self._dispatchable()

    def complete(self, task_id: int) -> list[Task]:
        self._pending = [t for t in self._pending if t.task_id != task_id]
        return self._dispatchable()

    def _dispatchable(self) -> list[Task]:
        ready = []
        for i, task in enumerate(self._pending):
            if task.dispatched:
                continue
            blocked = any(task.conflicts(earlier) and not (earlier.dispatched and earlier.kind == task.kind)
                          for earlier in self._pending[:i])
            if not blocked:
                task.dispatched = True
                ready.append(task)
        return ready
