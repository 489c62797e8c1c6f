"""The simulated device: 'GPU' tensors are views of a shared-memory arena, swaps are NumPy gathers.

It is the whole multi-process system minus CUDA, so it runs and is tested on any machine.
"""
from __future__ import annotations

import os

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..config import CacheSpec, TensorInfo
from ..ipc.naming import cache_arena_name, segment_name
from ..ipc.shm import ProcessMemory, SharedSegment
from .base import AttachedCache, Copier, DeviceOps, LocalCache, SwapSpace, check_adopted, usable_ids
from .frameworks import NUMPY_STORAGE, check_framework, share_host_memory, wrap_host_array

ALIGN = 256


def _layout(infos: list[TensorInfo]):
    """Offset of every tensor in the rank's arena, each aligned like a caching allocator would."""
    offsets, end = [], 0
    for info in infos:
        offsets.append(end)
        end += -(-info.nbytes // ALIGN) * ALIGN
    return offsets, end


class SimLocalCache(LocalCache):
    def __init__(self, spec, rank, device_id, framework, suffix, generation, name=None):
        check_framework(framework)
        infos = spec.tensors(rank, device_id)
        offsets, total = _layout(infos)
        name = name or cache_arena_name(suffix, rank, generation)      # name: another group's memory
        self._arena = SharedSegment.create(name, total, suffix)
        self._held = {}         # segments a reshard gave tensors of this cache (weights that outgrew the arena)
        self.tensors, self.manifest = {}, []
        for info, offset in zip(infos, offsets):
            array = self._arena.array(NUMPY_STORAGE[info.dtype], info.shape, offset)
            self.tensors[info.name] = wrap_host_array(array, info.dtype, framework)
            self.manifest.append({"name": info.name, "segment": self._arena.name, "offset": offset,
                                  "nbytes": info.nbytes})

    def segment(self, name: str) -> SharedSegment:
        """The arena or a held segment, by name."""
        return self._arena if name == self._arena.name else self._held[name]

    def hold(self, segment: SharedSegment):
        """Own another segment until release (a reshard's new allocation of a tensor)."""
        self._held[segment.name] = segment

    def drop_unused(self, names):
        """Free held segments no tensor lies in any more."""
        for name in [n for n in self._held if n not in names]:
            self._held.pop(name).close()

    def release(self):
        self.tensors = {}
        self.drop_unused(())
        self._arena.close()


class SimAdoptedCache(LocalCache):
    """An engine's own host tensors (vLLM's CPU KV cache), exported where they lie: each storage moves into
    shared memory in place once (every view the engine holds follows it), and the transfer manager maps it
    by this process's pid and descriptor. No copy of the cache exists; release leaves the memory to its
    owner."""

    def __init__(self, spec, rank, device_id, tensors: dict):
        infos = spec.tensors(rank, device_id)
        check_adopted(infos, tensors)
        self.tensors, self.manifest = dict(tensors), []
        for info in infos:
            fd, size, offset = share_host_memory(tensors[info.name])
            self.manifest.append({"name": info.name, "pid": os.getpid(), "fd": fd, "size": size,
                                  "offset": offset, "nbytes": info.nbytes})

    def release(self):
        self.tensors = {}


def _open_place(entry, suffix):
    """The mapping an export manifest entry points into: a named segment, or an adopted storage's descriptor."""
    if "fd" in entry:
        return f"pid{entry['pid']}.fd{entry['fd']}", lambda: ProcessMemory(entry["pid"], entry["fd"], entry["size"])
    return entry["segment"], lambda: SharedSegment.attach(entry["segment"], suffix)


class SimAttachedCache(AttachedCache):
    def __init__(self, manifest, infos, suffix):
        if len(manifest) != len(infos):
            raise ValueError(f"manifest lists {len(manifest)} tensors, the spec has {len(infos)}")
        self.infos = infos
        self._segments = {}
        self.rows, self.places = [], []      # places: (segment name, offset) per tensor
        try:
            for entry, info in zip(manifest, infos):
                if entry["name"] != info.name or entry["nbytes"] != info.nbytes:
                    raise ValueError(f"manifest entry {entry['name']} does not match the spec's {info.name}")
                place, open_place = _open_place(entry, suffix)
                seg = self._segments.get(place)
                if seg is None:
                    seg = self._segments[place] = open_place()
                if entry["offset"] < 0 or entry["offset"] + info.nbytes > seg.size:
                    raise ValueError(f"manifest entry {info.name} lies outside its segment")
                self.rows.append(seg.array(np.uint8, (info.num_blocks, info.block_bytes), entry["offset"]))
                self.places.append((place, entry["offset"]))
        except BaseException:
            self.close()
            raise

    def read(self, index, blocks=None):
        return self.rows[index].copy() if blocks is None else self.rows[index][np.asarray(blocks)]

    def write(self, index, rows, blocks=None):
        if blocks is None:
            self.rows[index][...] = rows
        else:
            self.rows[index][np.asarray(blocks)] = rows

    def close(self):
        self.rows, self.places = [], []
        for seg in self._segments.values():
            seg.close()
        self._segments = {}


class SimCopier(Copier):
    """Vectorised gather/scatter of block rows between the arena and the block-major CPU tier.

    Tensors that sit evenly spaced in one arena and side by side in the CPU block (every layer's K and V,
    typically) are viewed as one [tensors, blocks, bytes] array, so a task costs a few NumPy calls, not
    one per tensor. Large rows move run by run straight from source to destination: a fancy-indexed
    gather of the whole task would build a task-sized temporary first (a second pass over every byte,
    plus page faults on fresh memory), which held random-id swaps to 0.2x of a memcpy.
    """

    def __init__(self, cache: "SimAttachedCache", swap: SwapSpace, spec: CacheSpec):
        self._full = spec.num_gpu_blocks
        # (GPU view [tensors, blocks, bytes], CPU view [cpu blocks, tensors, bytes], blocks) per group
        self._groups = [(gpu, swap.rows[:, cols].reshape(len(swap.rows), gpu.shape[0], gpu.shape[2]), blocks)
                        for gpu, cols, blocks in _group_tensors(cache)]
        self._layers = _by_layer(self._groups, [info.layer for info in cache.infos])

    def swap_out(self, gpu_ids, cpu_ids, first=None):
        for gpu, cpu, keep in self._plan(gpu_ids):
            g, c = (gpu_ids, cpu_ids) if keep is None else (gpu_ids[keep], cpu_ids[keep])   # draft layers
            move_rows(gpu, cpu, g, c, to_cpu=True)          # blocks a draft layer lacks keep their old CPU bytes

    def swap_in(self, gpu_ids, cpu_ids, first=None):
        for gpu, cpu, keep in self._plan(gpu_ids):
            g, c = (gpu_ids, cpu_ids) if keep is None else (gpu_ids[keep], cpu_ids[keep])
            move_rows(gpu, cpu, g, c, to_cpu=False)

    def swap_in_layers(self, gpu_ids, cpu_ids, layers, published, first=None):
        """Layer by layer in layer order, each published as soon as its rows are in place."""
        for layer, parts in self._layers:
            for gpu, cpu, num_blocks in parts:
                keep = usable_ids(gpu_ids, num_blocks, self._full)
                g, c = (gpu_ids, cpu_ids) if keep is None else (gpu_ids[keep], cpu_ids[keep])
                move_chunks(gpu, cpu, g, c, to_cpu=False)   # a layer's rows: chunks, not a call per run
            published(layer)

    def close(self):
        self._groups = self._layers = []    # drop the views, so detaching the cache really unmaps it

    def _plan(self, gpu_ids):
        for gpu, cpu, num_blocks in self._groups:
            yield gpu, cpu, usable_ids(gpu_ids, num_blocks, self._full)


# Rows this long move run by run (one NumPy call per run of consecutive ids, no temporary); shorter
# rows are cheaper as fancy-indexed chunks whose temporaries stay cache-sized (measured on 2 cores:
# 16 tensors x 8 KiB rows, 512 random ids: 8.2 GB/s run by run, 4.6 in chunks, 3.3 whole-task).
RUN_MIN_ROW_BYTES = 4096
CHUNK_BYTES = 1 << 20


def move_rows(gpu, cpu, g, c, to_cpu):
    """Copy rows of GPU view [tensors, blocks, bytes] blocks g to CPU view [blocks, tensors, bytes] blocks c
    (or back)."""
    n = len(g)
    if n == 0:
        return
    if n == 1:          # one block: one basic-indexed copy per group, no index arrays or temporaries
        g0, c0 = int(g[0]), int(c[0])
        if to_cpu:
            cpu[c0] = gpu[:, g0]
        else:
            gpu[:, g0] = cpu[c0]
        return
    if gpu.shape[2] >= RUN_MIN_ROW_BYTES:
        for g0, c0, length in _runs(g, c):
            if to_cpu:
                cpu[c0:c0 + length] = gpu[:, g0:g0 + length].transpose(1, 0, 2)
            else:
                gpu[:, g0:g0 + length] = cpu[c0:c0 + length].transpose(1, 0, 2)
        return
    move_chunks(gpu, cpu, g, c, to_cpu)


def move_chunks(gpu, cpu, g, c, to_cpu):
    """move_rows in fancy-indexed chunks of about CHUNK_BYTES: few NumPy calls, cache-sized temporaries."""
    n = len(g)
    tensors, row = gpu.shape[0], gpu.shape[2]
    step = max(1, CHUNK_BYTES // (tensors * row))
    for s in range(0, n, step):
        gs, cs = g[s:s + step], c[s:s + step]
        if to_cpu:
            cpu[cs] = gpu[:, gs].transpose(1, 0, 2)
        else:
            gpu[:, gs] = cpu[cs].transpose(1, 0, 2)


def _runs(g, c):
    """(first GPU id, first CPU id, length) of each run where both id lists count up by one."""
    breaks = np.flatnonzero((np.diff(g) != 1) | (np.diff(c) != 1)) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), len(g)]
    gl, cl = g[starts].tolist(), c[starts].tolist()
    return zip(gl, cl, (e - s for s, e in zip(starts, ends)))


def _by_layer(groups, tensor_layers):
    """[(layer, [(GPU view, CPU view, blocks) of that layer's tensors in each group])], in layer order: the
    groups' tensor axis sliced where the layer changes (groups hold tensors in CacheSpec.tensors order)."""
    parts, first = {}, 0
    for gpu, cpu, blocks in groups:
        layers = tensor_layers[first:first + gpu.shape[0]]
        first += gpu.shape[0]
        start = 0
        for end in range(1, len(layers) + 1):
            if end == len(layers) or layers[end] != layers[start]:
                parts.setdefault(layers[start], []).append((gpu[start:end], cpu[:, start:end], blocks))
                start = end
    return sorted(parts.items())


def _group_tensors(cache):
    """Runs of tensors with one geometry, evenly spaced in one segment and adjacent in the CPU block,
    each as (strided [tensors, blocks, bytes] view, CPU-block columns, blocks)."""
    entries = list(zip(cache.rows, cache.infos, cache.places))
    groups, i = [], 0
    while i < len(entries):
        j = i + 1
        while j < len(entries) and _continues(entries, i, j):
            j += 1
        groups.append(_group_view(entries[i:j]))
        i = j
    return groups


def _continues(entries, i, j):
    """Does tensor j extend the run that starts at tensor i?"""
    _, first, (segment, first_offset) = entries[i]
    _, prev, (_, prev_offset) = entries[j - 1]
    _, info, (seg, offset) = entries[j]
    stride = entries[i + 1][2][1] - first_offset if j > i + 1 else offset - first_offset
    return (seg == segment and (info.block_bytes, info.num_blocks) == (first.block_bytes, first.num_blocks)
            and offset - prev_offset == stride >= first.nbytes
            and info.cpu_offset == prev.cpu_offset + prev.block_bytes)


def _group_view(run):
    rows, first, (_, offset) = run[0]
    stride = run[1][2][1] - offset if len(run) > 1 else first.nbytes
    view = as_strided(rows, (len(run), first.num_blocks, first.block_bytes), (stride, first.block_bytes, 1))
    return view, slice(first.cpu_offset, first.cpu_offset + len(run) * first.block_bytes), first.num_blocks


class SimOps(DeviceOps):
    name = "sim"

    def allocate(self, spec, rank, device_id, framework, suffix, generation):
        return SimLocalCache(spec, rank, device_id, framework, suffix, generation)

    def adopt(self, spec, rank, device_id, tensors):
        return SimAdoptedCache(spec, rank, device_id, tensors)

    def allocate_group(self, spec, rank, device_id, framework, suffix, generation, group):
        return SimLocalCache(spec, rank, device_id, framework, suffix, generation,
                             name=segment_name(suffix, f"{group}_gen{generation}_rank{rank}"))

    def attach(self, manifest, infos, suffix):
        return SimAttachedCache(manifest, infos, suffix)

    def copier(self, cache, swap, spec):
        return SimCopier(cache, swap, spec)

    def reshard_staging(self, nbytes, suffix, rank, framework, device_id):
        from .sim_reshard import SimStaging
        return SimStaging(suffix, rank, nbytes)

    def reshape(self, cache, spec, rank, device_id, framework):
        from .sim_reshard import reshape
        reshape(cache, spec, rank, device_id, framework)

    def reshape_group(self, cache, spec, rank, device_id, framework, replaced):
        from .sim_reshard import reshape
        reshape(cache, spec, rank, device_id, framework, replaced)

    def weight_allocation(self, nbytes, suffix, rank, index, seq, framework, device_id, dtype):
        from .sim_reshard import SimWeightAllocation
        return SimWeightAllocation(suffix, rank, index, seq, nbytes)

    def reshard_memory(self, suffix, plan, device_id):
        from .sim_reshard import SimMemory
        return SimMemory(suffix, plan)
