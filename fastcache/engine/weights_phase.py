"""SwapBackend's weight group (docs/design.md §11): placement at start, the engine-owned CPU weight regions,
streams of offloaded layers for a forward, and sleep/wake around clear/restore.

A mixin of SwapBackend. The state it owns: `weight_layout` (the placed WeightSpec, None without weights),
`_weight_regions` (one shared-memory segment per rank) and `_sleep_copied` (a level-1 sleep has saved the
weights; a retried sleep does not copy again).
"""
from __future__ import annotations

import shutil
import time

import numpy as np

from ..errors import TransferError
from ..ipc import protocol
from ..ipc.naming import weights_name
from ..ipc.shm import SHM_DIR, SharedSegment, check_shm_room
from ..ipc.signal import CLEARED, CLEARING, NORMAL, STATUS_NAMES, UPDATING
from ..ops import get_ops
from ..weight_spec import DEFAULT_RING_SLOTS, WeightSpec
from .handle import TransferHandle

LEVELS = (1, 2)


class WeightPhases:
    def _init_weights(self, weights, offload_fraction, weight_budget, ring_slots):
        """Place the weights (ValueError for a bad request, before anything is created)."""
        self.weight_layout, self._weight_regions, self._sleep_copied = None, [None] * self.tp_size, False
        if weights is None:
            if offload_fraction is not None or weight_budget is not None or ring_slots != DEFAULT_RING_SLOTS:
                raise ValueError("offload_fraction, weight_budget and ring_slots place weights: give weights=WeightSpec")
            return
        if not isinstance(weights, WeightSpec):
            raise ValueError(f"weights must be a WeightSpec, got {type(weights).__name__}")
        device = self._device_bytes() if weight_budget is not None else None
        self.weight_layout = weights.placed(offload_fraction, weight_budget, ring_slots, device)
        layout = self.weight_layout
        need = self.tp_size * (layout.cpu_cache_bytes + (layout.gpu_cache_bytes if self.device == "sim" else 0))
        check_shm_room(need, f"the weights, for {self.tp_size} rank(s),")

    def _device_bytes(self) -> int:
        """Free memory of the smallest device (sim: the shared memory its 'GPU' memory lives in)."""
        if self.device == "sim":
            return shutil.disk_usage(SHM_DIR).free
        ops = get_ops(self.device)
        return min(ops.device_memory_free(d) for d in set(self.device_ids))

    def _create_weight_regions(self):
        if self.weight_layout is None:
            return
        for rank in range(self.tp_size):
            if self._weight_regions[rank] is None:
                self._weight_regions[rank] = SharedSegment.create(
                    weights_name(self.suffix, rank, "cpu"), self.weight_layout.cpu_cache_bytes, self.suffix)

    def _resize_weight_regions(self, tp: int, layout: WeightSpec, recreate):
        """A reshard's CPU weight regions: ranks from tp on lose theirs, ranks in `recreate` get one made anew in
        `layout`'s size, the others keep theirs."""
        regions = self._weight_regions + [None] * max(0, tp - len(self._weight_regions))
        for rank, seg in enumerate(regions):
            if seg is not None and (rank >= tp or rank in recreate):
                seg.close()
                regions[rank] = None
        regions = regions[:tp]
        for rank in recreate:
            regions[rank] = SharedSegment.create(weights_name(self.suffix, rank, "cpu"), layout.cpu_cache_bytes,
                                                 self.suffix)
        self._weight_regions = regions

    def _release_weight_regions(self):
        for rank, seg in enumerate(self._weight_regions):
            if seg is not None:
                seg.close()
                self._weight_regions[rank] = None

    def _weights_ready(self) -> bool:
        return self.weight_layout is None or bool(self.signals.weights_ready[:self.tp_size].all())

    def weight_region(self, rank: int) -> np.ndarray:
        """Rank's CPU weight region as uint8 [num_layers, layer_bytes]: CPU block l holds layer l (for checks
        and tools)."""
        layout = self._layout()
        return self._weight_regions[rank].array(np.uint8, (layout.num_cpu_blocks, layout.layer_bytes))

    def _layout(self) -> WeightSpec:
        if self.weight_layout is None:
            raise ValueError("this deployment has no weights: SwapBackend(..., weights=WeightSpec(...))")
        return self.weight_layout

    # -- streams ----------------------------------------------------------------------------------
    def stream_weights(self) -> TransferHandle:
        """Stream the offloaded layers of one forward pass into the ring of device slots, in order; a slot is
        refilled once the forward has moved past the layer it held. `handle.wait_layer(i)` returns once the
        i-th offloaded layer is in place; a worker's forward waits by `handle.task_id`."""
        layout = self._layout()
        layers = list(layout.streamed_layers)
        if not layers:
            raise ValueError("no layer of this deployment is offloaded: nothing to stream")
        gpu = [layout.block_of(layer) for layer in layers]
        handle = self._new_task(protocol.SWAP_TO_GPU, layout.task_bytes(gpu) * self.tp_size, "weight stream",
                                self._weight_slots, "weight_claims")
        handle.publishes_layers(self.signals, range(self.tp_size), len(layers), self._weight_slots,
                                "weight_layers", "weight_claims")
        return self._send_weights(handle, gpu, layers, layerwise=True, ring=layout.ring_slots)

    def _weights_task(self, kind, blocks, what, deadline):
        """Copy resident layers between their device blocks and CPU blocks on every rank, outside NORMAL (a
        sleep's or a wake's copy); returns once done, TransferError naming the failed ranks."""
        self._raise_if_failed()
        missing = [r for r in range(self.tp_size) if not self.signals.weights_ready[r].all()]
        if missing:
            raise TransferError(f"{what} failed: ranks {missing} have no weights in place (registered by the "
                                f"worker, attached by the transfer manager)")
        handle = TransferHandle(next(self._task_ids), kind, range(self.tp_size),
                                self.weight_layout.task_bytes(blocks) * self.tp_size)
        handle.add_done_callback(self.counters.record)
        self._send_weights(handle, blocks, blocks)
        try:
            handle.result(max(0.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            raise TransferError(f"{what} timed out: {exc}") from None
        except TransferError as exc:
            raise TransferError(f"{what} failed: {exc}") from None

    def _send_weights(self, handle, gpu, cpu, layerwise=False, ring=0):
        return self._send_task(handle, protocol.encode_task(
            handle.task_id, handle.kind, np.array(gpu, np.int64), np.array(cpu, np.int64), layerwise,
            protocol.WEIGHTS, ring))

    # -- sleep / wake -----------------------------------------------------------------------------
    def sleep(self, level: int = 1, timeout: float = 60.0):
        """Free every rank's KV cache and weights, as clear_caches frees the cache (status CLEARED). level 1
        first copies the resident weights into the CPU weight region and compares them there; level 2 copies
        nothing (new weights come after wake). A dead rank fails it naming the rank: restart_rank, sleep again."""
        if isinstance(level, bool) or level not in LEVELS:
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        with self._phase_lock:
            asleep, status = int(self.signals.sleep_level[0]), self.signals.status
            if asleep and asleep != level:
                raise TransferError(f"sleep({level}) refused: a sleep({asleep}) is under way or done")
            if status == CLEARED and asleep:
                return
            if status not in (NORMAL, CLEARING) or (status == CLEARING and not asleep):
                raise TransferError(f"sleep refused: kv_cache_status is {STATUS_NAMES.get(status, status)}")
            if self._pending_reshard is not None:
                raise TransferError("sleep refused: a reshard is pending")
            self._raise_if_failed()
            deadline = time.monotonic() + timeout
            self.barrier.reset()
            self.signals.status = CLEARING          # refuses new swaps from here on
            self._drain(deadline)
            resident = list(range(self.weight_layout.resident_layers)) if self.weight_layout else []
            if level == 1 and resident and not self._sleep_copied:
                try:
                    self._weights_task(protocol.SWAP_TO_CPU, resident, "sleep", deadline)
                except BaseException:
                    self.signals.status = NORMAL    # nothing was freed: the deployment serves on
                    raise
                self._sleep_copied = True
            self.signals.sleep_level[0] = level     # workers and transfer managers let go of the weights too
            self._clear_phase(deadline)

    def wake(self, timeout: float = 60.0):
        """Re-create every rank's weights and KV cache (status NORMAL); after sleep(1) the weights are copied
        back first. A dead rank fails it naming the rank: restart_rank, wake again."""
        with self._phase_lock:
            level, status = int(self.signals.sleep_level[0]), self.signals.status
            if not level:
                if status == NORMAL:
                    return
                raise TransferError(f"wake needs a sleeping deployment; kv_cache_status is "
                                    f"{STATUS_NAMES.get(status, status)}")
            if status not in (CLEARED, UPDATING):
                raise TransferError(f"wake refused: the sleep has not finished (kv_cache_status is "
                                    f"{STATUS_NAMES.get(status, status)}); call sleep({level}) again")
            self._raise_if_failed()
            deadline = time.monotonic() + timeout
            self._restore_phase(deadline, "wake")
            resident = list(range(self.weight_layout.resident_layers)) if self.weight_layout else []
            if level == 1 and resident:
                self._weights_task(protocol.SWAP_TO_GPU, resident, "wake", deadline)
            self.signals.sleep_level[0] = 0
            self._sleep_copied = False
            self.signals.status = NORMAL

    @property
    def asleep(self) -> int:
        """The level of the sleep under way or done, 0 when awake."""
        return int(self.signals.sleep_level[0])

