"""The transfer manager's side of a fence (docs/design.md §4 "Ordering against the model"; worker/fences.py).

A KV swap that carries a fence for this rank makes the copy stream wait on the worker's fence event before the
copier queues anything that touches the device tensors (Copier's `first`). The worker's export is opened by
the generation the task names, once per generation; an export that is gone (its worker closed or restarted
since it took the fence) fails the task, since nothing would order the copy then.
"""
from __future__ import annotations

import os
import threading

from ..errors import TransferError
from ..ipc.shm import SegmentError

TEST_NO_FENCE = "FASTCACHE_TEST_NO_FENCE"      # "1", tests only: a fence is taken but never waited on


class FenceWaits:
    def __init__(self, suffix: str, rank: int, device_id: int):
        self.suffix, self.rank, self.device_id = suffix, rank, device_id
        self._peer = None
        self._lock = threading.Lock()       # both directions' threads; held across the wait, so the events
        #                                     are never closed (a new generation) under a stream wait

    def first(self, fence):
        """The copier's `first` for a task carrying `fence` (a protocol.Fence of this rank)."""
        def wait(stream):
            self.wait(stream, fence)
        return wait

    def wait(self, stream, fence):
        if os.environ.get(TEST_NO_FENCE) == "1":
            return
        from ..ops.cuda_events import PeerEvents, stream_wait
        with self._lock:
            if self._peer is None:
                self._peer = PeerEvents(self.suffix, self.rank, "fence", self.device_id)
            try:
                events = self._peer.current(fence.generation)
            except SegmentError:
                raise TransferError(f"rank {self.rank}: the worker's fence events of generation "
                                    f"{fence.generation:x} are gone (it closed or restarted since the fence)") from None
            if not fence.slot < len(events.events):
                raise TransferError(f"rank {self.rank}: fence slot {fence.slot} is outside the worker's "
                                    f"{len(events.events)} fence events")
            stream_wait(stream, events.events[fence.slot])

    def close(self):
        with self._lock:
            peer, self._peer = self._peer, None
        if peer is not None:
            peer.close()
