"""IPCSignal: a small NumPy array in a named shared-memory segment, and the deployment's set of them."""
from __future__ import annotations

import numpy as np

from .naming import signal_name
from .shm import SharedSegment

# kv_cache_status values (FastDeploy's; RESHARDING is fastcache's, docs/design.md §9)
NORMAL, UPDATING, CLEARING, CLEARED, RESHARDING = 0, 1, -1, -2, -3
STATUS_NAMES = {NORMAL: "NORMAL", UPDATING: "UPDATING", CLEARING: "CLEARING", CLEARED: "CLEARED",
                RESHARDING: "RESHARDING"}


WRITING = -1       # reshard_state's attempt while the engine rewrites the stage's fields


def publish_stage(state, seq: int, stage: int, from_tp: int, to_tp: int, attempt: int):
    """Publish a reshard stage in the reshard_state signal ([seq, stage, from tp, to tp, attempt]; docs/design.md
    §9) as a seqlock: the attempt reads WRITING while the fields change, then the new attempt (positive, new
    every time), so that a reader never acts on fields of two stages."""
    if attempt <= 0:
        raise ValueError(f"a stage's attempt must be positive, got {attempt}")
    state[4] = WRITING
    state[0], state[1], state[2], state[3] = seq, stage, from_tp, to_tp
    state[4] = attempt


def read_stage(state):
    """(attempt, seq, stage, from tp, to tp) of the published stage, or None while none is (attempt 0: never
    published) or it is being rewritten (the reader tries again on its next poll)."""
    attempt = int(state[4])
    if attempt <= 0:
        return None
    fields = tuple(int(x) for x in state[:4])
    if int(state[4]) != attempt:
        return None
    return (attempt, *fields)


class IPCSignal:
    """`IPCSignal(name, shape, dtype, suffix, create=True)` creates it (mode 0600); create=False attaches."""

    def __init__(self, name: str, shape, dtype, suffix: str, create: bool = False):
        self.name = name
        dtype = np.dtype(dtype)
        shape = tuple(shape)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        full = signal_name(suffix, name)
        if create:
            self._seg = SharedSegment.create(full, nbytes, suffix)
        else:
            self._seg = SharedSegment.attach(full, suffix)
            if self._seg.size < nbytes:
                self._seg.close()
                raise ValueError(f"signal {name}: segment holds {self._seg.size} bytes, expected {nbytes}")
        self.value = self._seg.array(dtype, shape)
        if create:
            self.value[...] = 0

    def view(self, shape):
        """Re-view the segment with another shape (a reshard changes tp); it must fit in the segment."""
        shape = tuple(shape)
        if int(np.prod(shape)) * self.value.dtype.itemsize > self._seg.size:
            raise ValueError(f"signal {self.name}: {shape} does not fit in its {self._seg.size}-byte segment")
        self.value = self._seg.array(self.value.dtype, shape)
        return self.value

    def whole(self) -> np.ndarray:
        """The signal over every rank its segment has room for (the creator's capacity), whatever the view."""
        row = self.value.shape[1:]
        row_bytes = int(np.prod(row)) * self.value.dtype.itemsize
        return self._seg.array(self.value.dtype, (self._seg.size // row_bytes, *row))

    def close(self):
        self.value = None
        self._seg.close()


LAYER_SLOTS = 64         # layer-by-layer tasks in flight at once (slot: task id modulo this; ipc/layers.py)
# ipc_events columns: who exported which interprocess CUDA events (ops/cuda_events.py)
EVENTS_LAYERS, EVENTS_WEIGHTS, EVENTS_RING_FREE, EVENTS_FENCE = 0, 1, 2, 3

# name -> (shape per tp_size, dtype)
SIGNALS = {
    "cache_ready": (lambda tp: (tp,), np.int32),
    "swap_space_ready": (lambda tp: (tp,), np.int32),
    "kv_cache_status": (lambda tp: (1,), np.int32),
    "worker_heartbeat": (lambda tp: (tp,), np.float64),
    # written by workers only: per rank the identity (random, not 0) of the worker that took it last; its export
    # manifest names it, so a transfer manager knows whether the tensors it maps are still its rank's
    "worker_id": (lambda tp: (tp,), np.int64),
    "transfer_heartbeat": (lambda tp: (tp,), np.float64),
    "task_received": (lambda tp: (tp,), np.int64),      # the last message number each transfer manager read
    # written by the engine only: per rank the highest message number it gave up waiting for that rank to read; a
    # task numbered up to it is not run if read later (docs/design.md §4)
    "task_abandoned": (lambda tp: (tp,), np.int64),
    # layer-by-layer swap-ins (ipc/layers.py): per rank and slot, [task id, layers in place, layers recorded]
    "layer_ready": (lambda tp: (tp, LAYER_SLOTS, 3), np.int64),
    # written by the engine only: per rank and slot [task id it claimed the slot for, outcome on that rank]
    "layer_claims": (lambda tp: (tp, LAYER_SLOTS, 2), np.int64),
    # reshard (docs/design.md §9): [sequence, stage, from tp, to tp, attempt], and per rank [sequence, progress] of its
    # journal; the attempt is written last, so a reader that sees it new sees the rest new too
    "reshard_state": (lambda tp: (5,), np.int64),
    "reshard_progress": (lambda tp: (tp, 2), np.int64),
    # weights (docs/design.md §11): per rank [worker exported them, transfer manager attached them]; the level
    # of a sleep under way or done (0: awake); per rank and slot the layers a weight stream has in place (as
    # layer_ready); per rank [stream task id, streamed layers its forward is done with] (ipc/ring.py)
    "weights_ready": (lambda tp: (tp, 2), np.int32),
    "sleep_level": (lambda tp: (1,), np.int32),
    "weight_layers": (lambda tp: (tp, LAYER_SLOTS, 3), np.int64),
    "weight_claims": (lambda tp: (tp, LAYER_SLOTS, 2), np.int64),
    "weight_ring": (lambda tp: (tp, 2), np.int64),
    # cuda (docs/design.md §11): per rank the generation (0: none) of the interprocess events exported for
    # [layer_ready (transfer manager), weight_layers (transfer manager), ring slots freed (worker), fences
    # (worker, docs/design.md §4)]
    "ipc_events": (lambda tp: (tp, 4), np.int64),
}


class ReadyView:
    """What an engine reads before every task, as byte views of the signals compared in one step each:
    kv_cache_status NORMAL and the first tp ranks' cache_ready, swap_space_ready and (with weights) both
    weights_ready columns all 1. `all_set()` True means all of that holds now; False only means "look closer"
    (a value other than 0 or 1 is not judged here). Made for one view of the signals: a resize needs a new one.
    It holds the segments' mappings until it is dropped."""

    def __init__(self, signals: "DeploymentSignals", tp: int, weights: bool):
        self.source, self.tp, self.weights = signals.cache_ready, tp, weights
        self._status = memoryview(signals.kv_cache_status).cast("B")
        self._normal = np.array([NORMAL], np.int32).tobytes()
        ready = [signals.cache_ready[:tp], signals.swap_space_ready[:tp]]
        if weights:
            ready.append(signals.weights_ready[:tp])
        self._ready = [(memoryview(a).cast("B"), np.ones(a.shape, a.dtype).tobytes()) for a in ready]

    def all_set(self) -> bool:
        if self._status != self._normal:
            return False
        for view, ones in self._ready:
            if view != ones:
                return False
        return True


class DeploymentSignals:
    """All signals of one deployment, created by the engine and attached by workers and transfer managers."""

    def __init__(self, suffix: str, tp_size: int, create: bool = False, capacity: int | None = None):
        """capacity (creator only): ranks the segments hold room for, so that a reshard can grow tp up to it
        without re-creating them; every process views the first tp_size."""
        self._signals = {}
        size = max(tp_size, capacity or 0) if create else tp_size
        try:
            for name, (shape, dtype) in SIGNALS.items():
                self._signals[name] = IPCSignal(name, shape(size), dtype, suffix, create=create)
        except BaseException:
            self.close()
            raise
        self.resize(tp_size)

    def resize(self, tp_size: int):
        """View tp_size ranks (a reshard); the memory behind every view stays the same."""
        for name, sig in self._signals.items():
            setattr(self, name, sig.view(SIGNALS[name][0](tp_size)))
        self.tp_size = tp_size

    def whole(self, name: str) -> np.ndarray:
        """Signal `name` over every rank its segment has room for (a reshard may view more ranks later)."""
        return self._signals[name].whole()

    @property
    def status(self) -> int:
        return int(self.kv_cache_status[0])

    @status.setter
    def status(self, value: int):
        self.kv_cache_status[0] = value

    def close(self):
        for name, sig in self._signals.items():
            if hasattr(self, name):
                delattr(self, name)
            sig.close()
        self._signals = {}
