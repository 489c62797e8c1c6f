"""Request traces (Mooncake's JSONL format) and the in-process model a replay must agree with.

The model runs the trace tool's engine policy on bare keys: a GPU prefix cache that is an LRU of
`gpu_blocks`, and below it an LRU of `cpu_blocks` with TieredCache's rules (store skips and refreshes
held hashes, refreshes a call's hashes from last to first, evicts the least recently used entry the call
does not name). It shares no code with TieredCache or the replay, so a difference between the two is a
bug in one of them.

Per request, with hashes h (a prefix chain) of n blocks:
  1. k = leading hashes resident on the GPU (refreshed, tail first);
  2. n - k GPU blocks are taken: free ones, then the GPU's least recently used (stored to L2 first);
  3. m = leading hashes of h[k:] held by L2, which are loaded;
  4. the rest is computed; the whole chain h is stored to L2 (held hashes skipped) and becomes the GPU's
     most recently used, head last.
With a store below L2 (l3=True: an L3 that never evicts, filled by L2's evictions, as TieredCache's
write-back does), step 3 counts the leading hashes held by L2 or L3, and loading them stores the L3
ones into L2 under the same rules (evicting, and so writing back, L2's least recently used).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Trace:
    path: str
    requests: list          # hash_ids per request
    timestamps: np.ndarray  # ms from the start

    @property
    def blocks(self) -> int:
        return sum(map(len, self.requests))


def load_trace(path: str, limit: int | None = None) -> Trace:
    """Read a JSONL trace; ValueError naming the line for anything malformed."""
    requests, stamps = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
            hashes = record.get("hash_ids") if isinstance(record, dict) else None
            if not isinstance(hashes, list) or not all(type(h) is int and 0 <= h < 2**64 for h in hashes):
                raise ValueError(f"{path}:{number}: hash_ids must be a list of ints in 0..2**64-1")
            if len(set(hashes)) != len(hashes):
                raise ValueError(f"{path}:{number}: a hash repeats within one request")
            stamp = record.get("timestamp", 0)
            if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
                raise ValueError(f"{path}:{number}: timestamp must be a number")
            requests.append(hashes)
            stamps.append(stamp)
    if not requests:
        raise ValueError(f"{path}: no requests")
    return Trace(path, requests, np.asarray(stamps, float))


@dataclass
class Hits:
    """Per-request counts of one run (replay or model)."""
    gpu: list = field(default_factory=list)
    cpu: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    l3: list = field(default_factory=list)     # hits only the store (L3) held

    def add(self, gpu, cpu, blocks, l3=0):
        self.gpu.append(gpu)
        self.cpu.append(cpu)
        self.blocks.append(blocks)
        self.l3.append(l3)

    def rates(self) -> dict:
        total = sum(self.blocks)
        g, c, s = sum(self.gpu), sum(self.cpu), sum(self.l3)
        return {"gpu_hits": g, "cpu_hits": c, "l3_hits": s, "misses": total - g - c - s, "blocks": total,
                "gpu_hit_rate": g / total, "cpu_hit_rate": c / total, "l3_hit_rate": s / total,
                "hit_rate": (g + c + s) / total}


def leading(keys, held) -> int:
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n


class _Lru:
    """The model's L2: TieredCache's store rules, sequential (nothing is ever in flight)."""

    def __init__(self, capacity):
        self.capacity, self.entries = capacity, OrderedDict()

    def store(self, keys):
        keys = list(dict.fromkeys(keys))
        new = [k for k in keys if k not in self.entries]
        room = self.capacity - len(self.entries)
        if len(new) > room:
            protect = set(keys)
            victims = []
            for k in self.entries:             # least recently used first
                if len(victims) == len(new) - room:
                    break
                if k not in protect:
                    victims.append(k)
            for k in victims:
                del self.entries[k]
            room += len(victims)
            dropped = set(new[room:])
            keys = [k for k in keys if k not in dropped]
            self.refresh(keys)
            return victims
        self.refresh(keys)
        return []

    def refresh(self, keys):
        for k in reversed(keys):
            self.entries[k] = True
            self.entries.move_to_end(k)


def simulate(requests, gpu_blocks: int, cpu_blocks: int, l3: bool = False) -> Hits:
    """The tiers of the replay, on keys only."""
    gpu, l2, hits = OrderedDict(), _Lru(cpu_blocks), Hits()
    below = set()                              # L3: what L2 evicted (used when l3)
    for h in requests:
        k = leading(h, gpu)
        for key in reversed(h[:k]):
            gpu.move_to_end(key)
        for key in h[k:]:                      # resident past a miss: only in a trace that is not a chain
            gpu.pop(key, None)
        over = len(gpu) + len(h) - k - gpu_blocks
        victims = [gpu.popitem(last=False)[0] for _ in range(max(0, over))]
        if victims:
            below.update(l2.store(victims[::-1]))     # the most recently used victim first
        s = 0
        if l3:
            m = leading(h[k:], _Either(l2.entries, below))
            s = sum(key not in l2.entries for key in h[k:k + m])
            below.update(l2.store(h[k:k + m]))        # L3 hits come up through L2
        else:
            m = leading(h[k:], l2.entries)
            l2.refresh(h[k:k + m])
        below.update(l2.store(h))
        for key in reversed(h):
            gpu[key] = True
            gpu.move_to_end(key)
        hits.add(k, m - s, len(h), s)
    return hits


class _Either:
    """Membership in either of two containers."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __contains__(self, key):
        return key in self.a or key in self.b


def infinite(requests) -> Hits:
    """A cache that never evicts: every leading hash seen before hits."""
    seen, hits = set(), Hits()
    for h in requests:
        hits.add(0, leading(h, seen), len(h))
        seen.update(h)
    return hits
