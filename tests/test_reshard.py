"""Liquid resharding (docs/design.md §9) on the sim device: the plan on its own (every head slice lands,
in place, for every tp change, also after a crash mid-chunk), then whole deployments (worker processes and
in-process workers) resharded 1 -> 2 -> 4 -> 2 -> 1 with every live GPU block and used CPU block checked
bit for bit, bad requests, and ranks killed or stalled in the middle of a step."""
import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest

from fastcache import RefusedError, SwapBackend, TieredCache, TransferError
from fastcache.config import CacheSpec
from fastcache.ops.host_memory import numpy_copy
from fastcache.reshard_plan import MAX_STAGING_BYTES, Capacity, Plan, compact_map, least, resharded_spec, run_chunks
from fastcache.ipc.signal import NORMAL, RESHARDING
from fastcache.launch.verify import Checks
from fastcache.launch.harness import WorkerProcesses
from fastcache.launch.liquid import BlockModel, ShmSampler, liquid, shm_now
from fastcache.transfer.reshard import TEST_PACE
from fastcache.worker import CacheWorker

from conftest import MemoryJournal, deployment, round_trip, small_spec


# -- the plan, without processes -------------------------------------------------------------------
def simulate(spec, m, n, live, cpu_live, staging, rng, crash=False):
    """Run a plan over NumPy memories (one per rank and tensor, and CPU tier), in the waves' order, on the
    same buffers in place; with crash, every in-place program is cut short at a random copy and resumed
    from its journal. Returns the plan; asserts every live block's head slices landed."""
    plan = Plan(spec, m, n, [Capacity.of(spec)] * m, live, cpu_live, staging)
    new = plan.new_spec
    mem = {}
    for r in range(max(m, n)):
        for sp in plan.spaces:
            size = max(sp.old_bytes(), sp.new_bytes())
            mem[plan._ref(sp, r)] = rng.integers(1, 256, size, dtype=np.uint8) if r < m else np.zeros(size, np.uint8)
        for kind in ("gpu", "cpu"):
            mem["staging", r, kind] = np.zeros(max(1, plan.staging_bytes_for(r, kind)), np.uint8)

    def block(sp, b, tp, geometry, row):
        """All heads of block b in space sp: per tensor, the ranks' slices side by side."""
        if sp.key[0] == "gpu":
            return np.concatenate([mem[plan._ref(sp, r)][b * row:(b + 1) * row] for r in range(tp)])
        return np.concatenate([mem[plan._ref(sp, r)][b * row + t.cpu_offset:b * row + t.cpu_offset + t.block_bytes]
                               for t in geometry.tensors() for r in range(tp)])

    want = {(sp.key, nb): block(sp, ob, m, spec, sp.old_row)
            for sp in plan.spaces for ob, nb in zip(*plan._pairs(sp))}
    execute = numpy_copy(lambda ref: mem[ref])
    for r in range(m):
        run_chunks(plan.compaction(r), execute)
    for wave in plan.waves:
        for r in wave:
            chunks, journaled = plan.program(r)
            if not journaled or not crash:
                run_chunks(chunks, execute)
                continue
            journal = MemoryJournal()
            budget = int(rng.integers(0, 1 + sum(len(c.gather) + len(c.write) for c in chunks)))

            def dying(c):
                nonlocal budget
                if budget == 0:
                    raise InterruptedError
                budget -= 1
                execute(c)
            with pytest.raises(InterruptedError) if budget < sum(len(c.gather) + len(c.write) for c in chunks) \
                    else _nothing():
                run_chunks(chunks, dying, journal)
            run_chunks(chunks, execute, journal)          # the replacement resumes from the journal
    for (key, nb), expected in want.items():
        sp = next(s for s in plan.spaces if s.key == key)
        assert np.array_equal(block(sp, nb, n, new, sp.new_row), expected), (key, nb, m, n)
    return plan


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def divisors(h):
    return [t for t in range(1, h + 1) if h % t == 0]


@pytest.mark.parametrize("heads,dtype,draft", [(4, "bfloat16", 0), (6, "block_wise_fp8", 1), (12, "uint8", 0),
                                              (8, "float16", 2)])
def test_every_head_slice_lands_in_place_for_every_tp_change(heads, dtype, draft):
    rng = np.random.default_rng(heads)
    for m in divisors(heads):
        for n in divisors(heads):
            if m == n:
                continue
            blocks = int(rng.integers(3, 12)) * heads // (heads // m)
            spec = CacheSpec(num_layers=2, num_gpu_blocks=blocks, num_cpu_blocks=max(2, blocks // 2), block_size=2,
                             num_kv_heads=heads // m, head_dim=3, cache_dtype=dtype, num_extra_layers=draft,
                             num_extra_gpu_blocks=max(1, blocks - 3) if draft else None)
            new = resharded_spec(spec, m, n, Capacity.of(spec))
            # in place: the CPU tier's blocks and their slots (per head) fit the memory the rank has
            assert new.cpu_cache_bytes <= spec.cpu_cache_bytes
            live = np.sort(rng.choice(blocks, int(rng.integers(0, min(new.num_gpu_blocks, blocks) + 1)), replace=False))
            if draft:       # blocks with draft rows must fit below the new draft count
                with_draft = live[live < spec.num_extra_gpu_blocks]
                live = np.setdiff1d(live, with_draft[new.num_extra_gpu_blocks // 2:])
            cpu = np.sort(rng.choice(spec.num_cpu_blocks, int(rng.integers(0, min(new.num_cpu_blocks,
                                                                                 spec.num_cpu_blocks) + 1)),
                                     replace=False))
            staging = int(rng.integers(1, 4)) * max(new.cpu_block_stride, spec.cpu_block_stride)
            simulate(spec, m, n, live, cpu, staging, rng, crash=True)


def test_rows_shrink_in_ascending_order_and_grow_in_descending_order_through_bounded_staging():
    spec = small_spec(num_gpu_blocks=40, num_cpu_blocks=20, num_kv_heads=4)
    out = Plan(spec, 1, 2, [Capacity.of(spec)], range(40), range(20), staging_bytes=4096)
    chunks, journaled = out.program(0)
    assert journaled and chunks
    firsts = [c.write[0].dst_rows[0] for c in chunks if c.write[0].dst[0] == "gpu" and c.write[0].dst[2] == 0]
    assert firsts == sorted(firsts)                      # scale-out: ascending
    assert all(len(c.write[0].dst_rows) * out.spaces[0].new_row <= 4096 for c in chunks if c.write[0].dst[0] == "gpu")
    back = Plan(out.new_spec, 2, 1, [Capacity.of(spec)] * 2, range(20), range(10), staging_bytes=4096)
    chunks, _ = back.program(0)
    firsts = [c.write[0].dst_rows[0] for c in chunks if c.write[0].dst[0] == "gpu" and c.write[0].dst[2] == 0]
    assert firsts == sorted(firsts, reverse=True)        # scale-in: descending
    assert back.program(1) == ([], False) and back.waves == [[0]]
    assert out.waves == [[1], [0]] and out.fresh == [1] and back.retired == [1]
    assert Plan(spec, 1, 4, [Capacity.of(spec)], range(40)).waves == [[1, 2, 3], [0]]
    two = resharded_spec(spec, 1, 2, Capacity.of(spec))
    assert Plan(two, 2, 4, [Capacity.of(spec)] * 2, range(80)).waves == [[2, 3], [1], [0]]
    four = resharded_spec(spec, 1, 4, Capacity.of(spec))
    assert Plan(four, 4, 2, [Capacity.of(spec)] * 4, range(80)).waves == [[0], [1]]


def test_block_maps_keep_ids_that_fit_and_compact_the_rest():
    assert compact_map(np.array([1, 5, 9]), 10).tolist() == [1, 5, 9]
    assert compact_map(np.array([1, 5, 9, 12, 13]), 10).tolist() == [1, 5, 9, 0, 2]
    with pytest.raises(ValueError, match="cannot fit"):
        compact_map(np.arange(11), 10)
    # blocks with draft-layer rows (below 6 before, below 3 after) keep them
    assert compact_map(np.array([0, 4, 7]), 8, old_draft=6, new_draft=3).tolist() == [0, 1, 7]
    with pytest.raises(ValueError, match="draft-layer rows"):
        compact_map(np.array([0, 1, 2, 4]), 8, old_draft=6, new_draft=3)
    # capacity is counted in head-blocks: 10 blocks of 3 heads -> 15 of 2 -> back to 10 (not 7)
    spec = small_spec(num_gpu_blocks=10, num_cpu_blocks=5, num_kv_heads=3)
    cap = Capacity.of(spec)
    two = resharded_spec(spec, 2, 3, cap)
    assert (two.num_kv_heads, two.num_gpu_blocks, two.num_cpu_blocks) == (2, 15, 7)
    assert resharded_spec(two, 3, 2, least([cap, cap])).num_gpu_blocks == 10


# -- deployments ------------------------------------------------------------------------------------
class InProcessWorkers:
    """start_workers/stop_workers over CacheWorkers in this process."""

    def __init__(self, backend, workers):
        self.backend = backend
        self.workers = dict(enumerate(workers))

    def start(self, ranks, spec):
        for r in ranks:
            self.workers[r] = CacheWorker(spec, rank=r, tp_size=self.backend.resharding.to_tp, device="sim",
                                          suffix=self.backend.suffix).start()

    def stop(self, ranks):
        for r in ranks:
            self.workers.pop(r).close()

    def ranks(self):
        return [self.workers[r] for r in sorted(self.workers)]

    def close(self):
        for w in self.workers.values():
            w.close()


@contextlib.contextmanager
def in_process_deployment(spec, tp, **backend_kwargs):
    """A sim deployment with in-process workers that a reshard can start and stop (the pool)."""
    with deployment(spec, tp=tp, **backend_kwargs) as (backend, workers):
        pool = InProcessWorkers(backend, workers)
        try:
            yield backend, pool
        finally:
            pool.close()


def filled_model(backend, rng, swaps, blocks=None):
    """A BlockModel attached to every GPU block (or `blocks`), filled with random bytes, then `swaps`
    blocks swapped out and back in (so the CPU tier holds data too)."""
    model = BlockModel(backend, rng)
    model.attach()
    model.fill(range(backend.spec.num_gpu_blocks) if blocks is None else blocks)
    model.swap_round(swaps)
    return model


def test_liquid_cycles_with_worker_processes_keep_every_block_bit_for_bit():
    """tp 1 -> 2 -> 4 -> 2 -> 1, twice, worker processes: after every step every live GPU block and used CPU
    block is checked on every rank, then swaps and a clear/restore; /dev/shm never holds a second cache."""
    spec = small_spec(num_layers=2, num_gpu_blocks=32, num_cpu_blocks=16, num_kv_heads=4, block_size=4, head_dim=16)
    rng = np.random.default_rng(11)
    with SwapBackend(spec, tp_size=1, device="sim") as backend:
        workers = WorkerProcesses(backend)
        try:
            workers.start([0])
            backend.wait_ready(timeout=60)
            checks, report = Checks(), {}
            steps = liquid(backend, workers, [1, 2, 4, 2, 1], 2, rng, checks, report, log=lambda *_: None)
            assert not checks.failed, checks.failed
            assert [(s["from_tp"], s["to_tp"]) for s in steps] == [(1, 2), (2, 4), (4, 2), (2, 1)] * 2
            assert [s["gpu_blocks_per_rank"] for s in steps[:4]] == [[32, 64], [64, 128], [128, 64], [64, 32]]
            assert all(s["bytes_moved"] > 0 and s["shm_samples"] > 0 for s in steps)
            assert backend.tp_size == 1 and backend.spec == spec and len(workers.procs) == 1
        finally:
            workers.close()


def test_draft_layers_and_fp8_scales_are_resharded_with_in_process_workers():
    spec = small_spec(num_gpu_blocks=24, num_cpu_blocks=12, num_kv_heads=6, cache_dtype="block_wise_fp8",
                      num_extra_layers=1, num_extra_gpu_blocks=18)
    rng = np.random.default_rng(12)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        checks, report = Checks(), {}
        liquid(backend, _Callbacks(pool), [1, 3, 6, 2, 1], 1, rng, checks, report, log=lambda *_: None)
        assert not checks.failed, checks.failed
        assert [s["to_tp"] for s in report["reshard_steps"]] == [3, 6, 2, 1]


class _Callbacks:
    """WorkerProcesses' interface over in-process workers (liquid() calls start/stop)."""

    def __init__(self, pool):
        self.start, self.stop = pool.start, pool.stop


def test_workers_tensors_become_views_of_the_new_shape():
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=4)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        k0 = pool.ranks()[0].key_caches[0]
        new, block_map = backend.reshard(2, start_workers=pool.start, stop_workers=pool.stop, timeout=60)
        assert block_map == {b: b for b in range(16)}
        assert (new.num_kv_heads, new.num_gpu_blocks, new.num_cpu_blocks) == (2, 32, 16)
        for w in pool.ranks():
            assert w.spec == new and w.tp_size == 2
            assert [t.shape for t in w.key_caches] == [(32, 2, 4, 8)] * spec.num_layers
        view = pool.ranks()[0].key_caches[0]
        assert np.shares_memory(view, k0)                # the same memory, another shape
        assert view.ctypes.data == k0.ctypes.data
        round_trip(backend, pool.ranks(), np.random.default_rng(1))
        again, _ = backend.reshard(2, timeout=60)         # the same tp: nothing to do
        assert again == new and backend.status == NORMAL


def test_spec_at_tells_each_ranks_geometry_before_the_step_and_the_step_gives_it():
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=4)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        want = {tp: backend.spec_at(tp) for tp in (1, 2, 4)}
        assert want[1] == spec and (want[2].num_kv_heads, want[2].num_gpu_blocks, want[2].num_cpu_blocks) == (2, 32, 16)
        with pytest.raises(ValueError, match="divide"):
            backend.spec_at(3)
        new, _ = backend.reshard(4, start_workers=pool.start, stop_workers=pool.stop, timeout=60)
        assert new == want[4] and backend.spec_at(4) == new
        assert backend.spec_at(1) == spec       # the memory each rank keeps brings tp=1 back to the same counts


def test_bad_requests_are_refused_before_anything_changes():
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=2)
    rng = np.random.default_rng(3)
    with deployment(spec, tp=2) as (backend, workers):
        pool = InProcessWorkers(backend, workers)
        pids = backend.transfer_pids
        cb = dict(start_workers=pool.start, stop_workers=pool.stop)
        bad = [
            (dict(tp_size=3, **cb), "does not divide the 4 KV heads"),
            (dict(tp_size=0, **cb), ">= 1"),
            (dict(tp_size=-2, **cb), ">= 1"),
            (dict(tp_size=True, **cb), "must be an int"),
            (dict(tp_size="4", **cb), "must be an int"),
            (dict(tp_size=8, **cb), "does not divide"),
            (dict(tp_size=1, **cb), "cannot fit"),                       # 32 live blocks, 16 after
            (dict(tp_size=1, live_blocks=range(9), **cb), "cannot fit"),
            (dict(tp_size=1, live_blocks=[3, 3], **cb), "more than once"),
            (dict(tp_size=1, live_blocks=[16], **cb), "out of range"),
            (dict(tp_size=1, live_blocks=[-1], **cb), "out of range"),
            (dict(tp_size=1, live_blocks="0", **cb), "sequence of ints"),
            (dict(tp_size=4, start_workers=None, stop_workers=pool.stop), "start_workers"),
            (dict(tp_size=1, live_blocks=[0], start_workers=pool.start, stop_workers=None), "stop_workers"),
            (dict(tp_size=4, staging_bytes=MAX_STAGING_BYTES + 1, **cb), "staging_bytes"),
            (dict(tp_size=4, staging_bytes=16, **cb), "smaller than one row"),
            (dict(tp_size=4, device_ids=[0, 1, 2], **cb), "device_ids"),
            (dict(tp_size=4, device_ids=[1, 0, 2, 3], **cb), "keeps its device"),
        ]
        for kwargs, message in bad:
            with pytest.raises(ValueError, match=message):
                backend.reshard(timeout=30, **kwargs)
            assert backend.status == NORMAL and backend.spec == spec and backend.tp_size == 2
            assert backend.transfer_pids == pids
        held = backend.allocate_cpu_blocks(5)      # 5 used CPU blocks cannot fit in the 4 a rank holds at tp 1
        with pytest.raises(ValueError, match="live CPU blocks cannot fit"):
            backend.reshard(1, live_blocks=[0], **cb)
        backend.free_cpu_blocks(held)
        round_trip(backend, workers, rng)


def test_swaps_are_refused_during_a_step_and_tasks_in_flight_finish_first(monkeypatch):
    monkeypatch.setenv(TEST_PACE, "0:0.05")
    spec = small_spec(num_gpu_blocks=256, num_cpu_blocks=256, num_kv_heads=2, head_dim=64)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        handles = [backend.swap_out(np.arange(i, 256, 8), np.arange(i, 256, 8)) for i in range(8)]
        refused = []

        def swap_meanwhile():
            while backend.status != RESHARDING:
                time.sleep(0.001)
            try:
                backend.swap_out([0], [0])
            except RefusedError as exc:     # a TransferError that means "not now"
                refused.append(str(exc))
        thread = threading.Thread(target=swap_meanwhile)
        thread.start()
        backend.reshard(2, start_workers=pool.start, stop_workers=pool.stop, timeout=60, staging_bytes=1 << 16)
        thread.join()
        for h in handles:
            h.result(timeout=0)          # every one finished, and successfully, before the step moved a byte
        assert refused and "RESHARDING" in refused[0]


def _full(backend):
    """Every GPU block, all heads, per tensor (BlockModel over everything)."""
    model = BlockModel(backend, np.random.default_rng(0))
    model.attach()
    return model


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_rank_killed_or_stalled_mid_step_fails_naming_it_and_restart_then_reshard_again_recovers(monkeypatch, how):
    monkeypatch.setenv(TEST_PACE, "0:0.1")
    spec = small_spec(num_gpu_blocks=64, num_cpu_blocks=16, num_kv_heads=4, head_dim=32)
    rng = np.random.default_rng(21)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        model = filled_model(backend, rng, 6)
        model.detach()
        victim = backend.transfer_pids[0]
        try:
            progress = backend.signals.reshard_progress

            done = threading.Event()

            def strike():
                while progress[0, 1] < 3:       # rank 0 is rewriting its memory in place: no way back
                    if done.wait(0.005):
                        return
                os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            thread = threading.Thread(target=strike)
            thread.start()
            t0 = time.monotonic()
            try:
                with pytest.raises(TransferError, match="rank 0") as info:
                    backend.reshard(2, start_workers=pool.start, stop_workers=pool.stop, timeout=4,
                                    staging_bytes=4096)
            finally:
                done.set()
                thread.join()
            assert time.monotonic() - t0 < 8
            if how == "stop":
                assert "did not finish" in str(info.value) or "stopped answering" in str(info.value)
            assert backend.status == RESHARDING                # pending: swaps stay refused
            with pytest.raises(RefusedError, match="RESHARDING"):
                backend.swap_out([0], [0])
            with pytest.raises(TransferError, match="pending"):
                backend.reshard(4, start_workers=pool.start, stop_workers=pool.stop)
            monkeypatch.delenv(TEST_PACE)
            backend.restart_rank(0)                          # kills the stalled process first
            new, block_map = backend.reshard(2, timeout=60)   # resumes from rank 0's journal
            assert backend.status == NORMAL and new.num_kv_heads == 2
            model.remap(block_map, backend.last_reshard["cpu_block_map"])
            model.attach()
            assert model.check() == []
            assert model.swap_round(4) == 4 and model.check() == []
            model.detach()
        finally:
            if how == "stop":
                try:
                    os.kill(victim, signal.SIGCONT)
                except ProcessLookupError:
                    pass


def test_a_failure_before_any_rank_overwrote_old_rows_leaves_the_old_layout_in_service():
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=4)
    rng = np.random.default_rng(5)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        model = filled_model(backend, rng, 4)

        def broken_start(ranks, new_spec):
            pool.start(ranks, new_spec)
            raise RuntimeError("no GPU for rank 1")
        with pytest.raises(TransferError, match="no GPU for rank 1"):
            backend.reshard(2, start_workers=broken_start, stop_workers=pool.stop, timeout=30)
        assert backend.status == NORMAL and backend.tp_size == 1 and backend.spec == spec
        assert sorted(pool.workers) == [0]                # the new rank was stopped again
        assert model.check() == []
        assert model.swap_round(4) == 4 and model.check() == []
        model.detach()
        # a worker that cannot allocate its staging buffer aborts the prepare barrier at once
        real = pool.workers[0]._reshard.poll

        def no_memory():
            ops = pool.workers[0].ops

            def failing(*args):
                raise MemoryError("no memory for the staging buffer")
            ops.reshard_staging = failing
            try:
                real()
            finally:
                del ops.reshard_staging
        pool.workers[0]._reshard.poll = no_memory
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="worker rank 0 reported a failure"):
            backend.reshard(2, start_workers=pool.start, stop_workers=pool.stop, timeout=30)
        assert time.monotonic() - t0 < 5
        pool.workers[0]._reshard.poll = real
        assert backend.status == NORMAL and backend.tp_size == 1
        model.attach()
        assert model.check() == []
        new, block_map = backend.reshard(2, start_workers=pool.start, stop_workers=pool.stop, timeout=30)
        model.remap(block_map, backend.last_reshard["cpu_block_map"])
        model.attach()
        assert model.check() == [] and new.num_kv_heads == 2
        model.detach()


def test_the_cpu_tier_is_compacted_on_a_scale_in_and_the_allocator_follows():
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=16, num_kv_heads=2)
    rng = np.random.default_rng(8)
    with in_process_deployment(spec, tp=2) as (backend, pool):
        model = BlockModel(backend, rng)
        model.attach()
        model.fill(range(8))
        held = backend.allocate_cpu_blocks(16)
        backend.free_cpu_blocks(held[:5] + held[7:13])       # used: 5, 6, 13, 14, 15
        model.swapped_out([0, 1, 2, 3, 4], [5, 6, 13, 14, 15])
        backend.swap_out([0, 1, 2, 3, 4], [5, 6, 13, 14, 15]).result(timeout=10)
        new, block_map = backend.reshard(1, live_blocks=range(8), start_workers=pool.start,
                                         stop_workers=pool.stop, timeout=30)
        cpu_map = backend.last_reshard["cpu_block_map"]
        assert new.num_cpu_blocks == 8 and cpu_map == {5: 5, 6: 6, 13: 0, 14: 1, 15: 2}
        assert backend.allocator.used_ids() == {0, 1, 2, 5, 6} and backend.allocator.num_free == 3
        model.remap(block_map, cpu_map)
        model.attach()
        assert model.check() == []
        model.detach()


def test_a_tiered_cache_keeps_its_entries_through_scale_out_and_scale_in():
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=16, num_kv_heads=4)
    rng = np.random.default_rng(9)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        model = BlockModel(backend, rng)
        model.attach()
        model.fill(range(16))
        cache = TieredCache(backend, namespace="m/0", capacity=12)
        hashes = [int(h) for h in rng.integers(1, 2**62, 6)]
        cache.store(hashes, list(range(6))).result(timeout=10)
        want = {h: model.gpu[b] for h, b in zip(hashes, range(6))}
        model.detach()
        steps = [(2, None), (4, None), (1, range(10, 16))]
        for tp, live in steps:
            backend.reshard(tp, live_blocks=live, start_workers=pool.start, stop_workers=pool.stop, timeout=30)
            assert cache.lookup(hashes) == 6
            dst = rng.choice(backend.spec.num_gpu_blocks, 6, replace=False)
            cache.load(hashes, dst).result(timeout=10)
            model = BlockModel(backend, rng)
            model.attach()
            got = model
            for h, b in zip(hashes, dst.tolist()):
                got.gpu[b] = want[h]
            assert model.check() == [], tp
            model.detach()
        # the tier shrank 16 -> 16*4/16... per rank at tp 1: 16 blocks; the quota never exceeds the tier
        assert cache.capacity <= backend.spec.num_cpu_blocks
        extra = [int(h) for h in rng.integers(1, 2**62, 3)]
        cache.store(extra, [10, 11, 12]).result(timeout=10)
        assert cache.lookup(hashes) == 6 and cache.lookup(extra) == 3
        cache.close()


def test_peak_shared_memory_during_a_step_is_the_cache_plus_staging():
    """In place: a scale-out adds only the new ranks' memory, a scale-in only the staging buffers."""
    spec = small_spec(num_layers=4, num_gpu_blocks=128, num_cpu_blocks=64, num_kv_heads=2, head_dim=64)
    rng = np.random.default_rng(13)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        model = filled_model(backend, rng, 8)    # every page of the cache
        model.touch()
        model.detach()
        one_rank = shm_now(backend, nominal=True)
        with ShmSampler(backend.suffix, every=0.0005) as sampler:
            new, block_map = backend.reshard(2, start_workers=pool.start, stop_workers=pool.stop, timeout=60,
                                             staging_bytes=64 << 10)
        r = backend.last_reshard
        staging = sum(r["staging_bytes"].values()) + sum(r["cpu_staging_bytes"].values())
        assert 0 < staging <= 2 * (64 << 10)
        assert sampler.peak <= 2 * one_rank + staging + (256 << 10), (sampler.peak, one_rank, staging)
        model.remap(block_map, r["cpu_block_map"])
        model.attach()
        assert model.check() == []
        live = sorted(model.gpu)[:64]
        model.gpu = {b: model.gpu[b] for b in live}
        model.touch()
        model.detach()
        two_ranks = shm_now(backend, nominal=True)
        with ShmSampler(backend.suffix, every=0.0005) as sampler:
            new, block_map = backend.reshard(1, live_blocks=live, start_workers=pool.start,
                                             stop_workers=pool.stop, timeout=60, staging_bytes=64 << 10)
        staging = sum(backend.last_reshard["staging_bytes"].values()) + \
            sum(backend.last_reshard["cpu_staging_bytes"].values())
        assert sampler.peak <= two_ranks + staging + (256 << 10), (sampler.peak, two_ranks, staging)
        model.remap(block_map, backend.last_reshard["cpu_block_map"])
        model.attach()
        assert model.check() == []
        model.detach()


def test_the_launcher_runs_liquid_cycles_and_reports_every_step(tmp_path):
    import json
    import subprocess
    import sys
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "fastcache.launch", "--reshard", "1,2,1", "--reshard-cycles", "1",
                           "--num-layers", "2", "--num-gpu-blocks", "32", "--num-cpu-blocks", "16",
                           "--num-kv-heads", "2", "--head-dim", "16", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "liquid reshard report" in proc.stdout and "0 failed: PASSED" in proc.stdout
    report = json.loads(out.read_text())
    steps = report["reshard_steps"]
    assert [(s["from_tp"], s["to_tp"]) for s in steps] == [(1, 2), (2, 1)]
    assert all(s["bytes_moved"] > 0 and s["gbps"] > 0 and s["shm_peak_mib"] <= s["shm_limit_mib"] for s in steps)
    assert [s["gpu_blocks_per_rank"] for s in steps] == [[32, 64], [64, 32]]
    # weights by default: they move with the KV, timed apart, and every byte is checked after every step
    assert all(s["weights_bytes"] > 0 and s["weights_gbps"] > 0 and s["kv_gbps"] > 0 for s in steps)
    assert [sorted({(m["from"], m["to"]) for m in s["weight_moves"]}) for s in steps] == \
        [[(0, 0), (0, 1)], [(0, 0), (1, 0)]]
    assert [[d["gpu_blocks"] for d in s["device_memory"]] for s in steps] == [[64, 64], [32]]
    assert "weight shards moved" in proc.stdout
    kv_only = subprocess.run([sys.executable, "-m", "fastcache.launch", "--reshard", "1,2", "--reshard-cycles", "1",
                              "--num-layers", "2", "--num-gpu-blocks", "32", "--num-cpu-blocks", "16",
                              "--num-kv-heads", "2", "--head-dim", "16", "--no-weights", "--json", str(out)],
                             capture_output=True, text=True, timeout=300)
    assert kv_only.returncode == 0, kv_only.stdout[-3000:] + kv_only.stderr[-3000:]
    assert json.loads(out.read_text())["reshard_steps"][0]["weights_bytes"] == 0
    bad = subprocess.run([sys.executable, "-m", "fastcache.launch", "--reshard", "1,3,1"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "do not divide the 4 KV heads" in bad.stderr


def test_a_new_rank_killed_while_it_fills_its_memory_rolls_back_to_the_old_layout(monkeypatch):
    """The new rank's program only writes its own, new memory: killing it loses nothing, the step rolls back."""
    monkeypatch.setenv(TEST_PACE, "1:0.1")
    spec = small_spec(num_gpu_blocks=64, num_cpu_blocks=16, num_kv_heads=4, head_dim=32)
    rng = np.random.default_rng(31)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        model = filled_model(backend, rng, 6)
        model.detach()
        killed = []

        def start_then_kill_later(ranks, new_spec):
            pool.start(ranks, new_spec)
            proc = backend._ranks.process(1)

            def later():
                time.sleep(0.5)     # rank 1 is in the middle of its (paced) program by then
                proc.kill()
                killed.append(proc.pid)
            threading.Thread(target=later, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="rank 1"):
            backend.reshard(2, start_workers=start_then_kill_later, stop_workers=pool.stop, timeout=20,
                            staging_bytes=4096)
        assert killed and time.monotonic() - t0 < 10
        assert backend.status == NORMAL and backend.tp_size == 1 and backend.spec == spec
        assert sorted(pool.workers) == [0] and len(backend.transfer_pids) == 1
        model.attach()
        assert model.check() == []
        assert model.swap_round(4) == 4 and model.check() == []
        model.detach()
        monkeypatch.delenv(TEST_PACE)
        new, block_map = backend.reshard(2, start_workers=pool.start, stop_workers=pool.stop, timeout=30)
        model.remap(block_map, backend.last_reshard["cpu_block_map"])
        model.attach()
        assert model.check() == []
        model.detach()


def test_a_reshard_waits_for_a_cache_call_that_named_blocks_it_has_not_submitted_yet(tmp_path):
    """A store evicts x (naming x's CPU block for its write-back), then stalls before submitting: a reshard
    that began meanwhile must not rename the blocks under it, or the write-back would put another block's
    bytes under x in the new geometry. The reshard waits for the call, whose submissions are then refused."""
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=4)
    with deployment(spec, tp=1, store=f"file://{tmp_path}/l3") as (backend, workers):
        pool = InProcessWorkers(backend, workers)
        try:
            cache = TieredCache(backend, "m/0", capacity=2)
            x, y, z = 11, 12, 13
            cache.store([x], [0]).result(10)
            cache.store([y], [1]).result(10)
            real, done = cache._write_back, threading.Event()
            results = []

            def reshard():
                try:
                    results.append(backend.reshard(2, start_workers=pool.start, stop_workers=pool.stop, timeout=60))
                finally:
                    done.set()

            def stalled_write_back(taken):              # the thread stalls right after naming x's block
                if [key for key, _ in taken[1]] == [x]:
                    threading.Thread(target=reshard).start()
                    done.wait(3)                        # a reshard that does not wait completes meanwhile
                return real(taken)
            cache._write_back = stalled_write_back
            with pytest.raises(TransferError, match="RESHARDING"):
                cache.store([z], [2])                   # evicts x; its submissions come during the step
            assert done.wait(60) and len(results) == 1 and backend.tp_size == 2
            assert not backend.store_contains("m/0", [x]).any()     # nothing was put with a stale block id
            assert cache.lookup([y]) == 1
            cache.close()
        finally:
            pool.close()


def test_a_rollback_whose_callbacks_raise_still_finishes_and_names_both_failures():
    """start_workers raises, and the rollback's stop_workers raises too (for ranks that never started): the
    rollback goes on to the end, the old layout serves, and the error names both failures."""
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=4)
    rng = np.random.default_rng(6)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        model = filled_model(backend, rng, 4)

        def broken_start(ranks, new_spec):
            raise RuntimeError(f"no GPU for ranks {ranks}")

        def broken_stop(ranks):
            raise KeyError(f"ranks {ranks} were never started")
        with pytest.raises(TransferError) as failed:
            backend.reshard(4, start_workers=broken_start, stop_workers=broken_stop, timeout=30)
        message = str(failed.value)
        assert "no GPU for ranks [1, 2, 3]" in message and "were never started" in message, message
        assert backend.status == NORMAL and backend.tp_size == 1 and backend.spec == spec
        assert model.check() == []
        assert model.swap_round(4) == 4 and model.check() == []
        backend.clear_caches(timeout=30)
        backend.restore_caches(timeout=30)
        with pytest.raises(ValueError, match="out of range"):
            backend.restart_rank(2)
        model.detach()
        new, block_map = backend.reshard(2, start_workers=pool.start, stop_workers=pool.stop, timeout=30)
        assert new.num_kv_heads == 2


def test_a_scale_out_that_cannot_make_a_new_ranks_cpu_tier_rolls_back_without_keeping_the_ones_it_made(monkeypatch):
    """Rank 2's CPU tier cannot be made after rank 1's was: the rollback removes rank 1's too, so the same
    scale-out later finds its names free and succeeds."""
    from fastcache.ipc.naming import swap_space_name
    from fastcache.ipc.shm import SharedSegment
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=4)
    rng = np.random.default_rng(8)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        model = filled_model(backend, rng, 4)
        real_create = SharedSegment.create

        def create(name, size, suffix):
            if name == swap_space_name(backend.suffix, 2):
                raise MemoryError("no shared memory for rank 2's CPU tier")
            return real_create(name, size, suffix)
        monkeypatch.setattr(SharedSegment, "create", create)
        with pytest.raises(MemoryError, match="rank 2's CPU tier"):
            backend.reshard(4, start_workers=pool.start, stop_workers=pool.stop, timeout=30)
        monkeypatch.undo()
        assert backend.status == NORMAL and backend.tp_size == 1 and backend.spec == spec
        leftover = [r for r in (1, 2, 3)
                    if os.path.exists(os.path.join("/dev/shm", swap_space_name(backend.suffix, r).lstrip("/")))]
        assert leftover == [], f"the CPU tiers of ranks {leftover} outlived the rollback"
        assert model.check() == [] and model.swap_round(4) == 4 and model.check() == []
        model.detach()
        new, block_map = backend.reshard(4, start_workers=pool.start, stop_workers=pool.stop, timeout=30)
        model.remap(block_map, backend.last_reshard["cpu_block_map"])
        model.attach()
        assert model.check() == [] and new.num_kv_heads == 1
        model.detach()


@pytest.mark.parametrize("how", ["blocks", "never_ready"])
def test_the_timeout_holds_while_a_callback_blocks_and_names_the_ranks_still_missing(how):
    """start_workers that never returns, or returns without starting rank 2: the reshard fails within its
    timeout naming rank 2, rolls back, and the old layout serves."""
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=4)
    rng = np.random.default_rng(7)
    release = threading.Event()
    with in_process_deployment(spec, tp=2) as (backend, pool):
        model = filled_model(backend, rng, 4)

        def partial_start(ranks, new_spec):
            pool.start([r for r in ranks if r != 2], new_spec)
            if how == "blocks":
                release.wait(60)
        began = time.monotonic()
        try:
            with pytest.raises(TransferError, match=r"rank 2\b") as failed:
                backend.reshard(4, start_workers=partial_start, stop_workers=pool.stop, timeout=3)
        finally:
            release.set()
        assert time.monotonic() - began < 3 + 10, "the reshard's timeout did not hold"
        assert "timed out" in str(failed.value) or "did not return" in str(failed.value)
        assert backend.status == NORMAL and backend.tp_size == 2
        assert model.check() == []
        assert model.swap_round(4) == 4 and model.check() == []
        model.detach()


def test_a_resumed_scale_out_refills_new_ranks_that_a_rollback_replaced():
    """1 -> 4: ranks 1 and 2 fill their new memory, rank 3's program fails and rank 0's transfer manager dies, so
    the rollback retires the new ranks and leaves the step pending. restart_rank(0) and the same reshard start new
    ranks 1-3 with empty memory: their programs must run again, or ranks 1 and 2 serve blocks they never got."""
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=4)
    rng = np.random.default_rng(41)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        model = filled_model(backend, rng, 4)
        model.detach()
        host = backend._resharder._host
        real_collect = host.collect_reports
        struck = []

        def collect(phase, ranks, deadline):
            got, copies = real_collect(phase, ranks, deadline)
            if not struck and phase == "reshard_move" and list(ranks) == [1, 2, 3]:
                struck.append(True)
                assert got == {1: None, 2: None, 3: None}      # every new rank filled its memory
                proc = backend._ranks.process(0)
                proc.kill()
                proc.wait()
                end = time.monotonic() + 30
                while 0 not in backend.failed_ranks and time.monotonic() < end:
                    threading.Event().wait(0.01)
                assert 0 in backend.failed_ranks
                got = {**got, 3: "injected: rank 3's program failed"}
            return got, copies
        host.collect_reports = collect
        try:
            with pytest.raises(TransferError, match="rank 3"):
                backend.reshard(4, start_workers=pool.start, stop_workers=pool.stop, timeout=30)
        finally:
            host.collect_reports = real_collect
        assert struck and backend._resharder.pending is not None and sorted(pool.workers) == [0]
        backend.restart_rank(0)
        new, block_map = backend.reshard(4, start_workers=pool.start, stop_workers=pool.stop, timeout=60)
        assert backend.status == NORMAL and backend.tp_size == 4 and new.num_kv_heads == 1
        model.remap(block_map, backend.last_reshard["cpu_block_map"])
        model.attach()
        assert model.check() == []
        model.detach()



def submitted_across_a_reshard(backend, pool, owner, submit, tp):
    """submit() on a thread, its send (owner._send_task) held until the reshard to tp waits at the submit gate
    while the submission holds it (or, never waiting for it, has finished). Returns the reshard's (spec, block
    map), what submit's handle gave (its result() or the exception), and the deployment's tp at each send."""
    host = backend._resharder._host
    real_send, real_wait = owner._send_task, host.wait_submissions
    held, at_gate, sent_at_tp, out = threading.Event(), threading.Event(), [], []

    def held_send(handle, message):
        held.set()
        at_gate.wait(60)
        sent_at_tp.append(backend.tp_size)
        return real_send(handle, message)

    def wait_submissions(deadline):
        if backend._submissions.held:     # the submission holds the gate: the reshard waits for it
            at_gate.set()
        return real_wait(deadline)
    owner._send_task, host.wait_submissions = held_send, wait_submissions

    def run():
        try:
            out.append(submit().result(30))
        except Exception as exc:        # noqa: BLE001 -- the caller asserts
            out.append(exc)
    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert held.wait(30)
        reshard = backend.reshard(tp, start_workers=pool.start, stop_workers=pool.stop, timeout=60)
    finally:
        at_gate.set()
        thread.join(60)
        owner._send_task, host.wait_submissions = real_send, real_wait
    return reshard, out, sent_at_tp


def test_a_store_task_that_read_normal_before_a_reshard_is_sent_in_the_old_geometry_before_it(tmp_path):
    """A put to the store past its status check (its CPU block id checked against tp 1) is held before it is
    sent while a reshard to tp 2 begins: the reshard waits for it, so it goes out in the geometry it was checked
    in. Sent after the step, it would name a CPU block id of the old tier on the new ranks."""
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=4)
    rng = np.random.default_rng(53)
    with in_process_deployment(spec, tp=1, store=f"file://{tmp_path}/l3") as (backend, pool):
        model = filled_model(backend, rng, 0)
        cpu = backend.allocate_cpu_blocks(1)
        backend.swap_out([5], cpu).result(30)
        model.detach()
        _, out, sent_at_tp = submitted_across_a_reshard(
            backend, pool, backend._store_tasks, lambda: backend.cpu_to_store("m/0", [0x5EED], cpu), 2)
        assert sent_at_tp == [1], sent_at_tp
        assert len(out) == 1 and not isinstance(out[0], Exception), out


def test_a_swap_that_read_normal_before_a_reshard_is_sent_in_the_old_geometry_before_it():
    """A swap past its status check (its ids checked against tp 1) is held before it is sent while a reshard to
    tp 2 begins: the reshard waits for it and drains it, so it copies every head of the block. Sent after the
    step, it went to rank 0 alone and left rank 1's half of its CPU block stale, while its handle succeeded."""
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=4)
    rng = np.random.default_rng(51)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        model = filled_model(backend, rng, 0)
        model.detach()
        cpu = backend.allocate_cpu_blocks(1)
        (new, block_map), out, _ = submitted_across_a_reshard(
            backend, pool, backend, lambda: backend.swap_out([3], cpu), 2)
        assert len(out) == 1 and not isinstance(out[0], Exception), out
        model.swapped_out([3], cpu)
        model.remap(block_map, backend.last_reshard["cpu_block_map"])
        model.attach()
        assert model.check() == []
        with pytest.raises(RefusedError, match="RESHARDING"):    # a swap that reads the new status is refused
            backend.signals.status = RESHARDING
            try:
                backend.swap_out([0], [0])
            finally:
                backend.signals.status = NORMAL
        model.detach()
