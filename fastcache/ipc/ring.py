"""Back-pressure on the ring of device slots a weight stream fills (docs/design.md §11).

The transfer manager copies the offloaded layers of a forward, in order, into k fixed slots; the worker's
forward reads them. A slot may be overwritten only once the forward is done with the layer it held. The
worker writes, per rank, [stream task id, streamed layers it is done with] in the weight_ring signal (the
count zeroed before the id is written, as in layers.py, so a reader that sees its task id reads that
task's count); the transfer manager reads it before each copy.

On cuda a forward that reads through a stream says "done with" before its kernels are: it first records the
slot's interprocess event on its stream, and the transfer manager's copy stream waits on that event before
refilling the slot (transfer/weights.py), so the count orders the host and the event the device.
"""
from __future__ import annotations

import time

from ..errors import TransferError

FINISHED = 1 << 62          # the count once a forward is over: every slot it read is free
POLL_S = 0.0002


def begin(ring, rank: int, task_id: int):
    """The worker starts a forward over stream task_id (the one before it is over)."""
    ring[rank, 1] = 0
    ring[rank, 0] = task_id


def done_with(ring, rank: int, task_id: int, count: int):
    """The forward of task_id is done with its first `count` streamed layers."""
    if int(ring[rank, 0]) == task_id:
        ring[rank, 1] = max(int(ring[rank, 1]), count)


def slot_free(ring, rank: int, task_id: int, index: int, slots: int) -> bool:
    """May streamed layer `index` of task_id be copied into its slot (index % slots)?"""
    owner, done = (int(v) for v in ring[rank])
    if owner > task_id:
        return True                         # the forward has moved past this stream: nobody reads it
    if owner == task_id:
        return done >= index - slots + 1    # the layer this slot held before, of this stream, is done with
    # the forward has not begun this stream: the first k slots are free once the last forward is over
    return index < slots and (owner == 0 or done >= FINISHED)


def wait_slot(ring, rank: int, task_id: int, index: int, slots: int, timeout: float, idle=None):
    """Until slot_free; TransferError naming the rank after `timeout` s (a forward that never moves on).
    idle(): called between reads (the cuda stream publishes the layers that landed meanwhile)."""
    deadline = time.monotonic() + timeout
    while not slot_free(ring, rank, task_id, index, slots):
        if time.monotonic() > deadline:
            raise TransferError(f"rank {rank}: the slot for streamed layer {index} of task {task_id} was still in "
                                f"use after {timeout:.0f} s (the worker's forward did not move on)")
        if idle is not None:
            idle()
        time.sleep(POLL_S)
