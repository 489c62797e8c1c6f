"""The deployment's weight group (docs/design.md §11): placement at start, the engine-owned CPU weight regions,
streams of offloaded layers for a forward, and the copies of the resident layers around a sleep.

A part of SwapBackend, which drives sleep/wake as phases (beside clear/restore) and delegates the weights'
share of them here. It owns the placed layout, the CPU weight regions (one shared-memory segment per rank),
the weight streams' slot claims and whether a sleep has saved the resident layers; what it needs of the rest
of the backend it is given as callables (see WeightGroup).
"""
from __future__ import annotations

import shutil
import time
from typing import Callable

import numpy as np

from ..errors import TransferError
from ..ipc import protocol
from ..ipc.layers import SlotClaims
from ..ipc.naming import weights_name
from ..ipc.shm import SHM_DIR, SharedSegment, check_shm_room
from ..ops import get_ops
from ..weight_spec import DEFAULT_RING_SLOTS, WeightSpec
from .handle import TransferHandle


def place_weights(weights, offload_fraction, weight_budget, ring_slots, tp_size: int, device: str,
                  device_ids) -> WeightSpec | None:
    """The placed layout (None without weights); ValueError for a bad request, before anything is created."""
    if weights is None:
        if offload_fraction is not None or weight_budget is not None or ring_slots != DEFAULT_RING_SLOTS:
            raise ValueError("offload_fraction, weight_budget and ring_slots place weights: give weights=WeightSpec")
        return None
    if not isinstance(weights, WeightSpec):
        raise ValueError(f"weights must be a WeightSpec, got {type(weights).__name__}")
    free = device_bytes(device, device_ids) if weight_budget is not None else None
    layout = weights.placed(offload_fraction, weight_budget, ring_slots, free)
    need = tp_size * (layout.cpu_cache_bytes + (layout.gpu_cache_bytes if device == "sim" else 0))
    check_shm_room(need, f"the weights, for {tp_size} rank(s),")
    return layout


def device_bytes(device: str, device_ids) -> int:
    """Free memory of the smallest device (sim: the shared memory its 'GPU' memory lives in)."""
    if device == "sim":
        return shutil.disk_usage(SHM_DIR).free
    ops = get_ops(device)
    return min(ops.device_memory_free(d) for d in set(device_ids))


class WeightGroup:
    """The weights of one deployment, `layout` None without any.

    tp_size() and signals() give the deployment's tp and signals now (a reshard changes the tp; the signals
    exist once it has started); new_task(kind, nbytes, what, slots, claims) is the handle of a task about to be
    sent in NORMAL, or why none can be (RefusedError, TransferError); new_phase_task(kind, nbytes) the handle of
    one a phase sends outside NORMAL; send_task(handle, message) sends it to every rank."""

    def __init__(self, layout: WeightSpec | None, suffix: str, tp_size: Callable[[], int], signals: Callable,
                 new_task: Callable[..., TransferHandle], new_phase_task: Callable[..., TransferHandle],
                 send_task: Callable[..., TransferHandle]):
        self.layout = layout
        self._suffix = suffix
        self._tp_size, self._signals = tp_size, signals
        self._new_task, self._new_phase_task, self._send_task = new_task, new_phase_task, send_task
        self._regions: list[SharedSegment | None] = [None] * tp_size()
        self._slots = SlotClaims("a weight stream")     # the streams' ids (ipc/layers.py)
        self._saved = False         # a level-1 sleep has saved the resident layers: a retried sleep does not copy again

    # -- CPU weight regions ------------------------------------------------------------------------
    def create_regions(self):
        if self.layout is None:
            return
        for rank in range(self._tp_size()):
            if self._regions[rank] is None:
                self._regions[rank] = SharedSegment.create(
                    weights_name(self._suffix, rank, "cpu"), self.layout.cpu_cache_bytes, self._suffix)

    def resize_regions(self, tp: int, layout: WeightSpec, recreate):
        """A reshard's CPU weight regions: ranks from tp on lose theirs, ranks in `recreate` get one made anew in
        `layout`'s size, the others keep theirs."""
        regions = self._regions + [None] * max(0, tp - len(self._regions))
        for rank, seg in enumerate(regions):
            if seg is not None and (rank >= tp or rank in recreate):
                seg.close()
                regions[rank] = None
        regions = regions[:tp]
        for rank in recreate:
            regions[rank] = SharedSegment.create(weights_name(self._suffix, rank, "cpu"), layout.cpu_cache_bytes,
                                                 self._suffix)
        self._regions = regions

    def take_layout(self, layout: WeightSpec, tp: int, kept):
        """A reshard's commit: the new layout, and every rank's CPU region in its slice size (a region's bytes
        matter only while the deployment sleeps, and a reshard refuses a sleeping one)."""
        self.layout = layout
        self.resize_regions(tp, layout, kept)

    def release_regions(self):
        for rank, seg in enumerate(self._regions):
            if seg is not None:
                seg.close()
                self._regions[rank] = None

    def region(self, rank: int) -> np.ndarray:
        layout = self._required()
        return self._regions[rank].array(np.uint8, (layout.num_cpu_blocks, layout.layer_bytes))

    def ready(self) -> bool:
        """Every rank's weights are in place (registered by the worker, attached by the transfer manager)."""
        return self.layout is None or bool(self._signals().weights_ready[:self._tp_size()].all())

    def _required(self) -> WeightSpec:
        if self.layout is None:
            raise ValueError("this deployment has no weights: SwapBackend(..., weights=WeightSpec(...))")
        return self.layout

    # -- streams ----------------------------------------------------------------------------------
    def stream(self) -> TransferHandle:
        layout = self._required()
        layers = list(layout.streamed_layers)
        if not layers:
            raise ValueError("no layer of this deployment is offloaded: nothing to stream")
        gpu = [layout.block_of(layer) for layer in layers]
        tp = self._tp_size()
        handle = self._new_task(protocol.SWAP_TO_GPU, layout.task_bytes(gpu) * tp, "weight stream",
                                self._slots, "weight_claims")
        handle.publishes_layers(self._signals(), range(tp), len(layers), self._slots,
                                "weight_layers", "weight_claims")
        return self._send(handle, gpu, layers, layerwise=True, ring=layout.ring_slots)

    # -- the weights' share of sleep and wake --------------------------------------------------------
    def save_resident(self, deadline):
        """A level-1 sleep: copy the resident layers into the CPU regions and compare them there, unless a
        retried sleep has saved them already; TransferError naming the failed ranks."""
        resident = self._resident()
        if resident and not self._saved:
            self._copy(protocol.SWAP_TO_CPU, resident, "sleep", deadline)
            self._saved = True

    def restore_resident(self, level: int, deadline):
        """A wake: after a level-1 sleep, copy the resident layers back; the saved copy is spent either way."""
        resident = self._resident()
        if level == 1 and resident:
            self._copy(protocol.SWAP_TO_GPU, resident, "wake", deadline)
        self._saved = False

    def _resident(self) -> list[int]:
        return list(range(self.layout.resident_layers)) if self.layout is not None else []

    def _copy(self, kind, blocks, what, deadline):
        """Copy resident layers between their device blocks and CPU blocks on every rank, outside NORMAL (a
        sleep's or a wake's copy); returns once done, TransferError naming the failed ranks."""
        signals, tp = self._signals(), self._tp_size()
        missing = [r for r in range(tp) if not signals.weights_ready[r].all()]
        if missing:
            raise TransferError(f"{what} failed: ranks {missing} have no weights in place (registered by the "
                                f"worker, attached by the transfer manager)")
        handle = self._new_phase_task(kind, self.layout.task_bytes(blocks) * tp)
        self._send(handle, blocks, blocks)
        try:
            handle.result(max(0.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            raise TransferError(f"{what} timed out: {exc}") from None
        except TransferError as exc:
            raise TransferError(f"{what} failed: {exc}") from None

    def _send(self, handle, gpu, cpu, layerwise=False, ring=0):
        return self._send_task(handle, protocol.encode_task(
            handle.task_id, handle.kind, np.array(gpu, np.int64), np.array(cpu, np.int64), layerwise,
            protocol.WEIGHTS, ring))
