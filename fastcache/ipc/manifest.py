"""JSON documents in named shared-memory segments: a worker's export manifest, a reshard plan, a rank's
reshard exports. One writer creates the segment; readers attach, copy the bytes out and detach."""
import json

import numpy as np

from .naming import manifest_name
from .shm import SharedSegment


def write_json_segment(name: str, payload, suffix: str) -> SharedSegment:
    """Create segment `name` holding `payload` as compact JSON; the caller owns (closes) it."""
    raw = json.dumps(payload, separators=(",", ":")).encode()
    seg = SharedSegment.create(name, len(raw), suffix)
    seg.array(np.uint8, (len(raw),))[:] = np.frombuffer(raw, np.uint8)
    return seg


def read_json_segment(name: str, suffix: str):
    with SharedSegment.attach(name, suffix) as seg:
        raw = bytes(seg.array(np.uint8, (seg.size,)))
    return json.loads(raw.rstrip(b"\0"))


def write_manifest(suffix: str, rank: int, manifest: list, worker: int = 0) -> SharedSegment:
    """Publish rank `rank`'s export manifest (one entry per tensor), each entry naming the worker that exported
    it (its worker_id signal's value)."""
    return write_json_segment(manifest_name(suffix, rank), [{**e, "worker": worker} for e in manifest], suffix)


def read_manifest(suffix: str, rank: int) -> list:
    return read_json_segment(manifest_name(suffix, rank), suffix)


def manifest_worker(manifest: list) -> int:
    """The worker_id of the worker that exported the manifest's tensors (0: not named)."""
    return int(manifest[0].get("worker", 0)) if manifest else 0
