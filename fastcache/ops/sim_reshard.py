"""The sim device's part of a reshard (docs/design.md §9): every rank's memory as flat byte views of shared memory.

Worker side: a staging buffer in shared memory (so that a transfer manager that dies mid-chunk can be
replaced and rewrite the chunk from it), and the cache's tensors re-viewed in the new shape at the same
offsets of the same arena (no new allocation). Transfer-manager side: `SimMemory` resolves the plan's
memory references (a rank's tensor, its CPU tier, a staging buffer) to flat uint8 views and executes the
plan's strided copies with NumPy. The CPU tier is host memory on every device, so the cuda device uses
`HostMemory` for it too.
"""
from __future__ import annotations

from ..config import CacheSpec
from ..ipc.manifest import read_json_segment
from ..ipc.naming import reshard_exports_name, reshard_staging_name, weights_name
from ..ipc.shm import SharedSegment
from ..reshard_plan import Plan
from .base import manifest_entry, new_weight_export, weight_entry
from .frameworks import NUMPY_STORAGE, wrap_host_array
from .host_memory import HostMemory, numpy_copy


# -- worker side -----------------------------------------------------------------------------------
class SimStaging:
    """A worker's staging buffer: a shared-memory segment it owns, exported by name."""

    def __init__(self, suffix: str, rank: int, nbytes: int):
        self.nbytes = nbytes
        self.segment = SharedSegment.create(reshard_staging_name(suffix, rank, "gpu"), nbytes, suffix)
        self.descriptor = {"device": "sim", "segment": self.segment.name, "nbytes": nbytes}

    def close(self):
        self.segment.close()


class SimWeightAllocation:
    """A kept rank's new allocation of one weight tensor that outgrew its own (docs/design.md §9): a segment
    the transfer managers fill during the moves and the worker's weights take over at commit."""

    def __init__(self, suffix: str, rank: int, index: int, seq: int, nbytes: int):
        self.nbytes = nbytes
        self.segment = SharedSegment.create(weights_name(suffix, rank, f"t{index}s{seq}"), nbytes, suffix)
        self.descriptor = {"device": "sim", "segment": self.segment.name, "nbytes": nbytes}

    def close(self):
        self.segment.close()


def reshape(cache, spec, rank: int, device_id: int, framework: str, replaced=None):
    """Re-view a SimLocalCache's tensors in spec's shape, each at its old offset of the same segment, or at the
    start of its new allocation (`replaced`: {tensor index: SimWeightAllocation}, which the cache then owns).
    A segment no tensor is left in is freed (an earlier new allocation); the arena stays whole."""
    infos = spec.tensors(rank, device_id)
    if len(infos) != len(cache.manifest):
        raise ValueError(f"the new spec has {len(infos)} tensors, the cache {len(cache.manifest)}")
    replaced = replaced or {}
    for alloc in replaced.values():
        cache.hold(alloc.segment)
    places = [(replaced[i].segment.name, 0) if i in replaced else (e["segment"], e["offset"])
              for i, e in enumerate(cache.manifest)]
    tensors, manifest = {}, []
    for info, (name, offset) in zip(infos, places):
        seg = cache.segment(name)
        # a tensor may grow up to the next tensor in its segment
        limit = min([o for n, o in places if n == name and o > offset], default=seg.size)
        if offset + info.nbytes > limit:
            raise ValueError(f"{info.name} of {info.nbytes} bytes does not fit where it was allocated")
        array = seg.array(NUMPY_STORAGE[info.dtype], info.shape, offset)
        tensors[info.name] = wrap_host_array(array, info.dtype, framework)
        manifest.append({"name": info.name, "segment": name, "offset": offset, "nbytes": info.nbytes})
    cache.tensors, cache.manifest = tensors, manifest
    cache.drop_unused({name for name, _ in places})


# -- transfer-manager side -------------------------------------------------------------------------
class SimMemory(HostMemory):
    """Every memory a sim transfer manager's reshard program touches, and the copies over it."""

    def __init__(self, suffix: str, plan: Plan):
        super().__init__(suffix, plan)
        self._manifests, self._weight_manifests = {}, {}
        self.execute = numpy_copy(self.resolve)

    def flush(self):
        pass

    def _resolve(self, ref):
        if ref[0] == "gpu":
            rank, index = ref[1], ref[2]
            entry = manifest_entry(self._manifests, self.suffix, self.plan, rank, index)
            return self._view(self._segment(entry["segment"]), entry["offset"],
                              self.plan.region_bytes(self.plan.spaces[index], rank), f"{entry['name']}")
        if ref[0] == "staging" and ref[2] == "gpu":
            desc = read_json_segment(reshard_exports_name(self.suffix, ref[1]), self.suffix)
            if desc.get("device") != "sim":
                raise ValueError(f"rank {ref[1]} exports a {desc.get('device')} staging buffer to a sim transfer "
                                 f"manager")
            need = self.plan.staging_bytes_for(ref[1], "gpu")
            return self._view(self._segment(desc["segment"]), 0, need, f"staging of rank {ref[1]}")
        if ref[0] == "weights":     # the rank's current weight tensor: old rows as a source, new as a destination
            rank, index = ref[1], ref[2]
            entry = weight_entry(self._weight_manifests, self.suffix, self.plan, rank, index)
            return self._view(self._segment(entry["segment"]), entry["offset"],
                              self.plan.region_bytes(self.plan.weight_spaces[index], rank), entry["name"])
        if ref[0] == "weights_new":
            rank, index = ref[1], ref[2]
            desc = new_weight_export(self.suffix, rank, index, "sim")
            return self._view(self._segment(desc["segment"]), 0, self.plan.weight_spaces[index].new_bytes(),
                              f"new allocation of weight tensor {index} of rank {rank}")
        return super()._resolve(ref)
