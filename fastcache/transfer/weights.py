"""A transfer manager's side of the weight group (docs/design.md §11): it attaches the worker's weight blocks
and the engine's CPU weight region as it attaches the cache and the CPU tier, and runs weight tasks: a
sleep's copy out (read back and compared before it reports done), a wake's copy in, and a forward's stream
of offloaded layers through the ring of slots, each layer published once in place."""
from __future__ import annotations

import logging

import numpy as np

from ..ipc import protocol, ring
from ..ipc.layers import LayerPublisher
from ..ipc.manifest import read_json_segment
from ..ipc.naming import weights_name
from ..ipc.shm import SegmentError, SharedSegment
from ..weight_spec import WeightSpec

log = logging.getLogger("fastcache.transfer")


class WeightGroup:
    def __init__(self, layout: WeightSpec, manager):
        self.layout, self.tm = layout, manager
        self.cache = self.region = self.copier = None

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
        tm.signals.weights_ready[tm.rank, 1] = 1
        log.info("rank %d: attached %d weight tensors", tm.rank, len(self.layout.layer_tensors))

    def detach(self, region: bool = False):
        """Drop the mappings of the worker's weights (and the CPU region too with region=True)."""
        copier, cache, self.copier, self.cache = self.copier, self.cache, None, None
        if copier is not None:
            copier.close()
        if cache is not None:
            cache.close()
        self.tm.signals.weights_ready[self.tm.rank, 1] = 0
        if region and self.region is not None:
            self.region.close()
            self.region = None

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
            for index in range(len(task.gpu_ids)):
                if task.ring:
                    ring.wait_slot(tm.signals.weight_ring, tm.rank, task.task_id, index, task.ring,
                                   tm.settings.worker_timeout)
                self.copier.swap_in(task.gpu_ids[index:index + 1], task.cpu_ids[index:index + 1])
                publisher.published(index)
        except BaseException:
            publisher.failed()          # a forward waiting on this rank raises at once
            raise
