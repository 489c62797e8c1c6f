"""Ordering rules of a rank's tasks (docs/design.md §4), without processes."""
import numpy as np

from fastcache.transfer.scheduler import Scheduler, Task

OUT, IN = "SWAP_TO_CPU", "SWAP_TO_GPU"


def task(task_id, kind, gpu, cpu):
    return Task(task_id, kind, np.array(gpu), np.array(cpu))


def ids(tasks):
    return [t.task_id for t in tasks]


def test_disjoint_opposite_directions_run_together():
    s = Scheduler()
    assert ids(s.add(task(1, OUT, [1, 2], [0, 1]))) == [1]
    assert ids(s.add(task(2, IN, [5], [7]))) == [2]


def test_conflicting_opposite_direction_waits_for_completion():
    s = Scheduler()
    s.add(task(1, OUT, [1, 2], [0, 1]))
    assert ids(s.add(task(2, IN, [5], [1]))) == []          # reads CPU block 1 that task 1 writes
    assert ids(s.add(task(3, IN, [6], [9]))) == [3]         # unrelated: runs now
    assert ids(s.complete(1)) == [2]


def test_same_direction_conflict_follows_fifo_once_earlier_is_dispatched():
    s = Scheduler()
    s.add(task(1, OUT, [1], [0]))
    assert ids(s.add(task(2, OUT, [2], [0]))) == [2]        # same executor queue keeps the order


def test_same_direction_task_waits_behind_blocked_conflicting_task():
    s = Scheduler()
    s.add(task(1, OUT, [1], [0]))
    s.add(task(2, IN, [1], [3]))                            # waits for 1 (GPU block 1)
    assert ids(s.add(task(3, IN, [4], [3]))) == []          # conflicts with 2, which is not dispatched yet
    assert ids(s.complete(1)) == [2, 3]
    assert len(s) == 2
