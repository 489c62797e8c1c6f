"""The laps and shadow policies (fastcache/eviction.py) decide exactly as their plain form below: the same
victims, in the same order, at every call of long call sequences.

eviction.py shortens two steps: shadow inserts a store's new keys with no look for them first (the dict's size
shows any that were there), and laps skips protected when probation gave every victim. The reference is each
policy with those two steps in their plain form. The sequences: the trace model
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

from fastcache.eviction import AdaptivePolicy, LapsPolicy, ShadowPolicy, take_oldest
from fastcache.tools import trace_gen
from fastcache.tools.trace_model import simulate

# -- the reference: the policies with the plain form of the two steps eviction.py shortens ---------------------

class Laps(LapsPolicy):
    """laps, taking from protected even when probation gave every victim (a call for none)"""

    def victims(self, n, skip=None):
        if self._room > 0:
            return AdaptivePolicy.victims(self, n, skip)
        taken = take_oldest(self._probation, n, skip)
        rest = self._take_protected(n - len(taken), skip)
        self._remember(taken, rest)
        return taken + rest


class Shadow(ShadowPolicy):
    """shadow, looking for a store's keys in the shadow before it inserts them, and computing room's step"""

    def stored(self, keys, new):
        shadow, floor, tick, back = self._shadow, self._floor, self._tick, False
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
        LapsPolicy.stored(self, keys, new)


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
