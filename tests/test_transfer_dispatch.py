"""A transfer manager's hand-over of ready tasks to its lanes (docs/design.md §4 "Ordering"), without processes:
the manager's own _dispatch, _finished and _drain_completions over a copier that moves random blocks in NumPy."""
import collections
from types import SimpleNamespace

import numpy as np
import zmq

from fastcache.config import Settings
from fastcache.ipc import protocol
from fastcache.transfer.l3 import StoreTask
from fastcache.transfer.manager import LANES, TransferManager, lane_of
from fastcache.transfer.scheduler import Scheduler, Task

from conftest import small_spec

OUT, IN = protocol.SWAP_TO_CPU, protocol.SWAP_TO_GPU
SPEC = small_spec()


class Blocks:
    """GPU and CPU blocks of random bytes; swaps copy whole blocks, in the order they run."""

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.gpu = rng.integers(0, 256, (SPEC.num_gpu_blocks, 64), np.uint8)
        self.cpu = rng.integers(0, 256, (SPEC.num_cpu_blocks, 64), np.uint8)
        self.ran = []

    def swap_out(self, gpu_ids, cpu_ids, first=None):
        self.cpu[cpu_ids] = self.gpu[gpu_ids]

    def swap_in(self, gpu_ids, cpu_ids, first=None):
        self.gpu[gpu_ids] = self.cpu[cpu_ids]

    def copy(self):
        other = Blocks.__new__(Blocks)
        other.gpu, other.cpu, other.ran = self.gpu.copy(), self.cpu.copy(), []
        return other


class Completions:
    """The executors' inproc socket, as _drain_completions reads it."""

    def __init__(self):
        self.ids = []

    def recv_multipart(self, flags=0):
        if not self.ids:
            raise zmq.Again()
        return [b"%d" % self.ids.pop(0)]


def manager(blocks):
    """A transfer manager's dispatch state (no threads: the test plays the executors)."""
    tm = TransferManager.__new__(TransferManager)
    tm.rank, tm.spec, tm.settings, tm.phase = 0, SPEC, Settings(), "running"
    tm.copier, tm.ring, tm.fail_every, tm.tasks_seen = blocks, None, 0, 0
    tm.ops = SimpleNamespace(name="sim")
    tm._worker_replaced = lambda: False         # the rank's worker is the one attached
    tm.scheduler = Scheduler()
    tm.ready, tm.dispatching = collections.deque(), False
    tm.queued = {lane: 0 for lane in LANES}
    tm.executing, tm.outcomes = {}, {}
    tm.done_pull, tm.sent = Completions(), []
    tm.send = lambda type_, **fields: tm.sent.append((type_, fields))
    tm.queues = {}
    for lane in LANES:
        items = []
        tm.queues[lane] = SimpleNamespace(items=items, put=items.append)
    run = tm._run
    tm._run = lambda task: (blocks.ran.append(task.task_id), run(task))[1]
    return tm


def execute(tm, lane):
    """The lane's executor takes its next task (FIFO) and reports it over the inproc socket."""
    task = tm.queues[lane].items.pop(0)
    tm.executing[task.task_id] = task
    if isinstance(task, StoreTask):     # no store here: its put only reads the CPU blocks
        blocks = tm.copier
        blocks.ran.append(task.task_id)
        tm.outcomes[task.task_id] = (None, 0, 0, 0.0)
    else:
        tm.outcomes[task.task_id] = tm._run(task)
    tm.done_pull.ids.append(task.task_id)
    tm._drain_completions()


def test_a_task_made_ready_by_an_inline_task_waits_for_those_made_ready_before_it():
    """A store's put of CPU blocks 10 and 11 holds back a swap-out onto 10 (A) and a swap-in from 11 onto GPU
    block 2 (B); a later swap-in writes GPU blocks 1 and 2 (D), after A read block 1 and after B wrote block 2.
    The put's completion readies A and B together; A runs inline and its completion readies D, which is cleared
    to follow B in B's lane: it must not be handed over before B is."""
    blocks = Blocks()
    reference = blocks.copy()
    tm = manager(blocks)
    z = StoreTask(1, protocol.CPU_TO_STORE, np.empty(0, np.int64), np.array([10, 11]), hashes=np.array([5, 6]))
    a = Task(2, OUT, np.array([1]), np.array([10]))
    b = Task(3, IN, np.array([2]), np.array([11]))
    d = Task(4, IN, np.array([1, 2]), np.array([12, 13]))
    for task in (z, a, b, d):
        tm._dispatch(tm.scheduler.add(task))
    assert blocks.ran == [] and [t.task_id for t in tm.queues[lane_of(z)].items] == [1]

    execute(tm, lane_of(z))             # the put completes: A and B are ready, D follows both
    for lane in LANES:                  # the executors run whatever was queued, in each lane's order
        while tm.queues[lane].items:
            execute(tm, lane)
    assert sorted((kind, fields["task_id"]) for kind, fields in tm.sent) == [("done", i) for i in (1, 2, 3, 4)]
    assert not tm.scheduler
    assert sorted(blocks.ran) == [1, 2, 3, 4]
    for task in (a, b, d):              # the same tasks, one after the other in submission order
        getattr(reference, "swap_out" if task.kind == OUT else "swap_in")(task.gpu_ids, task.cpu_ids)
    np.testing.assert_array_equal(blocks.gpu, reference.gpu)
    np.testing.assert_array_equal(blocks.cpu, reference.cpu)
    assert blocks.ran.index(3) < blocks.ran.index(4), blocks.ran

    wrong = blocks.copy()               # negative control: D before B leaves B's block on GPU block 2
    wrong.gpu[:], wrong.cpu[:] = Blocks().gpu, Blocks().cpu
    for task in (a, d, b):
        getattr(wrong, "swap_out" if task.kind == OUT else "swap_in")(task.gpu_ids, task.cpu_ids)
    assert not np.array_equal(wrong.gpu, reference.gpu)
