"""Wire format of the task queue: a JSON header frame, plus raw int32/int64 id frames for tasks.

Nothing is pickled. `decode` validates every field and raises ProtocolError, which the receiver turns
into an error reply; a malformed message never kills a process.
"""
from __future__ import annotations

import json
import struct
from typing import NamedTuple

import numpy as np

from ..config import check_namespace

SWAP_TO_CPU, SWAP_TO_GPU = "SWAP_TO_CPU", "SWAP_TO_GPU"
TASK_KINDS = (SWAP_TO_CPU, SWAP_TO_GPU)
# L3 tasks: a rank's CPU blocks to or from the store, named by hash (docs/design.md §8)
CPU_TO_STORE, STORE_TO_CPU = "CPU_TO_STORE", "STORE_TO_CPU"
STORE_KINDS = (CPU_TO_STORE, STORE_TO_CPU)
ALL_KINDS = TASK_KINDS + STORE_KINDS
# tensor groups a swap task moves (docs/design.md §11): the KV cache, or the model's weights (one block per
# layer); a weights task with ring=k streams into a ring of k device slots, waiting for the forward (ipc/ring.py)
KV, WEIGHTS = "kv", "weights"
GROUPS = (KV, WEIGHTS)
ID_DTYPES = {"int32": np.dtype("<i4"), "int64": np.dtype("<i8")}
MAX_HEADER_BYTES = 4096
MAX_IDS = 1 << 24
MAX_ERROR_CHARS = 2000

# message type -> required fields and their types; no other field is accepted
SCHEMAS = {
    "register": {"rank": int, "pid": int},
    # fence: [rank, generation, slot] per fenced rank (docs/design.md §4 "Ordering against the model")
    "task": {"task_id": int, "kind": str, "dtype": str, "count": int, "layerwise": bool, "group": str, "ring": int,
             "fence": list},
    "store_task": {"task_id": int, "kind": str, "namespace": str, "count": int},
    "done": {"task_id": int, "rank": int, "nbytes": int, "skipped": int, "seconds": float},   # skipped: puts a
    #   full store did not take
    "failed": {"task_id": int, "rank": int, "error": str},
    "clear": {"release_swap_space": bool},
    "restore": {},
    # a reshard move's copy time, and the part of it that built weight rows
    "phase_done": {"phase": str, "rank": int, "copy_seconds": float, "weights_seconds": float},
    "phase_failed": {"phase": str, "rank": int, "error": str},
    "stop": {},
    # completion records first..last of the rank's ring failed their MAC or were overwritten: report them again
    "resend": {"first": int, "last": int},
    "ping": {},     # a numbered no-op: shows a rank the gap a phase command taken off its pipe left (engine/channel.py)
    "error": {"error": str},
    # messages numbered first..last never reached this rank: another process took them off its pipe
    "lost": {"rank": int, "first": int, "last": int},
    # task ring records first..last failed their MAC or were destroyed (ipc/task_ring.py): their tasks are lost
    "ring_bad": {"rank": int, "first": int, "last": int},
    # a reshard step (docs/design.md §9): body is the step's JSON (engine/resharder.py), frames its block maps
    "reshard": {"step": str, "body": str},
}
PHASES = ("attach", "clear", "restore", "reshard_prepare", "reshard_move", "reshard_commit", "reshard_abort")
RESHARD_STEPS = ("prepare", "move", "commit", "abort")
# reshard steps as the engine posts them in the reshard_state signal (workers follow them)
PREPARE, MOVE, COMMIT, ABORT = 1, 2, 3, 4
STAGE_NAMES = {PREPARE: "prepare", MOVE: "move", COMMIT: "commit", ABORT: "abort"}
# a transfer manager's exit codes when it stops on its own, and why (the engine names the reason)
EXIT_WORKER_GONE, EXIT_ENGINE_GONE, EXIT_WORKER_REPLACED = 3, 4, 5
EXIT_REASONS = {EXIT_WORKER_GONE: "its worker stopped beating", EXIT_ENGINE_GONE: "its engine exited",
                EXIT_WORKER_REPLACED: "another worker took its rank (restart_rank attaches the new one's cache)"}
RESHARD_FRAMES = 4      # GPU ids old and new, CPU ids old and new (int64)
FENCE_SLOTS = 64        # fence events a worker exports (worker/fences.py): a fence names one by its slot


class Fence(NamedTuple):
    """What a KV swap waits for on `rank` before it touches the device: the worker's fence event `slot` of its
    export `generation` (worker/fences.py), recorded on the model's stream when the fence was taken."""
    rank: int
    generation: int
    slot: int


class ProtocolError(ValueError):
    """A received message is malformed; the text says what is wrong."""


def runs(indices) -> list[tuple]:
    """(first, last) of each run of consecutive indices: the ranges a resend or a failure names."""
    out = []
    for i in indices:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return [tuple(r) for r in out]


def encode(type_: str, **fields) -> list[bytes]:
    return [json.dumps({"type": type_, **fields}, separators=(",", ":")).encode()]


class TaskFrames(list):
    """A task message's frames, with the arguments they were made of (`task`): a transfer manager's task ring
    can carry the task as a record instead (ipc/task_ring.py)."""
    task: tuple = ()


def encode_task(task_id: int, kind: str, gpu_ids: np.ndarray, cpu_ids: np.ndarray,
                layerwise: bool = False, group: str = KV, ring: int = 0, fence=()) -> TaskFrames:
    """fence: Fences (one per rank at most) the task waits for on those ranks."""
    dtype = "int32" if gpu_ids.dtype == np.int32 and cpu_ids.dtype == np.int32 else "int64"
    wire = ID_DTYPES[dtype]
    header = encode("task", task_id=task_id, kind=kind, dtype=dtype, count=len(gpu_ids), layerwise=layerwise,
                    group=group, ring=ring, fence=[list(f) for f in fence])
    frames = TaskFrames(header + [np.ascontiguousarray(gpu_ids, wire).tobytes(),
                                  np.ascontiguousarray(cpu_ids, wire).tobytes()])
    frames.task = (task_id, kind, gpu_ids, cpu_ids, layerwise, group, ring, fence)
    return frames


_KIND_JSON = {kind: json.dumps(kind) for kind in TASK_KINDS}
_SMALL_HEADER = ',"kind":%s,"dtype":"%s","count":%d,"layerwise":%s,"group":"kv","ring":0,"fence":%s}'
_SMALL_CACHED = 64          # tasks of up to this many ids: their header's tail and id layout are kept
_small_forms: dict = {}     # (kind, wide, count, layerwise) -> (header after the task id, id layout)


def encode_small_task(task_id: int, kind: str, gpu_ids: list, cpu_ids: list, wide: bool, layerwise: bool = False,
                      fence=()) -> TaskFrames:
    """encode_task's message, byte for byte, for a KV swap whose ids are Python ints its caller has checked (in
    range of the wire dtype: int64 if wide, else int32), built without NumPy or the JSON encoder."""
    n = len(gpu_ids)
    form = None if fence else _small_forms.get((kind, wide, n, layerwise))
    if form is None:
        fences = json.dumps([list(f) for f in fence], separators=(",", ":")) if fence else "[]"
        form = ((_SMALL_HEADER % (_KIND_JSON[kind], "int64" if wide else "int32", n, "true" if layerwise else "false",
                                  fences)).encode(), struct.Struct(("<%dq" if wide else "<%di") % n))
        if not fence and n <= _SMALL_CACHED:
            _small_forms[kind, wide, n, layerwise] = form
    tail, layout = form
    frames = TaskFrames((b'{"type":"task","task_id":%d' % task_id + tail, layout.pack(*gpu_ids),
                         layout.pack(*cpu_ids)))
    frames.task = (task_id, kind, gpu_ids, cpu_ids, layerwise, KV, 0, fence)
    return frames


class SmallTask:
    """encode_small_task's message, made only when a pipe sends it (iterating it gives its frames): a task that
    goes as a task-ring record (ipc/task_ring.py) never needs the frames, which cost more than the record."""
    __slots__ = ("task", "_wide", "_frames")

    def __init__(self, task_id: int, kind: str, gpu_ids: list, cpu_ids: list, wide: bool, layerwise: bool = False,
                 fence=()):
        self.task = (task_id, kind, gpu_ids, cpu_ids, layerwise, KV, 0, fence)
        self._wide, self._frames = wide, None

    def __iter__(self):
        if self._frames is None:
            task_id, kind, gpu_ids, cpu_ids, layerwise, _, _, fence = self.task
            self._frames = encode_small_task(task_id, kind, gpu_ids, cpu_ids, self._wide, layerwise, fence)
        return iter(self._frames)


def decode(frames: list[bytes]) -> tuple[dict, list[np.ndarray]]:
    """(header, id arrays) of a received message; raises ProtocolError if anything is off."""
    if not frames:
        raise ProtocolError("empty message")
    raw = frames[0]
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"header is not JSON: {str(exc)[:200]}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    type_ = header.get("type")
    schema = SCHEMAS.get(type_) if isinstance(type_, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message type {type_!r}")
    extra = set(header) - set(schema) - {"type"}
    if extra:
        raise ProtocolError(f"{type_}: unexpected fields {sorted(extra)}")
    for field, kind in schema.items():
        value = header.get(field)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = header[field] = float(value)
            except OverflowError:
                raise ProtocolError(f"{type_}: field {field!r} is out of float range") from None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ProtocolError(f"{type_}: field {field!r} must be {kind.__name__}, got {value!r}")
        if kind is int and value < 0:
            raise ProtocolError(f"{type_}: field {field!r} must be >= 0, got {value}")
    if "phase" in header and header["phase"] not in PHASES:
        raise ProtocolError(f"{type_}: unknown phase {header['phase']!r}")
    if type_ == "store_task":
        return header, _store_task_ids(header, frames)
    if type_ == "reshard":
        return header, _reshard_ids(header, frames)
    if type_ != "task":
        if len(frames) != 1:
            raise ProtocolError(f"{type_}: expected 1 frame, got {len(frames)}")
        return header, []
    return header, _task_ids(header, frames)


def _task_ids(header: dict, frames: list[bytes]) -> list[np.ndarray]:
    if header["kind"] not in TASK_KINDS:
        raise ProtocolError(f"task: unknown kind {header['kind']!r}")
    if header["group"] not in GROUPS:
        raise ProtocolError(f"task: unknown group {header['group']!r}")
    if header["ring"] and (header["group"] != WEIGHTS or header["kind"] != SWAP_TO_GPU or not header["layerwise"]):
        raise ProtocolError("task: only a layer-by-layer weights swap-in streams through a ring")
    _check_fence(header)
    wire = ID_DTYPES.get(header["dtype"])
    if wire is None:
        raise ProtocolError(f"task: unknown id dtype {header['dtype']!r}")
    count = header["count"]
    if not 0 < count <= MAX_IDS:
        raise ProtocolError(f"task: count {count} out of range 1..{MAX_IDS}")
    if len(frames) != 3:
        raise ProtocolError(f"task: expected 3 frames, got {len(frames)}")
    ids = []
    for label, frame in zip(("gpu", "cpu"), frames[1:]):
        if len(frame) != count * wire.itemsize:
            raise ProtocolError(f"task: {label} ids frame holds {len(frame)} bytes, expected {count * wire.itemsize}")
        ids.append(np.frombuffer(frame, wire).astype(np.int64))
    return ids


def _check_fence(header: dict):
    """Each entry a Fence of three non-negative ints (generation never 0, slot in range), ranks distinct; the
    entries become Fences. Only a KV swap waits on the model's stream."""
    fence, ranks = [], set()
    for entry in header["fence"]:
        if not (isinstance(entry, list) and len(entry) == 3 and
                all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry)):
            raise ProtocolError(f"task: fence entry {entry!r} is not [rank, generation, slot] (ints >= 0)")
        item = Fence(*entry)
        if not item.generation or item.slot >= FENCE_SLOTS or item.rank in ranks:
            raise ProtocolError(f"task: fence entry {entry!r}: generation 0, slot out of range 0..{FENCE_SLOTS - 1} "
                                f"or a rank named twice")
        ranks.add(item.rank)
        fence.append(item)
    if fence and header["group"] != KV:
        raise ProtocolError("task: only a KV swap waits on a fence")
    header["fence"] = fence


def encode_store_task(task_id: int, kind: str, namespace: str, hashes: np.ndarray, cpu_ids: np.ndarray) -> list[bytes]:
    """An L3 task: hashes as raw uint64, CPU block ids as raw int64, beside the JSON header."""
    header = encode("store_task", task_id=task_id, kind=kind, namespace=namespace, count=len(hashes))
    return header + [np.ascontiguousarray(hashes, "<u8").tobytes(), np.ascontiguousarray(cpu_ids, "<i8").tobytes()]


def _store_task_ids(header: dict, frames: list[bytes]) -> list[np.ndarray]:
    """[hashes (uint64), cpu ids (int64)] of a store task."""
    if header["kind"] not in STORE_KINDS:
        raise ProtocolError(f"store_task: unknown kind {header['kind']!r}")
    try:
        check_namespace(header["namespace"])
    except ValueError as exc:
        raise ProtocolError(f"store_task: {exc}") from None
    count = header["count"]
    if not 0 < count <= MAX_IDS:
        raise ProtocolError(f"store_task: count {count} out of range 1..{MAX_IDS}")
    if len(frames) != 3 or any(len(frame) != count * 8 for frame in frames[1:]):
        raise ProtocolError(f"store_task: expected a header and two frames of {count * 8} bytes")
    return [np.frombuffer(frames[1], "<u8").astype(np.uint64), np.frombuffer(frames[2], "<i8").astype(np.int64)]


def encode_reshard(step: str, body: str, maps=()) -> list[bytes]:
    """A reshard step: its JSON body, and (for moves) the GPU and CPU block maps as raw int64 frames."""
    return encode("reshard", step=step, body=body) + [np.ascontiguousarray(m, "<i8").tobytes() for m in maps]


def _reshard_ids(header: dict, frames: list[bytes]) -> list[np.ndarray]:
    if header["step"] not in RESHARD_STEPS:
        raise ProtocolError(f"reshard: unknown step {header['step']!r}")
    maps = frames[1:]
    if len(maps) not in (0, RESHARD_FRAMES):
        raise ProtocolError(f"reshard: expected 0 or {RESHARD_FRAMES} id frames, got {len(maps)}")
    if any(len(f) % 8 or len(f) > 8 * MAX_IDS for f in maps):
        raise ProtocolError("reshard: an id frame is not a whole number of int64 ids (or too long)")
    if maps and (len(maps[0]) != len(maps[1]) or len(maps[2]) != len(maps[3])):
        raise ProtocolError("reshard: a block map's old and new ids differ in length")
    return [np.frombuffer(f, "<i8").astype(np.int64) for f in maps]


def check_ids(gpu_ids, cpu_ids, kind: str, num_gpu_blocks: int, num_cpu_blocks: int):
    """Range, sign and duplicate-destination checks shared by the engine and the transfer manager."""
    for label, ids, bound in (("gpu", gpu_ids, num_gpu_blocks), ("cpu", cpu_ids, num_cpu_blocks)):
        low, high = _min_max(ids)
        if low < 0 or high >= bound:
            bad = ids[(ids < 0) | (ids >= bound)][0]
            raise ValueError(f"{label} block id {int(bad)} out of range 0..{bound - 1}")
    dest_label, dest = ("cpu", cpu_ids) if kind == SWAP_TO_CPU else ("gpu", gpu_ids)
    distinct = len(set(dest.tolist())) if len(dest) < SMALL_TASK else len(np.unique(dest))
    if distinct != len(dest):
        raise ValueError(f"duplicate destination {dest_label} block ids")


SMALL_TASK = 256    # below this many ids Python's min/max/set beat NumPy's calls (the latency path)


def _min_max(ids):
    if len(ids) < SMALL_TASK:
        values = ids.tolist()
        return min(values), max(values)
    return ids.min(), ids.max()
