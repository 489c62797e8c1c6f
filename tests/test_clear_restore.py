"""Clear and restore around RL weight updates (docs/design.md §6) on the sim device."""
import os
import threading
import time

import numpy as np
import pytest

from fastcache import RefusedError, SwapBackend, TransferError
from fastcache.ipc.barrier import ENGINE_PARTY
from fastcache.ipc.signal import CLEARED, CLEARING, NORMAL
from fastcache.launch.harness import shm_bytes, start_workers, stop_workers

from conftest import all_tensors, cpu_image, deployment, randomize, round_trip, small_spec, wait_for
from test_swap import LAYOUTS, check_round_trip


def cache_segments(suffix):
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(f"fastcache.{suffix}.cache_rank"))


def test_clear_frees_shared_memory_and_restore_brings_new_tensors():
    rng = np.random.default_rng(1)
    spec = small_spec(num_gpu_blocks=256)
    with deployment(spec, tp=2) as (backend, workers):
        round_trip(backend, workers, rng)
        old = workers[0].key_caches[0]
        assert len(cache_segments(backend.suffix)) == 2
        backend.allocate_cpu_blocks(3)
        del old                                        # the engine lets go of its views first
        backend.clear_caches(timeout=30)
        assert backend.status == CLEARED
        assert cache_segments(backend.suffix) == []    # the cache's bytes are gone from /dev/shm
        assert workers[0].key_caches == [] and not backend.signals.cache_ready.any()
        assert backend.allocator.num_free == spec.num_cpu_blocks     # every cached block is stale
        with pytest.raises(RefusedError, match="CLEARED"):   # a TransferError that says "later", not "broken"
            backend.swap_out([1], [1])
        backend.clear_caches(timeout=30)               # idempotent
        backend.restore_caches(timeout=30)
        assert backend.status == NORMAL and len(cache_segments(backend.suffix)) == 2
        assert len(workers[1].value_caches) == spec.num_layers
        round_trip(backend, workers, rng)


def test_twenty_cycles_stay_bit_exact_and_leak_nothing():
    rng = np.random.default_rng(2)
    spec = small_spec(num_gpu_blocks=64)
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        backend.cpu_tier(0)[...] = 1
        backend.cpu_tier(1)[...] = 1
        baseline = shm_bytes(backend.suffix)        # every page touched
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            round_trip(backend, workers, rng)
            backend.clear_caches(timeout=30)
            assert shm_bytes(backend.suffix) < baseline
            backend.restore_caches(timeout=30)
        round_trip(backend, workers, rng)
        assert shm_bytes(backend.suffix) <= baseline + 64 * 1024
        assert len(os.listdir("/proc/self/fd")) <= fds + 2


def test_clear_releases_swap_space_when_configured(monkeypatch):
    monkeypatch.setenv("FASTCACHE_CLEAR_SWAP_SPACE", "1")
    rng = np.random.default_rng(3)
    with deployment(small_spec(cache_dtype="block_wise_fp8"), tp=2) as (backend, workers):
        round_trip(backend, workers, rng)
        backend.clear_caches(timeout=30)
        left = [e for e in os.listdir("/dev/shm") if e.startswith(f"fastcache.{backend.suffix}.swap")]
        assert left == [] and not backend.signals.swap_space_ready.any()
        with pytest.raises(TransferError, match="no CPU tier"):
            backend.cpu_tier(0)
        backend.restore_caches(timeout=30)
        assert backend.signals.swap_space_ready.all()
        round_trip(backend, workers, rng)


def test_clear_waits_for_swaps_in_flight():
    rng = np.random.default_rng(4)
    spec = small_spec(num_gpu_blocks=512, num_cpu_blocks=512, head_dim=256)
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        want = [[rows.copy() for rows in all_tensors(w)] for w in workers]
        handles = [backend.swap_out(np.arange(i, 512, 8), np.arange(i, 512, 8)) for i in range(8)]
        backend.clear_caches(timeout=30)
        for h in handles:
            h.result(timeout=0)                     # all finished (successfully) before the clear went on
        for r, rows_wanted in enumerate(want):
            for info, wanted in zip(spec.tensors(), rows_wanted):
                cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
                assert np.array_equal(backend.cpu_tier(r)[:, cols], wanted)
        backend.restore_caches(timeout=30)


def test_swaps_racing_a_clear_either_finish_or_are_refused():
    """Swaps run while a clear starts: each one either finishes with its bytes in the CPU tier or is refused
    with the tier's bytes untouched. The clear starts once some have finished, the hammer stops once some
    were refused (conditions, not pauses)."""
    rng = np.random.default_rng(5)
    with deployment(small_spec(num_gpu_blocks=64, num_cpu_blocks=64), tp=2) as (backend, workers):
        for r, w in enumerate(workers):
            randomize(w, rng)
            backend.cpu_tier(r)[...] = rng.integers(0, 256, backend.cpu_tier(r).shape, dtype=np.uint8)
        want = [cpu_image(w, np.arange(64)) for w in workers]
        tier_before = [backend.cpu_tier(r).copy() for r in range(2)]
        done, refused, errors = set(), [], []
        stop = threading.Event()

        def hammer():
            i = 0
            while not stop.is_set():
                block = i % 64
                try:
                    backend.swap_out([block], [block]).result(timeout=20)
                    done.add(block)
                except TransferError as exc:
                    if "kv_cache_status" not in str(exc):
                        errors.append(exc)
                    refused.append(block)
                i += 1

        thread = threading.Thread(target=hammer)
        thread.start()
        try:
            wait_for(lambda: len(done) >= 3, 30, "three swaps done before the clear")
            backend.clear_caches(timeout=30)
            wait_for(lambda: refused, 30, "a swap refused after the clear")
        finally:
            stop.set()
            thread.join()
        assert not errors, errors
        for r in range(2):
            tier = backend.cpu_tier(r)
            for block in range(64):
                if block in done:
                    np.testing.assert_array_equal(tier[block], want[r][block], f"rank {r} block {block}")
                else:
                    np.testing.assert_array_equal(tier[block], tier_before[r][block], f"rank {r} block {block}")
        backend.restore_caches(timeout=30)
        round_trip(backend, workers, rng)


@pytest.mark.parametrize("layout", ["4k_rows", "8k_rows_fp8_scales"])
def test_clear_restore_cycles_over_rows_moved_run_by_run(layout):
    """Rows of 4 KiB and more take the sim copier's run-by-run path: every byte checked around each cycle."""
    rng = np.random.default_rng(6)
    with deployment(small_spec(**LAYOUTS[layout]), tp=2) as (backend, workers):
        for _ in range(3):
            check_round_trip(backend, workers, rng)
            backend.clear_caches(timeout=30)
            backend.restore_caches(timeout=30)
        check_round_trip(backend, workers, rng)


def test_restore_waits_for_a_slow_worker(monkeypatch):
    rng = np.random.default_rng(6)
    with deployment(small_spec(), tp=2) as (backend, workers):
        backend.clear_caches(timeout=30)
        real_allocate = workers[1].ops.allocate

        def slow_allocate(*args, **kwargs):
            time.sleep(1.0)
            return real_allocate(*args, **kwargs)

        monkeypatch.setattr(workers[1].ops, "allocate", slow_allocate)
        t0 = time.monotonic()
        backend.restore_caches(timeout=30)
        assert time.monotonic() - t0 >= 1.0 and backend.status == NORMAL
        round_trip(backend, workers, rng)


def test_restore_times_out_naming_a_worker_that_never_re_exports(monkeypatch):
    with deployment(small_spec(), tp=2) as (backend, workers):
        backend.clear_caches(timeout=30)

        def broken_allocate(*args, **kwargs):
            raise MemoryError("no memory for the cache")

        monkeypatch.setattr(workers[1].ops, "allocate", broken_allocate)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="rank 1"):
            backend.restore_caches(timeout=2)
        assert time.monotonic() - t0 < 10


def test_clear_with_a_killed_worker_process_fails_naming_it(monkeypatch):
    monkeypatch.setenv("FASTCACHE_WORKER_TIMEOUT", "30")      # the barrier, not the heartbeat, notices
    spec = small_spec()
    with SwapBackend(spec, tp_size=2, device="sim") as backend:
        procs = start_workers(backend, None, "numpy")
        try:
            backend.wait_ready(timeout=30)
            procs[1].kill()
            procs[1].wait()
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="worker rank 1 died"):
                backend.clear_caches(timeout=20)
            assert time.monotonic() - t0 < 10
        finally:
            stop_workers(procs)
    # the killed worker could not unlink its cache; closing the backend removed it (creator dead)


def test_clear_with_a_killed_transfer_manager_fails_naming_it():
    with deployment(small_spec(), tp=2) as (backend, workers):
        os.kill(backend.transfer_pids[0], 9)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="rank 0"):
            backend.clear_caches(timeout=20)
        assert time.monotonic() - t0 < 10


def test_worker_processes_follow_clear_and_restore():
    spec = small_spec(num_gpu_blocks=128)
    with SwapBackend(spec, tp_size=2, device="sim") as backend:
        procs = start_workers(backend, None, "numpy")
        try:
            backend.wait_ready(timeout=30)
            for _ in range(3):
                backend.swap_out([1, 2], [0, 1]).result(timeout=20)
                backend.clear_caches(timeout=30)
                assert cache_segments(backend.suffix) == []
                backend.restore_caches(timeout=30)
                assert len(cache_segments(backend.suffix)) == 2
        finally:
            stop_workers(procs)


def test_a_restore_that_failed_on_a_dead_rank_is_retried_after_a_restart():
    rng = np.random.default_rng(9)
    with deployment(small_spec(), tp=2) as (backend, workers):
        round_trip(backend, workers, rng)
        backend.clear_caches(timeout=30)
        os.kill(backend.transfer_pids[1], 9)
        with pytest.raises(TransferError, match="rank 1"):
            backend.restore_caches(timeout=10)
        backend.restart_rank(1)
        backend.restore_caches(timeout=30)
        assert backend.status == NORMAL
        round_trip(backend, workers, rng)


def test_a_clear_that_broke_midway_can_be_retried_after_a_restart():
    """A stalled transfer manager breaks the clear (status stays CLEARING); after restart_rank the
    same clear is attempted again and succeeds, and workers take part in the new attempt."""
    import signal
    rng = np.random.default_rng(10)
    with deployment(small_spec(), tp=2) as (backend, workers):
        round_trip(backend, workers, rng)
        stalled = backend.transfer_pids[1]
        os.kill(stalled, signal.SIGSTOP)
        try:
            with pytest.raises(TransferError, match="transfer manager rank 1 did not arrive in time"):
                backend.clear_caches(timeout=2)
            assert backend.status == CLEARING
        finally:
            os.kill(stalled, signal.SIGCONT)
        backend.restart_rank(1)
        backend.clear_caches(timeout=30)
        assert cache_segments(backend.suffix) == []
        backend.restore_caches(timeout=30)
        round_trip(backend, workers, rng)


def clear_on_a_thread(backend, errors) -> threading.Thread:
    """clear_caches(timeout=30) on a thread of its own, started; what it raises goes into errors."""
    def clear():
        try:
            backend.clear_caches(timeout=30)
        except BaseException as exc:        # reported by the test
            errors.append(exc)
    thread = threading.Thread(target=clear)
    thread.start()
    return thread


def wait_at_barrier(barrier, workers, epoch, what):
    """Until a phase after `epoch` has reset the barrier and every worker has arrived at it, ahead of the engine."""
    wait_for(lambda: barrier.epoch > epoch and all(
        barrier.generation(w.party) > barrier.generation(ENGINE_PARTY) for w in workers), 30, what)


def mapped_cache_segments(pid):
    with open(f"/proc/{pid}/maps") as maps:
        return [line.split()[-1] for line in maps if "cache_rank" in line]


def test_transfer_managers_really_unmap_the_cache_on_clear():
    """The memory is free only if no process maps it any more (an unlinked segment lives on in a mapping)."""
    rng = np.random.default_rng(11)
    with deployment(small_spec(), tp=2) as (backend, workers):
        round_trip(backend, workers, rng)
        assert all(mapped_cache_segments(pid) for pid in backend.transfer_pids)
        backend.clear_caches(timeout=30)
        assert [mapped_cache_segments(pid) for pid in backend.transfer_pids] == [[], []]
        assert mapped_cache_segments(os.getpid()) == []         # the in-process workers let go too
        backend.restore_caches(timeout=30)
        assert all(mapped_cache_segments(pid) for pid in backend.transfer_pids)


def test_a_clear_that_timed_out_on_a_task_in_flight_frees_nothing_under_it_when_retried(monkeypatch, tmp_path):
    """A clear times out draining a swap still copying: the worker, already at the clear's barrier, must not
    take the retry's barrier reset for the clear passing and free its cache while that swap still reads it
    (the retry drains it first, then the transfer managers let go, then the worker frees)."""
    from fastcache.transfer.manager import TEST_SWAP_OUT_GATE
    gate = tmp_path / "gate"
    monkeypatch.setenv(TEST_SWAP_OUT_GATE, str(gate))
    monkeypatch.setenv("FASTCACHE_INLINE_BYTES", "0")
    rng = np.random.default_rng(12)
    gate.touch()
    with deployment(small_spec(), tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        want = [cpu_image(w, [5, 7]) for w in workers]
        barrier = backend.barrier
        gate.unlink()                                   # swap-outs wait from here on
        retry = None
        try:
            held = backend.swap_out([5, 7], [2, 3])
            with pytest.raises(TransferError, match="timed out waiting for task"):
                backend.clear_caches(timeout=0.5)
            assert backend.status == CLEARING and not held.done()
            epoch = barrier.epoch
            errors = []
            retry = clear_on_a_thread(backend, errors)
            # the retry has reset the barrier and every worker has arrived for it: the clear waits for the swap
            wait_at_barrier(barrier, workers, epoch, "the workers at the retried clear's barrier")
            assert not held.done()
            assert all(w.ready for w in workers) and backend.signals.cache_ready[:2].all(), \
                "a worker freed its cache under a swap still in flight"
        finally:
            gate.touch()
            if retry is not None:
                retry.join()
        held.result(timeout=10)
        assert not errors, errors
        assert backend.status == CLEARED
        for r in range(2):
            np.testing.assert_array_equal(backend.cpu_tier(r)[[2, 3]], want[r])
        backend.restore_caches(timeout=30)
        round_trip(backend, workers, rng)


def test_a_swap_that_read_normal_before_a_clear_is_not_sent_after_the_restore():
    """A swap-in past its status check is held before it is sent while a clear and a restore run: the clear must
    wait for it (and drain it) before it frees anything. Sent after the restore, it copied a CPU block the clear
    had freed (KV of the old weights) into the new cache, and its handle succeeded."""
    rng = np.random.default_rng(13)
    with deployment(small_spec(), tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        cpu = backend.allocate_cpu_blocks(1)
        backend.swap_out([3], cpu).result(timeout=10)
        old_kv = [cpu_image(w, [3]) for w in workers]
        gate = backend._submissions
        real_send, real_wait = backend._send_task, gate.wait_idle
        held, at_gate, out = threading.Event(), threading.Event(), []

        def held_send(handle, message):
            held.set()
            at_gate.wait(60)
            return real_send(handle, message)

        def wait_idle(timeout):
            if gate.held:           # the submission holds the gate: the clear waits for it
                at_gate.set()
            return real_wait(timeout)
        backend._send_task, gate.wait_idle = held_send, wait_idle

        def submit():
            try:
                out.append(backend.swap_in([4], cpu).result(timeout=30))
            except Exception as exc:        # noqa: BLE001 -- asserted below
                out.append(exc)
        thread = threading.Thread(target=submit)
        thread.start()
        try:
            assert held.wait(30)
            backend.clear_caches(timeout=30)
            backend.restore_caches(timeout=30)
            for w in workers:
                randomize(w, rng)           # the new cache's own bytes
            fresh = [cpu_image(w, [4]) for w in workers]
        finally:
            at_gate.set()
            thread.join(60)
            backend._send_task, gate.wait_idle = real_send, real_wait
        assert len(out) == 1, out
        for r, w in enumerate(workers):
            assert not np.array_equal(cpu_image(w, [4]), old_kv[r]), f"rank {r}: KV from before the clear served"
            np.testing.assert_array_equal(cpu_image(w, [4]), fresh[r])


def test_a_clear_the_backend_closes_under_fails_as_closed_and_phases_after_close_are_refused(monkeypatch, tmp_path):
    """close() while a clear drains a swap on another thread: the clear fails with a TransferError saying the
    backend was closed (not whatever broke first as close tore the sockets, barrier and signals down), and every
    phase called after close is refused as a swap is."""
    from fastcache.transfer.manager import TEST_SWAP_OUT_GATE
    gate = tmp_path / "gate"
    monkeypatch.setenv(TEST_SWAP_OUT_GATE, str(gate))
    monkeypatch.setenv("FASTCACHE_INLINE_BYTES", "0")
    gate.touch()
    out = []
    with deployment(small_spec(), tp=2) as (backend, workers):
        randomize(workers[0], np.random.default_rng(14))
        gate.unlink()                                   # swap-outs wait from here on
        backend.swap_out([5], [2])

        def clear():
            try:
                backend.clear_caches(timeout=30)
                out.append(None)
            except Exception as exc:        # noqa: BLE001 -- asserted below
                out.append(exc)
        phase = threading.Thread(target=clear)
        phase.start()
        closing = threading.Thread(target=backend.close)
        try:
            wait_for(lambda: backend.status == CLEARING, 10, "the clear under way")
            closing.start()
            wait_for(lambda: not backend.running, 10, "the close under way")
        finally:
            gate.touch()
            if closing.ident is not None:
                closing.join(60)
            phase.join(60)
        assert not phase.is_alive() and len(out) == 1
        assert isinstance(out[0], TransferError) and "closed" in str(out[0]), repr(out[0])
    for call in (backend.clear_caches, backend.restore_caches, backend.sleep, backend.wake):
        with pytest.raises(TransferError, match="not running"):
            call(timeout=1)


def test_a_sleep_that_failed_saving_the_weights_leaves_no_worker_to_free_its_cache_at_the_next_clear(tmp_path,
                                                                                                     monkeypatch):
    """A sleep fails after publishing CLEARING (saving the weights failed), with the workers already at its
    barrier, and the deployment serves on: the next clear's barrier reset must not let them through that old
    generation to free their caches under a swap the clear is still draining."""
    from fastcache.transfer.manager import TEST_SWAP_OUT_GATE
    gate = tmp_path / "gate"
    monkeypatch.setenv(TEST_SWAP_OUT_GATE, str(gate))
    monkeypatch.setenv("FASTCACHE_INLINE_BYTES", "0")
    rng = np.random.default_rng(15)
    gate.touch()
    with deployment(small_spec(), tp=2) as (backend, workers):
        barrier = backend.barrier

        def failing_save(deadline):
            wait_for(lambda: all(barrier.generation(w.party) > barrier.generation(ENGINE_PARTY) for w in workers),
                     10, "the workers at the sleep's barrier")
            raise TransferError("injected: the resident weights could not be saved")
        monkeypatch.setattr(backend._weights, "save_resident", failing_save)
        with pytest.raises(TransferError, match="injected"):
            backend.sleep(1, timeout=30)
        assert backend.status == NORMAL and not backend.asleep
        for w in workers:
            randomize(w, rng)
        want = [cpu_image(w, [6]) for w in workers]
        gate.unlink()                                   # swap-outs wait from here on
        clear, errors = None, []
        try:
            held = backend.swap_out([6], [1])
            epoch = barrier.epoch
            clear = clear_on_a_thread(backend, errors)
            wait_at_barrier(barrier, workers, epoch, "the workers at the clear's barrier")
            assert not held.done()
            assert all(w.ready for w in workers), "a worker freed its cache under a swap still in flight"
        finally:
            gate.touch()
            if clear is not None:
                clear.join()
        held.result(timeout=10)
        assert not errors, errors
        for r in range(2):
            np.testing.assert_array_equal(backend.cpu_tier(r)[[1]], want[r])
        backend.restore_caches(timeout=30)
        round_trip(backend, workers, rng)
