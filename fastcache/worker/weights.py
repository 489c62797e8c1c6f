"""A worker's weights as a tensor group (docs/design.md §11).

The device blocks (resident layers, then the ring's slots) are allocated with the worker's framework and
exported like the KV cache; the engine's CPU region is mapped too, to load the offloaded layers. A forward
reads each layer through `forward(task_id)`: a resident layer at once, a streamed one after its wait (the
per-layer readiness of ipc/layers.py), and moving on tells the transfer manager a slot is free again.

With a stream on cuda both are ordered on the device: a streamed layer's wait is a stream wait
(worker/streams.py), and before it publishes that it moved on, the forward records on that stream the
interprocess event of each ring slot it has read, which the transfer manager's copy stream waits on before
refilling the slot (ipc/ring.py). The host never waits for a copy or for the forward's kernels.
"""
from __future__ import annotations

import numpy as np

from ..errors import TransferError
from ..ipc import ring
from ..ipc.manifest import write_json_segment
from ..ipc.naming import weights_name
from ..ipc.shm import SegmentError, SharedSegment
from ..ipc.signal import EVENTS_RING_FREE, EVENTS_WEIGHTS
from ..ops.frameworks import NUMPY_STORAGE, wrap_host_array
from ..weight_spec import WeightSpec


class WorkerWeights:
    def __init__(self, layout: WeightSpec, worker):
        if not isinstance(layout, WeightSpec):
            raise ValueError(f"weights must be a WeightSpec (SwapBackend.weight_layout), got {type(layout).__name__}")
        self.layout, self.worker = layout, worker
        self.generation = 0
        self._local = self._manifest = None
        self._by_name = {}
        self._free_events = None        # cuda: ExportedEvents, one per ring slot, made on the first streamed forward

    @property
    def allocated(self) -> bool:
        return self._local is not None

    def allocate(self):
        w = self.worker
        self.generation += 1
        self._local = w.ops.allocate_group(self.layout, w.rank, w.device_id, w.framework, w.suffix,
                                           self.generation, "weights")
        self._publish()

    def reshard(self, layout: WeightSpec, replaced: dict):
        """A reshard's commit (docs/design.md §9): the tensors re-viewed in `layout`'s slice shapes in place, or
        taken over from their new allocations (`replaced`: {tensor index: allocation}), and exported again."""
        w = self.worker
        self._by_name = {}      # the old views go first, so that a tensor's old allocation can be freed (cuda)
        try:
            w.ops.reshape_group(self._local, layout, w.rank, w.device_id, w.framework, replaced)
        except BaseException:
            self._name_tensors()        # the old layout serves on
            raise
        self.layout = layout
        self._publish()

    def _name_tensors(self):
        w = self.worker
        infos = self.layout.tensors(w.rank, w.device_id)
        self._by_name = {name: self._local.tensors[info.name]
                         for (name, _, _), info in zip(self.layout.layer_tensors, infos)}

    def _publish(self):
        w = self.worker
        self._name_tensors()
        if self._manifest is not None:
            self._manifest.close()
        self._manifest = write_json_segment(weights_name(w.suffix, w.rank, "exports"), self._local.manifest, w.suffix)
        w.signals.weights_ready[w.rank, 0] = 1

    def release(self):
        if self._manifest is not None:
            self._manifest.close()
            self._manifest = None
        self._by_name = {}
        if self._local is not None:
            self._local.release()
            self._local = None
        self.worker.signals.weights_ready[self.worker.rank, 0] = 0      # only now is the memory free

    # -- loading ----------------------------------------------------------------------------------
    def load(self, layer: int, arrays: dict):
        """Write one layer's weights ({name: array}, every name of the model): into its device block if it is
        resident, else into the engine's CPU region it streams from. Checked in full before a byte moves."""
        self.layout.check_names(arrays)
        missing = sorted({n for n, _, _ in self.layout.layer_tensors} - set(arrays))
        if missing:
            raise ValueError(f"layer {layer}: weights {missing} are missing")
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"layer must be an int, got {layer!r}")
        self.layout.block_of(layer)         # range check
        host = {}
        for name, shape, dtype in self.layout.layer_tensors:
            a = np.asarray(arrays[name])
            if a.shape != shape or a.dtype != NUMPY_STORAGE[dtype]:
                raise ValueError(f"weight {name!r}: got {a.dtype}{list(a.shape)}, the model has {dtype}{list(shape)}")
            host[name] = a
        if not self.allocated:
            raise TransferError(f"rank {self.worker.rank}: the weights are not allocated (the deployment sleeps)")
        if layer < self.layout.resident_layers:
            for (name, _, dtype) in self.layout.layer_tensors:
                _copy_into(self._by_name[name][layer], host[name], dtype, self.worker.framework)
            return
        row = np.concatenate([a.reshape(-1).view(np.uint8) for a in host.values()])
        with self._cpu_region() as seg:
            seg.array(np.uint8, (self.layout.num_cpu_blocks, self.layout.layer_bytes))[layer] = row

    def _cpu_region(self) -> SharedSegment:
        w = self.worker
        try:
            return SharedSegment.attach(weights_name(w.suffix, w.rank, "cpu"), w.suffix)
        except SegmentError as exc:
            raise TransferError(f"rank {w.rank}: the engine's CPU weight region is not there ({exc})") from None

    # -- the forward ------------------------------------------------------------------------------
    def resident(self, layer: int) -> dict:
        """{name: tensor} of a resident layer."""
        if not layer < self.layout.resident_layers:
            raise ValueError(f"layer {layer} is streamed: read it inside forward(task_id)")
        return self.block(layer)

    def block(self, block: int) -> dict:
        """{name: tensor} of one device block (a resident layer, or a ring slot)."""
        return {name: t[block] for name, t in self._by_name.items()}

    def forward(self, task_id: int | None, timeout: float | None = None, stream=None,
                external: bool = False) -> "Forward":
        """One forward pass over the layers in order; task_id: the handle of backend.stream_weights() for
        this pass (None when no layer is offloaded). stream (cuda; a cudaStream_t int, or a torch / CuPy
        stream): the stream the forward's kernels run on; streamed layers are then waited for, and their
        slots freed, on it instead of on the host; external=True while it is being captured. Ignored on sim."""
        return Forward(self, task_id, timeout, stream, external)

    def ring_free_events(self):
        """cuda: this worker's exported events, one per ring slot (device block resident_layers + k)."""
        if self._free_events is None:
            from ..ops.cuda_events import ExportedEvents
            w = self.worker
            self._free_events = ExportedEvents(self.layout.ring_slots, w.device_id, w.signals, w.rank,
                                               EVENTS_RING_FREE, "ring_free", w.suffix,
                                               first_block=self.layout.resident_layers)
        return self._free_events

    def close_events(self):
        events, self._free_events = self._free_events, None
        if events is not None:
            events.close()


class Forward:
    """`with weights.forward(task_id) as f: for l in range(L): x = layer_fn(x, f.layer(l))`. Leaving the block
    frees the ring for the next pass, whatever happened inside it."""

    def __init__(self, weights: WorkerWeights, task_id, timeout, stream=None, external: bool = False):
        layout = weights.layout
        if layout.streamed_layers and (isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 1):
            raise ValueError(f"layers {list(layout.streamed_layers)} are offloaded: pass the task_id of "
                             f"backend.stream_weights(), got {task_id!r}")
        self.weights, self.task_id, self.timeout = weights, task_id, timeout
        self.signals, self.rank = weights.worker.signals, weights.worker.rank
        self.stream, self.external = stream, external
        self._free = self._stream_pointer = None
        self._unfreed = []          # (stream index, device block) read through the stream, slot not yet freed
        self._moved_on = 0          # streamed layers before this one are done with: their slots may be refilled
        if stream is not None and layout.streamed_layers and weights.worker.ops.name == "cuda":
            from ..ops.cuda_events import stream_pointer
            self._stream_pointer = stream_pointer(stream)
            self._free = weights.ring_free_events()

    def __enter__(self):
        if self.weights.layout.streamed_layers:
            self._check_newest()
            ring.begin(self.signals.weight_ring, self.rank, self.task_id)
        return self

    def _check_newest(self):
        """A forward over a later stream has begun: the transfer manager then fills the ring for that one, and
        an older stream's layers are no longer where this forward would read them. Nor are this stream's once a
        forward over it has begun: the slots of its first layers hold later ones (or the next stream's)."""
        began = int(self.signals.weight_ring[self.rank, 0])
        if began > self.task_id:
            raise ValueError(f"rank {self.rank}: a forward over weight stream {began} has begun, so stream "
                             f"{self.task_id} is stale (its slots hold the later stream's layers); run each "
                             f"stream's forward in the order stream_weights() returned them")
        if began == self.task_id:
            raise ValueError(f"rank {self.rank}: a forward over weight stream {self.task_id} has begun already, so "
                             f"the stream is stale (its slots were refilled past its first layers); each stream "
                             f"serves one forward: call stream_weights() for another")

    def __exit__(self, *exc):
        if self.weights.layout.streamed_layers:
            self._free_slots_before(None)
            ring.done_with(self.signals.weight_ring, self.rank, self.task_id, ring.FINISHED)

    def _free_slots_before(self, index):
        """Record, on the stream, the slot-free event of every streamed layer read before `index` (None: all):
        before the host says the forward is done with them, so the refill of a slot waits for these kernels."""
        if self._free is None:
            return
        from ..ops.cuda_events import record
        keep = []
        for read, block in self._unfreed:
            if index is None or read < index:
                record(self._free.events[block - self.weights.layout.resident_layers], self._stream_pointer,
                       self.external)
            else:
                keep.append((read, block))
        self._unfreed = keep

    def layer(self, layer: int) -> dict:
        """{name: tensor} of `layer`, once it is in place; every layer before it is done with."""
        layout, w = self.weights.layout, self.weights
        if not w.allocated:
            raise TransferError(f"rank {self.rank}: the weights are not allocated (the deployment sleeps)")
        block = layout.block_of(layer)
        index = layer - layout.resident_layers          # its place in the stream, when streamed
        if 0 <= index < self._moved_on:
            raise ValueError(f"layer {layer} is read after layer {layout.resident_layers + self._moved_on}: its ring "
                             f"slot may hold a later layer already; a forward reads its streamed layers in order")
        if layout.streamed_layers:
            if int(self.signals.weight_ring[self.rank, 0]) != self.task_id:
                raise ValueError(f"rank {self.rank}: a forward over another weight stream began inside this one "
                                 f"(stream {self.task_id}); its slots are refilled for that one")
            self._moved_on = max(self._moved_on, index)
            self._free_slots_before(max(0, index))
            ring.done_with(self.signals.weight_ring, self.rank, self.task_id, max(0, index))
        if index >= 0:
            w.worker.layer_waits.wait(self.task_id, index, self.timeout, stream=self.stream,
                                      slots=self.signals.weight_layers, column=EVENTS_WEIGHTS, external=self.external,
                                      claims=self.signals.weight_claims, layers=len(layout.streamed_layers))
            if self._free is not None and (index, block) not in self._unfreed:
                self._unfreed.append((index, block))
        return w.block(block)


def _copy_into(tensor, array: np.ndarray, dtype: str, framework: str):
    """Host array into a framework tensor (a device block of a resident layer)."""
    if isinstance(tensor, np.ndarray):
        tensor[...] = array
    elif framework == "cupy":   # a device array: set() copies host bytes in (bfloat16 travels as its bits)
        tensor.set(np.ascontiguousarray(array).view(tensor.dtype))
    else:                       # torch / paddle: copy_ from a host tensor sharing the array's memory
        tensor.copy_(wrap_host_array(np.ascontiguousarray(array), dtype, framework))
