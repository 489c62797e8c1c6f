"""Eviction policies for a prefix cache: which held block to give up when a store needs room.

One implementation per policy, used by every cache that evicts (TieredCache's CPU tier, the vLLM manager's
chunks, the trace model). A policy sees keys only; its owner keeps the bytes and tells it what happened:

- `stored(keys, new)`: one store call over a prefix chain, `keys` in chain order (head first), `new` the
  keys of it that were not held (inserted now, in chain order); the others were held and are refreshed.
- `touched(keys)`: held keys read (a load, or a lookup that will load), in chain order.
- `victims(n, skip)`: up to n held keys to evict, none for which `skip(key)` is true (pinned, in flight,
  named by the current call); the policy forgets them. Fewer when fewer can go.
- `remove(key)`: the owner dropped a key (a failed copy, a reset); `clear()` drops every key.

Policies: `lru`, the default (least recently used; a call's head ends most recent, so a chain goes from its
tail), `arc` (vLLM's ARC: T1/T2 with ghost lists B1/B2 steering T1's target size) and `prefix`, which ranks
what a prefix cache knows (see PrefixPolicy). `prefix` becomes the default once it beats lru and arc at
every capacity measured (docs/benchmarks.md, "Eviction policies"); today it does not below 4,000 blocks.
"""
from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict, deque
from itertools import islice, repeat

DEFAULT_POLICY = "lru"


class LruPolicy:
    """Least recently used first; a call refreshes its keys from last to first (its head most recent)."""

    name = "lru"

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._order: OrderedDict = OrderedDict()        # least recently used first

    def __len__(self):
        return len(self._order)

    def __contains__(self, key):
        return key in self._order

    def stored(self, keys, new):
        if len(new) == len(keys):       # all new (the common case): inserted last first, head most recent
            self._order.update(zip(reversed(new), repeat(None)))
            return
        self._order.update(zip(new, repeat(None)))
        deque(map(self._order.move_to_end, reversed(keys)), maxlen=0)

    def touched(self, keys):
        deque(map(self._order.move_to_end, reversed(keys)), maxlen=0)

    def victims(self, n, skip=None):
        order = self._order
        if skip is None:
            out = list(islice(order, n))
            deque(map(order.__delitem__, out), maxlen=0)
            return out
        out = []
        for key in order:
            if len(out) == n:
                break
            if not skip(key):
                out.append(key)
        deque(map(order.__delitem__, out), maxlen=0)
        return out

    def remove(self, key):
        self._order.pop(key, None)

    def clear(self):
        self._order.clear()


class ArcPolicy:
    """vLLM 0.32's ARC (vllm/v1/kv_offload/cpu/policies/arc.py) on this interface. New keys enter T1; a key
    read again (touched) moves to T2; a store of a held key restores its recency without counting as a
    second access; a new key found in a ghost list first moves T1's target (B1: up, B2: down). Eviction takes
    T1's least recent while T1 is at or above its target, else T2's; ghosts are bounded by the capacity."""

    name = "arc"

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.target_t1 = 0.0
        self.t1: OrderedDict = OrderedDict()
        self.t2: OrderedDict = OrderedDict()
        self.b1: OrderedDict = OrderedDict()
        self.b2: OrderedDict = OrderedDict()

    def __len__(self):
        return len(self.t1) + len(self.t2)

    def __contains__(self, key):
        return key in self.t1 or key in self.t2

    def _ghost_hit(self, key):
        if key in self.b1:
            self.target_t1 = min(self.target_t1 + max(1, len(self.b2) / len(self.b1)), self.capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            self.target_t1 = max(self.target_t1 - max(1, len(self.b1) / len(self.b2)), 0)
            self.b2.move_to_end(key)

    def stored(self, keys, new):
        for key in reversed(new):
            self._ghost_hit(key)
        fresh = set(new)
        for key in reversed(keys):
            if key in fresh:
                self.t1[key] = None
                self.b1.pop(key, None)
                self.b2.pop(key, None)
            elif key in self.t1:
                self.t1.move_to_end(key)
            elif key in self.t2:
                self.t2.move_to_end(key)

    def touched(self, keys):
        for key in reversed(keys):
            if key in self.t1:
                del self.t1[key]
                self.t2[key] = None
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._ghost_hit(key)

    def victims(self, n, skip=None):
        def next_free(entries):
            for key in entries:
                if skip is None or not skip(key):
                    return key
            return None
        chosen, t1_size = [], len(self.t1)
        t1_keys, t2_keys = iter(self.t1), iter(self.t2)
        for _ in range(n):
            key = None
            if t1_size >= int(self.target_t1):
                key = next_free(t1_keys)
                if key is not None:
                    chosen.append((key, True))
                    t1_size -= 1
            if key is None:
                key = next_free(t2_keys)
                if key is not None:
                    chosen.append((key, False))
            if key is None:
                key = next_free(t1_keys)
                if key is None:
                    break
                chosen.append((key, True))
                t1_size -= 1
        for key, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            for _ in range(len(ghost) - self.capacity):
                ghost.popitem(last=False)
        return [key for key, _ in chosen]

    def remove(self, key):
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def clear(self):
        for part in (self.t1, self.t2, self.b1, self.b2):
            part.clear()
        self.target_t1 = 0.0


class PrefixPolicy:
    """Recency, shifted by how often keys of the same kind of store come back (learned online).

    A prefix cache sees each store call whole: a chain whose head may be held and whose new keys were just
    computed. How many keys a call adds says much of what comes next: on a chat trace, a turn that adds a
    short reply is continued about half the time, one that adds a long document about a tenth. So:
    - **Classes.** A call's keys take the class of its size (the number of keys it added, by bit length:
      1, 2, 3-4, ..., 16 or more); its last key a class of its own (a prompt's last block is often partial
      and then never reused), ranked never above the call's body.
    - **What a class is worth.** Per class, the keys placed and, of those, the keys named again (held and
      stored or loaded again, or stored again soon after eviction: a ghost list as long as the cache
      remembers evicted keys, so eviction does not hide its own mistakes). p is their ratio; the counts
      halve every 16 capacities of insertions, so the order follows a workload that changes.
    - **The order.** A key's rank is `its last use + SHIFT x mean reuse gap x logit(p)`, the lowest goes
      first: recency, with a class that comes back often kept longer and one that does not given up sooner.
      With one class this is LRU. Within a class the keys of a call share a rank and go from the call's tail,
      so a chain is never cut at its head first. Ages count keys inserted plus one per call.
    SHIFT (0.3) is a measured choice: at 1 the classes' shifts outweigh recency and the order clogs with
    old keys of classes that were worth much once (docs/benchmarks.md, "Eviction policies").
    """

    name = "prefix"
    ADDED = 5                   # classes by keys added, bit length 0..5 (5: 16 or more)
    SHIFT = 0.3

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._clock = 0                     # ages count keys inserted, plus one per call (recency breaks ties)
        self._read: set = set()             # keys loaded since the last store call (each reuse counted once)
        self._class: dict = {}              # key -> its class
        self._last: dict = {}               # key -> clock when it was last named
        self._queues: dict = {}             # class -> OrderedDict of its keys, least recent first (with stale ones)
        self._ghosts: OrderedDict = OrderedDict()   # evicted key -> (class, last use), at most capacity
        self._placed: Counter = Counter()   # class -> keys placed in it
        self._reused: Counter = Counter()   # class -> of those, named again
        self._gap_sum, self._gap_count = float(capacity), 1.0    # reuse gaps, for the mean
        self._offsets_cache, self._offsets_at = {}, None

    def __len__(self):
        return len(self._class)

    def __contains__(self, key):
        return key in self._class

    def _credit(self, keys, classes, lasts):
        """keys named again: each counts as a reuse of the class it was in, after a gap."""
        self._reused.update(classes)
        self._gap_sum += self._clock * len(keys) - sum(lasts)
        self._gap_count += len(keys)

    def stored(self, keys, new):
        if not new:         # nothing added (a tier above gave back what it held): recency only
            self._refresh(keys)
            return
        if len(new) < len(keys):
            again = [k for k in keys if k in self._class and k not in self._read]
            if again:
                self._credit(again, map(self._class.__getitem__, again), map(self._last.__getitem__, again))
        returned = self._ghosts.keys() & new if self._ghosts else ()
        if returned:
            back = list(map(self._ghosts.pop, returned))
            self._credit(back, (c for c, _ in back), (t for _, t in back))
        self._clock += len(new) + 1
        self._read.clear()
        base = min(len(new).bit_length(), self.ADDED) * 2
        *body, tail = keys
        if body:
            self._place(body, base)
        self._place((tail,), base + 1)
        self._last.update(zip(keys, repeat(self._clock)))
        if sum(self._placed.values()) > max(16 * self.capacity, 1 << 16):    # forget slowly: halve every count
            for counts in (self._placed, self._reused):
                for c in counts:
                    counts[c] //= 2
            self._gap_sum, self._gap_count = self._gap_sum / 2, self._gap_count / 2

    def _place(self, keys, cls):
        queue = self._queues.get(cls)
        if queue is None:
            queue = self._queues[cls] = OrderedDict()
        keys = keys[::-1]                   # the call's head ends most recent
        queue.update(zip(keys, repeat(None)))
        deque(map(queue.move_to_end, keys), maxlen=0)
        self._class.update(zip(keys, repeat(cls)))
        self._placed[cls] += len(keys)

    def touched(self, keys):
        again = [k for k in keys if k not in self._read]
        if again:
            self._credit(again, map(self._class.__getitem__, again), map(self._last.__getitem__, again))
            self._read.update(again)
        self._refresh(keys)

    def _refresh(self, keys):
        queues, klass = self._queues, self._class
        for key in reversed(keys):
            queues[klass[key]].move_to_end(key)
        self._clock += 1
        self._last.update(zip(keys, repeat(self._clock)))

    def _offsets(self):
        """class -> how far its keys' ranks are shifted (in clock units), recomputed as the clock moves on
        by a sixteenth of the capacity (the counts change slowly)."""
        if self._offsets_at is not None and self._clock - self._offsets_at < self.capacity / 16 \
                and self._queues.keys() <= self._offsets_cache.keys():
            return self._offsets_cache
        self._offsets_at = self._clock
        self._offsets_cache = self._compute_offsets()
        return self._offsets_cache

    def _compute_offsets(self):
        unit = self.SHIFT * self._gap_sum / self._gap_count
        offsets = {c: unit * math.log((self._reused[c] + 1) / (max(self._placed[c] - self._reused[c], 0) + 1))
                   for c in self._queues}
        for c in offsets:       # a call's last key (odd class) goes before the body it ends
            if c & 1 and c - 1 in offsets:
                offsets[c] = min(offsets[c], offsets[c - 1] - 0.5)
        return offsets

    def victims(self, n, skip=None):
        if n <= 0 or not self._class:
            return []
        if sum(map(len, self._queues.values())) > 2 * len(self._class) + self.capacity:
            self._compact()
        offsets, klass, last = self._offsets(), self._class, self._last
        heads, cursors, stale = [], {}, []

        def advance(c):
            """The rank of class c's next evictable key, or None."""
            for key in cursors[c]:
                if klass.get(key) != c:
                    stale.append((c, key))      # moved to another class (or gone) since it was queued here
                elif skip is None or not skip(key):
                    return last[key] + offsets[c], key
            return None

        for c, queue in self._queues.items():
            cursors[c] = iter(queue)
            head = advance(c)
            if head is not None:
                heads.append((head[0], c, head[1]))
        heapq.heapify(heads)
        taken, count = [], 0                    # (class, its keys in eviction order)
        while heads and count < n:
            rank, c, key = heapq.heappop(heads)
            bound = heads[0][0] if heads else math.inf
            run, offset = [key], offsets[c]
            count += 1
            for key in cursors[c]:              # a run of this class while it ranks lowest
                if count == n:
                    break
                if klass.get(key) != c:
                    stale.append((c, key))
                elif skip is None or not skip(key):
                    rank = last[key] + offset
                    if rank > bound:
                        heapq.heappush(heads, (rank, c, key))
                        break
                    run.append(key)
                    count += 1
            taken.append((c, run))
        queues, ghosts = self._queues, self._ghosts
        for c, key in stale:
            del queues[c][key]
        out = []
        for c, run in taken:
            deque(map(queues[c].__delitem__, run), maxlen=0)
            deque(map(klass.__delitem__, run), maxlen=0)
            ghosts.update(zip(run, zip(repeat(c), map(last.pop, run))))
            out += run
        extra = len(ghosts) - self.capacity
        if extra > 0:
            deque(map(ghosts.__delitem__, list(islice(ghosts, extra))), maxlen=0)
        return out

    def _compact(self):
        """Drop the queues' stale keys (a key moved to another class stays queued in its old one until met)."""
        klass = self._class
        for c, queue in self._queues.items():
            self._queues[c] = OrderedDict((k, None) for k in queue if klass.get(k) == c)

    def remove(self, key):
        c = self._class.pop(key, None)
        if c is not None:
            del self._queues[c][key]
            self._last.pop(key, None)

    def clear(self):
        for part in (self._class, self._last, self._queues, self._ghosts, self._read):
            part.clear()


POLICIES = {"lru": LruPolicy, "arc": ArcPolicy, "prefix": PrefixPolicy}


def make_policy(name: str, capacity: int):
    """A policy by name for a cache of `capacity` keys; ValueError naming the choices."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}: choose one of {', '.join(sorted(POLICIES))}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"an eviction policy needs a positive capacity, got {capacity!r}")
    return POLICIES[name](capacity)
