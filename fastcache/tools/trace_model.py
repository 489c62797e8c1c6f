"""Request traces (Mooncake's JSONL format) and the in-process model a replay must agree with.

The model runs the trace tool's engine policy on bare keys: a GPU prefix cache that is an LRU of
`gpu_blocks`, and below it a tier of `cpu_blocks` with TieredCache's rules (store skips and refreshes
held hashes, loads touch what they read, eviction asks the tier's policy for victims the call does not
name). The policy is the one TieredCache uses (fastcache/eviction.py: one implementation per policy); the
tier's mechanics share no code with TieredCache or the replay, so a difference between the two is a bug in
one of them. `belady` is the offline ceiling: the CPU tier evicts what is used farthest ahead.

Per request, with hashes h (a prefix chain) of n blocks:
  1. k = leading hashes resident on the GPU (refreshed, tail first);
  2. n - k GPU blocks are taken: free ones, then the GPU's least recently used (stored to L2 first, unless
     write_back=False);
  3. m = leading hashes of h[k:] held by L2, which are loaded;
  4. the rest is computed; the whole chain h is stored to L2 (held hashes skipped) and becomes the GPU's
     most recently used, head last.
With a store below L2 (l3=True: an L3 that never evicts, filled by L2's evictions, as TieredCache's
write-back does), step 3 counts the leading hashes held by L2 or L3, and loading them stores the L3
ones into L2 under the same rules (evicting, and so writing back, L2's least recently used).
"""
from __future__ import annotations

import bisect
import heapq
import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..eviction import DEFAULT_POLICY, make_policy


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


class _Tier:
    """The model's L2: TieredCache's store rules over an eviction policy, sequential (nothing in flight)."""

    def __init__(self, capacity, policy):
        self.capacity, self.policy = capacity, policy

    def __contains__(self, key):
        return key in self.policy

    def store(self, keys):
        keys = list(dict.fromkeys(keys))
        new = [k for k in keys if k not in self.policy]
        over = len(new) - (self.capacity - len(self.policy))
        victims = []
        if over > 0:
            protect = set(keys)
            victims = self.policy.victims(over, protect.__contains__)
            if len(victims) < over:             # no room for the rest: skipped, not refreshed
                dropped = set(new[len(new) - (over - len(victims)):])
                new = [k for k in new if k not in dropped]
                keys = [k for k in keys if k not in dropped]
        self.policy.stored(keys, new)
        return victims

    def refresh(self, keys):
        if keys:
            self.policy.touched(keys)


def simulate(requests, gpu_blocks: int, cpu_blocks: int, l3: bool = False, policy=DEFAULT_POLICY,
             write_back: bool = True) -> Hits:
    """The tiers of the replay, on keys only. `policy` names the CPU tier's eviction policy (or "belady"), or is
    a policy object of `cpu_blocks` keys. write_back=False leaves out step 2's store of the GPU's victims: the
    GPU drops them, as vLLM's offloading connector does (it stores a block when it is computed only)."""
    gpu, hits = OrderedDict(), Hits()
    if policy == "belady":
        policy = Belady(requests)
    elif isinstance(policy, str):
        policy = make_policy(policy, cpu_blocks)
    l2 = _Tier(cpu_blocks, policy)
    below = set()                              # L3: what L2 evicted (used when l3)
    for i, h in enumerate(requests):
        if isinstance(l2.policy, Belady):
            l2.policy.at(i)
        k = leading(h, gpu)
        for key in reversed(h[:k]):
            gpu.move_to_end(key)
        for key in h[k:]:                      # resident past a miss: only in a trace that is not a chain
            gpu.pop(key, None)
        over = len(gpu) + len(h) - k - gpu_blocks
        victims = [gpu.popitem(last=False)[0] for _ in range(max(0, over))]
        if victims and write_back:
            below.update(l2.store(victims[::-1]))     # the most recently used victim first
        s = 0
        if l3:
            m = leading(h[k:], _Either(l2, below))
            s = sum(key not in l2 for key in h[k:k + m])
            if s:
                below.update(l2.store(h[k:k + m]))    # L3 hits come up through L2 (one store of the load's run)
            else:
                l2.refresh(h[k:k + m])                # all in L2: a load, which only reads
        else:
            m = leading(h[k:], l2)
            l2.refresh(h[k:k + m])
        below.update(l2.store(h))
        for key in reversed(h):
            gpu[key] = True
            gpu.move_to_end(key)
        hits.add(k, m - s, len(h), s)
    return hits


class Belady:
    """The offline ceiling for the CPU tier: evict the held key whose next use lies farthest ahead (never used
    again first). It reads the whole trace; the model calls `at(i)` before serving request i."""

    def __init__(self, requests):
        self._requests, self._now, self._held = requests, 0, {}      # held key -> its next use
        self._uses: dict = {}                   # key -> the requests that name it, in order
        for i, h in enumerate(requests):
            for key in h:
                self._uses.setdefault(key, []).append(i)
        self._heap = []                         # (-next use, key), stale ones skipped

    def _next_use(self, key):
        uses = self._uses.get(key, ())
        at = bisect.bisect_right(uses, self._now)
        return uses[at] if at < len(uses) else math.inf

    def _rank(self, keys):
        for key in keys:
            use = self._held[key] = self._next_use(key)
            heapq.heappush(self._heap, (-use, key))

    def at(self, i):
        """Serving request i: the held keys of the requests since passed get their next use."""
        passed = [k for r in self._requests[self._now:i] for k in r if k in self._held]
        self._now = i
        self._rank(passed)

    def __len__(self):
        return len(self._held)

    def __contains__(self, key):
        return key in self._held

    def stored(self, keys, new):
        self._rank(new)

    def touched(self, keys):
        pass

    def victims(self, n, skip=None):
        out, kept = [], []
        while self._heap and len(out) < n:
            use, key = heapq.heappop(self._heap)
            if self._held.get(key) != -use:
                continue                        # evicted, or ranked again since
            if skip is not None and skip(key):
                kept.append((use, key))
                continue
            out.append(key)
            del self._held[key]
        for item in kept:
            heapq.heappush(self._heap, item)
        return out

    def remove(self, key):
        self._held.pop(key, None)

    def clear(self):
        self._held.clear()
        self._heap.clear()


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
