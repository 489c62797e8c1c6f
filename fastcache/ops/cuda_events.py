"""Interprocess CUDA events (docs/design.md §11): per-layer readiness without a host block.

The transfer manager records an event per (task slot, layer) on its copy stream right after that layer's
copies; a worker's stream waits on it with cudaStreamWaitEvent instead of the worker's host thread waiting
for the copy. Streamed weights add the reverse direction: the worker records an event per ring slot on its
stream once its kernels are done with the layer there, and the transfer manager's copy stream waits on it
before refilling the slot.

Events are created with cudaEventInterprocess | cudaEventDisableTiming and shared as their
cudaIpcGetEventHandle bytes in a JSON segment (ipc/manifest.py) named by a fresh generation; the ipc_events
signal announces the generation (0: none). An opener re-opens whenever the generation changes: a restarted
creator's events are new ones. The creator unlinks its segment; a killed creator's is a leftover of a dead
process, which the engine removes at close.
"""
from __future__ import annotations

import contextlib
import ctypes
import secrets
import threading
from collections import deque

from cuda.bindings import runtime

from ..errors import TransferError
from ..ipc.manifest import read_json_segment, write_json_segment
from ..ipc.naming import events_name
from .cuda_kernels import cuda_check, set_device

IPC_EVENT_HANDLE_BYTES = 64
# task slots that have events of their own (task id modulo this): fewer than the signal's LAYER_SLOTS keeps
# the count of interprocess events down (EVENT_SLOTS x layers per rank and kind; drivers limit them). Safe:
# a waiter checks on the host that its task recorded the layer, so a later task's record of the same
# event only makes the stream wait for that later copy, queued behind this one on the same copy stream.
EVENT_SLOTS = 16


def create_events(count: int, interprocess: bool) -> list:
    flags = runtime.cudaEventDisableTiming | (runtime.cudaEventInterprocess if interprocess else 0)
    events = []
    try:
        for _ in range(count):
            events.append(cuda_check(runtime.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags"))
    except BaseException:
        destroy_events(events)
        raise
    return events


def destroy_events(events: list):
    for event in events:
        cuda_check(runtime.cudaEventDestroy(event), "cudaEventDestroy")


def stream_pointer(stream) -> int:
    """The raw cudaStream_t of an int, a torch stream (.cuda_stream), a CuPy one (.ptr), or a cuda.core /
    cuda.bindings stream."""
    if isinstance(stream, bool):
        raise ValueError(f"stream must be a CUDA stream, got {stream!r}")
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):
        value = getattr(stream, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    try:
        return int(stream)          # cudaStream_t, CUstream
    except (TypeError, ValueError):
        raise ValueError(f"stream must be a CUDA stream (an int, or with .cuda_stream or .ptr), got "
                         f"{type(stream).__name__}") from None


def record(event, stream, external: bool = False):
    """event recorded on stream; external: as an external-event node when the stream is being captured."""
    if external:
        cuda_check(runtime.cudaEventRecordWithFlags(event, stream, runtime.cudaEventRecordExternal),
                   "cudaEventRecordWithFlags")
    else:
        cuda_check(runtime.cudaEventRecord(event, stream), "cudaEventRecord")


def stream_wait(stream, event, external: bool = False):
    """Work queued on stream from now on waits for event's last record. external: inside a capture the wait
    becomes an external-event node, so every launch of the graph waits for the event's record at launch."""
    flags = runtime.cudaEventWaitExternal if external else 0
    cuda_check(runtime.cudaStreamWaitEvent(stream, event, flags), "cudaStreamWaitEvent")


def capturing(stream) -> bool:
    """Is stream being captured into a CUDA graph? (A record then would be a node of the graph, not now.)"""
    status = cuda_check(runtime.cudaStreamIsCapturing(stream), "cudaStreamIsCapturing")
    return status != runtime.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone


def host_sync(stream):
    cuda_check(runtime.cudaStreamSynchronize(stream), "cudaStreamSynchronize")


def complete(event) -> bool:
    """Has the work captured by event's last record finished (without blocking)?"""
    (err,) = runtime.cudaEventQuery(event)
    if err == runtime.cudaError_t.cudaErrorNotReady:
        return False
    cuda_check((err,), "cudaEventQuery")
    return True


class Completions:
    """Events recorded in stream order, each with what to call once it has completed; called in that order,
    so a count published from them is always a prefix. poll() never blocks, drain() waits for the rest."""

    def __init__(self):
        self._pending = deque()

    def add(self, event, done):
        self._pending.append((event, done))

    def poll(self):
        while self._pending and complete(self._pending[0][0]):
            self._pending.popleft()[1]()

    def drain(self):
        while self._pending:
            cuda_check(runtime.cudaEventSynchronize(self._pending[0][0]), "cudaEventSynchronize")
            self._pending.popleft()[1]()

    def __len__(self):
        return len(self._pending)


@contextlib.contextmanager
def on_device(device_id: int):
    """device_id current on this thread meanwhile; the caller's device (a framework's) is put back after."""
    previous = cuda_check(runtime.cudaGetDevice(), "cudaGetDevice")
    set_device(device_id)
    try:
        yield
    finally:
        if previous != device_id:
            cuda_check(runtime.cudaSetDevice(previous), "cudaSetDevice")


def handle_bytes(event) -> bytes:
    handle = cuda_check(runtime.cudaIpcGetEventHandle(event), "cudaIpcGetEventHandle")
    return ctypes.string_at(handle.getPtr(), IPC_EVENT_HANDLE_BYTES)


def open_event(raw: bytes):
    handle = runtime.cudaIpcEventHandle_t()
    ctypes.memmove(handle.getPtr(), raw, IPC_EVENT_HANDLE_BYTES)
    return cuda_check(runtime.cudaIpcOpenEventHandle(handle), "cudaIpcOpenEventHandle")


class ExportedEvents:
    """`count` interprocess events made in this process and announced to the others: their handles in a
    segment named by a fresh generation, then the generation in signals.ipc_events[rank, column]."""

    def __init__(self, count: int, device_id: int, signals, rank: int, column: int, what: str, suffix: str,
                 **meta):
        self.device_id, self.count = device_id, count
        self._signals, self._cell = signals, (rank, column)
        self.generation = secrets.randbits(62) | 1          # never 0: that means "none exported"
        with on_device(device_id):
            self.events = create_events(count, interprocess=True)
            try:
                handles = b"".join(handle_bytes(event) for event in self.events)
                self._segment = write_json_segment(
                    events_name(suffix, rank, what, self.generation),
                    {"device": device_id, "count": count, "handles": handles.hex(), **meta}, suffix)
            except BaseException:
                destroy_events(self.events)
                raise
        signals.ipc_events[self._cell] = self.generation     # only once the segment is there

    def close(self):
        events, self.events = self.events, []
        if not events:
            return
        cells = getattr(self._signals, "ipc_events", None)       # None once the signals are closed
        if cells is not None and int(cells[self._cell]) == self.generation:
            cells[self._cell] = 0
        self._segment.close()
        with on_device(self.device_id):
            destroy_events(events)


class SlotEvents(ExportedEvents):
    """The transfer manager's events of one signal: one per (task slot, layer), EVENT_SLOTS x `layers`."""

    def __init__(self, layers: int, device_id: int, signals, rank: int, column: int, what: str, suffix: str):
        super().__init__(EVENT_SLOTS * layers, device_id, signals, rank, column, what, suffix, layers=layers)
        self.layers = layers

    def slot(self, task_id: int) -> list:
        """The events of task_id's slot, by layer."""
        first = (task_id % EVENT_SLOTS) * self.layers
        return self.events[first:first + self.layers]


class PeerEvents:
    """Another process's exported events, opened in this one once per generation of its export."""

    def __init__(self, suffix: str, rank: int, what: str, device_id: int):
        self.suffix, self.rank, self.what, self.device_id = suffix, rank, what, device_id
        self.generation, self.events, self.meta = 0, [], {}
        self._lock = threading.Lock()

    def current(self, generation: int) -> "PeerEvents | None":
        """Self with the events of `generation` open (re-opened if it changed), None for generation 0. A
        SegmentError (ipc/shm.py) if the export is gone: its creator closed or died meanwhile."""
        with self._lock:
            if generation != self.generation:
                self._close()
                if generation:
                    doc = read_json_segment(events_name(self.suffix, self.rank, self.what, generation), self.suffix)
                    raw = bytes.fromhex(doc["handles"])
                    if len(raw) != doc["count"] * IPC_EVENT_HANDLE_BYTES:
                        raise TransferError(f"rank {self.rank}: malformed {self.what} event export")
                    with on_device(self.device_id):
                        events = []
                        try:
                            for k in range(doc["count"]):
                                events.append(open_event(raw[k * IPC_EVENT_HANDLE_BYTES:(k + 1) * IPC_EVENT_HANDLE_BYTES]))
                        except BaseException:
                            destroy_events(events)
                            raise
                    self.events, self.meta, self.generation = events, doc, generation
            return self if self.generation else None

    def slot(self, task_id: int) -> list:
        """Of a SlotEvents export: the events of task_id's slot, by layer."""
        layers = self.meta["layers"]
        first = (task_id % EVENT_SLOTS) * layers
        return self.events[first:first + layers]

    def _close(self):
        events, self.events, self.generation, self.meta = self.events, [], 0, {}
        if events:
            with on_device(self.device_id):
                destroy_events(events)      # how an opened interprocess event is let go

    def close(self):
        with self._lock:
            self._close()
