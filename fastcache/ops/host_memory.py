"""Host memory in a reshard, on every device: the CPU tiers and their staging buffers (engine-owned shared
memory) as flat byte views, and the plan's row copies over such views with NumPy."""
from __future__ import annotations

import numpy as np

from ..ipc.naming import reshard_staging_name, swap_space_name
from ..ipc.shm import SharedSegment
from ..reshard_plan import Copy, Plan


class HostMemory:
    """CPU tiers and the CPU tier's staging buffers (engine-owned shared memory), on every device."""

    def __init__(self, suffix: str, plan: Plan):
        self.suffix, self.plan = suffix, plan
        self._segments, self._views = {}, {}

    def _segment(self, name):
        seg = self._segments.get(name)
        if seg is None:
            seg = self._segments[name] = SharedSegment.attach(name, self.suffix)
        return seg

    def _view(self, seg, offset, nbytes, what):
        if offset < 0 or offset + nbytes > seg.size:
            raise ValueError(f"{what}: {nbytes} bytes at {offset} lie outside its {seg.size}-byte segment")
        return seg.array(np.uint8, (nbytes,), offset)

    def resolve(self, ref):
        view = self._views.get(ref)
        if view is None:
            view = self._views[ref] = self._resolve(ref)
        return view

    def _resolve(self, ref):
        if ref[0] == "cpu":
            space = self.plan.spaces[-1]
            seg = self._segment(swap_space_name(self.suffix, ref[1]))
            return self._view(seg, 0, self.plan.region_bytes(space, ref[1]), f"CPU tier of rank {ref[1]}")
        if ref[0] == "staging" and ref[2] == "cpu":
            seg = self._segment(reshard_staging_name(self.suffix, ref[1], "cpu"))
            return self._view(seg, 0, self.plan.staging_bytes_for(ref[1], "cpu"), f"CPU staging of rank {ref[1]}")
        raise KeyError(f"not host memory: {ref}")

    def close(self):
        self._views = {}
        for seg in self._segments.values():
            seg.close()
        self._segments = {}


def strided(flat: np.ndarray, offset: int, pitch: int, height: int, width: int) -> np.ndarray:
    """[height, width] uint8 view of flat bytes: row i at offset + i*pitch (bounds checked)."""
    end = offset + (height - 1) * pitch + width
    if offset < 0 or width < 0 or height < 1 or end > flat.size:
        raise ValueError(f"strided copy [{offset}, {end}) outside a region of {flat.size} bytes")
    base = flat[offset:end]
    return np.lib.stride_tricks.as_strided(base, (height, width), (pitch, 1), writeable=True)


def _rows_view(flat: np.ndarray, pitch: int, off: int, width: int, rows: np.ndarray) -> np.ndarray:
    """[rows that reach the highest id, width] view of flat bytes (bounds checked)."""
    top = int(rows.max()) if len(rows) else 0
    end = top * pitch + off + width
    if off < 0 or width < 0 or (len(rows) and int(rows.min()) < 0) or end > flat.size:
        raise ValueError(f"row copy up to byte {end} outside a region of {flat.size} bytes")
    return strided(flat, off, pitch, top + 1, width)


def _consecutive(rows) -> bool:
    return len(rows) == 1 or (int(rows[-1]) - int(rows[0]) == len(rows) - 1 and bool((np.diff(rows) == 1).all()))


def numpy_copy(resolve):
    """An `execute` for run_chunks over host memory: resolve(ref) -> flat uint8 array of that memory. One
    run moves through strided views; scattered rows through one fancy-indexed gather (a chunk-sized
    temporary at most)."""
    def execute(c: Copy):
        n = len(c.src_rows)
        if not n:
            return
        if _consecutive(c.src_rows) and _consecutive(c.dst_rows):
            s, d = int(c.src_rows[0]) * c.src_pitch + c.src_off, int(c.dst_rows[0]) * c.dst_pitch + c.dst_off
            strided(resolve(c.dst), d, c.dst_pitch, n, c.width)[...] = strided(resolve(c.src), s, c.src_pitch, n,
                                                                               c.width)
            return
        src = _rows_view(resolve(c.src), c.src_pitch, c.src_off, c.width, c.src_rows)
        dst = _rows_view(resolve(c.dst), c.dst_pitch, c.dst_off, c.width, c.dst_rows)
        dst[c.dst_rows] = src[c.src_rows]
    return execute
