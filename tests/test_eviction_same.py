"""The laps and shadow policies (fastcache/eviction.py) decide exactly as their plain reference below: the same
victims, in the same order, at every call of long call sequences.

The reference is the policies' straightforward bookkeeping, kept here as it stands (a store into the shadow
looks for the call's keys there before it inserts them; every victims call goes through each class's own
steps); eviction.py keeps the same rules with fewer steps. The sequences: the trace model
(fastcache.tools.trace_model.simulate, which drives a policy as TieredCache does) over generated traces of the
three shapes, with and without write-back and with an L3, at tiers that evict all the time; and random calls
with skipped (pinned) keys, loads, write-backs that come and go, removals and clears. Each run checks that it
reached the rules it is meant to compare (write-backs seen, lent keys, the shadow cut, room above 0, laps
given), and a policy perturbed by one constant or one key is told apart: the comparison can see a
difference."""
from __future__ import annotations

from collections import OrderedDict, deque
from itertools import islice, repeat

import numpy as np
import pytest

from fastcache.eviction import AFTER_LAP, FROM_PROBATION, FROM_PROTECTED, LapsPolicy, ShadowPolicy
from fastcache.tools import trace_gen
from fastcache.tools.trace_model import simulate

# -- the reference: the policies' plain bookkeeping (docstrings in fastcache/eviction.py) --------------------------

def take_oldest(entries: OrderedDict, n: int, skip=None) -> list:
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


class Probation:
    name = 'probation'
    GHOSTS = 0.5
    STEP = 1 / 256

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._probation: OrderedDict = OrderedDict()
        self._protected: OrderedDict = OrderedDict()
        self._ghosts: dict = {}
        self._old_ghosts: dict = {}
        self._generation = max(1, int(self.GHOSTS * capacity))
        self._room = 0.0
        self._step = max(1.0, self.STEP * capacity)
        self._last_read = None
        self._clock = 0

    def __len__(self):
        return len(self._probation) + len(self._protected)

    def __contains__(self, key):
        return key in self._probation or key in self._protected

    def _protect(self, keys, held=True):
        prob, prot = (self._probation, self._protected)
        if held and (not prob or prob.keys().isdisjoint(keys)):
            deque(map(prot.move_to_end, reversed(keys)), maxlen=0)
            return
        keys = keys[::-1]
        if held and prot.keys().isdisjoint(keys):
            deque(map(prob.__delitem__, keys), maxlen=0)
        else:
            deque(map(prob.pop, keys, repeat(None)), maxlen=0)
            deque(map(prot.pop, keys, repeat(None)), maxlen=0)
        prot.update(zip(keys, repeat(self._clock)))

    def _returned(self, new):
        ghosts, old = (self._ghosts, self._old_ghosts)
        returned = ghosts.keys() & new if ghosts and (not ghosts.keys().isdisjoint(new)) else set()
        if old and (not old.keys().isdisjoint(new)):
            returned |= old.keys() & new
        if returned:
            deque(map(ghosts.pop, returned, repeat(None)), maxlen=0)
            deque(map(old.pop, returned, repeat(None)), maxlen=0)
        return returned

    def _missed(self, keys):
        last, self._last_read = (self._last_read, None)
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
        if len(new) == len(keys) and (not returned):
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
        prob, prot = (self._probation, self._protected)
        over = len(prot) - int(self.capacity - self._room)
        first = take_oldest(prot, min(n, over), skip)
        taken = take_oldest(prob, n - len(first), skip)
        rest = take_oldest(prot, n - len(first) - len(taken), skip)
        self._remember(taken, first + rest)
        return first + taken + rest

    def _remember(self, from_probation, from_protected):
        ghosts = self._ghosts
        if from_probation:
            ghosts.update(zip(from_probation, repeat(FROM_PROBATION)))
        if from_protected:
            ghosts.update(zip(from_protected, repeat(FROM_PROTECTED)))
        if len(ghosts) >= self._generation:
            self._old_ghosts, self._ghosts = (ghosts, {})

    def remove(self, key):
        if key in self._probation:
            del self._probation[key]
        else:
            self._protected.pop(key, None)

    def clear(self):
        for part in (self._probation, self._protected, self._ghosts, self._old_ghosts):
            part.clear()
        self._room, self._last_read = (0.0, None)


class Adaptive(Probation):
    name = 'adaptive'

    def _protect(self, keys, held=True):
        prob, prot = (self._probation, self._protected)
        if held and (not prob or prob.keys().isdisjoint(keys)):
            keys = keys[::-1]
            deque(map(prot.move_to_end, keys), maxlen=0)
            prot.update(zip(keys, repeat(self._clock)))
        else:
            super()._protect(keys, held)

    def victims(self, n, skip=None):
        prob, prot = (self._probation, self._protected)
        over = len(prot) - int(self.capacity - self._room)
        if over <= 0 or n <= 0:
            return super().victims(n, skip)
        young, old = oldest_of_two(prob, prot, n, over, skip)
        taken = young + take_oldest(prob, n - len(young) - len(old), skip)
        rest = old + take_oldest(prot, n - len(taken) - len(old), skip)
        self._remember(taken, rest)
        return taken + rest


class Laps(Adaptive):
    name = 'laps'
    LAP_STEP = 1 / 256

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._lap_step = max(1.0, self.LAP_STEP * capacity)
        self._hot: set = set()
        self._lapped: set = set()
        self._target = float(capacity)
        self._kinds = [0, 0, 0]
        self._old_kinds = [0, 0, 0]

    def _protect(self, keys, held=True):
        prob, prot = (self._probation, self._protected)
        if held and (not prob or prob.keys().isdisjoint(keys)):
            self._hot.update(keys)
            keys = keys[::-1]
            deque(map(prot.move_to_end, keys), maxlen=0)
            if self._room > 0:
                prot.update(zip(keys, repeat(self._clock)))
            return
        if prot and (not prot.keys().isdisjoint(keys)):
            self._hot |= prot.keys() & keys
        Probation._protect(self, keys, held)

    def _returned(self, new):
        ghosts, old = (self._ghosts, self._old_ghosts)
        returned = ghosts.keys() & new if ghosts and (not ghosts.keys().isdisjoint(new)) else set()
        if old and (not old.keys().isdisjoint(new)):
            returned |= old.keys() & new
        if not returned:
            return returned
        kinds, old_kinds, target, step = (self._kinds, self._old_kinds, self._target, self._lap_step)
        for key in returned:
            origin = ghosts.pop(key, None)
            if origin is not None:
                kinds[origin] -= 1
            else:
                origin = old.pop(key)
                old_kinds[origin] -= 1
            without = kinds[FROM_PROTECTED] + old_kinds[FROM_PROTECTED]
            after = kinds[AFTER_LAP] + old_kinds[AFTER_LAP]
            if origin == FROM_PROTECTED:
                target -= step * max(1.0, after / max(without, 1))
            elif origin == AFTER_LAP:
                target += step * max(1.0, without / max(after, 1))
        self._target = min(max(target, 0.0), float(self.capacity))
        return returned

    def _take_protected(self, n, skip):
        prot, hot = (self._protected, self._hot)
        if not hot or len(hot) > self._target or n <= 0:
            return take_oldest(prot, n, skip)
        out, lapped = ([], self._lapped)
        while len(out) < n:
            key = next((k for k in prot if skip is None or not skip(k)), None)
            if key is None:
                break
            if key in hot:
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
        else:
            taken = take_oldest(self._probation, n, skip)
            rest = self._take_protected(n - len(taken), skip)
            out = taken + rest
            self._remember(taken, rest)
        return out

    def _remember(self, from_probation, from_protected):
        ghosts, kinds, hot, lapped = (self._ghosts, self._kinds, self._hot, self._lapped)
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
            self._old_ghosts, self._ghosts = (ghosts, {})
            self._old_kinds, self._kinds = (kinds, [0, 0, 0])

    def remove(self, key):
        super().remove(key)
        self._hot.discard(key)
        self._lapped.discard(key)

    def clear(self):
        super().clear()
        for part in (self._hot, self._lapped):
            part.clear()
        self._target, self._kinds, self._old_kinds = (float(self.capacity), [0, 0, 0], [0, 0, 0])


class Shadow(Laps):
    name = 'shadow'
    NWB_STEP = 1 / 128
    RATE = 1 / 64
    ON = 0.1

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._shadow: dict = {}
        self._tick = 0
        self._floor = 0
        self._backs = 0.0
        self._lent: set = set()

    def write_back_seen(self) -> bool:
        return self._backs >= self.ON

    def stored(self, keys, new):
        shadow, floor, tick, back = (self._shadow, self._floor, self._tick, False)
        if keys and shadow.get(keys[0], 0) > floor:
            stamps = [shadow.get(k, 0) for k in keys]
            newest = max(stamps)
            back = min(stamps) > floor and tick - newest > (tick - floor) // 2
        self._backs += (back - self._backs) * self.RATE
        if back:
            self._floor = newest
        elif keys:
            if not shadow.keys().isdisjoint(keys):
                deque(map(shadow.pop, keys, repeat(None)), maxlen=0)
            shadow.update(zip(reversed(keys), range(tick + 1, tick + 1 + len(keys))))
            self._tick = tick + len(keys)
            if len(shadow) > 2 * self.capacity:
                self._shadow = shadow = dict(islice(shadow.items(), len(shadow) - self.capacity, None))
                self._lent.intersection_update(shadow)
        self._step = max(1.0, (self.STEP if self.write_back_seen() else self.NWB_STEP) * self.capacity)
        super().stored(keys, new)

    def _returned(self, new):
        returned = super()._returned(new)
        lent = self._lent
        if lent and (not lent.isdisjoint(new)):
            back = lent.intersection(new)
            lent -= back
            returned = set(returned) | back
        return returned

    def victims(self, n, skip=None):
        if n <= 0 or not self.write_back_seen() or (
                self._room > 0 and len(self._protected) > int(self.capacity - self._room)):
            return super().victims(n, skip)
        taken = take_oldest(self._probation, n, skip)
        held, prot = ([], self._protected)
        if len(taken) < n:
            floor = self._floor
            for key, stamp in reversed(self._shadow.items()):
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
        self._tick, self._floor, self._backs = (0, 0, 0.0)


def oldest_of_two(first: OrderedDict, second: OrderedDict, n: int, limit: int, skip=None):

    def free(entries):
        for key in entries:
            if skip is None or not skip(key):
                return key
        return None
    a, b = (iter(first), iter(second))
    head_a, head_b = (free(a), free(b))
    out_a, out_b = ([], [])
    while len(out_a) + len(out_b) < n and len(out_b) < limit and (head_b is not None):
        if head_a is not None and first[head_a] < second[head_b]:
            out_a.append(head_a)
            head_a = free(a)
        else:
            out_b.append(head_b)
            head_b = free(b)
    deque(map(first.__delitem__, out_a), maxlen=0)
    deque(map(second.__delitem__, out_b), maxlen=0)
    return (out_a, out_b)



REFERENCE = {"laps": (LapsPolicy, Laps), "shadow": (ShadowPolicy, Shadow)}


class Twin:
    """A policy that runs an implementation and a reference side by side on every call, and fails at the first
    victims call where they differ; it counts what the calls reached."""

    def __init__(self, fast, plain):
        self.fast, self.plain, self.capacity = fast, plain, fast.capacity
        self.calls, self.cuts, self.reached = 0, 0, set()

    def __len__(self):
        assert len(self.fast) == len(self.plain)
        return len(self.fast)

    def __contains__(self, key):
        held = key in self.fast
        assert held == (key in self.plain), f"key {key} held by one only, after {self.calls} victims calls"
        return held

    def stored(self, keys, new):
        shadow = getattr(self.plain, "_shadow", None)
        self.fast.stored(keys, new)
        self.plain.stored(keys, new)
        self.cuts += shadow is not None and shadow is not self.plain._shadow    # rebuilt from its newest keys

    def touched(self, keys):
        self.fast.touched(keys)
        self.plain.touched(keys)

    def victims(self, n, skip=None):
        self.calls += 1
        out = self.fast.victims(n, skip)
        expected = self.plain.victims(n, skip)
        assert out == expected, f"victims differ at victims call {self.calls}: {out} != {expected}"
        plain = self.plain
        self.reached.update(name for name, seen in (
            ("room above 0", plain._room > 0), ("laps", bool(plain._lapped)),
            ("write-backs", isinstance(plain, Shadow) and plain.write_back_seen()),
            ("lent", isinstance(plain, Shadow) and bool(plain._lent))) if seen)
        return out

    def remove(self, key):
        self.fast.remove(key)
        self.plain.remove(key)

    def clear(self):
        self.fast.clear()
        self.plain.clear()


def twin(name, capacity, fast=None):
    cls, plain = REFERENCE[name]
    return Twin((fast or cls)(capacity), plain(capacity))


def replay(pol, shape, write_back, l3=False, requests=4000, seed=5, gpu_blocks=300):
    trace = [r["hash_ids"] for r in trace_gen.generate(shape, requests=requests, seed=seed)]
    return simulate(trace, gpu_blocks, pol.capacity, l3=l3, policy=pol, write_back=write_back).rates()["hit_rate"]


@pytest.mark.parametrize("name", sorted(REFERENCE))
@pytest.mark.parametrize("write_back", [True, False])
def test_the_same_victims_as_the_reference_on_the_trace_model(name, write_back):
    """Each shape at a tier twice its GPU, five times with an L3 below, and a third of it (the GPU keeps
    blocks longer than the shadow does)."""
    reached = set()
    for shape in trace_gen.SHAPES:
        for capacity, gpu_blocks, l3 in ((600, 300, False), (1500, 300, True), (300, 900, False)):
            pol = twin(name, capacity)
            rate = replay(pol, shape, write_back, l3=l3, gpu_blocks=gpu_blocks)
            assert pol.calls > 1000 and 0 < rate < 1
            reached |= pol.reached
            if name == "shadow":
                assert pol.cuts > 10                    # the shadow was cut many times
    assert {"laps"} <= reached
    if name == "shadow":
        assert ({"write-backs", "lent"} <= reached) == write_back
    if not write_back:
        assert "room above 0" in reached


def random_calls(pol, steps=30000):
    """Random chains (fresh, or continuing a recent one) under a GPU that stores what it evicts (40 keys, then
    400 for a while: its write-backs stop, then 40 again):
    stores with skipped (pinned) keys, loads, write-backs, chains named long ago stored again, removals, and
    now and then a clear."""
    rng = np.random.default_rng(11)
    capacity, fresh = pol.capacity, iter(range(10**9))
    held, chains, gpu = set(), [], OrderedDict()
    for step in range(steps):
        roll = rng.random()
        if roll < 0.0005:
            pol.clear()
            held.clear()
            continue
        if roll < 0.01 and held:
            key = sorted(held)[int(rng.integers(len(held)))]
            pol.remove(key)
            held.discard(key)
            continue
        size = 40 if step // 1500 % 2 else 400      # the GPU's keys: its write-backs come and go
        if len(gpu) > size:                         # a write-back: the GPU's least recent keys, most recent first
            keys = [gpu.popitem(last=False)[0] for _ in range(min(len(gpu) - size, 8))][::-1]
        elif roll < 0.02 and len(chains) > 60:      # a chain named long ago, stored again
            keys = chains[-int(rng.integers(16, 60))]
        else:
            base = chains[-int(rng.integers(1, min(len(chains), 30) + 1))] if chains and roll < 0.5 else []
            keys = base[:int(rng.integers(len(base) + 1))] + list(islice(fresh, int(rng.integers(1, 10))))
            chains.append(keys)
            gpu.update(zip(reversed(keys), repeat(None)))
            deque(map(gpu.move_to_end, reversed(keys)), maxlen=0)
            read = keys[:next((i for i, k in enumerate(keys) if k not in held), len(keys))]
            if read and roll > 0.75:
                pol.touched(read)
        new = [k for k in keys if k not in held]
        over = len(new) - (capacity - len(held))
        if over > 0:
            pinned = set(keys) | {k for k in held if k % 9 == int(rng.integers(9))}
            out = pol.victims(over, pinned.__contains__)
            held -= set(out)
            if len(out) < over:
                dropped = set(new[len(new) - (over - len(out)):])
                new = [k for k in new if k not in dropped]
                keys = [k for k in keys if k not in dropped]
        pol.stored(keys, new)
        held |= set(new)
        assert len(pol) == len(held)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_the_same_victims_as_the_reference_on_random_calls(name):
    pol = twin(name, 48)
    random_calls(pol)
    assert pol.calls > 5000 and "laps" in pol.reached
    if name == "shadow":
        assert {"write-backs", "lent"} <= pol.reached and pol.cuts > 100


class CutsOneMore(ShadowPolicy):
    """a shadow that keeps one key fewer than the newest capacity when it is cut"""

    def stored(self, keys, new):
        shadow = self._shadow
        super().stored(keys, new)
        if self._shadow is not shadow:
            del self._shadow[next(iter(self._shadow))]


def test_a_perturbed_policy_is_told_apart():
    """One constant or one key of difference is seen: room's step (shadow's with no write-back, laps'), a
    shadow cut one key further."""
    for name, perturbed, shape in (("shadow", type("Shadow", (ShadowPolicy,), {"NWB_STEP": 1 / 127}), "documents"),
                                   ("laps", type("Laps", (LapsPolicy,), {"STEP": 1 / 255}), "agent")):
        with pytest.raises(AssertionError, match="victims differ"):
            replay(twin(name, 600, fast=perturbed), shape, write_back=False)
    with pytest.raises(AssertionError, match="victims differ"):
        random_calls(twin("shadow", 48, fast=CutsOneMore))
