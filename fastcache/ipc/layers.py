"""Per-layer readiness of a layer-by-layer swap-in (docs/design.md §11): the transfer manager publishes, in
a shared-memory slot per task, how far the task's layers got; the engine's handle and a worker (by task id)
wait on it.

A task publishes in slot `task_id % LAYER_SLOTS`. The engine picks the ids of these tasks so that no two
unfinished ones share a slot, and records in a claims table, per rank and slot, [task id, outcome]: the
task it claimed the slot for, and RUNNING until that rank reported the task (DONE or FAILED, failures the
engine decides itself included: a lost message, a dead rank). A slot names its task, and a wait reads only
its own task's progress: a task id the claims do not name is refused, never read as finished.

A slot is [task id, layers in place, layers recorded]. Each count is written in one store together with the
id of the task it counts (`task id * SPAN + count + 1`), and a reader takes only a count its own task wrote:
a task that runs late on a rank (the engine failed it there, and its slot serves a later task) may write
after the later task took the slot, past its check of the slot's task id, but never as the later task.
- in place: that many leading layers have their bytes on the device. Host waiters (the engine's handle, a
  worker's wait without a stream) wait for this.
- recorded: on cuda, the transfer manager has recorded that many layers' interprocess events on its copy
  stream, each after its layer's copies (ops/cuda_events.py); a worker's stream may wait on such an event
  (cudaStreamWaitEvent) from then on, while the copy itself may still run. On sim it moves with in place.
Recorded is never behind in place. A failed task sets both to FAILED.
"""
from __future__ import annotations

import threading
import time

from ..errors import RefusedError, TransferError
from .signal import LAYER_SLOTS

POLL_S = 0.0002         # between reads of the slots while a layer is still on its way
FAILED = -1             # the counts of a task that failed on that rank; an outcome too
RUNNING, DONE = 0, 1    # outcomes in the claims table
UNCLAIMED = -1          # the claimed id of a slot no task has had yet (0: no engine keeps claims, as in tests
                        # that drive a transfer manager's side alone; the slot then answers by itself)
OWNER, IN_PLACE, RECORDED = 0, 1, 2     # a slot's fields
SPAN = 1 << 20          # a count field holds task id * SPAN + count + 1 (counts below SPAN - 1)
CLAIMED, OUTCOME = 0, 1                 # a claim's fields


def count_word(task_id: int, count: int) -> int:
    return task_id * SPAN + count + 1


def count_of(slot, field: int, task_id: int) -> int:
    """A slot's count in `field` (IN_PLACE or RECORDED) if task_id wrote it (FAILED included), else 0."""
    word = int(slot[field])
    return word % SPAN - 1 if word // SPAN == task_id else 0


class LayerPublisher:
    """The transfer manager's side for one task: recorded(layer) once that layer's event is recorded after its
    copies (cuda), published(layer) once its rows are in place."""

    def __init__(self, layer_ready, rank: int, task_id: int):
        self._slot = layer_ready[rank, task_id % LAYER_SLOTS]
        self._task_id = task_id
        self._slot[IN_PLACE] = 0
        self._slot[RECORDED] = 0
        self._slot[OWNER] = task_id

    def _mine(self) -> bool:
        # a task the engine failed on this rank (never read in time) may still run late: by then its slot may
        # serve a later task, whose counts it must not touch
        return int(self._slot[OWNER]) == self._task_id

    def recorded(self, layer: int):
        if self._mine():
            self._slot[RECORDED] = count_word(self._task_id, layer + 1)

    def published(self, layer: int):
        if not self._mine():
            return
        if count_of(self._slot, RECORDED, self._task_id) < layer + 1:     # sim: in place without an event
            self._slot[RECORDED] = count_word(self._task_id, layer + 1)
        self._slot[IN_PLACE] = count_word(self._task_id, layer + 1)

    def failed(self):
        """The task failed on this rank: a waiter on it raises instead of waiting for its timeout."""
        if self._mine():
            self._slot[RECORDED] = count_word(self._task_id, FAILED)
            self._slot[IN_PLACE] = count_word(self._task_id, FAILED)


class SlotClaims:
    """The engine's side of one table (layer_ready or weight_layers, with its claims signal): task ids for
    layer-by-layer tasks whose slot no unfinished task holds, and each rank's outcome as it reports."""

    def __init__(self, what: str):
        self._what = what
        self._held: dict[int, int] = {}     # slot -> task id, until its handle is done
        self._lock = threading.Lock()

    @staticmethod
    def open(claims):
        """At start, over every rank the table has room for: no slot is claimed yet."""
        claims[..., CLAIMED] = UNCLAIMED
        claims[..., OUTCOME] = RUNNING

    def claim(self, claims, ranks, task_ids) -> int:
        """A task id from `task_ids` (the engine's counter) whose slot is free, claimed on every rank; ids
        that would share a held slot are skipped. RefusedError while every slot is held."""
        with self._lock:
            if len(self._held) >= LAYER_SLOTS:
                raise RefusedError(f"{self._what} refused: {LAYER_SLOTS} of them are in flight already; wait "
                                   f"for one to finish")
            task_id = next(task_ids)
            while task_id % LAYER_SLOTS in self._held:
                task_id = next(task_ids)
            slot = task_id % LAYER_SLOTS
            self._held[slot] = task_id
        for rank in ranks:
            claims[rank, slot, OUTCOME] = RUNNING
            claims[rank, slot, CLAIMED] = task_id
        return task_id

    @staticmethod
    def settle(claims, rank: int, task_id: int, ok: bool):
        """Rank reported task_id (or the engine failed it there): every waiter on that rank wakes."""
        slot = claims[rank, task_id % LAYER_SLOTS]
        if int(slot[CLAIMED]) == task_id:
            slot[OUTCOME] = DONE if ok else FAILED

    def release(self, task_id: int):
        """The task's handle is done: its slot may serve a later task (its outcome stays readable until then)."""
        with self._lock:
            if self._held.get(task_id % LAYER_SLOTS) == task_id:
                del self._held[task_id % LAYER_SLOTS]


def layers_in_place(layer_ready, rank: int, task_id: int, field: int = IN_PLACE, claims=None) -> float:
    """How many leading layers of task_id are in place on rank (with field=RECORDED: have their event
    recorded): FAILED if it failed there, inf once the rank reported it done. ValueError for a task the
    claims do not name (never a layer-by-layer task, or its slot has served a later one since). Without
    claims (a transfer manager driven without an engine) the slot alone answers, and a slot a later task
    took is refused as well."""
    index = task_id % LAYER_SLOTS
    slot = layer_ready[rank, index]
    owner, count = int(slot[OWNER]), count_of(slot, field, task_id)     # 0 unless task_id wrote it
    claimed = int(claims[rank, index, CLAIMED]) if claims is not None else 0
    if claimed:
        outcome = int(claims[rank, index, OUTCOME])
        if claimed != task_id:
            raise ValueError(unknown_task(rank, task_id, claimed))
        if outcome == FAILED:
            return FAILED
        if outcome == DONE:
            return float("inf")
        return count
    if owner > task_id:
        raise ValueError(unknown_task(rank, task_id, owner))
    return count


def unknown_task(rank: int, task_id: int, holder: int) -> str:
    held = f"its slot names task {holder}" if holder > 0 else "no task has had its slot"
    return (f"task {task_id} is not a layer-by-layer task known on rank {rank} ({held}): "
            f"pass the task_id of a swap_in(..., layerwise=True) or stream_weights() handle, "
            f"while it runs or soon after")


def check_wait(task_id, layer, layers: int | None):
    """ValueError for a task id or layer no wait can be for (a layer past the last would wait forever)."""
    if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 1:
        raise ValueError(f"task_id must be a positive int (a handle's task_id), got {task_id!r}")
    bound = f"[0, {layers})" if layers is not None else "≥ 0"
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0 or (layers is not None and layer >= layers):
        raise ValueError(f"layer must be an int in {bound}, got {layer!r}")


def wait_layer(signals, ranks, task_id: int, layer: int, timeout: float | None, failed=lambda: None,
               heartbeat_timeout: float | None = None, slots=None, field: int = IN_PLACE, claims=None):
    """Until `layer` of task_id is in place on every rank (field=RECORDED: its event is recorded). `failed()`
    returns an error to raise at once (the engine's handle); with heartbeat_timeout a rank whose transfer
    manager stopped beating fails the wait naming it (a worker's wait). TimeoutError past `timeout` seconds.
    slots: the signal published in (default layer_ready; weight streams publish in weight_layers), claims: its
    claims table (default layer_claims)."""
    slots = signals.layer_ready if slots is None else slots
    claims = signals.layer_claims if claims is None else claims
    deadline = None if timeout is None else time.monotonic() + timeout
    what = "in place" if field == IN_PLACE else "recorded"
    while True:
        error = failed()
        if error is not None:
            raise TransferError(error)
        counts = [layers_in_place(slots, r, task_id, field, claims) for r in ranks]
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
            missing = [r for r, count in zip(ranks, counts) if count <= layer]
            raise TimeoutError(f"layer {layer} of task {task_id} not {what} after {timeout} s on ranks {missing}")
        time.sleep(POLL_S)
