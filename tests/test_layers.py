"""Layer-by-layer swap-in (docs/design.md §5): `swap_in(..., layerwise=True)` copies layer by layer in
layer order and publishes each layer once its rows are in place; the handle's `wait_layer(i)` and a
worker's `wait_layer(task_id, i)` return then, never before, and a failed task wakes every waiter."""
from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from conftest import all_tensors, cpu_image, deployment, randomize, round_trip, small_spec
from fastcache import RefusedError, TransferError
from fastcache.ipc.layers import FAILED, IN_PLACE, OWNER, LayerPublisher, SlotClaims, layers_in_place, wait_layer
from fastcache.ipc.signal import LAYER_SLOTS
from fastcache.transfer.manager import TEST_LAYER_PACE, TEST_SWAP_OUT_GATE

SPEC = small_spec(num_layers=6, num_gpu_blocks=32, num_cpu_blocks=32)
PACE = 0.05         # seconds after each published layer: a layer published before its copy would show


def layer_rows(worker, blocks):
    """{layer: [rows of each of its tensors at these GPU blocks]}."""
    out = {}
    for info, rows in zip(worker.spec.tensors(worker.rank, worker.device_id), all_tensors(worker)):
        out.setdefault(info.layer, []).append(rows[blocks].copy())
    return out


def prepared(backend, workers, rng, n=8):
    """n blocks swapped out; their destinations poisoned. Returns (dst, cpu, each rank's expected rows)."""
    src, dst = rng.choice(SPEC.num_gpu_blocks, (2, n), replace=False)
    cpu = np.array(backend.allocate_cpu_blocks(n))
    for w in workers:
        for rows in all_tensors(w):
            rows[src] = rng.integers(1, 256, rows[src].shape, dtype=np.uint8)
    want = [layer_rows(w, src) for w in workers]
    backend.swap_out(src, cpu).result(timeout=30)
    for w in workers:
        for rows in all_tensors(w):
            rows[dst] = rng.integers(1, 256, rows[dst].shape, dtype=np.uint8)
    return dst, cpu, want


def test_each_layer_is_in_place_when_its_wait_returns_and_not_before(monkeypatch):
    monkeypatch.setenv(TEST_LAYER_PACE, str(PACE))
    rng = np.random.default_rng(50)
    with deployment(SPEC, tp=2) as (backend, workers):
        dst, cpu, want = prepared(backend, workers, rng)
        began = time.monotonic()
        handle = backend.swap_in(dst, cpu, layerwise=True)
        ready_at = []
        for layer in range(SPEC.num_layers):
            handle.wait_layer(layer, timeout=30)
            ready_at.append(time.monotonic() - began)
            for w, expected in zip(workers, want):
                got = layer_rows(w, dst)
                for below in range(layer + 1):           # this layer and every one before it
                    for g, e in zip(got[below], expected[below]):
                        np.testing.assert_array_equal(g, e)
        handle.result(timeout=30)
        assert ready_at[0] < ready_at[-1]           # layer 0 was ready before the last one
        # the worker's side waits by task id on its own rank; on sim a stream is accepted and the host waits
        for w in workers:
            w.wait_layer(handle.task_id, SPEC.num_layers - 1, timeout=5)
            w.wait_layer(handle.task_id, SPEC.num_layers - 1, timeout=5, stream=12345)
        round_trip(backend, workers, rng)


def test_layer_zero_is_ready_well_before_the_whole_task(monkeypatch):
    """Measured here only as an order: layer 0's wait returns before the task is done (the benchmark
    prints the times)."""
    monkeypatch.setenv(TEST_LAYER_PACE, str(PACE))
    rng = np.random.default_rng(51)
    with deployment(SPEC, tp=1) as (backend, workers):
        dst, cpu, _ = prepared(backend, workers, rng)
        handle = backend.swap_in(dst, cpu, layerwise=True)
        handle.wait_layer(0, timeout=30)
        assert not handle.done()                    # five paced layers are still to come
        handle.result(timeout=30)


def test_a_transfer_manager_killed_while_a_layer_is_awaited_fails_every_waiter_naming_it(monkeypatch):
    monkeypatch.setenv(TEST_LAYER_PACE, "1.0")
    monkeypatch.setenv("FASTCACHE_TRANSFER_TIMEOUT", "2")
    monkeypatch.setenv("FASTCACHE_HEARTBEAT_INTERVAL", "0.2")
    rng = np.random.default_rng(52)
    with deployment(SPEC, tp=2) as (backend, workers):
        dst, cpu, _ = prepared(backend, workers, rng)
        handle = backend.swap_in(dst, cpu, layerwise=True)
        handle.wait_layer(0, timeout=30)
        errors = {}

        def worker_waits():
            try:
                workers[1].wait_layer(handle.task_id, SPEC.num_layers - 1, timeout=30)
            except Exception as exc:      # recorded for the assertions below
                errors["worker"] = exc
        waiter = threading.Thread(target=worker_waits)
        waiter.start()
        began = time.monotonic()
        backend._ranks.process(1).kill()
        with pytest.raises(TransferError, match="rank 1"):
            handle.wait_layer(SPEC.num_layers - 1, timeout=30)
        waiter.join(30)
        assert not waiter.is_alive(), "the worker was left blocked"
        assert isinstance(errors.get("worker"), TransferError) and "rank 1" in str(errors["worker"])
        assert time.monotonic() - began < 2 + 10
        with pytest.raises(TransferError, match="rank 1"):
            handle.result(timeout=30)           # rank 0 is done with its part (paced, on its main thread) too
        backend.restart_rank(1)
        backend.wait_ready(timeout=30)
        monkeypatch.delenv(TEST_LAYER_PACE)
        round_trip(backend, workers, rng)


def test_bad_layer_requests_are_refused_before_anything_moves():
    rng = np.random.default_rng(53)
    with deployment(SPEC, tp=1) as (backend, workers):
        dst, cpu, _ = prepared(backend, workers, rng, n=2)
        with pytest.raises(ValueError, match="layerwise must be a bool"):
            backend.swap_in(dst, cpu, layerwise="yes")
        plain = backend.swap_in(dst, cpu)
        with pytest.raises(ValueError, match="layerwise=True"):
            plain.wait_layer(0)
        plain.result(timeout=30)
        handle = backend.swap_in(dst, cpu, layerwise=True)
        for bad in (-1, SPEC.num_layers, 1.5, True):
            with pytest.raises(ValueError, match="layer must be an int"):
                handle.wait_layer(bad)
        handle.result(timeout=30)
        handle.wait_layer(SPEC.num_layers - 1, timeout=0)      # done: every layer is in place


@pytest.mark.parametrize("layout", [dict(num_extra_layers=2, num_extra_gpu_blocks=12),
                                    dict(cache_dtype="block_wise_fp8"), dict(has_value=False)],
                         ids=["draft_layers", "fp8_scales", "k_only"])
def test_a_layerwise_swap_in_writes_exactly_what_a_plain_one_does(layout):
    spec = small_spec(num_layers=3, num_gpu_blocks=24, num_cpu_blocks=16, **layout)
    rng = np.random.default_rng(54)
    with deployment(spec, tp=2) as (backend, workers):
        for r, w in enumerate(workers):
            randomize(w, rng)
            tier = backend.cpu_tier(r)
            tier[...] = rng.integers(1, 256, tier.shape, dtype=np.uint8)
        before = [[rows.copy() for rows in all_tensors(w)] for w in workers]
        gpu, cpu = rng.choice(24, 10, replace=False), rng.choice(16, 10, replace=False)   # some past the drafts'
        backend.swap_in(gpu, cpu).result(timeout=30)
        plain = [[rows.copy() for rows in all_tensors(w)] for w in workers]
        for w, saved in zip(workers, before):
            for rows, old in zip(all_tensors(w), saved):
                rows[...] = old
        handle = backend.swap_in(gpu, cpu, layerwise=True)
        handle.wait_layer(spec.total_layers - 1, timeout=30)
        for w, expected in zip(workers, plain):
            for rows, e in zip(all_tensors(w), expected):
                np.testing.assert_array_equal(rows, e)


def test_a_wait_never_reads_a_later_task_s_progress_as_its_own(monkeypatch, tmp_path):
    """A layer-by-layer swap-in B held behind a conflicting swap-out, 63 unrelated swaps, then a layer-by-layer
    swap-in C that (with ids in a row) would share B's slot: B's waits, the handle's and the worker's, return
    only once B's own layers are in place, with B's bytes."""
    gate = tmp_path / "gate"
    monkeypatch.setenv(TEST_SWAP_OUT_GATE, str(gate))
    monkeypatch.setenv("FASTCACHE_INLINE_BYTES", "0")       # every task on an executor: a held one holds no other
    rng = np.random.default_rng(55)
    gate.touch()
    with deployment(SPEC, tp=2) as (backend, workers):
        dst, cpu, want = prepared(backend, workers, rng, n=4)
        gate.unlink()                                   # swap-outs wait from here on
        try:
            spare = backend.allocate_cpu_blocks(1)
            held = backend.swap_out(dst[:1], spare)     # reads dst[0]: B must wait for it
            b = backend.swap_in(dst, cpu, layerwise=True)
            others = [g for g in range(SPEC.num_gpu_blocks) if g not in set(dst.tolist())]
            unrelated = backend.allocate_cpu_blocks(2)
            for _ in range(LAYER_SLOTS - 1):
                backend.swap_in(others[:1], unrelated[:1]).result(timeout=30)     # they run meanwhile
            c = backend.swap_in(others[1:3], unrelated, layerwise=True)
            c.wait_layer(SPEC.num_layers - 1, timeout=30)
            c.result(timeout=30)
            assert not held.done() and not b.done()
            with pytest.raises(TimeoutError):
                b.wait_layer(0, timeout=0.3)
            for w in workers:
                with pytest.raises(TimeoutError):
                    w.wait_layer(b.task_id, 0, timeout=0.3)
            for w in workers:                           # B's rows still hold what they held
                assert all(not np.array_equal(g, e) for g, e in zip(layer_rows(w, dst)[0], want[0][0]))
        finally:
            gate.touch()
        for layer in range(SPEC.num_layers):
            b.wait_layer(layer, timeout=30)
            for w, expected in zip(workers, want):
                for g, e in zip(layer_rows(w, dst)[layer], expected[layer]):
                    np.testing.assert_array_equal(g, e)
        for w in workers:
            w.wait_layer(b.task_id, SPEC.num_layers - 1, timeout=30)
        b.result(timeout=30)
        held.result(timeout=30)
        round_trip(backend, workers, rng)


def test_a_worker_s_wait_refuses_what_no_task_can_satisfy_at_once():
    rng = np.random.default_rng(56)
    with deployment(SPEC, tp=1) as (backend, (worker,)):
        dst, cpu, want = prepared(backend, [worker], rng, n=3)
        plain = backend.swap_in(dst, cpu).result(timeout=30)
        handle = backend.swap_in(dst, cpu, layerwise=True)
        began = time.monotonic()
        for layer in (-1, SPEC.num_layers, 1.5, True):
            with pytest.raises(ValueError, match="layer must be an int"):
                worker.wait_layer(handle.task_id, layer, timeout=None)
        for task_id in (0, -3, True, "1"):
            with pytest.raises(ValueError, match="task_id must be a positive int"):
                worker.wait_layer(task_id, 0, timeout=None)
        for task_id in (plain.task_id, handle.task_id + 1, handle.task_id + LAYER_SLOTS):
            with pytest.raises(ValueError, match="not a layer-by-layer task"):
                worker.wait_layer(task_id, 0, timeout=None)
        assert time.monotonic() - began < 5, "a refused wait waited"
        worker.wait_layer(handle.task_id, SPEC.num_layers - 1, timeout=30)
        handle.result(timeout=30)
        for layer in range(SPEC.num_layers):
            for g, e in zip(layer_rows(worker, dst)[layer], want[0][layer]):
                np.testing.assert_array_equal(g, e)


def test_a_task_failed_before_its_layers_start_fails_the_worker_s_wait_at_once(monkeypatch):
    """The failure is the rank's (an injected fault before the copy starts): the worker's wait raises as the
    handle does, long before its timeout, and the other rank's worker sees its own rank's bytes."""
    monkeypatch.setenv("FASTCACHE_FAIL_EVERY", "1:1")      # every task on rank 1 fails before it copies
    rng = np.random.default_rng(57)
    with deployment(SPEC, tp=2) as (backend, workers):
        for r, w in enumerate(workers):
            randomize(w, rng)
            tier = backend.cpu_tier(r)
            tier[...] = rng.integers(1, 256, tier.shape, dtype=np.uint8)
        dst, cpu = rng.choice(SPEC.num_gpu_blocks, 4, replace=False), np.arange(4)
        began = time.monotonic()
        handle = backend.swap_in(dst, cpu, layerwise=True)
        with pytest.raises(TransferError, match="rank 1"):
            workers[1].wait_layer(handle.task_id, SPEC.num_layers - 1, timeout=20)
        assert time.monotonic() - began < 10, "the worker waited out its timeout"
        with pytest.raises(TransferError, match="rank 1"):
            handle.wait_layer(0, timeout=20)
        workers[0].wait_layer(handle.task_id, SPEC.num_layers - 1, timeout=20)     # rank 0 did its part
        np.testing.assert_array_equal(cpu_image(workers[0], dst), backend.cpu_tier(0)[cpu])


def test_the_engine_never_gives_two_unfinished_tasks_one_slot():
    """SlotClaims alone: ids whose slot an unfinished task holds are skipped, the 65th task in flight is refused
    (nothing claimed), and a finished task's slot serves again once released."""
    import itertools
    claims = np.zeros((2, LAYER_SLOTS, 2), np.int64)
    slots = SlotClaims("a layer-by-layer swap-in")
    SlotClaims.open(claims)
    ids = itertools.count(1)
    first = slots.claim(claims, range(2), ids)
    for _ in range(LAYER_SLOTS - 1):
        next(ids)                                   # other tasks take ids 2..64 meanwhile
    later = slots.claim(claims, range(2), ids)
    assert (first, later) == (1, LAYER_SLOTS + 2), "id 65 would share task 1's slot: it is skipped"
    held = [slots.claim(claims, range(2), ids) for _ in range(LAYER_SLOTS - 2)]
    assert len({t % LAYER_SLOTS for t in [first, later, *held]}) == LAYER_SLOTS
    before = claims.copy()
    with pytest.raises(RefusedError, match="in flight"):
        slots.claim(claims, range(2), ids)
    np.testing.assert_array_equal(claims, before)
    SlotClaims.settle(claims, 1, first, ok=False)
    assert layers_in_place(np.zeros((2, LAYER_SLOTS, 3), np.int64), 1, first, claims=claims) == FAILED
    slots.release(first)
    again = slots.claim(claims, range(2), ids)
    assert again % LAYER_SLOTS == first % LAYER_SLOTS
    with pytest.raises(ValueError, match="not a layer-by-layer task"):
        layers_in_place(np.zeros((2, LAYER_SLOTS, 3), np.int64), 1, first, claims=claims)


class OvertakenSlot:
    """One slot of layer_ready as a late task's publisher sees it: right after it reads the slot's task id (its
    ownership check), a later task takes the slot over, as another thread of the transfer manager can."""

    def __init__(self, real, take_over):
        self.real, self.take_over = real, take_over

    def __getitem__(self, field):
        value = self.real[field]
        if field == OWNER and self.take_over is not None:
            take_over, self.take_over = self.take_over, None
            take_over()
        return value

    def __setitem__(self, field, value):
        self.real[field] = value


def test_a_late_task_s_count_is_never_read_as_the_later_task_s_own():
    """Task 1 ran late on rank 0 (the engine failed it there and released its slot); task 65 claimed the slot,
    and its publisher took it over between task 1's ownership check and its write: a wait for task 65 still
    waits for task 65's own layers, and returns once they are in place."""
    import itertools
    ready = np.zeros((1, LAYER_SLOTS, 3), np.int64)
    claims = np.zeros((1, LAYER_SLOTS, 2), np.int64)
    slots = SlotClaims("a layer-by-layer swap-in")
    SlotClaims.open(claims)
    ids = itertools.count(1)
    first = slots.claim(claims, [0], ids)
    late = LayerPublisher(ready, 0, first)
    late.published(0)
    SlotClaims.settle(claims, 0, first, ok=False)       # failed on rank 0 by the engine; it still runs there
    slots.release(first)
    for _ in range(LAYER_SLOTS - 1):
        next(ids)
    later = slots.claim(claims, [0], ids)
    assert later % LAYER_SLOTS == first % LAYER_SLOTS
    publishers = []
    late._slot = OvertakenSlot(ready[0, first % LAYER_SLOTS],
                               lambda: publishers.append(LayerPublisher(ready, 0, later)))
    late.published(2)                               # three layers of task 1, written into task 65's slot
    assert publishers and int(ready[0, later % LAYER_SLOTS, OWNER]) == later, "the take-over did not happen"
    assert layers_in_place(ready, 0, later, claims=claims) == 0
    signals = types.SimpleNamespace(layer_ready=ready, layer_claims=claims)
    with pytest.raises(TimeoutError):
        wait_layer(signals, [0], later, 2, timeout=0.2)
    for layer in range(3):
        publishers[0].published(layer)
    wait_layer(signals, [0], later, 2, timeout=30)
    assert layers_in_place(ready, 0, later, claims=claims) == 3


def test_a_handle_released_twice_frees_only_its_own_slot():
    """A second release of a finished task's id, after a later task took its slot, leaves the later task's
    claim held: the next claim does not get that slot."""
    import itertools
    claims = np.zeros((1, LAYER_SLOTS, 2), np.int64)
    slots = SlotClaims("a layer-by-layer swap-in")
    SlotClaims.open(claims)
    ids = itertools.count(1)
    first = slots.claim(claims, [0], ids)
    slots.release(first)
    for _ in range(LAYER_SLOTS - 1):
        next(ids)
    later = slots.claim(claims, [0], ids)
    assert later % LAYER_SLOTS == first % LAYER_SLOTS
    slots.release(first)                            # the first handle again
    held = [slots.claim(claims, [0], ids) for _ in range(LAYER_SLOTS - 1)]
    assert later % LAYER_SLOTS not in {t % LAYER_SLOTS for t in held}
    with pytest.raises(RefusedError, match="in flight"):
        slots.claim(claims, [0], ids)
    assert int(claims[0, later % LAYER_SLOTS, 0]) == later


def test_a_handle_s_wait_answers_from_its_reports_once_a_later_task_has_its_slot(monkeypatch, tmp_path):
    """63 layer-by-layer swap-ins held behind a swap-out hold every slot but task A's. A's ranks report (its
    slot is free from then on) while its done callback still runs, and a later task takes the slot: A's own
    wait for a layer returns, as its reports say every layer is in place, instead of raising the ValueError
    meant for a task id that names no layer-by-layer task."""
    gate = tmp_path / "gate"
    monkeypatch.setenv(TEST_SWAP_OUT_GATE, str(gate))
    monkeypatch.setenv("FASTCACHE_INLINE_BYTES", "0")       # every task on an executor: a held one holds no other
    rng = np.random.default_rng(58)
    gate.touch()
    with deployment(SPEC, tp=1) as (backend, workers):
        dst, cpu, want = prepared(backend, workers, rng, n=4)
        others = [g for g in range(SPEC.num_gpu_blocks) if g not in set(dst.tolist())]
        spare = backend.allocate_cpu_blocks(2)
        entered, go = threading.Event(), threading.Event()

        def callback(_):
            entered.set()
            go.wait(60)
        gate.unlink()                                   # swap-outs wait from here on
        try:
            held = backend.swap_out(others[:1], spare[:1])
            behind = [backend.swap_in(others[:1], spare[1:], layerwise=True) for _ in range(LAYER_SLOTS - 1)]
            a = backend.swap_in(dst, cpu, layerwise=True)
            a.add_done_callback(callback)
            assert entered.wait(30), "task A did not finish"
            later = backend.swap_in(others[1:2], spare[1:], layerwise=True)
            assert later.task_id % LAYER_SLOTS == a.task_id % LAYER_SLOTS     # the only slot free
            assert not a.done()                         # its callback runs
            assert a.wait_layer(SPEC.num_layers - 1, timeout=30) is a
        finally:
            go.set()
            gate.touch()
        a.result(timeout=30)
        for layer in range(SPEC.num_layers):
            for g, e in zip(layer_rows(workers[0], dst)[layer], want[0][layer]):
                np.testing.assert_array_equal(g, e)
        for handle in [held, *behind, later]:
            handle.result(timeout=30)
        round_trip(backend, workers, rng)


def test_a_wait_for_a_task_from_before_a_clear_is_refused_after_the_restore():
    """The clear frees the cache and the restore makes new tensors, so a layer-by-layer swap-in from before the
    clear has nothing in place any more: a worker's wait for it is refused (ValueError), never answered as in
    place, and a swap-in after the restore is waited for and lands as before."""
    rng = np.random.default_rng(59)
    with deployment(SPEC, tp=2) as (backend, workers):
        dst, cpu, want = prepared(backend, workers, rng, n=3)
        before = backend.swap_in(dst, cpu, layerwise=True)
        before.result(timeout=30)
        for w in workers:
            w.wait_layer(before.task_id, SPEC.num_layers - 1, timeout=30)
        backend.clear_caches(timeout=30)
        backend.restore_caches(timeout=30)
        for w in workers:
            with pytest.raises(ValueError, match="not a layer-by-layer task"):
                w.wait_layer(before.task_id, 0, timeout=5)
        round_trip(backend, workers, rng)
        dst, cpu, want = prepared(backend, workers, rng, n=3)
        after = backend.swap_in(dst, cpu, layerwise=True)
        for w, expected in zip(workers, want):
            w.wait_layer(after.task_id, SPEC.num_layers - 1, timeout=30)
            for layer in range(SPEC.num_layers):
                for g, e in zip(layer_rows(w, dst)[layer], expected[layer]):
                    np.testing.assert_array_equal(g, e)
        after.result(timeout=30)
