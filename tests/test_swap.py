"""Swap round trips through real transfer-manager processes, verified bit for bit on random data."""
import numpy as np
import pytest

from fastcache import RefusedError, SwapBackend, TransferError
from fastcache.ipc import protocol
from fastcache.ops.sim import RUN_MIN_ROW_BYTES

from conftest import all_tensors, cpu_image, deployment, randomize, small_spec

LAYOUTS = {
    "bf16_kv": dict(cache_dtype="bfloat16"),
    "fp16_kv": dict(cache_dtype="float16"),
    "k_only": dict(has_value=False),
    "fp8_scales": dict(cache_dtype="block_wise_fp8"),
    "fp8_k_only_bf16_scales": dict(cache_dtype="block_wise_fp8", has_value=False, scale_dtype="bfloat16"),
    "extra_layers": dict(num_extra_layers=2, num_extra_gpu_blocks=12),
    "odd_rows": dict(cache_dtype="uint8", head_dim=3, block_size=3, num_kv_heads=1),   # 9-byte rows
    # rows of 4 KiB and more: the sim copier moves these run by run (RUN_MIN_ROW_BYTES), shorter ones in chunks
    "4k_rows": dict(block_size=16, num_kv_heads=2, head_dim=64),
    "8k_rows_fp8_scales": dict(cache_dtype="block_wise_fp8", block_size=32, num_kv_heads=2, head_dim=128),
    "4k_rows_extra_layers": dict(block_size=16, num_kv_heads=2, head_dim=64, num_extra_layers=2,
                                 num_extra_gpu_blocks=12),
}


def ids_with_runs(rng, gpu_blocks, cpu_blocks, n=8):
    """n distinct GPU and CPU ids, the first four two runs that count up together in both lists (what the run
    by run path moves in one call), the rest random."""
    g0 = rng.integers(0, gpu_blocks // 2 - 2)
    g1 = rng.integers(gpu_blocks // 2, gpu_blocks - 2)
    c0 = rng.integers(0, cpu_blocks // 2 - 2)
    c1 = rng.integers(cpu_blocks // 2, cpu_blocks - 2)
    gpu, cpu = [g0, g0 + 1, g1, g1 + 1], [c0, c0 + 1, c1, c1 + 1]
    gpu += rng.choice(np.setdiff1d(np.arange(gpu_blocks), gpu), n - 4, replace=False).tolist()
    cpu += rng.choice(np.setdiff1d(np.arange(cpu_blocks), cpu), n - 4, replace=False).tolist()
    return np.array(gpu), np.array(cpu)


def one_block(rng, gpu_blocks, cpu_blocks):
    """One random GPU id and one random CPU id (a one-block task: the copier's one-block path)."""
    return rng.integers(0, gpu_blocks, 1), rng.integers(0, cpu_blocks, 1)


def check_round_trip(backend, workers, rng, pick=ids_with_runs):
    """Swap out random blocks (pick(rng, GPU blocks, CPU blocks) -> the ids), overwrite every GPU byte, swap in
    elsewhere: check CPU and GPU bytes. A draft layer's rows exist only below its num_blocks; its other CPU rows
    must keep their bytes."""
    spec = backend.spec
    ranks = range(len(workers))
    for w in workers:
        randomize(w, rng)
    for r in ranks:
        backend.cpu_tier(r)[...] = rng.integers(0, 256, backend.cpu_tier(r).shape, dtype=np.uint8)
    src, cpu = pick(rng, spec.num_gpu_blocks, spec.num_cpu_blocks)
    before = [[rows.copy() for rows in all_tensors(w)] for w in workers]
    tier_before = [backend.cpu_tier(r).copy() for r in ranks]
    h = backend.swap_out(src, cpu)
    assert h.result(timeout=20) is h and h.done() and h.elapsed > 0
    assert 0 < h.run_seconds < h.elapsed        # the ranks' own time is part of the round trip
    assert h.nbytes == spec.task_bytes(src) * len(workers)
    for r in ranks:
        for info, was in zip(spec.tensors(), before[r]):
            cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
            has = src < info.num_blocks
            assert np.array_equal(backend.cpu_tier(r)[cpu[has], cols], was[src[has]]), info.name
            assert np.array_equal(backend.cpu_tier(r)[cpu[~has], cols], tier_before[r][cpu[~has], cols])
    tier = [backend.cpu_tier(r).copy() for r in ranks]
    for w in workers:
        randomize(w, rng)                           # overwrite everything, the sources included
    dst, _ = pick(rng, spec.num_gpu_blocks, spec.num_cpu_blocks)
    between = [[rows.copy() for rows in all_tensors(w)] for w in workers]
    backend.swap_in(dst, cpu).result(timeout=20)
    for r, w in zip(ranks, workers):
        for info, rows, mid in zip(spec.tensors(), all_tensors(w), between[r]):
            cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
            has = dst < info.num_blocks
            assert np.array_equal(rows[dst[has]], tier[r][cpu[has], cols]), info.name
            untouched = np.setdiff1d(np.arange(info.num_blocks), dst)
            assert np.array_equal(rows[untouched], mid[untouched]), f"{info.name}: other blocks changed"


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip(layout, tp):
    rng = np.random.default_rng(abs(hash((layout, tp))) % 2**32)
    with deployment(small_spec(**LAYOUTS[layout]), tp=tp) as (backend, workers):
        check_round_trip(backend, workers, rng)


@pytest.mark.parametrize("layout", ["bf16_kv", "extra_layers", "4k_rows_extra_layers", "odd_rows"])
def test_one_block_round_trips(layout):
    """One-block tasks, blocks with and without a draft layer's rows among them, every byte checked."""
    rng = np.random.default_rng(abs(hash(("one", layout))) % 2**32)
    with deployment(small_spec(**LAYOUTS[layout]), tp=2) as (backend, workers):
        for _ in range(8):
            check_round_trip(backend, workers, rng, pick=one_block)


def test_the_large_row_layouts_reach_the_run_by_run_path():
    for name in ("4k_rows", "8k_rows_fp8_scales", "4k_rows_extra_layers"):
        assert small_spec(**LAYOUTS[name]).tensors()[0].block_bytes >= RUN_MIN_ROW_BYTES, name


def test_cpu_tier_holds_block_major_rows():
    rng = np.random.default_rng(7)
    spec = small_spec()
    with deployment(spec) as (backend, (worker,)):
        randomize(worker, rng)
        backend.swap_out([5, 2], [3, 0]).result(timeout=20)
        tier = backend.cpu_tier(0)
        for info, rows in zip(spec.tensors(), all_tensors(worker)):
            cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
            assert np.array_equal(tier[3, cols], rows[5]) and np.array_equal(tier[0, cols], rows[2])


@pytest.fixture(params=["inline", "threads"])
def executor(request, monkeypatch):
    """Small tasks run on the transfer manager's main thread; 'threads' forces the executor threads."""
    if request.param == "threads":
        monkeypatch.setenv("FASTCACHE_INLINE_BYTES", "0")
    return request.param


def test_back_to_back_dependent_tasks_keep_submission_order(executor):
    """Out, overwrite-by-swap-in, out again on shared blocks, all submitted before any completes."""
    rng = np.random.default_rng(11)
    spec = small_spec(num_gpu_blocks=64, num_cpu_blocks=64)
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        snap = [[r.copy() for r in all_tensors(w)] for w in workers]
        handles = []
        for step in range(30):
            # chain: block a -> cpu c -> block b -> cpu d ..., each task reading what the previous wrote
            handles.append(backend.swap_out([step], [step]))
            handles.append(backend.swap_in([step + 1 + 30], [step]))
            handles.append(backend.swap_out([step + 1 + 30], [step + 32]))
        for h in handles:
            h.result(timeout=30)
        tier = [backend.cpu_tier(r) for r in range(2)]
        for w, old, cpu in zip(workers, snap, tier):
            for info, rows, was in zip(spec.tensors(), all_tensors(w), old):
                cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
                for step in range(30):
                    assert np.array_equal(rows[step + 31], was[step])
                    assert np.array_equal(cpu[step + 32, cols], was[step])


def test_many_concurrent_tasks_from_threads(executor):
    import concurrent.futures as cf
    rng = np.random.default_rng(3)
    spec = small_spec(num_gpu_blocks=64, num_cpu_blocks=64)
    with deployment(spec, tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        snap = [[r.copy() for r in all_tensors(w)] for w in workers]

        def one(i):
            return backend.swap_out([i], [i]).result(timeout=30)

        with cf.ThreadPoolExecutor(4) as pool:
            assert len(list(pool.map(one, range(64)))) == 64
        for r, old in enumerate(snap):
            for info, was in zip(spec.tensors(), old):
                cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
                assert np.array_equal(backend.cpu_tier(r)[:, cols], was[:64])


BAD_REQUESTS = [
    ([24], [0], "out of range"),             # gpu id == num_gpu_blocks
    ([0], [16], "out of range"),
    ([-1], [0], "out of range"),
    ([1, 2], [0], "has 2 ids but"),
    ([], [], "moves 1.."),
    ([1.0], [0], "integers"),
    ([[1]], [[0]], "one-dimensional"),
    ("12", [0], "sequence of ints"),
    ([None], [0], "integers"),
]


@pytest.mark.parametrize("gpu,cpu,message", BAD_REQUESTS)
def test_bad_requests_raise_before_anything_is_sent(gpu, cpu, message):
    rng = np.random.default_rng(5)
    with deployment(small_spec()) as (backend, (worker,)):
        randomize(worker, rng)
        before = backend.cpu_tier(0).copy()
        for submit in (backend.swap_out, backend.swap_in):
            with pytest.raises(ValueError, match=message):
                submit(gpu, cpu)
        assert np.array_equal(backend.cpu_tier(0), before)
        backend.swap_out([1], [1]).result(timeout=10)       # and the deployment still works


SMALL_BAD_REQUESTS = [         # the shapes the small-swap path takes (engine/ids.py): the generic check's error
    ((24,), (0,), "gpu block id 24 out of range"),
    (np.array([3], np.int32), np.array([16], np.int32), "cpu block id 16 out of range"),
    (np.array([-1]), np.array([0]), "gpu block id -1 out of range"),
    (np.array([2**63], np.uint64), np.array([0], np.uint64), "out of range"),
    ([np.int64(1), 2], (3, 3), "duplicate destination cpu"),
    ([True], [0], "integers"),
    (np.array([1, 2]), np.array([3]), "has 2 ids but"),
]


@pytest.mark.parametrize("gpu,cpu,message", SMALL_BAD_REQUESTS)
def test_a_small_bad_request_gets_the_generic_error_and_submits_nothing(gpu, cpu, message):
    with deployment(small_spec()) as (backend, (worker,)):
        randomize(worker, np.random.default_rng(8))
        before = [backend.cpu_tier(0).copy()] + [t.copy() for t in all_tensors(worker)]
        first = backend.swap_out([1], [1]).result(timeout=10)
        backend.cpu_tier(0)[1] = before[0][1]
        with pytest.raises(ValueError, match=message):
            backend.swap_out(gpu, cpu)
        if "duplicate" not in message:
            with pytest.raises(ValueError, match=message):
                backend.swap_in(gpu, cpu)
        assert all(np.array_equal(a, b) for a, b in zip([backend.cpu_tier(0)] + all_tensors(worker), before))
        assert backend.swap_out([1], [1]).result(timeout=10).task_id == first.task_id + 1   # no task was made


@pytest.mark.parametrize("signal", ["cache_ready", "swap_space_ready"])
def test_a_rank_that_stops_being_ready_refuses_the_next_swap_with_the_reason(signal):
    """The engine reads the ranks' readiness in shared memory on every task (a worker releasing its cache writes
    cache_ready 0 from its own process)."""
    with deployment(small_spec(), tp=2) as (backend, _):
        backend.swap_out([1], [1]).result(timeout=10)
        getattr(backend.signals, signal)[1] = 0
        with pytest.raises(RefusedError, match=f"not ready .*rank 1: .*{signal}=0"):
            backend.swap_out([2], [2])
        with pytest.raises(RefusedError, match="not ready"):
            backend.swap_in(np.array([2, 3]), np.array([2, 3]))
        getattr(backend.signals, signal)[1] = 1
        backend.swap_out([2], [2]).result(timeout=10)


def test_duplicate_destination_ids_are_refused():
    with deployment(small_spec()) as (backend, _):
        with pytest.raises(ValueError, match="duplicate destination cpu"):
            backend.swap_out([1, 2], [3, 3])
        with pytest.raises(ValueError, match="duplicate destination gpu"):
            backend.swap_in([4, 4], [1, 2])
        backend.swap_out([4, 4], [1, 2]).result(timeout=10)  # one source to two destinations is fine


@pytest.mark.parametrize("kind,gpu,cpu,message", [
    (protocol.SWAP_TO_CPU, [1, 2], [3, 16], "cpu block id 16 out of range"),
    (protocol.SWAP_TO_GPU, [24, 2], [3, 4], "gpu block id 24 out of range"),
    (protocol.SWAP_TO_CPU, [1, 2], [5, 5], "duplicate destination cpu"),
    (protocol.SWAP_TO_GPU, [7, 7], [1, 2], "duplicate destination gpu")])
def test_a_swap_that_skips_the_engines_check_is_still_refused_by_every_transfer_manager(kind, gpu, cpu, message):
    """TieredCache's swaps skip the engine-side id check (it checked them itself); the transfer managers'
    check is what stands behind that: a bad task fails on every rank and moves nothing."""
    rng = np.random.default_rng(sum(gpu) * 31 + sum(cpu))
    with deployment(small_spec(), tp=2) as (backend, workers):
        for w in workers:
            randomize(w, rng)
        for r in range(2):
            backend.cpu_tier(r)[...] = rng.integers(0, 256, backend.cpu_tier(r).shape, dtype=np.uint8)
        before = [backend.cpu_tier(r).copy() for r in range(2)] + [t.copy() for w in workers for t in all_tensors(w)]
        handle = backend.submit_checked_swap(kind, gpu, cpu)
        with pytest.raises(TransferError, match=f"rank 0: {message}.*rank 1: {message}"):
            handle.result(timeout=10)
        after = [backend.cpu_tier(r) for r in range(2)] + [t for w in workers for t in all_tensors(w)]
        assert all(np.array_equal(a, b) for a, b in zip(after, before))
        backend.submit_checked_swap(protocol.SWAP_TO_CPU, [1], [1]).result(timeout=10)     # the deployment works on
        assert np.array_equal(backend.cpu_tier(1)[1], cpu_image(workers[1], [1])[0])


def test_swap_before_ready_is_refused_with_a_reason():
    from fastcache import SwapBackend
    with SwapBackend(small_spec(), tp_size=1, device="sim") as backend:
        with pytest.raises(TransferError, match="not ready"):
            backend.swap_out([1], [1])
        with pytest.raises(TimeoutError, match="cache_ready=0"):
            backend.wait_ready(timeout=0.5)


def test_swap_after_close_is_refused():
    with deployment(small_spec()) as (backend, _):
        pass
    with pytest.raises(TransferError, match="not running"):
        backend.swap_out([1], [1])


def test_close_stops_the_transfer_managers_before_it_frees_the_workers_memory(monkeypatch):
    """On CUDA a transfer manager maps the workers' tensors through IPC until it exits: close() must not
    free them under it. Each in-process worker records which transfer managers still run when it frees."""
    from fastcache.ipc.heartbeat import process_alive
    from fastcache.worker.cache_worker import CacheWorker

    seen = []
    release = CacheWorker._release

    def recording_release(worker):
        seen.append([process_alive(pid) for pid in pids])
        release(worker)

    monkeypatch.setattr(CacheWorker, "_release", recording_release)
    spec = small_spec()
    with SwapBackend(spec, tp_size=2, device="sim") as backend:     # the workers are left to its close
        for r in range(2):
            CacheWorker(spec, rank=r, tp_size=2, device="sim", suffix=backend.suffix, framework="numpy").start()
        backend.wait_ready(timeout=30)
        pids = backend.transfer_pids
        backend.swap_out([1], [1]).result(timeout=10)
    assert seen == [[False, False], [False, False]], seen
