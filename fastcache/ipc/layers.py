"""Per-layer readiness of a layer-by-layer swap-in (docs/design.md §11): the transfer manager publishes, in
a shared-memory slot per task, how far the task's layers got; the engine's handle and a worker (by task id)
wait on it.

A slot is [task id, layers in place, layers recorded]. The writer zeroes both counts before it names the
task, so a reader that sees its task id reads counts of that task.
- in place: that many leading layers have their bytes on the device. Host waiters (the engine's handle, a
  worker's wait without a stream) wait for this.
- recorded: on cuda, the transfer manager has recorded that many layers' interprocess events on its copy
  stream, each after its layer's copies (ops/cuda_events.py); a worker's stream may wait on such an event
  (cudaStreamWaitEvent) from then on, while the copy itself may still run. On sim it moves with in place.
Recorded is never behind in place. A failed task sets both to FAILED.
"""
from __future__ import annotations

import time

from ..errors import TransferError
from .signal import LAYER_SLOTS

POLL_S = 0.0002         # between reads of the slots while a layer is still on its way
FAILED = -1             # the counts of a task that failed on that rank
OWNER, IN_PLACE, RECORDED = 0, 1, 2     # a slot's fields


class LayerPublisher:
    """The transfer manager's side for one task: recorded(layer) once that layer's event is recorded after its
    copies (cuda), published(layer) once its rows are in place."""

    def __init__(self, layer_ready, rank: int, task_id: int):
        self._slot = layer_ready[rank, task_id % LAYER_SLOTS]
        self._slot[IN_PLACE] = 0
        self._slot[RECORDED] = 0
        self._slot[OWNER] = task_id

    def recorded(self, layer: int):
        self._slot[RECORDED] = layer + 1

    def published(self, layer: int):
        if self._slot[RECORDED] < layer + 1:        # sim: in place without an event
            self._slot[RECORDED] = layer + 1
        self._slot[IN_PLACE] = layer + 1

    def failed(self):
        """The task failed on this rank: a waiter on it raises instead of waiting for its timeout."""
        self._slot[RECORDED] = FAILED
        self._slot[IN_PLACE] = FAILED


def layers_in_place(layer_ready, rank: int, task_id: int, field: int = IN_PLACE) -> float:
    """How many leading layers of task_id are in place on rank (with field=RECORDED: have their event
    recorded); inf once a later task took the slot: a rank runs its swap-ins in order and publishes every
    layer in place before it reports a task done, so this one finished."""
    slot = layer_ready[rank, task_id % LAYER_SLOTS]
    owner = int(slot[OWNER])
    count = int(slot[field])
    if owner == task_id:
        return count
    return float("inf") if owner > task_id else 0


def wait_layer(signals, ranks, task_id: int, layer: int, timeout: float | None, failed=lambda: None,
               heartbeat_timeout: float | None = None, slots=None, field: int = IN_PLACE):
    """Until `layer` of task_id is in place on every rank (field=RECORDED: its event is recorded). `failed()`
    returns an error to raise at once (the engine's handle); with heartbeat_timeout a rank whose transfer
    manager stopped beating fails the wait naming it (a worker's wait). TimeoutError past `timeout` seconds.
    slots: the signal published in (default layer_ready; weight streams publish in weight_layers)."""
    slots = signals.layer_ready if slots is None else slots
    deadline = None if timeout is None else time.monotonic() + timeout
    what = "in place" if field == IN_PLACE else "recorded"
    while True:
        error = failed()
        if error is not None:
            raise TransferError(error)
        counts = [layers_in_place(slots, r, task_id, field) for r in ranks]
        if all(count > layer for count in counts):
            return
        if FAILED in counts:
            raise TransferError(f"rank {ranks[counts.index(FAILED)]}: task {task_id} failed before layer {layer} "
                                f"was {what}")
        if heartbeat_timeout is not None:
            now = time.time()
            for r in ranks:
                beat = float(signals.transfer_heartbeat[r])
                if beat and now - beat > heartbeat_timeout:
                    raise TransferError(f"rank {r}: its transfer manager stopped answering (no heartbeat for "
                                        f"{now - beat:.1f} s) while layer {layer} of task {task_id} was awaited")
        if deadline is not None and time.monotonic() > deadline:
            missing = [r for r in ranks if layers_in_place(slots, r, task_id, field) <= layer]
            raise TimeoutError(f"layer {layer} of task {task_id} not {what} after {timeout} s on ranks {missing}")
        time.sleep(POLL_S)
