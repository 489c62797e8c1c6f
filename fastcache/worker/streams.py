"""A worker's per-layer waits (docs/design.md §11): on its host thread, or on cuda on one of its streams.

stream=None: the host waits until the layer is in place (ipc/layers.py). With a stream on cuda the host waits
only until the transfer manager has *recorded* the layer's interprocess event for this task, then makes the
stream wait on it (cudaStreamWaitEvent) and returns; kernels queued on the stream after that run once the
bytes are there. The host check cannot be left out: cudaStreamWaitEvent on an event not yet recorded for
this task returns at once (or waits for an older task's copy) and the kernels would read stale bytes.
On sim a stream is accepted and the host waits, so the same engine code runs on both devices.
"""
from __future__ import annotations

import threading

from ..errors import TransferError
from ..ipc.layers import RECORDED, check_wait, layers_in_place, wait_layer
from ..ipc.shm import SegmentError
from ..ipc.signal import EVENTS_LAYERS, EVENTS_WEIGHTS

# ipc_events column -> the name of the transfer manager's export (ipc/naming.py)
EXPORTS = {EVENTS_LAYERS: "layers", EVENTS_WEIGHTS: "weights"}


class LayerWaits:
    def __init__(self, signals, rank: int, suffix: str, device_id: int, cuda: bool, transfer_timeout: float):
        self.signals, self.rank, self.suffix, self.device_id = signals, rank, suffix, device_id
        self.cuda, self.transfer_timeout = cuda, transfer_timeout
        self._peers = {}            # ipc_events column -> PeerEvents, opened on first use
        self._lock = threading.Lock()

    def wait(self, task_id: int, layer: int, timeout: float | None, stream=None, slots=None,
             column: int = EVENTS_LAYERS, external: bool = False, claims=None, layers: int | None = None):
        """Layer `layer` of task_id (published in `slots`, claimed by the engine in `claims`, its events
        announced in ipc_events[rank, column]), of `layers`. ValueError for a layer or task no wait can be for;
        TransferError naming the rank if the task fails or the transfer manager stops beating; TimeoutError."""
        check_wait(task_id, layer, layers)
        common = dict(heartbeat_timeout=self.transfer_timeout, slots=slots, claims=claims)
        if stream is None or not self.cuda:
            wait_layer(self.signals, [self.rank], task_id, layer, timeout, **common)
            return
        from ..ops.cuda_events import stream_pointer, stream_wait
        pointer = stream_pointer(stream)
        generation = int(self.signals.ipc_events[self.rank, column])
        if not generation:          # the transfer manager exports no events: wait on the host
            wait_layer(self.signals, [self.rank], task_id, layer, timeout, **common)
            return
        wait_layer(self.signals, [self.rank], task_id, layer, timeout, field=RECORDED, **common)
        slots = self.signals.layer_ready if slots is None else slots
        claims = self.signals.layer_claims if claims is None else claims
        if not external and layers_in_place(slots, self.rank, task_id, claims=claims) > layer:
            return                  # landed already (or the task is over): nothing to order
        # (a graph being captured always gets the wait node: it is launched again for later tasks)
        try:
            events = self._peer(column).current(generation)
        except SegmentError:
            events = None
        if events is None or not layer < events.meta["layers"]:
            raise TransferError(f"rank {self.rank}: the transfer manager's events for layer {layer} of task "
                                f"{task_id} are gone (it stopped or was restarted)")
        # a later task may have re-recorded the event by now: the stream then waits for that task's copy of
        # the layer, which follows this one's on the same copy stream, so it only waits longer
        stream_wait(pointer, events.slot(task_id)[layer], external)
        if int(self.signals.ipc_events[self.rank, column]) != generation:
            raise TransferError(f"rank {self.rank}: the transfer manager was restarted while layer {layer} of "
                                f"task {task_id} was awaited")

    def _peer(self, column: int):
        with self._lock:
            if column not in self._peers:
                from ..ops.cuda_events import PeerEvents
                self._peers[column] = PeerEvents(self.suffix, self.rank, EXPORTS[column], self.device_id)
            return self._peers[column]

    def close(self):
        with self._lock:
            peers, self._peers = self._peers, {}
        for peer in peers.values():
            peer.close()
