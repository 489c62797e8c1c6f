"""TransferHandle on its own (engine/handle.py): completion by the ranks' reports, the waits of result(), and the
callbacks that run before any waiter returns. No processes: the reports are made here."""
from __future__ import annotations

import threading

import pytest

from fastcache import TransferError
from fastcache.engine.combined import CombinedHandle
from fastcache.engine.handle import TransferHandle
from fastcache.ipc import protocol


def test_a_handle_completes_once_every_rank_reported_and_not_before():
    h = TransferHandle(7, protocol.SWAP_TO_CPU, range(3), 300)
    for rank, left in ((2, r"\[0, 1\]"), (0, r"\[1\]")):
        h.rank_finished(rank, nbytes=100)
        assert not h.done()
        with pytest.raises(TimeoutError, match=rf"task 7 .*waiting for ranks {left}"):
            h.result(timeout=0)
    h.rank_finished(1, nbytes=100, seconds=0.5)
    h.rank_finished(1, nbytes=100)          # a report twice counts once
    assert h.done() and h.result(timeout=0) is h and h.result() is h
    assert (h.nbytes, h.run_seconds, h.error) == (300, 0.5, None) and h.elapsed >= 0


@pytest.mark.parametrize("timeout", [0, -1, 0.01])
def test_a_pending_handle_times_out_without_waiting_for_a_negative_or_zero_timeout(timeout):
    h = TransferHandle(3, protocol.SWAP_TO_GPU, range(1), 10)
    with pytest.raises(TimeoutError):
        h.result(timeout=timeout)
    assert not h.done()
    h.rank_finished(0, nbytes=10)
    assert h.result(timeout=timeout) is h       # done: no timeout matters any more


def test_every_waiter_wakes_with_the_outcome_after_the_callbacks_ran():
    h = TransferHandle(9, protocol.SWAP_TO_CPU, range(2), 20)
    seen, got = [], []
    h.add_done_callback(lambda handle: seen.append(handle.done()))
    ready = threading.Barrier(9)

    def wait(timeout):
        ready.wait()
        try:
            h.result(timeout)
        except TransferError as exc:
            got.append((str(exc), list(seen)))
    waiters = [threading.Thread(target=wait, args=(None if i % 2 else 30,)) for i in range(8)]
    for t in waiters:
        t.start()
    ready.wait()
    h.rank_finished(0, nbytes=10)
    h.rank_finished(1, "copy failed", lost=False)
    for t in waiters:
        t.join(30)
    assert not any(t.is_alive() for t in waiters)
    # each waiter returned after the callback had run, and it ran while the handle was not yet done
    assert got == [("task 9 (SWAP_TO_CPU) failed on rank 1: copy failed", [False])] * 8
    late = []
    h.add_done_callback(late.append)        # once done: at once
    assert late == [h]


def test_a_combined_handle_is_done_once_its_parts_are():
    a, b = (TransferHandle(i, protocol.SWAP_TO_GPU, range(1), 1) for i in (1, 2))
    both = CombinedHandle([a, b], "load", 1)
    a.rank_finished(0)
    with pytest.raises(TimeoutError):
        both.result(timeout=0.01)
    b.rank_finished(0, "gone", lost=True)
    with pytest.raises(TransferError, match="task 2 .*rank 0: gone"):
        both.result(timeout=5)
    assert both.done() and b.ranks_lost
