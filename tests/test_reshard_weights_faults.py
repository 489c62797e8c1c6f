"""Failures of a reshard that moves the weights with the KV (docs/design.md §9, "Failures", "Weights in the live
step"), on the sim device with in-process workers that register the weights (column-split, row-split and
replicated tensors of random bytes, never zeros) and transfer-manager processes, mirroring the KV-only fault
tests of tests/test_reshard.py. After every failure and every recovery, every weight byte of every rank equals
its slice of the full tensors at the tp the deployment is at, and every live GPU block and used CPU block holds
its bytes:

- a failure before any rank overwrote old rows (a worker without memory for its staging buffer or for a new
  weight allocation, a start_workers that raises, a new rank whose weights never come up) rolls back: the old
  tp and weight layout serve, and nothing of the step is left in /dev/shm (new weight allocations freed); the
  same reshard then succeeds;
- a transfer manager killed (or stopped) in the middle of its in-place program, after some weight chunks were
  written, leaves the step pending; restart_rank then the same reshard resumes from the journal: scale-outs
  whose weights are rewritten in place (1 -> 2, 2 -> 4) and a scale-in where rank 1's weights move to a new
  allocation (1 -> 4 -> 2), and rank 0 growing its rows in place on the same scale-in;
- a negative control: the same resume with the journal reset to 0 (written into the reshard_progress signal
  from here, as a lost journal would leave it) rewrites chunks from rows already overwritten, and the check
  finds the weights wrong;
- a transfer manager killed during COMMIT, and a worker whose COMMIT fails once: the step is pending and the
  same reshard finishes it.
"""
import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest

from fastcache import RefusedError, SwapBackend, TransferError
from fastcache.ipc.signal import NORMAL, RESHARDING
from fastcache.launch.liquid import BlockModel
from fastcache.reshard_plan import Capacity, Plan
from fastcache.transfer.reshard import TEST_PACE
from fastcache.weight_spec import WeightSpec
from fastcache.worker import CacheWorker

from conftest import small_spec
from test_reshard_weights_live import WeightModel, leftovers

# 8 layers: a column-split tensor of one 512-byte row per layer at tp 1, a row-split one of 8 rows of 64 bytes,
# a replicated one; staging of 512 bytes cuts both split tensors into several chunks at every step
MODEL = WeightSpec(8, {"qkv": ((32, 8), "float16", 0), "o": ((8, 32), "float16", 1), "norm": ((8,), "float32")})
SPEC = small_spec(num_layers=2, num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=4, block_size=2, head_dim=4)
STAGING = 512


def layout(tp):
    return MODEL.placed().resharded(tp)


class Pool:
    """start_workers/stop_workers over in-process CacheWorkers with the weights registered (a rank started
    during a step registers the step's new layout, as the harness's workers do)."""

    def __init__(self, backend):
        self.backend, self.workers = backend, {}
        self.without_weights = set()        # ranks whose worker comes up but never registers its weights

    def start(self, ranks, spec=None):
        b = self.backend
        step = b.resharding
        tp = step.to_tp if step is not None else b.tp_size
        weights = step.weights if step is not None else b.weight_layout
        for r in ranks:
            worker = self.workers[r] = CacheWorker(spec or b.spec, rank=r, tp_size=tp, device="sim",
                                                   suffix=b.suffix).start()
            if r not in self.without_weights:
                worker.register_weights(weights)

    def stop(self, ranks):
        for r in ranks:
            self.workers.pop(r).close()

    def close(self):
        self.stop(sorted(self.workers))


@contextlib.contextmanager
def deployment(tp, seed):
    """A running deployment at tp with random weights and random KV in 6 GPU blocks (some swapped out
    and back, so the CPU tier holds blocks too): (backend, pool, kv, weights)."""
    rng = np.random.default_rng(seed)
    with SwapBackend(SPEC, tp_size=tp, device="sim", weights=layout(tp)) as backend:
        pool = Pool(backend)
        kv = None
        try:
            pool.start(range(tp))
            backend.wait_ready(timeout=30)
            kv, weights = BlockModel(backend, rng), WeightModel(backend, rng)
            kv.attach()
            kv.fill(range(6))
            kv.swap_round(3)
            kv.detach()
            weights.load()
            yield backend, pool, kv, weights
        finally:
            if kv is not None:
                kv.detach()
            pool.close()


def step(backend, pool, kv, tp, **kwargs):
    """reshard(tp) with the live blocks, the model remapped afterwards."""
    _, block_map = backend.reshard(tp, live_blocks=sorted(kv.gpu), start_workers=pool.start, stop_workers=pool.stop,
                                   staging_bytes=STAGING, **kwargs)
    kv.remap(block_map, backend.last_reshard["cpu_block_map"])


def intact(backend, kv, weights, tp):
    """The deployment serves tp with its weights' layout, every weight byte and every live block right."""
    assert backend.status == NORMAL and backend.tp_size == tp and backend.resharding is None
    assert backend.weight_layout == layout(tp)
    assert weights.check() == []
    kv.attach()
    try:
        assert kv.check() == []
    finally:
        kv.detach()


def shm(backend):
    return sorted(leftovers(backend.suffix))


# -- failures before any rank overwrote old rows: rollback -----------------------------------------
def no_staging(backend, pool):
    """Rank 0's worker has no memory for its staging buffer (scale-out 1 -> 2)."""
    def failing(*args):
        raise MemoryError("no memory for the staging buffer")
    pool.workers[0].ops.reshard_staging = failing
    return 2, "worker rank 0 reported a failure", lambda: delattr(pool.workers[0].ops, "reshard_staging")


def no_weight_allocation(backend, pool):
    """Rank 1 (born at tp 4, a quarter of each split tensor) needs new allocations for half at tp 2: its
    first one succeeds, the second fails: the first must be freed."""
    ops = pool.workers[1].ops
    real = ops.weight_allocation

    def second_fails(nbytes, suffix, rank, index, *args):
        if index == 1:      # at once, before the other workers reached the barrier (the rollback settles it)
            raise MemoryError(f"no memory for weight tensor {index}")
        return real(nbytes, suffix, rank, index, *args)
    ops.weight_allocation = second_fails
    return 2, "worker rank 1 reported a failure", lambda: delattr(ops, "weight_allocation")


def wait_for(condition, timeout):
    """Poll condition until it holds (True) or timeout seconds pass (False)."""
    end, idle = time.monotonic() + timeout, threading.Event()
    while not condition():
        if time.monotonic() > end:
            return False
        idle.wait(0.002)
    return True


def no_staging_after_allocations(backend, pool):
    """Rank 1 allocates both its new weight tensors, then rank 0 finds no memory for its staging buffer: the
    abort frees rank 1's allocations."""
    ops0, ops1 = pool.workers[0].ops, pool.workers[1].ops
    real = ops1.weight_allocation
    allocated = threading.Event()

    def allocation(nbytes, suffix, rank, index, *args):
        out = real(nbytes, suffix, rank, index, *args)
        if index == 1:
            allocated.set()
        return out

    def failing(*args):
        assert allocated.wait(30), "rank 1 never allocated its new weight tensors"
        raise MemoryError("no memory for the staging buffer")
    ops1.weight_allocation, ops0.reshard_staging = allocation, failing

    def undo():
        del ops1.weight_allocation, ops0.reshard_staging
    return 2, "worker rank 0 reported a failure", undo


def start_raises(backend, pool):
    """start_workers starts the new ranks (their weights registered) and then raises (scale-out 2 -> 4)."""
    real = pool.start

    def broken(ranks, spec):
        real(ranks, spec)
        raise RuntimeError(f"no GPUs for ranks {list(ranks)}")
    pool.start = broken
    return 4, r"no GPUs for ranks \[2, 3\]", lambda: delattr(pool, "start")


def weights_never_ready(backend, pool):
    """Rank 3's worker comes up but never registers its weights (scale-out 2 -> 4): the step times out
    naming it."""
    pool.without_weights.add(3)
    return 4, r"rank 3: worker not ready", pool.without_weights.clear


@pytest.mark.parametrize("how,path", [(no_staging, [1]), (no_weight_allocation, [1, 4]),
                                      (no_staging_after_allocations, [1, 4]), (start_raises, [2]),
                                      (weights_never_ready, [2])],
                         ids=["staging", "weight_allocation", "staging_after_allocations", "start_raises",
                              "weights_never_ready"])
def test_a_failure_before_any_rank_overwrote_rolls_back_with_the_weights_intact(how, path):
    with deployment(path[0], seed=len(path) + path[0]) as (backend, pool, kv, weights):
        for tp in path[1:]:
            step(backend, pool, kv, tp, timeout=60)
        tp = path[-1]
        intact(backend, kv, weights, tp)
        before, pids = shm(backend), backend.transfer_pids
        to, message, undo = how(backend, pool)
        with pytest.raises(TransferError, match=message):
            step(backend, pool, kv, to, timeout=5)
        undo()
        intact(backend, kv, weights, tp)
        assert sorted(pool.workers) == list(range(tp)) and backend.transfer_pids == pids
        assert shm(backend) == before       # new weight allocations, staging, new ranks' memory: all gone
        # the deployment serves on: swaps, then the same reshard succeeds
        kv.attach()
        assert kv.swap_round(2) == 2 and kv.check() == []
        kv.detach()
        step(backend, pool, kv, to, timeout=60)
        intact(backend, kv, weights, to)
        assert bool(backend.last_reshard["weight_allocations"]) == (to < tp)


# -- a transfer manager killed in the middle of its in-place program: resume ------------------------
def weight_chunks(backend, kv, tp, rank):
    """(index of rank's first weight chunk, its chunks) in the program the engine will send it."""
    b = backend
    plan = Plan(b.spec, b.tp_size, tp, [Capacity.of(b.spec)] * b.tp_size, sorted(kv.gpu),
                sorted(b.allocator.used_ids()), STAGING, weights=b.weight_layout)
    chunks, journaled = plan.program(rank)
    assert journaled
    first = next(i for i, c in enumerate(chunks) if c.gather[0].src[0] == "weights")
    return first, len(chunks)


def kill_mid_program(backend, pool, kv, tp, rank, how, target):
    """reshard(tp) with rank's transfer manager paced, struck (SIGKILL or SIGSTOP) once its journal reaches
    target; returns (the TransferError, the journal when struck, the victim's pid)."""
    progress = backend.signals.reshard_progress
    victim = backend.transfer_pids[rank]
    done, seen = threading.Event(), []
    earlier = int(progress[rank, 0])        # the journal is [step, progress]: a kept rank's holds its last step's

    def strike():
        while int(progress[rank, 0]) == earlier or progress[rank, 1] < target:
            if done.wait(0.002):
                return
        os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        seen.append(int(progress[rank, 1]))
    thread = threading.Thread(target=strike)
    thread.start()
    try:
        with pytest.raises(TransferError, match=f"rank {rank}") as failed:
            step(backend, pool, kv, tp, timeout=15 if how == "kill" else 6)
    finally:
        done.set()
        thread.join()
    assert seen, "the program ended before the strike"
    return failed.value, seen[0], victim


@pytest.mark.parametrize("path,rank,how,at,journal", [
    ([1, 2], 0, "kill", "written", "kept"),     # scale-out, weights rewritten in place, rows shrink (ascending)
    ([1, 2], 0, "kill", "staged", "kept"),      # the same, struck with a chunk staged: written again from staging
    ([1, 2], 0, "stop", "staged", "kept"),      # the transfer manager stalled instead
    ([2, 4], 1, "kill", "staged", "kept"),      # scale-out, the middle wave (rank 0 still to go after the resume)
    ([1, 4, 2], 1, "kill", "written", "kept"),  # scale-in, rank 1's split tensors gathered into new allocations
    ([1, 4, 2], 1, "kill", "staged", "kept"),
    ([1, 4, 2], 0, "kill", "staged", "kept"),   # scale-in, rank 0 grows its rows in place (descending)
    ([1, 2], 0, "kill", "written", "reset"),    # negative control: the journal lost, the program run from the start
], ids=["1-2-kill-written", "1-2-kill-staged", "1-2-stop-staged", "2-4-kill-staged", "1-4-2-rank1-written",
        "1-4-2-rank1-staged", "1-4-2-rank0-staged", "journal-reset"])
def test_a_transfer_manager_struck_mid_program_resumes_from_its_journal(monkeypatch, path, rank, how, at, journal):
    *before, tp = path
    with deployment(before[0], seed=sum(path) + rank) as (backend, pool, kv, weights):
        for t in before[1:]:
            step(backend, pool, kv, t, timeout=60)
            kv.attach()
            kv.fill(np.random.default_rng(t).choice(backend.spec.num_gpu_blocks, 4, replace=False))
            kv.detach()
        intact(backend, kv, weights, before[-1])
        monkeypatch.setenv(TEST_PACE, f"{rank}:0.05")
        backend.restart_rank(rank)              # its transfer manager now paced
        first, total = weight_chunks(backend, kv, tp, rank)
        # two weight chunks written (at least four rows of every split tensor of the rank), the third staged
        target = 2 * (first + 2) + (at == "staged")
        assert target < 2 * total - 2, (first, total)
        failed, journaled, victim = kill_mid_program(backend, pool, kv, tp, rank, how, target)
        try:
            # struck within the pace's 50 ms after the journal moved: still at the state the case is about
            assert journaled == target, (journaled, target, total)
            if how == "stop":
                assert "did not finish" in str(failed) or "stopped answering" in str(failed)
            assert backend.status == RESHARDING and backend.tp_size == before[-1]      # pending
            with pytest.raises(RefusedError, match="RESHARDING"):
                backend.swap_out([0], [0])
            with pytest.raises(TransferError, match="pending"):
                backend.reshard(1 if tp != 1 else 2, start_workers=pool.start, stop_workers=pool.stop)
            monkeypatch.delenv(TEST_PACE)
            if journal == "reset":              # what a replacement would do without the journal
                backend.signals.reshard_progress[rank, 1] = 0
            backend.restart_rank(rank)          # kills a stalled process first
            _, block_map = backend.reshard(tp, timeout=60)
            kv.remap(block_map, backend.last_reshard["cpu_block_map"])
        finally:
            if how == "stop":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGCONT)
        if journal == "reset":
            assert backend.status == NORMAL and backend.tp_size == tp
            wrong = weights.check()
            # qkv's first rows were rewritten before the strike: run again from old rows already overwritten
            assert (rank, "qkv") in wrong and all(r == rank for r, _ in wrong), wrong
            return
        intact(backend, kv, weights, tp)
        assert bool(backend.last_reshard["weight_allocations"]) == (path == [1, 4, 2])
        # the resumed step's allocations are the deployment's: it serves on and reshards on
        kv.attach()
        assert kv.swap_round(2) == 2 and kv.check() == []
        kv.detach()
        step(backend, pool, kv, before[0], timeout=60)
        intact(backend, kv, weights, before[0])


# -- failures at COMMIT: the step is pending, the same reshard finishes it ---------------------------
@pytest.mark.parametrize("how", ["worker_fails_once", "transfer_manager_killed"])
def test_a_failure_at_commit_leaves_the_step_pending_and_the_same_reshard_finishes_it(how):
    """1 -> 4 -> 2: at COMMIT rank 1's worker switches its split tensors to their new allocations. Either that
    fails once (the worker reports it, the step is pending), or rank 1's transfer manager is killed while the
    worker is at it; then (restart_rank and) the same reshard finishes the step with every byte right."""
    with deployment(1, seed=41) as (backend, pool, kv, weights):
        step(backend, pool, kv, 4, timeout=60)
        intact(backend, kv, weights, 4)
        ops = pool.workers[1].ops
        real = ops.reshape_group
        entered, release, calls = threading.Event(), threading.Event(), []

        def commit(*args):
            calls.append(args)
            if how == "worker_fails_once" and len(calls) == 1:
                raise MemoryError("the new weight allocations cannot be mapped")
            if how == "transfer_manager_killed":
                entered.set()
                assert release.wait(30)
            return real(*args)
        ops.reshape_group = commit
        victim = backend.transfer_pids[1]

        def strike():           # once rank 1's worker is in its commit, its transfer manager dies
            if entered.wait(30):
                os.kill(victim, signal.SIGKILL)
            release.set()
        thread = threading.Thread(target=strike)
        if how == "transfer_manager_killed":
            thread.start()
        try:
            with pytest.raises(TransferError, match="rank 1"):
                step(backend, pool, kv, 2, timeout=15)
        finally:
            if thread.is_alive():
                release.set()
                thread.join()
        assert backend.status == RESHARDING
        if how == "transfer_manager_killed":
            backend.restart_rank(1)
        _, block_map = backend.reshard(2, timeout=60)
        kv.remap(block_map, backend.last_reshard["cpu_block_map"])
        del ops.reshape_group
        intact(backend, kv, weights, 2)
        assert backend.last_reshard["weight_allocations"]
        step(backend, pool, kv, 1, timeout=60)
        intact(backend, kv, weights, 1)
