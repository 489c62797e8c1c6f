"""A worker's fences (docs/design.md §4 "Ordering against the model"): a KV swap ordered after the model's stream.

fence(stream) records one of FENCE_SLOTS interprocess events on the stream the model computes on and returns
the Fence naming it; a swap submitted with it makes the transfer manager's copy stream wait on that event
(cudaStreamWaitEvent) before the swap touches the device tensors, so a store reads what the work queued before
the fence wrote and a load writes after it (a zeroing of its destination blocks included). The host never waits.

Slots are taken in turn, so a slot can be recorded again for a later fence before the transfer manager has
queued its wait for the earlier one (the task waited behind others, or 64 fences were taken meanwhile). Its
wait then captures the later record. That is safe because every record of a slot completes only after the
slot's previous record did: the stream first waits on the slot's event (the "chain" below), whatever stream
the previous record was on. A stream handle does not tell: cudaStreamPerThread names each host thread's own
default stream, and a destroyed stream's handle can come back for a new one; on the one stream the wait is
already met by stream order. So the later record covers everything the earlier one did, and a copy waiting on
it can only wait longer, never shorter. The ring only keeps such longer waits rare. The chain cannot deadlock:
like every cudaStreamWaitEvent it waits for a record already made (the one current at the call), so no wait can
depend on work queued after it.

No record while the stream is being captured into a CUDA graph (it would become a node of the graph, run at
each launch instead of now); the work captured runs only when the graph is launched, so such a fence is None:
fence on the stream after launching the graph. Where the driver refuses interprocess events, the host
synchronizes the stream instead (logged once) and the fence is None: ordered, at the cost of a host wait.
On sim the model's writes are host writes made before the call, so there is nothing to order: None.
"""
from __future__ import annotations

import logging
import threading

from ..errors import TransferError
from ..ipc.protocol import FENCE_SLOTS, Fence
from ..ipc.signal import EVENTS_FENCE

log = logging.getLogger("fastcache.worker")


class FenceRing:
    def __init__(self, signals, rank: int, suffix: str, device_id: int, cuda: bool):
        self.signals, self.rank, self.suffix, self.device_id, self.cuda = signals, rank, suffix, device_id, cuda
        self._events = None             # ExportedEvents, made on the first fence
        self._refused = False           # the driver refused interprocess events: host syncs instead
        self._recorded = [False] * FENCE_SLOTS  # the slots recorded since the export: the next record chains
        self._next = 0
        self._warned = set()
        self._lock = threading.Lock()

    def fence(self, stream) -> Fence | None:
        if not self.cuda:
            return None
        from ..ops.cuda_events import capturing, host_sync, record, stream_pointer, stream_wait
        pointer = stream_pointer(stream)
        if capturing(pointer):
            self._warn_once("capture", "a fence was asked for on a stream being captured into a CUDA graph: none "
                                       "recorded (the captured work runs at launch; fence after launching it)")
            return None
        with self._lock:
            events = self._export()
            if events is None:
                host_sync(pointer)
                return None
            slot = self._next % FENCE_SLOTS
            self._next += 1
            if self._recorded[slot]:
                stream_wait(pointer, events.events[slot])     # the chain: this record covers the slot's last one
            record(events.events[slot], pointer)
            self._recorded[slot] = True
            return Fence(self.rank, events.generation, slot)

    def _export(self):
        if self._events is None and not self._refused:
            from ..ops.cuda_events import ExportedEvents
            try:
                self._events = ExportedEvents(FENCE_SLOTS, self.device_id, self.signals, self.rank, EVENTS_FENCE,
                                              "fence", self.suffix)
            except TransferError as exc:
                self._refused = True
                self._warn_once("refused", f"no interprocess events ({exc}): each fence synchronizes its stream "
                                           f"on the host instead")
        return self._events

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            log.warning("rank %d: %s", self.rank, message)

    def close(self):
        with self._lock:
            events, self._events = self._events, None
            self._recorded = [False] * FENCE_SLOTS
        if events is not None:
            events.close()
