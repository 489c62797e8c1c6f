"""Isolation and request validation (docs/design.md §4 "two deployments on one machine never collide", signals
mode 0600, socket directory 0700; §5 "invalid requests raise ValueError at submission, before anything
is sent").
"""
from __future__ import annotations

import contextlib
import glob
import os
import stat
import tempfile
import zlib

import numpy as np
import psutil
import pytest

from fastcache import SwapBackend, TransferError
from fastcache.worker import CacheWorker
from fastcache.ipc.naming import PREFIX, barrier_name, new_suffix, segment_name, signal_name, swap_space_name
from fastcache.ipc.shm import SHM_DIR, SegmentError, SharedSegment
from fastcache.worker import CacheWorker

from conftest import all_tensors, cpu_image, deployment, randomize, round_trip, small_spec


def entries(suffix):
    return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(f"{PREFIX}.{suffix}."))


def socket_dirs(suffix):
    return glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}.{suffix}.*"))


def snapshot(backend, workers):
    return ([backend.cpu_tier(r).copy() for r in range(backend.tp_size)],
            [[rows.copy() for rows in all_tensors(w)] for w in workers])


def assert_same(a, b):
    for x, y in zip(a[0], b[0]):
        np.testing.assert_array_equal(x, y)
    for wx, wy in zip(a[1], b[1]):
        for x, y in zip(wx, wy):
            np.testing.assert_array_equal(x, y)


# -- permissions --------------------------------------------------------------------------------------
def test_segments_are_0600_and_the_socket_dir_0700_through_a_clear_restore_cycle():
    rng = np.random.default_rng(31)
    old_umask = os.umask(0)             # a permissive umask must not widen anything
    try:
        with deployment(small_spec(), tp=2) as (backend, workers):
            for phase in ("start", "restore"):
                names = entries(backend.suffix)
                kinds = {n.split(".", 2)[2].split("_rank")[0].split(".gen")[0] for n in names}
                assert {"barrier", "swap", "cache", "exports", "signal.cache_ready"} <= kinds, (phase, names)
                for name in names:
                    st = os.stat(os.path.join(SHM_DIR, name))
                    assert stat.S_IMODE(st.st_mode) == 0o600, (phase, name, oct(st.st_mode))
                    assert st.st_uid == os.getuid()
                st = os.stat(backend.socket_dir)
                assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, oct(st.st_mode)
                assert st.st_uid == os.getuid()
                if phase == "start":
                    backend.clear_caches(timeout=30)
                    backend.restore_caches(timeout=30)
            for w in workers:
                randomize(w, rng)
            round_trip(backend, workers, rng)
    finally:
        os.umask(old_umask)


# -- two deployments ----------------------------------------------------------------------------------
def test_two_deployments_at_once_do_not_see_each_other():
    rng = np.random.default_rng(32)
    spec = small_spec()
    with contextlib.ExitStack() as stack_b:
        stack_a = contextlib.ExitStack()
        try:
            a, wa = stack_a.enter_context(deployment(spec, tp=2))
            b, wb = stack_b.enter_context(deployment(spec, tp=2))
            assert a.suffix != b.suffix and a.socket_dir != b.socket_dir
            assert not set(entries(a.suffix)) & set(entries(b.suffix))
            assert not set(a.transfer_pids) & set(b.transfer_pids)
            for w in wa + wb:
                randomize(w, rng)
            # the same block ids in both: each deployment moves only its own bytes
            before_b = snapshot(b, wb)
            round_trip(a, wa, rng, n=8)
            assert_same(snapshot(b, wb), before_b)
            before_a = snapshot(a, wa)
            round_trip(b, wb, rng, n=8)
            assert_same(snapshot(a, wa), before_a)
            # one clears: the other keeps its cache and keeps swapping
            a.clear_caches(timeout=30)
            assert all(w.ready for w in wb) and not any(w.ready for w in wa)
            round_trip(b, wb, rng)
            a.restore_caches(timeout=30)
            for w in wa:
                randomize(w, rng)
            round_trip(a, wa, rng)
            # closing one leaves the other whole and working
            a_suffix, a_dir = a.suffix, a.socket_dir
            b_entries = entries(b.suffix)
            stack_a.close()
            assert not entries(a_suffix) and not os.path.exists(a_dir)
            assert entries(b.suffix) == b_entries and os.path.isdir(b.socket_dir)
            assert all(psutil.pid_exists(p) for p in b.transfer_pids)
            round_trip(b, wb, rng)
        finally:
            stack_a.close()


# -- attach refusals -----------------------------------------------------------------------------------
def test_attach_refuses_another_deployments_segment():
    rng = np.random.default_rng(33)
    mine, theirs = new_suffix(), new_suffix()
    name = segment_name(theirs, "signal.cache_ready")
    with SharedSegment.create(name, 64, theirs) as seg:
        payload = rng.integers(1, 256, 64, dtype=np.uint8)
        seg.array(np.uint8, (64,))[:] = payload
        with pytest.raises(SegmentError, match="belongs to deployment"):
            SharedSegment.attach(name, mine)
        with SharedSegment.attach(name, theirs) as ok:            # the right suffix attaches
            np.testing.assert_array_equal(ok.array(np.uint8, (64,)), payload)
        with pytest.raises(SegmentError, match="does not exist"):
            SharedSegment.attach(segment_name(mine, "signal.cache_ready"), mine)
        np.testing.assert_array_equal(seg.array(np.uint8, (64,)), payload)    # refusal touched nothing
    # a worker pointed at a deployment that is not there fails cleanly
    with pytest.raises(SegmentError):
        CacheWorker(small_spec(), rank=0, tp_size=1, device="sim", suffix=mine).start()
    assert not entries(mine) and not entries(theirs)


def test_attach_refuses_a_segment_with_a_wrong_mode():
    suffix = new_suffix()
    name = segment_name(suffix, "barrier")
    with SharedSegment.create(name, 64, suffix):
        SharedSegment.attach(name, suffix).close()
        for mode in (0o640, 0o604, 0o666, 0o620):
            os.chmod(os.path.join(SHM_DIR, name.lstrip("/")), mode)
            with pytest.raises(SegmentError, match="refusing"):
                SharedSegment.attach(name, suffix)
        os.chmod(os.path.join(SHM_DIR, name.lstrip("/")), 0o600)
        SharedSegment.attach(name, suffix).close()


@pytest.mark.skipif(os.getuid() != 0, reason="changing a segment's owner needs root")
def test_attach_refuses_a_segment_owned_by_another_user():
    suffix = new_suffix()
    name = segment_name(suffix, "barrier")
    with SharedSegment.create(name, 64, suffix):
        path = os.path.join(SHM_DIR, name.lstrip("/"))
        os.chown(path, 65534, -1)
        with pytest.raises(SegmentError, match="owned by uid 65534"):
            SharedSegment.attach(name, suffix)
        os.chown(path, os.getuid(), -1)
        SharedSegment.attach(name, suffix).close()


def test_attach_refuses_a_foreign_file_under_a_fastcache_name():
    suffix = new_suffix()
    name = segment_name(suffix, "barrier")
    path = os.path.join(SHM_DIR, name.lstrip("/"))
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, np.random.default_rng(34).integers(1, 256, 4096, dtype=np.uint8).tobytes())
        with pytest.raises(SegmentError, match="not a fastcache segment"):
            SharedSegment.attach(name, suffix)
        os.ftruncate(fd, 8)
        with pytest.raises(SegmentError, match="too small"):
            SharedSegment.attach(name, suffix)
    finally:
        os.close(fd)
        os.unlink(path)


# -- suffix collisions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("taken", ["signal.cache_ready", "signal.transfer_heartbeat", "barrier", "swap_rank1"])
def test_a_deployment_whose_suffix_collides_fails_clearly_and_leaves_nothing(taken):
    rng = np.random.default_rng(35)
    suffix = new_suffix()
    names = {"barrier": barrier_name(suffix), "swap_rank1": swap_space_name(suffix, 1)}
    name = names.get(taken) or signal_name(suffix, taken.split(".", 1)[1])
    kids = {p.pid for p in psutil.Process().children(recursive=True)}
    with SharedSegment.create(name, 256, suffix) as squatter:
        payload = rng.integers(1, 256, 256, dtype=np.uint8)
        squatter.array(np.uint8, (256,))[:] = payload
        backend = SwapBackend(small_spec(), tp_size=2, device="sim", suffix=suffix)
        with pytest.raises(SegmentError) as err:
            backend.start()
        assert name in str(err.value) and "already exists" in str(err.value)
        # nothing of the failed deployment is left; the squatter's segment is intact
        assert entries(suffix) == [name.lstrip("/")]
        assert not socket_dirs(suffix)
        assert {p.pid for p in psutil.Process().children(recursive=True)} <= kids
        np.testing.assert_array_equal(squatter.array(np.uint8, (256,)), payload)
        backend.close()         # harmless after the failed start
        assert entries(suffix) == [name.lstrip("/")]
    assert not entries(suffix)


def test_a_second_engine_or_worker_for_a_live_deployment_is_refused_and_takes_nothing_from_it():
    """In one process (vLLM's layout): a SwapBackend on a live deployment's suffix is refused and leaves its
    in-process workers running; a second CacheWorker for a live rank is refused before it touches anything."""
    rng = np.random.default_rng(36)
    spec = small_spec()
    with deployment(spec, tp=2) as (backend, workers):
        before = entries(backend.suffix)
        second = SwapBackend(spec, tp_size=2, device="sim", suffix=backend.suffix)
        with pytest.raises(SegmentError, match="already exists"):
            second.start()
        second.close()
        assert all(w.ready for w in workers) and entries(backend.suffix) == before
        round_trip(backend, workers, rng)
        for rank in range(2):
            with pytest.raises(TransferError, match=f"rank {rank} of deployment .* has a live worker already"):
                CacheWorker(spec, rank=rank, tp_size=2, device="sim", suffix=backend.suffix).start()
        assert all(w.ready for w in workers) and entries(backend.suffix) == before
        assert list(backend.signals.cache_ready) == [1, 1]
        round_trip(backend, workers, rng)
        backend.clear_caches(timeout=30)        # the live workers have let go of their memory: no name collides
        with pytest.raises(TransferError, match="rank 0 of deployment .* has a live worker already"):
            CacheWorker(spec, rank=0, tp_size=2, device="sim", suffix=backend.suffix).start()
        backend.restore_caches(timeout=30)
        assert all(w.ready for w in workers)
        round_trip(backend, workers, rng)


# -- a spec that does not fit -------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [dict(num_cpu_blocks=10**9), dict(num_gpu_blocks=10**9),
                                       dict(num_cpu_blocks=2 * 10**7, num_layers=80)])
def test_a_spec_that_does_not_fit_is_refused_before_anything_is_allocated(overrides):
    spec = small_spec(**overrides)
    kids = {p.pid for p in psutil.Process().children(recursive=True)}
    suffix = new_suffix()
    with pytest.raises(ValueError, match="GiB") as err:
        with SwapBackend(spec, tp_size=2, device="sim", suffix=suffix):
            pass
    assert "num_cpu_blocks" in str(err.value)
    need = 2 * (spec.cpu_cache_bytes + spec.gpu_cache_bytes) / 2**30
    assert f"{need:.2f} GiB" in str(err.value)
    assert not entries(suffix) and not socket_dirs(suffix)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= kids
    # the same geometry with few blocks fits: the refusal is about size, not about the spec
    SwapBackend(small_spec(**{k: 16 for k in overrides if k.endswith("blocks")}), tp_size=2, device="sim")


# -- bad requests at the API ---------------------------------------------------------------------------
SPEC = small_spec()          # 24 GPU blocks, 16 CPU blocks
INT_TYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, int]


@pytest.fixture(scope="module")
def live():
    """One tp-2 deployment for every request test of this module (each test leaves it as it found it)."""
    with deployment(SPEC, tp=2) as (backend, workers):
        yield backend, workers


def as_container(ids, int_type, container):
    if int_type is int:
        values = [int(i) for i in ids]
    else:
        values = [int_type(i) for i in ids]
    if container == "list":
        return values
    if container == "tuple":
        return tuple(values)
    if container == "array":
        return np.array(ids, dtype=np.int64 if int_type is int else int_type)
    if container == "range":        # only for consecutive ids
        return range(int(ids[0]), int(ids[0]) + len(ids))
    raise AssertionError(container)


@pytest.mark.parametrize("container", ["list", "tuple", "array", "range"])
@pytest.mark.parametrize("int_type", INT_TYPES, ids=lambda t: t.__name__)
def test_every_integer_type_and_container_is_accepted_and_moves_the_right_blocks(live, int_type, container):
    backend, workers = live
    rng = np.random.default_rng(zlib.crc32(f"{int_type.__name__}-{container}".encode()))
    for w in workers:
        randomize(w, rng)
    if container == "range":
        start = int(rng.integers(0, SPEC.num_gpu_blocks - 5))
        src, cpu = np.arange(start, start + 5), np.arange(3, 8)
        dst_start = int(rng.integers(0, SPEC.num_gpu_blocks - 5))
        dst = np.arange(dst_start, dst_start + 5)
    else:
        src = rng.choice(SPEC.num_gpu_blocks, 5, replace=False)
        cpu = rng.choice(SPEC.num_cpu_blocks, 5, replace=False)
        dst = rng.choice(SPEC.num_gpu_blocks, 5, replace=False)
    want = [cpu_image(w, src) for w in workers]
    handle = backend.swap_out(as_container(src, int_type, container), as_container(cpu, int_type, container))
    handle.result(timeout=10)
    assert handle.nbytes == 2 * 5 * SPEC.cpu_block_bytes
    for r in range(2):
        np.testing.assert_array_equal(backend.cpu_tier(r)[cpu], want[r])
    for w in workers:
        for rows in all_tensors(w):
            rows[dst] = rng.integers(1, 256, rows[dst].shape, dtype=np.uint8)
    backend.swap_in(as_container(dst, int_type, container), as_container(cpu, int_type, container)).result(timeout=10)
    for r, w in enumerate(workers):
        np.testing.assert_array_equal(cpu_image(w, dst), want[r])


def test_the_largest_ids_and_duplicate_sources_are_valid(live):
    backend, workers = live
    rng = np.random.default_rng(36)
    for w in workers:
        randomize(w, rng)
    last_gpu, last_cpu = SPEC.num_gpu_blocks - 1, SPEC.num_cpu_blocks - 1
    backend.swap_out(np.array([last_gpu, last_gpu, 0], np.uint8), [last_cpu, 0, 1]).result(timeout=10)
    for r, w in enumerate(workers):          # one GPU block copied to two CPU blocks
        np.testing.assert_array_equal(backend.cpu_tier(r)[[last_cpu, 0, 1]], cpu_image(w, [last_gpu, last_gpu, 0]))
    want = [backend.cpu_tier(r)[[last_cpu, last_cpu]].copy() for r in range(2)]
    backend.swap_in([2, last_gpu], np.array([last_cpu, last_cpu], np.int8)).result(timeout=10)
    for r, w in enumerate(workers):          # one CPU block copied to two GPU blocks
        np.testing.assert_array_equal(cpu_image(w, [2, last_gpu]), want[r])


def bad_requests():
    """(label, direction, gpu_block_ids, cpu_block_ids, text the ValueError must contain)."""
    g, c = SPEC.num_gpu_blocks, SPEC.num_cpu_blocks
    cases = []
    for t in INT_TYPES:
        name = t.__name__
        mk = (lambda v, t=t: [int(x) for x in v]) if t is int else (lambda v, t=t: np.array(v, dtype=t))
        cases += [(f"gpu-out-of-range-{name}", "out", mk([0, g]), mk([0, 1]), "out of range"),
                  (f"cpu-out-of-range-{name}", "out", mk([0, 1]), mk([c, 0]), "out of range"),
                  (f"cpu-out-of-range-in-{name}", "in", mk([0, 1]), mk([1, c + 3]), "out of range"),
                  (f"gpu-out-of-range-in-{name}", "in", mk([g + 7]), mk([0]), "out of range"),
                  (f"length-mismatch-{name}", "out", mk([0, 1, 2]), mk([0, 1]), "ids but"),
                  (f"dup-cpu-dest-{name}", "out", mk([0, 1]), mk([5, 5]), "duplicate destination cpu"),
                  (f"dup-gpu-dest-{name}", "in", mk([4, 4]), mk([0, 1]), "duplicate destination gpu")]
        if t is int or np.issubdtype(t, np.signedinteger):
            cases += [(f"negative-gpu-{name}", "out", mk([0, -1]), mk([0, 1]), "out of range"),
                      (f"negative-cpu-{name}", "in", mk([0, 1]), mk([-3, 1]), "out of range")]
    cases += [
        ("uint64-beyond-int64", "out", np.array([2**64 - 1], np.uint64), [0], "out of range"),
        ("python-int-beyond-int64", "out", [2**70], [0], "integers"),
        ("python-int-2**63", "in", [0], [2**63], "out of range"),
        ("uint64-with-negative", "out", [np.uint64(1), -1], [0, 1], "integers"),
        ("float-list", "out", [0.0, 1.0], [0, 1], "integers"),
        ("float-array", "in", [0, 1], np.array([0.5, 1.5]), "integers"),
        ("mixed-int-float", "out", [0, 1.0], [0, 1], "integers"),
        ("float32-array", "out", np.arange(2, dtype=np.float32), [0, 1], "integers"),
        ("2-D-array", "out", np.arange(4).reshape(2, 2), [0, 1, 2, 3], "one-dimensional"),
        ("2-D-list", "in", [[0, 1]], [[0, 1]], "one-dimensional"),
        ("ragged", "out", [[0], [1, 2]], [0, 1], ""),
        ("scalar", "out", 3, 3, "one-dimensional"),
        ("string", "out", "01", [0, 1], "sequence of ints"),
        ("bytes", "out", b"\x00\x01", [0, 1], "sequence of ints"),
        ("list-of-strings", "out", ["0", "1"], [0, 1], "integers"),
        ("set", "out", {0, 1}, [0, 1], "sequence of ints"),
        ("dict", "in", {0: 1}, [0], "sequence of ints"),
        ("none", "out", None, [0], ""),
        ("bools", "out", [True, False], [0, 1], "integers"),
        ("object-array", "out", np.array([0, "x"], dtype=object), [0, 1], "integers"),
        ("empty", "out", [], [], "moves 1.."),
        ("empty-array", "in", np.array([], np.int64), np.array([], np.int64), "moves 1.."),
    ]
    return cases


@pytest.mark.parametrize("label,direction,gpu,cpu,text", bad_requests(), ids=[c[0] for c in bad_requests()])
def test_bad_requests_raise_value_error_and_send_nothing(live, label, direction, gpu, cpu, text):
    backend, workers = live
    rng = np.random.default_rng(zlib.crc32(label.encode()))
    for w in workers:
        randomize(w, rng)
    for r in range(2):
        backend.cpu_tier(r)[...] = rng.integers(1, 256, backend.cpu_tier(r).shape, dtype=np.uint8)
    fence = backend.swap_out([0], [0]).result(timeout=10)      # every rank idle, ids counted from here
    before = snapshot(backend, workers)
    submit = backend.swap_out if direction == "out" else backend.swap_in
    with pytest.raises(ValueError, match=text or None):
        submit(gpu_block_ids=gpu, cpu_block_ids=cpu)
    # nothing was sent: the next task gets the next id, and after it (tasks run in order per rank)
    # every byte is as it was
    after = backend.swap_out([0], [0]).result(timeout=10)
    assert after.task_id == fence.task_id + 1
    assert_same(snapshot(backend, workers), before)


ROUNDS = 150
DEAD_PID = 2 ** 22 + 1          # above any pid a Linux machine hands out


def _dead_claim(suffix):
    """A rank's claim as a worker that died left it: its header names a process that is gone."""
    import mmap
    import posix_ipc
    from fastcache.ipc.shm import HEADER, HEADER_BYTES, MAGIC
    name = segment_name(suffix, "worker_rank0")
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=HEADER_BYTES + 8)
    with mmap.mmap(shm.fd, HEADER_BYTES) as buf:
        buf[:HEADER.size] = HEADER.pack(MAGIC, DEAD_PID, 1.0, 8, suffix.encode())
    shm.close_fd()


def _taker(suffix, barrier, results):
    from fastcache.worker.cache_worker import claim_rank
    for _ in range(ROUNDS):
        barrier.wait()                  # the dead worker's claim is there
        try:
            claim = claim_rank(suffix, 0)
        except (TransferError, SegmentError):        # refused (a live worker holds it), or lost the race
            claim = None
        results.put(claim is not None)
        barrier.wait()                  # both took or were refused
        if claim is not None:
            claim.close()
        barrier.wait()                  # the winner let go


def test_two_workers_taking_over_a_dead_worker_s_rank_at_once_one_gets_it():
    """Two processes race, round after round, to take over the claim a dead worker left for its rank:
    exactly one gets it each time, and the name is free again once it lets go."""
    import multiprocessing
    from fastcache.ipc.shm import unlink
    suffix = new_suffix()
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    takers = [ctx.Process(target=_taker, args=(suffix, barrier, results)) for _ in range(2)]
    for p in takers:
        p.start()
    winners = []
    try:
        for _ in range(ROUNDS):
            _dead_claim(suffix)
            barrier.wait(timeout=60)
            winners.append(results.get(timeout=60) + results.get(timeout=60))
            barrier.wait(timeout=60)
            barrier.wait(timeout=60)
            assert not entries(suffix), "the winner's claim outlived its close"
        assert winners == [1] * ROUNDS, f"rounds with two owners: {winners.count(2)}, none: {winners.count(0)}"
    finally:
        barrier.abort()
        for p in takers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        unlink(segment_name(suffix, "worker_rank0"))
