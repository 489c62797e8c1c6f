"""Swaps ordered after the model's stream by fences (docs/design.md §4 "Ordering against the model"), without a GPU.

The lazy fake runtime of test_cuda_events.py stands in for the device: the model's stream runs late (what the
test queues on it runs only when something waits for it), so a copy that does not wait for the fence runs
before the model's write (or zeroing) it should follow, and the test sees it. Each ordering test runs with the
transfer manager's wait and, as its negative control, with the wait removed (FASTCACHE_TEST_NO_FENCE=1, or the
chain of a reused slot cut), asserting the stale bytes then.
"""
import logging
import threading
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.runtime")

from fastcache import TransferError  # noqa: E402
from fastcache.ipc import protocol  # noqa: E402
from fastcache.ipc.protocol import FENCE_SLOTS, Fence  # noqa: E402
from fastcache.ipc.shm import SharedSegment  # noqa: E402
from fastcache.ipc.signal import EVENTS_FENCE  # noqa: E402
from fastcache.ipc.task_ring import TaskRingReader, TaskRingWriter, inline, ring_name  # noqa: E402
from fastcache.transfer.fences import TEST_NO_FENCE, FenceWaits  # noqa: E402
from fastcache.transfer.manager import TransferManager  # noqa: E402
from fastcache.transfer.scheduler import Scheduler  # noqa: E402
from fastcache.worker import CacheWorker  # noqa: E402
from fastcache.worker.fences import FenceRing  # noqa: E402

from conftest import cpu_image, deployment, randomize, small_spec  # noqa: E402
from test_cuda_events import FakeStream, lazy, rig, signals_of  # noqa: E402,F401 (lazy: a fixture)

SPEC = small_spec(num_gpu_blocks=160, num_cpu_blocks=128, num_layers=2, num_extra_layers=1, num_extra_gpu_blocks=100)
METHODS = ["staged", "memcpy", "batch", "kernel"]


def stand_in(copier, waits, rank=0):
    """A transfer manager's state that _on_task and _run read, over the test's copier and fence waits."""
    tm = SimpleNamespace(rank=rank, phase="running", copier=copier, weights=None, spec=SPEC, fences=waits,
                         ops=SimpleNamespace(name="cuda"), scheduler=Scheduler(), ready=[], sent=[],
                         _maybe_fail=lambda task: None, _worker_replaced=lambda: False)
    tm._dispatch = tm.ready.extend
    tm._fenced = lambda task: TransferManager._fenced(tm, task)
    tm._swap_in_layers = lambda task, first=None: TransferManager._swap_in_layers(tm, task, first)
    tm.send = lambda type_, **fields: tm.sent.append((type_, fields))
    return tm


def late_write(lazy, gpu, gpu_ids, rng):
    """Fresh random rows for gpu_ids, written by a model stream that runs late (queued, not yet run): returns the
    rows before, the rows written, and the stream."""
    old = device_rows(gpu, gpu_ids)
    written = [rng.integers(0, 256, r.shape, dtype=np.uint8) for r in old]
    model = lazy.compute_stream()

    def write():
        for rows, new in zip(gpu, written):
            rows[gpu_ids[gpu_ids < len(rows)]] = new
    lazy.on_stream(model, write)
    return old, written, model


def run_task(tm, kind, gpu_ids, cpu_ids, fence, layerwise=False):
    """The task as the engine encodes it, received, decoded and run as a transfer manager does."""
    header, ids = protocol.decode(protocol.encode_task(7, kind, gpu_ids, cpu_ids, layerwise, fence=fence))
    TransferManager._on_task(tm, header, ids)
    assert not tm.sent, tm.sent
    (task,) = tm.ready
    tm.ready.clear()
    assert task.fence == (fence[0] if fence else None)
    error = TransferManager._run(tm, task)[0]
    assert error is None, error


def device_rows(gpu, gpu_ids):
    """Each tensor's rows of the blocks it has (a draft layer lacks the high ones)."""
    return [rows[gpu_ids[gpu_ids < len(rows)]].copy() for rows in gpu]


def tier_rows(swap, gpu_ids, cpu_ids):
    return [swap.rows[cpu_ids[gpu_ids < info.num_blocks], info.cpu_offset:info.cpu_offset + info.block_bytes].copy()
            for info in SPEC.tensors()]


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("blocks", [10, 100], ids=["small", "chunked"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("fenced", [True, False], ids=["fence", "no_fence"])
def test_a_store_submitted_behind_a_late_write_reads_the_written_bytes(lazy, monkeypatch, method, blocks, fenced):
    """The model's stream queues a write of random bytes into the blocks; the worker takes a fence on it and
    the store is submitted at once (the write has not run). The store must read the written bytes, bit for
    bit. With the wait removed it reads the old ones: asserted, and the device shows the write landed later."""
    monkeypatch.setenv("FASTCACHE_STAGING_MB", str(16 * SPEC.cpu_block_stride / 2**20))    # chunks of 16 blocks
    if not fenced:
        monkeypatch.setenv(TEST_NO_FENCE, "1")
    rng = np.random.default_rng(blocks + 7 * METHODS.index(method))
    with signals_of() as (suffix, signals), rig(SPEC, method, seed=blocks) as (gpu, swap, copier):
        ring = lazy.closing(FenceRing(signals, 0, suffix, 0, cuda=True))
        waits = lazy.closing(FenceWaits(suffix, 0, 0))
        gpu_ids, cpu_ids = rng.choice(160, blocks, replace=False), rng.choice(128, blocks, replace=False)
        for rows in gpu:
            rows[...] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
        old, written, model = late_write(lazy, gpu, gpu_ids, rng)
        assert not same(written, old)
        fence = ring.fence(model)
        assert fence == Fence(0, int(signals.ipc_events[0, EVENTS_FENCE]), 0)
        run_task(stand_in(copier, waits), protocol.SWAP_TO_CPU, gpu_ids, cpu_ids, [fence])
        stored = tier_rows(swap, gpu_ids, cpu_ids)
        lazy.cudaStreamSynchronize(model)           # the host moves on: the model's write lands in any case
        assert same(device_rows(gpu, gpu_ids), written)
        if fenced:
            assert same(stored, written), "the store read blocks the model had not written yet"
        else:
            assert same(stored, old), "without the fence's wait the store must read the stale bytes"


@pytest.mark.parametrize("layerwise", [False, True], ids=["swap_in", "layerwise"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("fenced", [True, False], ids=["fence", "no_fence"])
def test_a_load_behind_a_pending_zeroing_of_its_blocks_lands_after_it(lazy, monkeypatch, method, layerwise, fenced):
    """The model's stream queues a zeroing of the destination blocks (vLLM zeroes blocks it allocates); the
    load is submitted with a fence right behind it. Every loaded byte must survive; with the wait removed the
    late zeroing wipes the load: asserted."""
    monkeypatch.setenv("FASTCACHE_STAGING_MB", str(16 * SPEC.cpu_block_stride / 2**20))
    if not fenced:
        monkeypatch.setenv(TEST_NO_FENCE, "1")
    rng = np.random.default_rng(11 + METHODS.index(method) + 5 * layerwise)
    with signals_of() as (suffix, signals), rig(SPEC, method, seed=3) as (gpu, swap, copier):
        ring = lazy.closing(FenceRing(signals, 0, suffix, 0, cuda=True))
        waits = lazy.closing(FenceWaits(suffix, 0, 0))
        gpu_ids, cpu_ids = rng.choice(160, 40, replace=False), rng.choice(128, 40, replace=False)
        loaded = tier_rows(swap, gpu_ids, cpu_ids)      # random, never zero rows
        assert all(r.any(axis=1).all() for r in loaded)
        model = lazy.compute_stream()

        def zero():
            for rows in gpu:
                rows[gpu_ids[gpu_ids < len(rows)]] = 0
        lazy.on_stream(model, zero)
        fence = ring.fence(model)
        tm = stand_in(copier, waits)
        tm.signals, tm.layer_events = signals, None
        run_task(tm, protocol.SWAP_TO_GPU, gpu_ids, cpu_ids, [fence], layerwise=layerwise)
        lazy.cudaStreamSynchronize(model)
        if fenced:
            assert same(device_rows(gpu, gpu_ids), loaded), "the zeroing ran after the load"
        else:
            assert all(not r.any() for r in device_rows(gpu, gpu_ids)), \
                "without the fence's wait the late zeroing must wipe the load"


@pytest.mark.parametrize("fenced", [True, False], ids=["fence", "no_fence"])
def test_a_small_task_through_the_task_ring_carries_the_fence_the_worker_took(lazy, monkeypatch, fenced):
    """A small swap (what vLLM's jobs are) goes to each rank as a task-ring record: at tp=2 with a fence taken on
    rank 1 only, rank 1's record must carry that fence (its generation is the worker's export's: 62 random
    bits) and its store read the late write; rank 0's record carries none. The wait removed is the negative
    control."""
    if not fenced:
        monkeypatch.setenv(TEST_NO_FENCE, "1")
    rng = np.random.default_rng(23)
    with signals_of(tp=2) as (suffix, signals), rig(SPEC, "staged", seed=23) as (gpu, swap, copier):
        ring = lazy.closing(FenceRing(signals, 1, suffix, 0, cuda=True))
        waits = lazy.closing(FenceWaits(suffix, 1, 0))
        gpu_ids, cpu_ids = rng.choice(100, 6, replace=False), rng.choice(128, 6, replace=False)
        old, written, model = late_write(lazy, gpu, gpu_ids, rng)
        fence = ring.fence(model)
        assert fence.rank == 1 and fence.generation >= 1 << 32, "the export's generation, as the worker makes it"
        task = protocol.SmallTask(9, protocol.SWAP_TO_CPU, gpu_ids.tolist(), cpu_ids.tolist(), False, fence=[fence])
        record = inline(*task.task)
        token = bytes(rng.integers(0, 256, 16, dtype=np.uint8))
        got = {}
        for rank in (0, 1):
            writer = lazy.closing(TaskRingWriter.create(suffix, token, rank, 1))
            reader = lazy.closing(TaskRingReader(SharedSegment.attach(ring_name(suffix, rank, 1), suffix), token,
                                                 rank, 1))
            assert writer.put(1, record)
            (got[rank],), bad, malformed = reader.read(reader.head())
            assert not bad and not malformed
        assert got[0].header["fence"] == [] and got[1].header["fence"] == [fence]
        tm = stand_in(copier, waits, rank=1)
        TransferManager._on_task(tm, got[1].header, got[1].ids)
        assert not tm.sent, tm.sent
        (queued,) = tm.ready
        assert queued.fence == fence
        assert TransferManager._run(tm, queued)[0] is None
        stored = tier_rows(swap, gpu_ids, cpu_ids)
        lazy.cudaStreamSynchronize(model)
        if fenced:
            assert same(stored, written), "the store read blocks the model had not written yet"
        else:
            assert same(stored, old), "without the fence's wait the store must read the stale bytes"


@pytest.mark.parametrize("chained", [True, False], ids=["chain", "no_chain"])
def test_a_slot_reused_on_another_stream_before_the_wait_only_makes_the_copy_wait_longer(lazy, chained):
    """Fence A on stream 1 behind a late write; then FENCE_SLOTS more fences on stream 2, the last one reusing
    A's slot, all before the transfer manager queues A's wait, which so captures the later record. The chain
    (stream 2 waits on the slot's event before recording it) makes that record complete only after A's: the
    store still reads the write. Cut the chain and it reads stale bytes: asserted."""
    rng = np.random.default_rng(5)
    with signals_of() as (suffix, signals), rig(SPEC, "memcpy") as (gpu, swap, copier):
        ring = lazy.closing(FenceRing(signals, 0, suffix, 0, cuda=True))
        waits = lazy.closing(FenceWaits(suffix, 0, 0))
        gpu_ids, cpu_ids = rng.choice(100, 8, replace=False), rng.choice(128, 8, replace=False)
        old = device_rows(gpu, gpu_ids)
        written = [rng.integers(0, 256, r.shape, dtype=np.uint8) for r in old]
        one, two = lazy.compute_stream(), lazy.compute_stream()

        def write():
            for rows, new in zip(gpu, written):
                rows[gpu_ids[gpu_ids < len(rows)]] = new
        lazy.on_stream(one, write)
        first = ring.fence(one)
        if not chained:
            ring._recorded = [False] * FENCE_SLOTS      # the mutation: the ring forgets which slots were recorded
        later = [ring.fence(two) for _ in range(FENCE_SLOTS)]
        assert later[-1].slot == first.slot and later[-1].generation == first.generation
        run_task(stand_in(copier, waits), protocol.SWAP_TO_CPU, gpu_ids, cpu_ids, [first])
        stored = tier_rows(swap, gpu_ids, cpu_ids)
        lazy.cudaStreamSynchronize(one)
        if chained:
            assert same(stored, written)
        else:
            assert same(stored, old), "a reused slot without the chain must let the copy run early"


PER_THREAD = 2      # cudaStreamPerThread: one handle that names each host thread's own default stream


def test_a_slot_reused_through_the_same_handle_on_another_thread_s_default_stream_only_makes_the_copy_wait_longer(
        lazy, monkeypatch):
    """One stream handle need not be one stream: cudaStreamPerThread names the calling thread's default stream
    (and a destroyed stream's handle can come back for a new one). A model thread writes late on its default
    stream and takes fence A; another thread takes FENCE_SLOTS fences on its own default stream through the
    same handle, the last reusing A's slot, before the transfer manager queues A's wait. That record must
    still complete only after A's: the store reads the write."""
    mine = threading.local()
    streams = lazy._stream

    def resolve(stream):
        if isinstance(stream, int) and stream == PER_THREAD:
            if not hasattr(mine, "stream"):
                mine.stream = FakeStream()
            return mine.stream
        return streams(stream)
    monkeypatch.setattr(lazy, "_stream", resolve)
    rng = np.random.default_rng(31)
    with signals_of() as (suffix, signals), rig(SPEC, "memcpy", seed=31) as (gpu, swap, copier):
        ring = lazy.closing(FenceRing(signals, 0, suffix, 0, cuda=True))
        waits = lazy.closing(FenceWaits(suffix, 0, 0))
        gpu_ids, cpu_ids = rng.choice(100, 8, replace=False), rng.choice(128, 8, replace=False)
        written = [rng.integers(0, 256, r.shape, dtype=np.uint8) for r in device_rows(gpu, gpu_ids)]
        model = {}

        def model_thread():
            def write():
                for rows, new in zip(gpu, written):
                    rows[gpu_ids[gpu_ids < len(rows)]] = new
            lazy.on_stream(PER_THREAD, write)
            model["fence"], model["stream"] = ring.fence(PER_THREAD), resolve(PER_THREAD)
        thread = threading.Thread(target=model_thread)
        thread.start()
        thread.join(30)
        first = model["fence"]
        later = [ring.fence(PER_THREAD) for _ in range(FENCE_SLOTS)]     # this thread's own default stream
        assert resolve(PER_THREAD) is not model["stream"]
        assert later[-1].slot == first.slot and later[-1].generation == first.generation
        run_task(stand_in(copier, waits), protocol.SWAP_TO_CPU, gpu_ids, cpu_ids, [first])
        stored = tier_rows(swap, gpu_ids, cpu_ids)
        lazy.cudaStreamSynchronize(model["stream"])
        assert same(stored, written), "the store ran before the write its fence stands for"


def test_no_record_during_capture_and_a_host_sync_where_interprocess_events_are_refused(lazy, monkeypatch, caplog):
    with signals_of() as (suffix, signals):
        ring = lazy.closing(FenceRing(signals, 0, suffix, 0, cuda=True))
        model = lazy.compute_stream()
        lazy.capturing.add(model.ptr)
        with caplog.at_level(logging.WARNING, "fastcache.worker"):
            assert ring.fence(model) is None and ring.fence(model) is None
        assert not [d for _, what, d in lazy.log if what == "record"], "a record inside a capture"
        assert sum("captured" in r.message for r in caplog.records) == 1, "logged once"
        lazy.capturing.clear()

    caplog.clear()
    with signals_of() as (suffix, signals):
        ring = lazy.closing(FenceRing(signals, 0, suffix, 0, cuda=True))

        def refused(event):
            return (lazy.cudaError_t.cudaErrorNotSupported,)
        monkeypatch.setattr(lazy, "cudaIpcGetEventHandle", refused)
        model = lazy.compute_stream()
        ran = []
        with caplog.at_level(logging.WARNING, "fastcache.worker"):
            for k in range(2):
                lazy.on_stream(model, lambda k=k: ran.append(k))
                assert ring.fence(model) is None
                assert ran == list(range(k + 1)), "the host did not synchronize the stream"
        assert sum("synchronizes its stream" in r.message for r in caplog.records) == 1, "logged once"
        assert int(signals.ipc_events[0, EVENTS_FENCE]) == 0


def test_a_fence_of_a_closed_worker_fails_the_task_naming_the_rank(lazy):
    with signals_of() as (suffix, signals), rig(SPEC, "memcpy") as (gpu, swap, copier):
        ring = FenceRing(signals, 0, suffix, 0, cuda=True)
        waits = lazy.closing(FenceWaits(suffix, 0, 0))
        fence = ring.fence(lazy.compute_stream())
        ring.close()
        header, ids = protocol.decode(protocol.encode_task(3, protocol.SWAP_TO_CPU, np.arange(2), np.arange(2),
                                                           fence=[fence]))
        tm = stand_in(copier, waits)
        TransferManager._on_task(tm, header, ids)
        error = TransferManager._run(tm, tm.ready[0])[0]
        assert error is not None and "rank 0" in error and "fence" in error


def test_the_task_header_carries_fences_validated():
    ids = np.arange(3), np.arange(3)
    header, _ = protocol.decode(protocol.encode_task(1, protocol.SWAP_TO_CPU, *ids, fence=[Fence(1, 9, 3)]))
    assert header["fence"] == [Fence(1, 9, 3)]
    assert protocol.decode(protocol.encode_task(1, protocol.SWAP_TO_CPU, *ids))[0]["fence"] == []
    for bad in ([[0, 9]], [[0, 0, 1]], [[0, 9, FENCE_SLOTS]], [[0, 9, 1], [0, 8, 2]], [[0, True, 1]], [[-1, 9, 1]],
                ["x"], [[0, 9, 1.0]]):
        frames = protocol.encode_task(1, protocol.SWAP_TO_CPU, *ids)
        frames[0] = frames[0].replace(b'"fence":[]', b'"fence":' + str(bad).replace("'", '"').replace(
            "True", "true").encode())
        with pytest.raises(protocol.ProtocolError, match="fence"):
            protocol.decode(frames)
    with pytest.raises(protocol.ProtocolError, match="only a KV swap"):
        protocol.decode(protocol.encode_task(1, protocol.SWAP_TO_GPU, *ids, True, protocol.WEIGHTS, 2,
                                             fence=[Fence(0, 9, 1)]))


def test_engine_code_is_the_same_on_sim_a_fence_is_none_and_fences_travel_to_the_ranks():
    """On sim a worker's fence is None (its writes are host writes); swap_out/swap_in take it, or real fences
    (a sim transfer manager receives and ignores them), bit for bit; bad fences are refused before sending."""
    spec = small_spec()
    rng = np.random.default_rng(2)
    with deployment(spec, tp=2) as (backend, workers):
        fences = [w.fence(None) for w in workers]
        assert fences == [None, None]
        for w in workers:
            randomize(w, rng)
        want = [cpu_image(w, [1, 2, 3]) for w in workers]
        backend.swap_out([1, 2, 3], [4, 5, 6], fence=fences).result(timeout=10)
        for w in workers:
            randomize(w, rng)
        backend.swap_in([7, 8, 9], [4, 5, 6], fence=[Fence(0, 5, 1), Fence(1, 6, 2)]).result(timeout=10)
        for w, image in zip(workers, want):
            np.testing.assert_array_equal(cpu_image(w, [7, 8, 9]), image)
        for bad in (Fence(2, 5, 1), [Fence(0, 5, 1), Fence(0, 6, 1)], Fence(0, 0, 1), Fence(0, 5, FENCE_SLOTS),
                    "fence", (0, 5, 1)):
            with pytest.raises(ValueError, match="fence"):
                backend.swap_out([1], [4], fence=bad)
    with pytest.raises(TransferError, match="not started"):
        CacheWorker(spec, 0, 1, suffix="x").fence(None)


def test_a_cuda_worker_needs_the_stream_it_fences():
    worker = SimpleNamespace(signals=object(), fences=SimpleNamespace(cuda=True))
    with pytest.raises(ValueError, match="stream"):
        CacheWorker.fence(worker, None)
