"""Per-layer readiness on cuda through interprocess CUDA events (docs/design.md §11), without a GPU.

A lazy fake runtime stands in for the device: async calls only queue work on their stream, and a stream
runs when it is synchronized, when an event it recorded is synchronized, or when another stream's queued
wait on such an event comes up (CUDA's order, none of its timing). So a layer's bytes land only where the
event order says they may, and a read queued on a worker's stream sees exactly what the stream waits
order before it. IPC handles of the fake's events open to the same events (one process plays both sides).
"""
import contextlib
import ctypes
import itertools
import threading
import time
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.runtime")

import fastcache.ops.cuda as cuda_ops  # noqa: E402
import fastcache.ops.cuda_copiers as copiers  # noqa: E402
import fastcache.ops.cuda_events as cuda_events  # noqa: E402
import fastcache.ops.cuda_kernels as kernels  # noqa: E402
import fastcache.ops.cuda_swap_space as swap_space  # noqa: E402
from fastcache import TransferError  # noqa: E402
from fastcache.ipc import protocol  # noqa: E402
from fastcache.ipc.layers import IN_PLACE, OWNER, RECORDED, LayerPublisher, count_of  # noqa: E402
from fastcache.ipc.naming import new_suffix, segment_name  # noqa: E402
from fastcache.ipc.shm import SharedSegment  # noqa: E402
from fastcache.ipc.signal import EVENTS_LAYERS, EVENTS_RING_FREE, LAYER_SLOTS, DeploymentSignals  # noqa: E402
from fastcache.transfer.manager import TransferManager  # noqa: E402
from fastcache.transfer.weights import WeightGroup  # noqa: E402
from fastcache.weight_spec import WeightSpec  # noqa: E402
from fastcache.worker.streams import LayerWaits  # noqa: E402
from fastcache.worker.weights import Forward  # noqa: E402

from conftest import small_spec  # noqa: E402
from test_cuda_logic import OK, FakeRuntime, copy_rows, install_runtime, longs  # noqa: E402

NOT_READY = FakeRuntime.cudaError_t.cudaErrorNotReady


class FakeStream:
    _ids = itertools.count(0x1000)

    def __init__(self):
        self.ptr = next(self._ids)          # what a worker hands over (CuPy's attribute name)
        self.queue = deque()


class FakeEvent:
    def __init__(self, flags):
        self.flags, self.last = flags, None     # last: the marker of its latest record


class Marker:
    def __init__(self, stream, seq):
        self.stream, self.seq, self.done = stream, seq, False


class LazyRuntime(FakeRuntime):
    """Streams that run only when something needs their work (see the module docstring). `log` holds
    (seq, what, detail) of every call in call order; cudaEventSynchronize waits for `gpu_go` first, so a test
    decides when the transfer manager's stream may run."""

    def __init__(self):
        super().__init__()
        self.lock = threading.RLock()
        self.streams = {}                   # pointer -> FakeStream
        self.handles = {}                   # IPC handle bytes -> FakeEvent
        self.log, self.seq = [], itertools.count()
        self.gpu_go = threading.Event()
        self.gpu_go.set()
        self.threads, self.closers = [], []
        self.greedy = False     # a stream another one waits on runs all it has queued, not just up to the record

    def new_stream(self):
        stream = FakeStream()
        self.streams[stream.ptr] = stream
        return stream

    def compute_stream(self):
        """A model's stream that runs late: what a test queues on it (on_stream) runs only when the test
        synchronizes it, or when a stream waiting on an event recorded on it behind that work comes to the
        wait; never because the host called something else meanwhile."""
        return self.new_stream()

    def _stream(self, stream):
        return stream if isinstance(stream, FakeStream) else self.streams[stream]

    def _note(self, what, detail=None):
        seq = next(self.seq)
        self.log.append((seq, what, detail))
        return seq

    def _enqueue(self, stream, fn):
        with self.lock:
            self._stream(stream).queue.append(fn)

    def _run(self, stream, until=None):
        with self.lock:
            stream = self._stream(stream)
            while stream.queue and not (until is not None and until.done):
                stream.queue.popleft()()

    # -- streams and events
    def cudaStreamCreateWithPriority(self, flags, priority):
        return OK, self.new_stream()

    def cudaStreamSynchronize(self, stream):
        self._note("stream sync", stream)
        self._run(stream)
        return (OK,)

    def cudaEventCreateWithFlags(self, flags):
        return OK, FakeEvent(flags)

    def cudaEventRecord(self, event, stream):
        with self.lock:
            marker = Marker(self._stream(stream), self._note("record", event))
            event.last = marker
            self._enqueue(stream, lambda: setattr(marker, "done", True))
        return (OK,)

    def cudaEventRecordWithFlags(self, event, stream, flags):
        return self.cudaEventRecord(event, stream)

    def cudaStreamWaitEvent(self, stream, event, flags):
        with self.lock:
            captured = event.last           # CUDA waits for the record current at this call, or not at all
            self._note("wait", (self._stream(stream), event, captured))

            def wait():
                if captured is not None and not captured.done:
                    self._run(captured.stream, until=None if self.greedy else captured)
            self._enqueue(stream, wait)
        return (OK,)

    def cudaEventQuery(self, event):
        with self.lock:
            return (OK,) if event.last is None or event.last.done else (NOT_READY,)

    def cudaEventSynchronize(self, event):
        assert self.gpu_go.wait(30), "the test never let the device run"
        with self.lock:
            self._note("event sync", event)
            if event.last is not None:
                self._run(event.last.stream, until=event.last)
        return (OK,)

    def cudaIpcGetEventHandle(self, event):
        assert event.flags & self.cudaEventInterprocess and event.flags & self.cudaEventDisableTiming
        handle = self.cudaIpcEventHandle_t()
        raw = len(self.handles).to_bytes(8, "little") * 8
        ctypes.memmove(handle.getPtr(), raw, 64)
        self.handles[raw] = event
        return OK, handle

    def cudaIpcOpenEventHandle(self, handle):
        return OK, self.handles[ctypes.string_at(handle.getPtr(), 64)]

    # -- copies, queued
    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        self._note("copy", (dst, n))
        pageable = kind == self.cudaMemcpyKind.cudaMemcpyHostToDevice and \
            not any(a <= src < a + m for a, m in self.registered) and src not in self.buffers
        if pageable:        # CUDA stages pageable bytes before the call returns: the caller may free them
            staged = ctypes.create_string_buffer(ctypes.string_at(src, n), n)
            self._enqueue(stream, lambda: ctypes.memmove(dst, staged, n))
        else:
            self._enqueue(stream, lambda: ctypes.memmove(dst, src, n))
        return (OK,)

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        rows = [(dst + r * dpitch, src + r * spitch, width) for r in range(height)]
        for d, _, n in rows:
            self._note("copy", (d, n))
        self._enqueue(stream, lambda: [ctypes.memmove(d, s, n) for d, s, n in rows])
        return (OK,)

    def cudaMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, indices, num_attrs, stream):
        rows = list(zip(dsts, srcs, sizes))
        for d, _, n in rows:
            self._note("copy", (d, n))
        self._enqueue(stream, lambda: [ctypes.memmove(d, s, n) for d, s, n in rows])
        return OK, 0

    def on_stream(self, stream, fn):
        """A worker's kernel: fn runs when the stream gets to it."""
        self._enqueue(stream, fn)

    def abandon(self):
        """At the end of a test, failed or not: let waiting threads go, join them, drop queued copies before
        their memory goes, close what the test exported."""
        self.gpu_go.set()
        for thread in self.threads:
            thread.join(30)
        with self.lock:
            for stream in self.streams.values():
                stream.queue.clear()
        while self.closers:
            self.closers.pop().close()

    def closing(self, thing):
        self.closers.append(thing)
        return thing


FAKE = None


def lazy_launch(function, stream, grid, table, num_tensors, *args):
    """copy_rows queued on its stream: each row it will write is noted as a copy now (call order), and the
    rows move when the stream runs (the ids and the table are read then, as the kernel reads them)."""
    if not args[-1]:        # to the cache: the rows it writes are the cache's
        for ptr, row_bytes, _, _ in longs(table, 4 * num_tensors).reshape(-1, 4).tolist():
            FAKE._note("copy", (ptr, row_bytes))
    FAKE._enqueue(stream, lambda: copy_rows(table, num_tensors, *args))


@pytest.fixture
def lazy(monkeypatch):
    global FAKE
    fake = FAKE = LazyRuntime()
    install_runtime(monkeypatch, fake)
    monkeypatch.setattr(kernels, "launch_rows", lazy_launch)
    yield fake
    fake.abandon()


@contextlib.contextmanager
def signals_of(tp=1):
    suffix = new_suffix()
    signals = DeploymentSignals(suffix, tp, create=True)
    try:
        yield suffix, signals
    finally:
        FAKE.abandon()          # no thread of the test writes a signal any more
        signals.close()


@contextlib.contextmanager
def rig(spec, method, seed=0):
    """(device rows per tensor, poisoned; the tier, random; a copier) over the lazy runtime (FAKE)."""
    rng = np.random.default_rng(seed)
    gpu = [np.full((i.num_blocks, i.block_bytes), 0xEE, np.uint8) for i in spec.tensors()]
    cache = cuda_ops.DeviceTensors(spec.tensors(), [rows.ctypes.data for rows in gpu], 0)
    suffix = new_suffix()
    segment = SharedSegment.create(segment_name(suffix, "swap"), spec.cpu_cache_bytes, suffix)
    swap = swap_space.CudaSwapSpace(segment, spec, 0)
    copier = copiers.make_copier(method, cache, swap, spec)
    try:
        swap.wait_pinned()
        swap.blocks[...] = rng.integers(1, 255, swap.blocks.shape, dtype=np.uint8)      # never 0xEE
        yield gpu, swap, copier
    finally:
        FAKE.abandon()
        copier.close()
        swap.close()


def layer_checker(spec, gpu, swap, gpu_ids, cpu_ids):
    infos = spec.tensors()

    def in_place(layer):
        for info, rows in zip(infos, gpu):
            if info.layer == layer:
                has = gpu_ids < info.num_blocks
                cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
                if not np.array_equal(rows[gpu_ids[has]], swap.rows[cpu_ids[has], cols]):
                    return False
        return True

    def layer_of(ptr):
        """The layer a copy writes, -1 for staging."""
        for info, rows in zip(infos, gpu):
            if rows.ctypes.data <= ptr < rows.ctypes.data + rows.nbytes:
                return info.layer
        return -1
    return in_place, layer_of


SPEC = small_spec(num_gpu_blocks=24, num_cpu_blocks=16, num_layers=3, num_extra_layers=1, num_extra_gpu_blocks=8)


@pytest.mark.parametrize("method,driver,greedy", [("staged", 12080, False), ("staged", 12080, True),
                                                   ("memcpy", 12040, False), ("batch", 12080, False)])
def test_layers_run_back_to_back_each_event_recorded_after_its_copies_and_in_place_only_once_landed(
        lazy, method, driver, greedy):
    """(a) No host sync between layers: when layer l is announced recorded nothing has run yet, its event was
    recorded after every copy of layer l and before any of layer l+1; (c) in place is published only once the
    layer's bytes landed, in order; (b) a second task reuses the events and records them again (never
    announces a layer on the previous task's record). Greedy: the staging copies run as far ahead as their
    waits allow, so a slot refilled before its scatter ran would show."""
    lazy.driver_version, lazy.greedy = driver, greedy
    with signals_of() as (suffix, signals), rig(SPEC, method, seed=driver) as (gpu, swap, copier):
        events = lazy.closing(cuda_events.SlotEvents(SPEC.total_layers, 0, signals, 0, EVENTS_LAYERS, "layers", suffix))
        rng = np.random.default_rng(1)
        for task_id in (5, 5 + LAYER_SLOTS):            # the same slot, so the same events
            gpu_ids, cpu_ids = rng.choice(24, 10, replace=False), rng.choice(16, 10, replace=False)
            in_place, layer_of = layer_checker(SPEC, gpu, swap, gpu_ids, cpu_ids)
            publisher = LayerPublisher(signals.layer_ready, 0, task_id)
            slot_events = events.slot(task_id)
            start = len(lazy.log)
            seen = {"recorded": [], "published": []}

            def recorded(layer):
                ours = lazy.log[start:]
                copies = [seq for seq, what, d in ours if what == "copy" and layer_of(d[0]) == layer]
                later = [seq for seq, what, d in ours if what == "copy" and layer_of(d[0]) > layer]
                mark = slot_events[layer].last
                assert mark is not None and mark.seq >= lazy.log[start][0], f"layer {layer} announced before its record"
                assert all(seq < mark.seq for seq in copies) and not later
                assert not any(in_place(done) for done in range(layer + 1)), "the host waited for the copies"
                assert not any(what.endswith("sync") for _, what, _ in ours), "a host sync between layers"
                publisher.recorded(layer)
                seen["recorded"].append(layer)

            def published(layer):
                assert seen["recorded"] == list(range(SPEC.total_layers)), "in place before every layer was queued"
                assert all(in_place(done) for done in range(layer + 1)), f"layer {layer} in place too early"
                publisher.published(layer)
                seen["published"].append(layer)
            copier.swap_in_layers(gpu_ids, cpu_ids, SPEC.total_layers, published, events=slot_events,
                                  recorded=recorded)
            assert seen["published"] == list(range(SPEC.total_layers))
            records = [d for _, what, d in lazy.log[start:] if what == "record" and d in slot_events]
            assert records == slot_events, "one event per layer, in layer order"
            slot = signals.layer_ready[0, task_id % LAYER_SLOTS]
            assert [int(slot[OWNER]), count_of(slot, IN_PLACE, task_id), count_of(slot, RECORDED, task_id)] == [task_id, 4, 4]
        events.close()
        assert int(signals.ipc_events[0, EVENTS_LAYERS]) == 0


def tm_thread(fn):
    """fn on a thread of its own (the transfer manager's executor); the lazy runtime joins it on teardown."""
    errors = []

    def run():
        try:
            fn()
        except BaseException as exc:        # re-raised in the test's thread
            errors.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    FAKE.threads.append(thread)
    thread.start()
    return thread, errors


@pytest.mark.parametrize("honest", [True, False], ids=["host_check", "no_host_check"])
def test_a_stream_wait_orders_the_worker_after_the_copy_and_is_never_enqueued_before_the_record(
        lazy, monkeypatch, honest):
    """(b) The worker's host returns from each stream wait without the copy having run, and a read queued on
    its stream right after the wait sees the layer's bytes once the device runs. Without the host check of
    "recorded" (the mutation run here as no_host_check) a stream wait is enqueued on an event not yet recorded
    for this task, and the test's own assertion must see it."""
    with signals_of() as (suffix, signals), rig(SPEC, "memcpy") as (gpu, swap, copier):
        events = lazy.closing(cuda_events.SlotEvents(SPEC.total_layers, 0, signals, 0, EVENTS_LAYERS, "layers", suffix))
        waits = lazy.closing(LayerWaits(signals, 0, suffix, 0, cuda=True, transfer_timeout=30))
        if not honest:
            monkeypatch.setattr("fastcache.worker.streams.wait_layer", lambda *a, **k: None)
        rng = np.random.default_rng(3)
        gpu_ids, cpu_ids = rng.choice(24, 10, replace=False), rng.choice(16, 10, replace=False)
        in_place, _ = layer_checker(SPEC, gpu, swap, gpu_ids, cpu_ids)
        task_id = 9
        publisher = LayerPublisher(signals.layer_ready, 0, task_id)

        def recorded(layer):
            time.sleep(0.02)                # the worker is ahead: it must wait for each layer's record
            publisher.recorded(layer)
        lazy.gpu_go.clear()                 # the copy stream stays idle until the worker has queued everything
        thread, errors = tm_thread(lambda: copier.swap_in_layers(
            gpu_ids, cpu_ids, SPEC.total_layers, publisher.published, events=events.slot(task_id), recorded=recorded))
        stream, reads = lazy.new_stream(), {}
        infos = SPEC.tensors()
        for layer in range(SPEC.total_layers):
            waits.wait(task_id, layer, timeout=10, stream=stream)
            assert not in_place(layer), "the host waited for the copy"
            waited = [d for _, what, d in lazy.log if what == "wait" and d[0] is stream][-1]
            if honest:
                assert waited[1] is events.slot(task_id)[layer] and waited[2] is not None, \
                    f"layer {layer}: the stream waits on no record of this task"
            for k, (info, rows) in enumerate(zip(infos, gpu)):
                if info.layer == layer:
                    has = gpu_ids < info.num_blocks
                    lazy.on_stream(stream, lambda k=k, rows=rows, has=has: reads.__setitem__(k, rows[gpu_ids[has]].copy()))
        lazy.cudaStreamSynchronize(stream)          # the worker's kernels run; its waits pull the copies in
        lazy.gpu_go.set()
        thread.join(30)
        assert not errors, errors
        stale = [info.name for k, info in enumerate(infos)
                 if not np.array_equal(reads[k], swap.rows[cpu_ids[gpu_ids < info.num_blocks],
                                                           info.cpu_offset:info.cpu_offset + info.block_bytes])]
        if honest:
            assert not stale
        else:
            assert stale, "reading through a stream wait enqueued before the record must see stale bytes"
        waits.close()
        events.close()


def test_a_host_wait_returns_only_once_the_layer_is_in_place_not_when_recorded(lazy):
    """(c) stream=None (and a worker on sim, or an engine's handle): recorded is not enough."""
    with signals_of() as (suffix, signals), rig(SPEC, "memcpy") as (gpu, swap, copier):
        events = lazy.closing(cuda_events.SlotEvents(SPEC.total_layers, 0, signals, 0, EVENTS_LAYERS, "layers", suffix))
        waits = lazy.closing(LayerWaits(signals, 0, suffix, 0, cuda=True, transfer_timeout=30))
        gpu_ids, cpu_ids = np.arange(4), np.arange(4)
        in_place, _ = layer_checker(SPEC, gpu, swap, gpu_ids, cpu_ids)
        publisher = LayerPublisher(signals.layer_ready, 0, 3)
        lazy.gpu_go.clear()
        thread, errors = tm_thread(lambda: copier.swap_in_layers(
            gpu_ids, cpu_ids, SPEC.total_layers, publisher.published, events=events.slot(3), recorded=publisher.recorded))
        deadline = time.monotonic() + 10
        while count_of(signals.layer_ready[0, 3], RECORDED, 3) < SPEC.total_layers and time.monotonic() < deadline:
            time.sleep(0.001)
        assert count_of(signals.layer_ready[0, 3], IN_PLACE, 3) == 0
        with pytest.raises(TimeoutError, match="not in place"):
            waits.wait(3, 0, timeout=0.2)
        landed = {}

        def host_wait():
            waits.wait(3, SPEC.total_layers - 1, timeout=10)
            landed["ok"] = all(in_place(layer) for layer in range(SPEC.total_layers))
        waiter = threading.Thread(target=host_wait)
        waiter.start()
        time.sleep(0.1)
        assert waiter.is_alive()
        lazy.gpu_go.set()
        waiter.join(10)
        thread.join(10)
        assert not errors and landed == {"ok": True}
        waits.close()
        events.close()


def test_a_failed_task_wakes_a_stream_waiter_naming_the_rank(lazy):
    """(d) A stream waiter whose layer is not recorded yet raises the rank's failure at once; and the transfer
    manager marks the slot failed when a layer-by-layer swap-in fails midway."""
    with signals_of(tp=2) as (suffix, signals):
        events = lazy.closing(cuda_events.SlotEvents(SPEC.total_layers, 0, signals, 1, EVENTS_LAYERS, "layers", suffix))
        waits = lazy.closing(LayerWaits(signals, 1, suffix, 0, cuda=True, transfer_timeout=30))
        publisher = LayerPublisher(signals.layer_ready, 1, 4)
        publisher.recorded(0)
        caught = []

        def stream_wait():
            try:
                waits.wait(4, 2, timeout=20, stream=lazy.new_stream())
            except TransferError as exc:
                caught.append(exc)
        waiter = threading.Thread(target=stream_wait)
        waiter.start()
        time.sleep(0.1)
        began = time.monotonic()
        publisher.failed()
        waiter.join(5)
        assert time.monotonic() - began < 2 and caught and "rank 1" in str(caught[0])
        assert not [d for _, what, d in lazy.log if what == "wait"]

        class Broken:
            def swap_in_layers(self, gpu, cpu, layers, published, events=None, recorded=None, first=None):
                recorded(0)
                raise TransferError("cudaMemcpyAsync failed")
        tm = SimpleNamespace(signals=signals, rank=1, layer_events=events, copier=Broken(),
                             spec=SimpleNamespace(total_layers=SPEC.total_layers))
        with pytest.raises(TransferError):
            TransferManager._swap_in_layers(tm, SimpleNamespace(task_id=6, gpu_ids=[0], cpu_ids=[0]))
        with pytest.raises(TransferError, match="rank 1: task 6 failed"):
            waits.wait(6, 1, timeout=5, stream=lazy.new_stream())
        waits.close()
        events.close()


def test_a_stream_opens_the_events_once_and_again_after_a_restart(lazy):
    """A worker opens the transfer manager's events lazily, once; a restarted transfer manager exports new
    ones (a new generation) and the worker's next wait opens those."""
    with signals_of() as (suffix, signals):
        waits = lazy.closing(LayerWaits(signals, 0, suffix, 0, cuda=True, transfer_timeout=30))
        stream = lazy.new_stream()
        for incarnation in range(2):
            events = lazy.closing(cuda_events.SlotEvents(2, 0, signals, 0, EVENTS_LAYERS, "layers", suffix))
            for task_id in (1, 2):
                publisher = LayerPublisher(signals.layer_ready, 0, task_id)
                lazy.cudaEventRecord(events.slot(task_id)[1], lazy.new_stream())
                publisher.recorded(1)
                waits.wait(task_id, 1, timeout=5, stream=stream)
                waited = [d for _, what, d in lazy.log if what == "wait"][-1]
                assert waited[1] is events.slot(task_id)[1]
            events.close()


MODEL_TENSORS = (("w", (4, 8), "float16"), ("b", (8,), "float16"))


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("free_wait", [True, False], ids=["free_wait", "no_free_wait"])
def test_the_ring_refills_a_slot_only_after_the_workers_stream_is_done_with_it(lazy, monkeypatch, slots, free_wait):
    """(e) A forward reads every streamed layer through its stream (host never waits for a copy or a kernel);
    the transfer manager's copy stream waits on the worker's slot-free event before refilling a slot. The
    copy stream is let run ahead of the worker's kernels: without that wait (the mutation run as
    no_free_wait) a later layer overwrites a slot before the worker's stream read it."""
    layout = WeightSpec(6, MODEL_TENSORS, resident_layers=1, ring_slots=slots)
    streamed = len(layout.streamed_layers)
    rng = np.random.default_rng(slots)
    infos = layout.tensors()
    device = [np.full((i.num_blocks, i.block_bytes), 0xEE, np.uint8) for i in infos]
    with signals_of() as (suffix, signals):
        segment = SharedSegment.create(segment_name(suffix, "weights_cpu"), layout.cpu_cache_bytes, suffix)
        region = swap_space.CudaSwapSpace(segment, layout, 0)
        region.wait_pinned()
        region.blocks[...] = rng.integers(1, 255, region.blocks.shape, dtype=np.uint8)
        copier = copiers.make_copier("memcpy", cuda_ops.DeviceTensors(infos, [d.ctypes.data for d in device], 0),
                                     region, layout)
        tm = SimpleNamespace(signals=signals, rank=0, suffix=suffix, device_id=0, ops=SimpleNamespace(name="cuda"),
                             settings=SimpleNamespace(worker_timeout=10))
        group = WeightGroup(layout, tm)
        group.copier = copier
        group._export_events()
        if not free_wait:
            monkeypatch.setattr(group, "_slot_freed", lambda block: [])
        free = lazy.closing(cuda_events.ExportedEvents(slots, 0, signals, 0, EVENTS_RING_FREE, "ring_free", suffix,
                                          first_block=layout.resident_layers))
        worker = SimpleNamespace(signals=signals, rank=0, ops=SimpleNamespace(name="cuda"),
                                 layer_waits=LayerWaits(signals, 0, suffix, 0, cuda=True, transfer_timeout=30))
        weights = SimpleNamespace(layout=layout, worker=worker, allocated=True, block=lambda b: b,
                                  ring_free_events=lambda: free)
        task_id = 11
        blocks = [layout.block_of(layer) for layer in layout.streamed_layers]
        task = SimpleNamespace(task_id=task_id, kind=protocol.SWAP_TO_GPU, layerwise=True, ring=slots,
                               gpu_ids=np.array(blocks), cpu_ids=np.array(list(layout.streamed_layers)))
        lazy.gpu_go.clear()
        stream, reads = lazy.new_stream(), {}
        with Forward(weights, task_id, timeout=10, stream=stream) as f:
            thread, errors = tm_thread(lambda: group.run(task))
            for layer in range(layout.num_layers):
                block = f.layer(layer)
                if layer >= layout.resident_layers:
                    lazy.on_stream(stream, lambda layer=layer, block=block: reads.__setitem__(
                        layer, np.concatenate([d[block] for d in device])))
        assert count_of(signals.weight_layers[0, task_id % LAYER_SLOTS], IN_PLACE, task_id) == 0, "the host waited for copies"
        lazy.gpu_go.set()               # the copy stream runs first, as far as its waits let it
        thread.join(30)
        assert not errors, errors
        lazy.cudaStreamSynchronize(stream)
        want = {layer: np.concatenate([region.rows[layer, i.cpu_offset:i.cpu_offset + i.block_bytes] for i in infos])
                for layer in layout.streamed_layers}
        wrong = [layer for layer in layout.streamed_layers if not np.array_equal(reads[layer], want[layer])]
        if free_wait:
            assert not wrong
            waits_on_free = [d for _, what, d in lazy.log if what == "wait" and d[1] in free.events]
            assert len(waits_on_free) == streamed
        else:
            assert wrong, "without the slot-free wait a slot must be overwritten before it was read"
        assert count_of(signals.weight_layers[0, task_id % LAYER_SLOTS], IN_PLACE, task_id) == streamed
        lazy.abandon()
        worker.layer_waits.close()
        free.close()
        group.detach(region=True)
        copier.close()
        region.close()


@pytest.mark.parametrize("greedy", [False, True])
def test_staged_chunks_split_over_two_copy_streams_land_whole_both_ways(lazy, monkeypatch, greedy):
    """A staged task of many chunks through the ring, each chunk's runs split over two copy streams: a chunk
    counts as copied only once both halves are (on the lazy runtime, a half nobody waits for never runs), and
    a slot is refilled only after it was drained. Every byte checked, each way."""
    lazy.driver_version, lazy.greedy = 12080, greedy
    spec = small_spec(num_gpu_blocks=40, num_cpu_blocks=64)
    monkeypatch.setenv("FASTCACHE_STAGING_MB", str(4 * spec.cpu_block_stride / 2**20))     # 4-block chunks
    rng = np.random.default_rng(3)
    with rig(spec, "staged", seed=3) as (gpu, swap, copier):
        gpu_ids = rng.choice(40, 30, replace=False)
        cpu_ids = 2 * rng.choice(32, 30, replace=False)          # none adjacent: a run a block, both streams busy
        copier.swap_in(gpu_ids, cpu_ids)
        for info, rows in zip(spec.tensors(), gpu):
            cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
            assert np.array_equal(rows[gpu_ids], swap.rows[cpu_ids, cols]), info.name
        back = cpu_ids + 1                                       # the odd blocks, untouched so far
        tier = swap.blocks.copy()
        copier.swap_out(gpu_ids, back)
        for info, rows in zip(spec.tensors(), gpu):
            cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
            assert np.array_equal(swap.rows[back, cols], rows[gpu_ids]), info.name
        others = np.setdiff1d(np.arange(spec.num_cpu_blocks), back)
        assert np.array_equal(swap.blocks[others], tier[others])


def test_a_staged_task_that_fails_midway_leaves_nothing_queued_that_lands_after_a_later_task(lazy, monkeypatch):
    """A chunked staged swap-out whose CUDA call fails at its second chunk has queued the first chunk's DMA on
    the copy streams, which no later task's small path (one stream) waits for. The engine may give the failed
    task's CPU blocks to the next store at once: that store reports done, and then the device runs what the
    failed task left queued (streams run late). The failed task's stale DMA must not land on the later task's
    blocks: the lane waits for what a failed task queued before it takes the next one."""
    lazy.driver_version = 12080
    spec = small_spec(num_gpu_blocks=40, num_cpu_blocks=64)
    monkeypatch.setenv("FASTCACHE_STAGING_MB", str(4 * spec.cpu_block_stride / 2**20))     # 4-block chunks
    rng = np.random.default_rng(17)
    with rig(spec, "staged", seed=17) as (gpu, swap, copier):
        for rows in gpu:
            rows[...] = rng.integers(1, 255, rows.shape, dtype=np.uint8)
        gpu_ids = rng.choice(40, 12, replace=False)
        cpu_ids = 2 * rng.choice(32, 12, replace=False)      # none adjacent: both copy streams get runs
        batch, calls = lazy.cudaMemcpyBatchAsync, []

        def fails_third(*args):
            calls.append(1)
            if len(calls) == 3:                              # the second chunk's first half
                return FakeRuntime.cudaError_t.cudaErrorInvalidValue, 0
            return batch(*args)
        monkeypatch.setattr(lazy, "cudaMemcpyBatchAsync", fails_third)
        with pytest.raises(TransferError, match="cudaMemcpyBatchAsync"):
            copier.swap_out(gpu_ids, cpu_ids)
        monkeypatch.setattr(lazy, "cudaMemcpyBatchAsync", batch)
        first_chunk = np.sort(cpu_ids)[:4]                   # staged in CPU-id order
        later_gpu = np.setdiff1d(np.arange(40), gpu_ids)[:3]
        later_cpu = first_chunk[1:]                          # staged one place off the failed task's
        copier.swap_out(later_gpu, later_cpu)                # small: one stream, reported done
        stored = np.concatenate([rows[later_gpu] for rows in gpu], axis=1)
        assert np.array_equal(swap.rows[later_cpu], stored)
        for stream in list(lazy.streams.values()):           # the device runs what is left queued
            lazy.cudaStreamSynchronize(stream)
        assert np.array_equal(swap.rows[later_cpu], stored), \
            "the failed task's queued DMA overwrote a later store after that store was done"
