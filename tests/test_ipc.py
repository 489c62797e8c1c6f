"""Signals, segments and the phase barrier across real processes."""
import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

from fastcache.ipc import BrokenBarrierError, IPCSignal, RankBarrier
from fastcache.ipc.naming import new_suffix
from fastcache.ipc.shm import SegmentError, SharedSegment, read_creator

ctx = mp.get_context("spawn")


def _bump(suffix, value):
    sig = IPCSignal("probe", (4,), np.int64, suffix)
    sig.value[2] = value
    sig.close()


def test_signal_is_shared_between_processes_and_unlinked_by_creator():
    suffix = new_suffix()
    sig = IPCSignal("probe", (4,), np.int64, suffix, create=True)
    value = int(np.random.default_rng().integers(1, 2**40))
    p = ctx.Process(target=_bump, args=(suffix, value))
    p.start()
    p.join(30)
    assert p.exitcode == 0 and sig.value[2] == value and sig.value[0] == 0
    assert os.path.exists(f"/dev/shm/fastcache.{suffix}.signal.probe")
    sig.close()
    assert not os.path.exists(f"/dev/shm/fastcache.{suffix}.signal.probe")


def test_segment_header_names_creator_and_mode_is_private():
    suffix = new_suffix()
    with SharedSegment.create(f"/fastcache.{suffix}.x", 100, suffix) as seg:
        pid, _start, owner = read_creator(seg.name)
        assert (pid, owner) == (os.getpid(), suffix)
        assert os.stat(f"/dev/shm/fastcache.{suffix}.x").st_mode & 0o777 == 0o600
        with pytest.raises(SegmentError, match="already exists"):
            SharedSegment.create(seg.name, 100, suffix)
        with pytest.raises(SegmentError, match="belongs to deployment"):
            SharedSegment.attach(seg.name, "someone-else")
    with pytest.raises(SegmentError, match="does not exist"):
        SharedSegment.attach(f"/fastcache.{suffix}.x", suffix)


def _barrier_party(suffix, party, delay, timeout, out):
    barrier = RankBarrier(suffix, 3)
    barrier.register(party)
    time.sleep(delay)
    try:
        out.put((party, barrier.wait(party, timeout)))
    except BrokenBarrierError as exc:
        out.put((party, str(exc)))
    barrier.close()


def test_barrier_releases_all_parties_together():
    suffix = new_suffix()
    barrier = RankBarrier(suffix, 3, create=True)
    barrier.register(0)
    out = ctx.Queue()
    procs = [ctx.Process(target=_barrier_party, args=(suffix, p, 0.3 * p, 20, out)) for p in (1, 2)]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    assert barrier.wait(0, 20) == 1
    assert time.monotonic() - t0 >= 0.3            # waited for the slowest party
    assert sorted(out.get(timeout=20) for _ in procs) == [(1, 1), (2, 1)]
    for p in procs:
        p.join(10)
    barrier.close()


def _arrive_then_hang(suffix, party):
    barrier = RankBarrier(suffix, 3)
    barrier.register(party)
    time.sleep(60)


def test_barrier_breaks_when_a_party_dies_instead_of_hanging():
    suffix = new_suffix()
    barrier = RankBarrier(suffix, 3, create=True, party_names=["engine", "rank 0", "rank 1"])
    barrier.register(0)
    victim = ctx.Process(target=_arrive_then_hang, args=(suffix, 2))
    victim.start()
    out = ctx.Queue()
    helper = ctx.Process(target=_barrier_party, args=(suffix, 1, 0, 30, out))
    helper.start()
    while barrier._pids[2] == 0:
        time.sleep(0.01)
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(BrokenBarrierError, match="rank 1 died") as info:
        barrier.wait(0, 30)
    assert time.monotonic() - t0 < 5 and info.value.missing == [2]
    party, message = out.get(timeout=10)       # the other waiter is released too, not left hanging
    assert party == 1 and "broken" in message or "died" in message
    for p in (victim, helper):
        p.join(10)
    barrier.close()


def test_barrier_times_out_on_a_late_party_and_can_be_reused_after_reset():
    suffix = new_suffix()
    barrier = RankBarrier(suffix, 2, create=True, party_names=["engine", "worker"])
    barrier.register(0)
    with pytest.raises(BrokenBarrierError, match="worker did not arrive in time"):
        barrier.wait(0, 0.2)
    barrier.reset()
    out = ctx.Queue()
    barrier2_party = ctx.Process(target=_barrier_party2, args=(suffix, out))
    barrier2_party.start()
    gen = barrier.wait(0, 20)
    assert out.get(timeout=20) == gen
    barrier2_party.join(10)
    barrier.close()


def _barrier_party2(suffix, out):
    barrier = RankBarrier(suffix, 2)
    barrier.register(1)
    out.put(barrier.wait(1, 20))
    barrier.close()



def _meet(barrier, parties):
    """Each party waits once, on threads; the generations they got."""
    done = {}
    threads = [threading.Thread(target=lambda p=p: done.__setitem__(p, barrier.wait(p, 10))) for p in parties]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    return done


@pytest.mark.parametrize("settled", [True, False], ids=["settled", "reset-at-once"])
def test_settle_holds_a_reset_until_a_slow_party_has_seen_the_broken_generation(settled):
    """Worker 0 aborts generation 1 before worker 1 reached it. With settle, worker 1 arrives, learns that
    generation 1 broke, and only then the reset lets everyone meet in generation 2. Reset at once (the negative
    control), worker 1's late wait for generation 1 is counted in generation 2 and returns as if it had
    passed."""
    suffix = new_suffix()
    barrier = RankBarrier(suffix, 3, create=True, party_names=["engine", "worker 0", "worker 1"])
    try:
        for p in range(3):
            barrier.register(p)
        barrier.abort(1)
        with pytest.raises(BrokenBarrierError, match="worker 0 reported a failure"):
            barrier.wait(0, 5)
        if settled:
            assert barrier.settle(0.05) == [2]          # the slow worker, not the one that aborted
            with pytest.raises(BrokenBarrierError, match="worker 0 reported a failure"):
                barrier.wait(2, 5)                      # it arrives late and learns of the failure
            assert barrier.settle(5) == []
            barrier.reset()
            assert _meet(barrier, [0, 1, 2]) == {0: 2, 1: 2, 2: 2}
        else:
            barrier.reset()
            # worker 1 still means generation 1; it meets the others' generation 2 and passes
            assert _meet(barrier, [0, 1, 2]) == {0: 2, 1: 2, 2: 2}
            assert barrier.settle(0.05) == []           # nothing tells them apart any more
    finally:
        barrier.close()
