"""Eviction policies for a prefix cache: which held block to give up when a store needs room.

One implementation per policy, used by every cache that evicts (TieredCache's CPU tier, the vLLM manager's
chunks, the trace model). A policy sees keys only; its owner keeps the bytes and tells it what happened:

- `stored(keys, new)`: one store call over a prefix chain, `keys` in chain order (head first), `new` the
  keys of it that were not held (inserted now, in chain order); the others were held and are refreshed.
- `touched(keys)`: held keys read (a load, or a lookup that will load), in chain order.
- `victims(n, skip)`: up to n held keys to evict, none for which `skip(key)` is true (pinned, in flight,
  named by the current call); the policy forgets them. Fewer when fewer can go.
- `remove(key)`: the owner dropped a key (a failed copy, a reset); `clear()` drops every key.

Policies: `probation`, the default, which gives up first what was stored once and not named since (under a
GPU cache that stores its evictions: blocks the GPU still holds), learning online how far to protect what was
named again (see ProbationPolicy); `lru` (least recently used; a call's head ends most recent, so a chain goes
from its tail); `arc` (vLLM's ARC: T1/T2 with ghost lists B1/B2 steering T1's target size); `adaptive`,
probation's segments and learned room with lru's order over both segments past the room (see AdaptivePolicy);
`laps`, adaptive plus a second lap for protected keys named again while protected, as many as the returns of
protected's victims say (see LapsPolicy).
`shadow`, laps plus a shadow of the GPU cache read from the calls: where the GPU stores what it evicts,
the protected copies of blocks it holds go right after probation (see ShadowPolicy).
`probation` is at or above lru and arc at every capacity
measured on the three traces and on held-out ones (docs/benchmarks.md, "Eviction policies"), at lru's cost
within 6-15% in a real store call, and on vLLM's engine computes fewer prefill tokens than lru.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from itertools import islice, repeat

DEFAULT_POLICY = "probation"

# where an evicted key left from, as its ghost remembers it
FROM_PROTECTED, FROM_PROBATION, AFTER_LAP = 0, 1, 2


def take_oldest(entries: OrderedDict, n: int, skip=None) -> list:
    """Up to n of entries' first (oldest) keys for which skip(key) is not true, taken out of entries."""
    if n <= 0:
        return []
    if skip is None:
        taken = list(islice(entries, n))
    else:
        taken = []
        for key in entries:
            if not skip(key):
                taken.append(key)
                if len(taken) == n:
                    break
    deque(map(entries.__delitem__, taken), maxlen=0)
    return taken


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
        return take_oldest(self._order, n, skip)

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


class ProbationPolicy:
    """A key stored once waits on probation; a key named again is kept by recency. Probation goes first,
    unless the misses it causes say that protected keys should go first instead (learned online).

    Two LRU segments and ghost lists:
    - **probation**: keys stored new (by a call) that the ghost lists do not name;
    - **protected**: keys named again: stored again while held, loaded (touched), or stored new while a
      ghost list still names them (evicted, then wanted back);
    - **ghosts**: the keys evicted lately (keys only, and whether each left from probation), in two
      generations of half a capacity each: the last 1/2 to 1 capacity of evictions are remembered.
    Victims are probation's least recent first, then protected's; within each a call's keys go from its tail
    (its head ends most recent, as under lru), and skipped keys stay. Protected is held to at most
    `capacity - room` keys; beyond it protected's least recent go first.

    Why probation first: the CPU tier sits under the engine's GPU prefix cache and is written through: every
    request stores its whole chain, and the GPU stores what it evicts again when it lets it go. Under lru a
    block a request just computed takes a slot as fresh as anything, though the GPU holds the same block;
    much of an lru tier repeats the GPU (at 2,000 blocks, 1,000 on each side, nearly all of it). Here such a
    block waits on probation and goes first; the GPU's later store of it finds it in the ghost list and it
    comes back protected, now a block no tier above holds. The tier keeps what the GPU gave up, plus what
    was loaded or stored twice, and a block read once and never again (a private document streaming past)
    never pushes out one that came back. With one class of key and no repeats it is lru.

    Why `room` (0 at first, so probation always goes first): where nothing stores the GPU's evictions
    (vLLM's connector stores a block when it is computed, only), a block on probation is not a copy, and
    protected, never bounded, fills with blocks named twice long ago while new blocks go at once. The
    policy sees what its evictions cost: a load (`touched`) reads the leading held blocks of a prompt, and
    when the next store (the prompt's) names, right after the last block read, a block a ghost list holds,
    that eviction made the load stop short. A miss of a block evicted from probation moves `room` up
    by a 256th of the capacity (protected gives way), one evicted from protected moves it down as much;
    `room` stays within 0..0.9 x capacity. Where the GPU stores its evictions, blocks taken from probation
    are back before they are missed and `room` stays near 0.
    Measured choices (docs/benchmarks.md, "Eviction policies"; chosen on the three traces, not the held-out
    ones): ghosts remembered for 1/2-1 capacity (a quarter loses to lru on agent at 2,000 and 4,000 blocks;
    1-2 capacities gives up 5 points on documents at 2,000); the step of a 256th (a 32nd overshoots and loses
    to lru on agent at 2,000; a 512th follows slower, a point below lru on the chat trace at 32,000 where
    nothing stores the GPU's evictions). Costs: lru's for a call of new keys plus a lookup of each in the
    ghost lists, a few bulk dict operations per key otherwise; a store 1.06-1.15x lru's in the real call,
    1.2-1.9x warm (docs/benchmarks.md).
    """

    name = "probation"
    GHOSTS = 0.5            # a ghost generation's length, in capacities: the last 1/2 to 1 capacity of keys
    STEP = 1 / 256          # room's move per miss an eviction caused, in capacities

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._probation: OrderedDict = OrderedDict()    # stored once, least recent first -> its call
        self._protected: OrderedDict = OrderedDict()    # named again, least recent first -> its call
        self._ghosts: dict = {}                         # evicted key -> left from probation: this generation ...
        self._old_ghosts: dict = {}                     # ... and the one before
        self._generation = max(1, int(self.GHOSTS * capacity))
        self._room = 0.0                                # protected holds at most capacity - room
        self._step = max(1.0, self.STEP * capacity)
        self._last_read = None                          # the last key of the last load, until the next store
        self._clock = 0                                 # calls so far: a segment's value is the call that
        #                                                 placed the key there (adaptive compares them)

    def __len__(self):
        return len(self._probation) + len(self._protected)

    def __contains__(self, key):
        return key in self._probation or key in self._protected

    def _protect(self, keys, held=True):
        """keys (chain order) to protected's most recent end, head last, from wherever they are (held: all
        are)."""
        prob, prot = self._probation, self._protected
        if held and (not prob or prob.keys().isdisjoint(keys)):     # all protected already: lru's refresh
            deque(map(prot.move_to_end, reversed(keys)), maxlen=0)
            return
        keys = keys[::-1]
        if held and prot.keys().isdisjoint(keys):                   # all on probation
            deque(map(prob.__delitem__, keys), maxlen=0)
        else:
            deque(map(prob.pop, keys, repeat(None)), maxlen=0)
            deque(map(prot.pop, keys, repeat(None)), maxlen=0)
        prot.update(zip(keys, repeat(self._clock)))

    def _returned(self, new):
        """the keys of new that a ghost list names, forgotten there"""
        ghosts, old = self._ghosts, self._old_ghosts
        # the common case, none returned, is two disjointness checks (no set built)
        returned = ghosts.keys() & new if ghosts and not ghosts.keys().isdisjoint(new) else set()
        if old and not old.keys().isdisjoint(new):
            returned |= old.keys() & new
        if returned:
            deque(map(ghosts.pop, returned, repeat(None)), maxlen=0)
            deque(map(old.pop, returned, repeat(None)), maxlen=0)
        return returned

    def _missed(self, keys):
        """A store right after a load: a ghost named right after the load's last key is a miss an eviction
        caused; room follows where it was evicted from."""
        last, self._last_read = self._last_read, None
        try:
            at = keys.index(last) + 1
        except ValueError:
            return
        if at < len(keys):
            key = keys[at]
            origin = self._ghosts.get(key, self._old_ghosts.get(key))
            if origin is not None:
                room = self._room + (self._step if origin == FROM_PROBATION else -self._step)
                self._room = min(max(room, 0.0), 0.9 * self.capacity)

    def stored(self, keys, new):
        self._clock += 1
        if self._last_read is not None:
            self._missed(keys)
        returned = self._returned(new) if new else ()
        if len(new) == len(keys) and not returned:      # all new, none wanted back: lru's one insert
            self._probation.update(zip(reversed(new), repeat(self._clock)))
            return
        first = [k for k in new if k not in returned] if returned else new
        if first:
            self._probation.update(zip(reversed(first), repeat(self._clock)))
        if len(first) == len(keys):
            return
        if first:
            first = set(first)
            keys = [k for k in keys if k not in first]
        self._protect(keys, held=not returned)

    def touched(self, keys):
        if keys:
            self._clock += 1
            self._last_read = keys[-1]
            self._protect(keys)

    def victims(self, n, skip=None):
        prob, prot = self._probation, self._protected
        over = len(prot) - int(self.capacity - self._room)
        first = take_oldest(prot, min(n, over), skip)       # protected beyond its room goes first
        taken = take_oldest(prob, n - len(first), skip)
        rest = take_oldest(prot, n - len(first) - len(taken), skip)
        self._remember(taken, first + rest)
        return first + taken + rest

    def _remember(self, from_probation, from_protected):
        """the victims of one call as ghosts; a new generation once this one is full (the one before is
        forgotten)"""
        ghosts = self._ghosts
        if from_probation:
            ghosts.update(zip(from_probation, repeat(FROM_PROBATION)))
        if from_protected:
            ghosts.update(zip(from_protected, repeat(FROM_PROTECTED)))
        if len(ghosts) >= self._generation:
            self._old_ghosts, self._ghosts = ghosts, {}

    def remove(self, key):
        if key in self._probation:
            del self._probation[key]
        else:
            self._protected.pop(key, None)

    def clear(self):
        for part in (self._probation, self._protected, self._ghosts, self._old_ghosts):
            part.clear()
        self._room, self._last_read = 0.0, None


class AdaptivePolicy(ProbationPolicy):
    """probation's segments, ghosts and learned `room`; past its room, protected competes by recency.

    Under ProbationPolicy, once the misses a load reports (a load stopped short by a block evicted from
    probation) have moved `room` up, protected's least recent go first while protected holds more than
    `capacity - room`: a block that waits on probation (stored once) still goes before every protected
    block within the room, however recent it is and however old they are. Where nothing stores the GPU's
    evictions, a block stored once is often the next step of a session still running (agent tools, a
    follow-up question): that order gives it up before blocks named twice long ago, and probation stays up
    to 1.1 points below lru at 4,000-32,000 blocks (docs/benchmarks.md, "Eviction policies").

    Here, while protected is over its room, the two segments' least recent are compared by the call that
    last named each (a clock counting calls), and the older goes: lru's order over the whole cache, until
    protected is back within its room; then probation first, as in ProbationPolicy. So `room`, learned from
    which evictions cost a load, sets how much of the cache is ordered by recency (lru) and how much by the
    filter of blocks stored once (probation): room 0 is ProbationPolicy exactly (where the GPU stores its
    evictions, room stays near 0 and so does the difference), room at its bound (0.9 x capacity) orders by
    recency until protected is down to a tenth of the cache. Costs: ProbationPolicy's, plus one stamp per key a load refreshes, and a comparison per victim
    while protected is over its room.
    """

    name = "adaptive"

    def _protect(self, keys, held=True):
        prob, prot = self._probation, self._protected
        if held and (not prob or prob.keys().isdisjoint(keys)):     # all protected already: lru's refresh,
            keys = keys[::-1]                                       # and the call's stamp (moving keeps the old)
            deque(map(prot.move_to_end, keys), maxlen=0)
            prot.update(zip(keys, repeat(self._clock)))
        else:
            super()._protect(keys, held)

    def victims(self, n, skip=None):
        prob, prot = self._probation, self._protected
        over = len(prot) - int(self.capacity - self._room)
        if over <= 0 or n <= 0:
            return super().victims(n, skip)
        young, old = oldest_of_two(prob, prot, n, over, skip)
        taken = young + take_oldest(prob, n - len(young) - len(old), skip)
        rest = old + take_oldest(prot, n - len(taken) - len(old), skip)
        self._remember(taken, rest)
        return taken + rest


class LapsPolicy(AdaptivePolicy):
    """adaptive, plus a second lap for protected keys named again while protected, as many of them as the
    misses they and the others cause say.

    While `room` is 0 (no load has shown that protected should give way: the case of a GPU cache that stores
    what it evicts), protected's victims are taken as under ProbationPolicy, least recent first, except that a
    key named again while protected (`hot`: stored again while held, or loaded) is passed over once: it goes
    to protected's most recent end and loses its mark (a lap: S3-FIFO's main queue and CLOCK's second chance,
    on top of lru's order). A block of a prefix read again and again (a popular document, a conversation
    continued turn after turn) then outlives blocks named once since they came back from the GPU.

    How many laps pay is learned, like ARC's target, from the ghosts of protected's victims: the return
    (a store of it as new while a ghost list names it) of a key that left protected without a lap says laps
    cost that key its place (`target` down), the return of one that left after its lap says one lap was not
    enough (`target` up). Each return moves `target` by room's step times the ratio of the other kind's
    ghosts to its own kind's (at least 1): returns are compared as rates, not counts, since keys that leave
    without a lap are most of them. Laps are given while the hot keys number at most `target` (0..capacity,
    capacity at first). While `room` is above 0, no laps: AdaptivePolicy's victims. While it is 0, a refresh
    of keys all protected moves them (lru's order) without AdaptivePolicy's stamp, which only victims taken
    while `room` is above 0 read (the same hit rates at all 70 points of docs/benchmarks.md).
    Measured choices (docs/benchmarks.md, "Eviction policies"; one set of constants for every trace): laps
    only while room is 0 (a lap for every marked key under no write-back as well loses 0.5-0.7 point to lru
    on the agent traces at 4,000 blocks); the target learned (a lap for every marked key loses 0.5-0.7 point
    to probation on the agent traces at 8,000 blocks with write-back), by rates (counts give up most of the
    gains); its step a 256th (a 64th gives up the gains, a 1,024th loses 0.45 point on a held-out trace).
    It is not the default: with write-back it is up to 0.31 point below probation on the agent and shifts
    traces at 8,000-32,000 blocks. Costs: AdaptivePolicy's, less its stamp while room is 0, plus a set update
    per refresh of protected keys and a move per lap; in the real call a load 1.09-1.15x lru's, a store
    1.03-1.09x.
    """

    name = "laps"
    LAP_STEP = 1 / 256      # target's move per return, in capacities (times the ratio of the ghosts' kinds)

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._lap_step = max(1.0, self.LAP_STEP * capacity)
        self._hot: set = set()          # protected keys named again while protected, since their last lap
        self._lapped: set = set()       # protected keys that had a lap (their ghosts say so)
        self._target = float(capacity)  # laps while len(hot) <= target
        self._kinds = [0, 0, 0]         # ghosts per origin (FROM_PROTECTED, -, AFTER_LAP): this generation ...
        self._old_kinds = [0, 0, 0]     # ... and the one before

    def _protect(self, keys, held=True):
        prob, prot = self._probation, self._protected
        if held and (not prob or prob.keys().isdisjoint(keys)):     # all protected already: all named again;
            self._hot.update(keys)                                  # lru's refresh, and adaptive's stamp only
            keys = keys[::-1]                                       # while stamps are read (room above 0)
            deque(map(prot.move_to_end, keys), maxlen=0)
            if self._room > 0:
                prot.update(zip(keys, repeat(self._clock)))
            return
        if prot and not prot.keys().isdisjoint(keys):
            self._hot |= prot.keys() & keys
        ProbationPolicy._protect(self, keys, held)

    def _returned(self, new):
        ghosts, old = self._ghosts, self._old_ghosts
        returned = ghosts.keys() & new if ghosts and not ghosts.keys().isdisjoint(new) else set()
        if old and not old.keys().isdisjoint(new):
            returned |= old.keys() & new
        if not returned:
            return returned
        kinds, old_kinds, target, step = self._kinds, self._old_kinds, self._target, self._lap_step
        for key in returned:
            origin = ghosts.pop(key, None)
            if origin is not None:
                kinds[origin] -= 1
            else:
                origin = old.pop(key)
                old_kinds[origin] -= 1
            without, after = kinds[FROM_PROTECTED] + old_kinds[FROM_PROTECTED], kinds[AFTER_LAP] + old_kinds[AFTER_LAP]
            if origin == FROM_PROTECTED:
                target -= step * max(1.0, after / max(without, 1))
            elif origin == AFTER_LAP:
                target += step * max(1.0, without / max(after, 1))
        self._target = min(max(target, 0.0), float(self.capacity))
        return returned

    def _take_protected(self, n, skip):
        """up to n of protected's keys, least recent first, a hot key passed over once (while laps pay)"""
        prot, hot = self._protected, self._hot
        if not hot or len(hot) > self._target or n <= 0:
            return take_oldest(prot, n, skip)
        out, lapped = [], self._lapped
        while len(out) < n:
            key = next((k for k in prot if skip is None or not skip(k)), None)
            if key is None:
                break
            if key in hot:                              # its lap: to the most recent end, unmarked
                hot.discard(key)
                lapped.add(key)
                del prot[key]
                prot[key] = self._clock
            else:
                del prot[key]
                out.append(key)
        return out

    def victims(self, n, skip=None):
        if self._room > 0:
            out = super().victims(n, skip)
        else:                                           # protected is within its room: probation first
            taken = take_oldest(self._probation, n, skip)
            rest = self._take_protected(n - len(taken), skip) if len(taken) < n else []
            out = taken + rest
            self._remember(taken, rest)
        return out

    def _remember(self, from_probation, from_protected):
        ghosts, kinds, hot, lapped = self._ghosts, self._kinds, self._hot, self._lapped
        if from_probation:
            ghosts.update(zip(from_probation, repeat(FROM_PROBATION)))
            kinds[FROM_PROBATION] += len(from_probation)
        for key in from_protected:
            hot.discard(key)
            if key in lapped:
                lapped.discard(key)
                ghosts[key] = AFTER_LAP
                kinds[AFTER_LAP] += 1
            else:
                ghosts[key] = FROM_PROTECTED
                kinds[FROM_PROTECTED] += 1
        if len(ghosts) >= self._generation:
            self._old_ghosts, self._ghosts = ghosts, {}
            self._old_kinds, self._kinds = kinds, [0, 0, 0]

    def remove(self, key):
        super().remove(key)
        self._hot.discard(key)
        self._lapped.discard(key)

    def clear(self):
        super().clear()
        for part in (self._hot, self._lapped):
            part.clear()
        self._target, self._kinds, self._old_kinds = float(self.capacity), [0, 0, 0], [0, 0, 0]


class ShadowPolicy(LapsPolicy):
    """laps, plus a shadow of the GPU cache above, read from the calls: where the GPU stores what it evicts,
    a block it still holds is a copy here that costs nothing to give up.

    Every request stores its whole chain (the GPU then holds it, head most recent), and a GPU that stores
    its evictions stores its least recent blocks. So the policy keeps the keys of the calls in lru order,
    each stamped with a count of the keys named so far (the shadow), and a floor: a store whose keys are
    all stamped above the floor and in the older half of the stamps above it is a write-back; the GPU no
    longer holds them, nor any key stamped before the newest of them, and the floor rises to it. Other
    stores enter the shadow, head most recent (the newest 1-2 capacities of keys are kept). A moving
    average of write-backs per store call (weight RATE) at ON or above says the GPU stores what it evicts.

    While it does, and protected is within its room (room 0, or room above 0 and protected not over
    `capacity - room`), the victims are probation's least recent (as ever: blocks the GPU holds), then the
    protected keys the shadow holds, the GPU's most recent first (the longest to wait for their write-back),
    then laps' protected order. A protected key given up while the GPU holds it is `lent`: its write-back
    brings it back to protected, however long the GPU keeps it (no ghost needed; its lap mark is kept).
    Otherwise (no write-backs, or protected over its room) the victims are laps'. With no write-backs,
    room moves by a 128th of the capacity per miss (NWB_STEP), twice probation's step: there the misses
    are the only evidence, and the 256th trails lru by up to 0.22 point.
    Measured choices (docs/benchmarks.md, "Eviction policies"): write-back evidence only for GPU-first
    order (with it on everywhere, the no-write-back figures lose up to 26 points, shifts at 8,000 blocks:
    the GPU drops its victims there); a write-back's keys protected only when they were lent or ghosts (protecting every write-back
    gains 2.8 points on agent at 2,000 blocks and loses 2.8 on documents); while room is above 0 and
    protected over it, adaptive's order (GPU-first there too loses 0.5 point on agent at 2,000 blocks).
    Costs: laps', plus per store call a lookup of its head and an insert per key (a plain dict: its order
    is the stamps'; a head not in it means new keys, inserted with no look before, the count showing any
    that were there), a rebuild of the newest capacity of keys each time it holds more than two, and per
    victims call under write-back a scan of the shadow from its most recent end down to the floor. In the
    real call (`python benchmarks/tier_bench.py --policy lru,laps,shadow`) a store 1.19-1.26x lru's, a load
    1.02-1.17x (over the 1.2x a default may cost; laps' store 1.05-1.10x in the same runs: the insert per
    key is most of the difference, and exact write-back reading needs it, since any key can head a store).
    Not the default: at 2,000 and 4,000 blocks it is strictly above lru, arc and probation at 13 of 28 points.
    """

    name = "shadow"
    NWB_STEP = 1 / 128      # room's move per miss while no write-backs are seen, in capacities
    RATE = 1 / 64           # the write-back average's weight per store call
    ON = 0.1                # write-backs per store call from which the GPU's blocks go first

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._shadow: dict = {}                     # key -> stamp, in stamp order: above the floor, the keys
        #                                             the GPU holds as the calls show it
        self._tick = 0                              # keys named by store calls that were not write-backs
        self._floor = 0                             # the newest stamp the GPU has let go
        self._backs = 0.0                           # write-backs per store call (a moving average)
        self._lent: set = set()                     # protected keys given up while the GPU held them
        self._steps = (max(1.0, self.NWB_STEP * capacity), max(1.0, self.STEP * capacity))  # room's, by
        #                                             whether write-backs are seen

    def write_back_seen(self) -> bool:
        """whether the calls show a GPU that stores what it evicts"""
        return self._backs >= self.ON

    def stored(self, keys, new):
        shadow, floor, tick, back = self._shadow, self._floor, self._tick, False
        head = shadow.get(keys[0], 0) if keys else 0
        if head > floor:
            stamps = list(map(shadow.get, keys, repeat(0)))
            newest = max(stamps)                # all in the shadow, all in the older half of its stamps:
            back = min(stamps) > floor and tick - newest > (tick - floor) // 2     # a write-back
        self._backs += (back - self._backs) * self.RATE
        if back:                                # the GPU let these go, and whatever it used before them
            self._floor = newest
        elif keys:                              # to the most recent end, head last (stamps stay sorted)
            stamps = range(tick + 1, tick + 1 + len(keys))
            again = head                        # named again (the head at least)
            if not head:                        # new keys, the common case: in with no look before; the
                before = len(shadow)            # count says whether any was there after all (kept its place)
                shadow.update(zip(reversed(keys), stamps))
                again = len(shadow) - before != len(keys)
            if again:                           # out first, then in at the most recent end
                deque(map(shadow.pop, keys, repeat(None)), maxlen=0)
                shadow.update(zip(reversed(keys), stamps))
            self._tick = tick + len(keys)
            if len(shadow) > 2 * self.capacity:     # bounded: the newest capacity of keys are kept
                self._shadow = shadow = dict(islice(shadow.items(), len(shadow) - self.capacity, None))
                self._lent.intersection_update(shadow)
        self._step = self._steps[1] if self.write_back_seen() else self._steps[0]
        super().stored(keys, new)

    def _returned(self, new):
        returned = super()._returned(new)
        lent = self._lent
        if lent and not lent.isdisjoint(new):       # given up while the GPU held it, now stored back
            back = lent.intersection(new)
            lent -= back
            returned = set(returned) | back
        return returned

    def victims(self, n, skip=None):
        if n <= 0 or not self.write_back_seen() or (
                self._room > 0 and len(self._protected) > int(self.capacity - self._room)):
            return super().victims(n, skip)
        taken = take_oldest(self._probation, n, skip)
        held, prot = [], self._protected
        if len(taken) < n:
            floor = self._floor
            for key, stamp in reversed(self._shadow.items()):   # the GPU's most recent first
                if stamp <= floor:
                    break
                if key in prot and (skip is None or not skip(key)):
                    held.append(key)
                    if len(held) + len(taken) == n:
                        break
            deque(map(prot.__delitem__, held), maxlen=0)
            self._lent.update(held)
        rest = self._take_protected(n - len(taken) - len(held), skip)
        self._remember(taken, rest)
        return taken + held + rest

    def remove(self, key):
        super().remove(key)
        self._lent.discard(key)

    def clear(self):
        super().clear()
        self._shadow.clear()
        self._lent.clear()
        self._tick, self._floor, self._backs = 0, 0, 0.0


def oldest_of_two(first: OrderedDict, second: OrderedDict, n: int, limit: int, skip=None):
    """Up to n keys, each the older (by value; ties: second's) of the two dicts' least recent keys for which
    skip(key) is not true, at most `limit` of them from second; taken out of both. Returns (from first,
    from second)."""
    def free(entries):
        for key in entries:
            if skip is None or not skip(key):
                return key
        return None
    a, b = iter(first), iter(second)
    head_a, head_b = free(a), free(b)
    out_a, out_b = [], []
    while len(out_a) + len(out_b) < n and len(out_b) < limit and head_b is not None:
        if head_a is not None and first[head_a] < second[head_b]:
            out_a.append(head_a)
            head_a = free(a)
        else:
            out_b.append(head_b)
            head_b = free(b)
    deque(map(first.__delitem__, out_a), maxlen=0)
    deque(map(second.__delitem__, out_b), maxlen=0)
    return out_a, out_b


POLICIES = {"lru": LruPolicy, "arc": ArcPolicy, "probation": ProbationPolicy, "adaptive": AdaptivePolicy,
            "laps": LapsPolicy, "shadow": ShadowPolicy}


def make_policy(name: str, capacity: int):
    """A policy by name for a cache of `capacity` keys; ValueError naming the choices."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}: choose one of {', '.join(sorted(POLICIES))}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"an eviction policy needs a positive capacity, got {capacity!r}")
    return POLICIES[name](capacity)
