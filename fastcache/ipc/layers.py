"""Per-layer readiness of a layer-by-layer swap-in (docs/design.md §5): the transfer manager publishes,
in a shared-memory slot per task, how many layers are in place; the engine's handle and a worker (by
task id) wait on it. A slot is [task id, layers in place]; the writer zeroes the count before it names
the task, so a reader that sees its task id reads a count of that task."""
from __future__ import annotations

import time

from ..errors import TransferError
from .signal import LAYER_SLOTS

POLL_S = 0.0002         # between reads of the slots while a layer is still on its way
FAILED = -1             # the count of a task that failed on that rank


class LayerPublisher:
    """The transfer manager's side for one task: published(layer) once that layer's rows are in place."""

    def __init__(self, layer_ready, rank: int, task_id: int):
        self._slot = layer_ready[rank, task_id % LAYER_SLOTS]
        self._slot[1] = 0
        self._slot[0] = task_id

    def published(self, layer: int):
        self._slot[1] = layer + 1

    def failed(self):
        """The task failed on this rank: a waiter on it raises instead of waiting for its timeout."""
        self._slot[1] = FAILED


def layers_in_place(layer_ready, rank: int, task_id: int) -> float:
    """How many leading layers of task_id are in place on rank (inf once a later task took the slot: a
    rank runs its swap-ins in order, so this one finished)."""
    owner, count = (int(v) for v in layer_ready[rank, task_id % LAYER_SLOTS])
    if owner == task_id:
        return count
    return float("inf") if owner > task_id else 0


def wait_layer(signals, ranks, task_id: int, layer: int, timeout: float | None, failed=lambda: None,
               heartbeat_timeout: float | None = None, slots=None):
    """Until `layer` of task_id is in place on every rank. `failed()` returns an error to raise at once (the
    engine's handle); with heartbeat_timeout a rank whose transfer manager stopped beating fails the wait
    naming it (a worker's wait). TimeoutError past `timeout` seconds. slots: the signal published in
    (default layer_ready; weight streams publish in weight_layers)."""
    slots = signals.layer_ready if slots is None else slots
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        error = failed()
        if error is not None:
            raise TransferError(error)
        counts = [layers_in_place(slots, r, task_id) for r in ranks]
        if all(count > layer for count in counts):
            return
        if FAILED in counts:
            raise TransferError(f"rank {ranks[counts.index(FAILED)]}: task {task_id} failed before layer {layer} "
                                f"was in place")
        if heartbeat_timeout is not None:
            now = time.time()
            for r in ranks:
                beat = float(signals.transfer_heartbeat[r])
                if beat and now - beat > heartbeat_timeout:
                    raise TransferError(f"rank {r}: its transfer manager stopped answering (no heartbeat for "
                                        f"{now - beat:.1f} s) while layer {layer} of task {task_id} was awaited")
        if deadline is not None and time.monotonic() > deadline:
            missing = [r for r in ranks if layers_in_place(slots, r, task_id) <= layer]
            raise TimeoutError(f"layer {layer} of task {task_id} not in place after {timeout} s on ranks {missing}")
        time.sleep(POLL_S)
