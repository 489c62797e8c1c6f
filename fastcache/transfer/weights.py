"""A transfer manager's side of the weight group (docs/design.md §11): it attaches the worker's weight blocks
and the engine's CPU weight region as it attaches the cache and the CPU tier, and runs weight tasks: a
sleep's copy out (read back and compared before it reports done), a wake's copy in, and a forward's stream
of offloaded layers through the ring of slots, each layer published once in place.

On cuda the stream is ordered on the device both ways: each layer's copy records an interprocess event that
a worker's stream may wait on, and the copy into a ring slot first waits (on the copy stream) for the event
the worker records once its kernels are done with the slot's previous layer (ops/cuda_events.py)."""
from __future__ import annotations

import functools
import logging

import numpy as np

from ..errors import TransferError
from ..ipc import protocol, ring
from ..ipc.layers import LayerPublisher
from ..ipc.manifest import read_json_segment
from ..ipc.naming import weights_name
from ..ipc.shm import SegmentError, SharedSegment
from ..ipc.signal import EVENTS_RING_FREE, EVENTS_WEIGHTS
from ..weight_spec import WeightSpec

log = logging.getLogger("fastcache.transfer")


class WeightGroup:
    def __init__(self, layout: WeightSpec, manager):
        self.layout, self.tm = layout, manager
        self.cache = self.region = self.copier = None
        self.ready_events = self.free_events = None     # cuda: ours per (task slot, layer); the worker's per slot

    @property
    def attached(self) -> bool:
        return self.copier is not None

    def attach(self):
        """Attach what is ready; a no-op until the worker has exported its weights."""
        tm = self.tm
        if self.attached or tm.signals.weights_ready[tm.rank, 0] != 1:
            return
        if self.region is None:
            try:
                seg = SharedSegment.attach(weights_name(tm.suffix, tm.rank, "cpu"), tm.suffix)
            except SegmentError:
                return
            try:
                self.region = tm.ops.attach_swap_space(seg, self.layout, tm.device_id)
            except BaseException:
                seg.close()
                raise
        try:
            manifest = read_json_segment(weights_name(tm.suffix, tm.rank, "exports"), tm.suffix)
            self.cache = tm.ops.attach(manifest, self.layout.tensors(tm.rank, tm.device_id), tm.suffix)
        except (SegmentError, ValueError) as exc:
            log.debug("rank %d: weights not attachable yet: %s", tm.rank, exc)
            return
        self.copier = tm.ops.copier(self.cache, self.region, self.layout)
        self._export_events()
        tm.signals.weights_ready[tm.rank, 1] = 1
        log.info("rank %d: attached %d weight tensors", tm.rank, len(self.layout.layer_tensors))

    def _export_events(self):
        """cuda, once for this process's life: our per-layer events for workers' streams, and the opener of the
        worker's slot-free events. Without interprocess events the stream is ordered on the host."""
        tm, streamed = self.tm, len(self.layout.streamed_layers)
        if tm.ops.name != "cuda" or not streamed or self.free_events is not None:
            return
        from ..ops.cuda_events import PeerEvents, SlotEvents
        try:
            self.ready_events = SlotEvents(streamed, tm.device_id, tm.signals, tm.rank, EVENTS_WEIGHTS, "weights",
                                           tm.suffix)
        except TransferError as exc:
            log.warning("rank %d: no interprocess events for weights (%s): streamed on the host", tm.rank, exc)
            return
        self.free_events = PeerEvents(tm.suffix, tm.rank, "ring_free", tm.device_id)

    def detach(self, region: bool = False):
        """Drop the mappings of the worker's weights (and the CPU region and the events too with region=True)."""
        copier, cache, self.copier, self.cache = self.copier, self.cache, None, None
        if copier is not None:
            copier.close()
        if cache is not None:
            cache.close()
        self.tm.signals.weights_ready[self.tm.rank, 1] = 0
        if region and self.region is not None:
            self.region.close()
            self.region = None
        if region:
            for events in (self.ready_events, self.free_events):
                if events is not None:
                    events.close()
            self.ready_events = self.free_events = None

    def check(self, kind: str, gpu_ids, cpu_ids, ring: int):
        """What _on_task checks for a KV task, against the group's geometry (ValueError). A stream refills
        its slots in turn, so only its layers (CPU blocks) must be distinct."""
        if not self.attached:
            raise ValueError(f"rank {self.tm.rank} has no weights attached")
        protocol.check_ids(gpu_ids, cpu_ids, protocol.SWAP_TO_CPU if ring else kind, self.layout.num_gpu_blocks,
                           self.layout.num_cpu_blocks)

    def run(self, task):
        if task.kind == protocol.SWAP_TO_CPU:
            self.copier.swap_out(task.gpu_ids, task.cpu_ids)
            self._verify(task.gpu_ids, task.cpu_ids)
        elif task.layerwise:
            self._stream(task)
        else:
            self.copier.swap_in(task.gpu_ids, task.cpu_ids)

    def _verify(self, gpu_ids, cpu_ids):
        """A sleep frees the device copy next: compare every byte of the CPU copy with it first."""
        rows = self.region.rows
        for index, info in enumerate(self.cache.infos):
            device = self.cache.read(index, gpu_ids)
            if not np.array_equal(device, rows[cpu_ids, info.cpu_offset:info.cpu_offset + info.block_bytes]):
                raise RuntimeError(f"weights {info.name}: the CPU copy differs from the device's after the copy")

    def _stream(self, task):
        """Block by block in order, each copied only once its ring slot is free and published once in place."""
        tm = self.tm
        publisher = LayerPublisher(tm.signals.weight_layers, tm.rank, task.task_id)
        try:
            if self.ready_events is not None and len(task.gpu_ids) <= self.ready_events.layers:
                self._stream_ordered(task, publisher)
                return
            for index in range(len(task.gpu_ids)):
                if task.ring:
                    ring.wait_slot(tm.signals.weight_ring, tm.rank, task.task_id, index, task.ring,
                                   tm.settings.worker_timeout)
                self.copier.swap_in(task.gpu_ids[index:index + 1], task.cpu_ids[index:index + 1])
                publisher.published(index)
        except BaseException:
            publisher.failed()          # a forward waiting on this rank raises at once
            raise

    def _stream_ordered(self, task, publisher):
        """cuda: the layers back to back on the copy stream. The host still waits for a slot's previous layer
        to be done with (ring.wait_slot: the worker's host thread said so); the copy stream then also waits for
        the worker's slot-free event, recorded on the worker's stream before it said so, because a worker
        reading through a stream says it long before its kernels are done. Layers that landed are published
        in place while waiting (host waiters on the worker wait for that, and the forward for them)."""
        from ..ops.cuda_events import Completions
        tm = self.tm
        events, landed = self.ready_events.slot(task.task_id), Completions()
        for index in range(len(task.gpu_ids)):
            if task.ring:
                ring.wait_slot(tm.signals.weight_ring, tm.rank, task.task_id, index, task.ring,
                               tm.settings.worker_timeout, idle=landed.poll)
            block = int(task.gpu_ids[index])
            self.copier.enqueue_swap_in(task.gpu_ids[index:index + 1], task.cpu_ids[index:index + 1],
                                        events[index], after=self._slot_freed(block))
            publisher.recorded(index)
            landed.add(events[index], functools.partial(publisher.published, index))
            landed.poll()
        landed.drain()

    def _slot_freed(self, block: int) -> list:
        """The worker's event for device block `block` (a ring slot), recorded once its stream was done with
        the layer there; none if the worker exports none (it reads on the host, or not on cuda). Waiting on an
        event never recorded, or recorded for an earlier pass, costs nothing."""
        tm = self.tm
        try:
            peer = self.free_events.current(int(tm.signals.ipc_events[tm.rank, EVENTS_RING_FREE]))
        except SegmentError:
            return []           # the worker closed meanwhile
        if peer is None:
            return []
        index = block - peer.meta["first_block"]
        return [peer.events[index]] if 0 <= index < len(peer.events) else []
