"""The eviction policies (fastcache/eviction.py) on their interface, and the trace model's Belady ceiling.

Every policy: never returns a key its owner skips, never returns more than asked or a key it does not hold,
forgets what it returns, and a chain stored in one call goes from its tail. Each policy's own rule is
checked against a hand-worked case, and the prefix policy's learning against a workload where one class of
keys comes back and another never does."""
from __future__ import annotations

import numpy as np
import pytest

from fastcache.eviction import DEFAULT_POLICY, POLICIES, ArcPolicy, LruPolicy, PrefixPolicy, make_policy
from fastcache.tools.trace_model import infinite, simulate


def chain(start, n):
    return list(range(start, start + n))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_keeps_the_interfaces_rules(name):
    rng = np.random.default_rng(7)
    policy = make_policy(name, 64)
    held = set()
    for step in range(400):
        keys = [int(k) for k in rng.choice(200, int(rng.integers(1, 12)), replace=False)]
        if rng.random() < 0.3 and held:
            read = [k for k in keys if k in held]
            policy.touched(read)
            continue
        new = [k for k in keys if k not in held]
        over = len(new) - (64 - len(held))
        if over > 0:
            skip = set(keys) | {k for k in held if k % 7 == 0}     # the call's keys and some "pinned" ones
            out = policy.victims(over, skip.__contains__)
            assert len(out) <= over and len(set(out)) == len(out)
            assert not set(out) & skip, "a skipped key was evicted"
            assert set(out) <= held, "evicted a key it did not hold"
            held -= set(out)
            if len(out) < over:
                dropped = set(new[len(new) - (over - len(out)):])
                new = [k for k in new if k not in dropped]
                keys = [k for k in keys if k not in dropped]
        policy.stored(keys, new)
        held |= set(new)
        assert len(policy) == len(held) and all(k in policy for k in held)
    victim = next(iter(held))
    policy.remove(victim)
    assert victim not in policy and len(policy) == len(held) - 1
    policy.clear()
    assert len(policy) == 0 and policy.victims(3) == []


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_chain_goes_from_its_tail(name):
    """A chain stored in one call loses its tail before its head (a tail without its head is useless)."""
    policy = make_policy(name, 16)
    keys = chain(100, 6)
    policy.stored(keys, keys)
    out = policy.victims(5)
    assert 100 not in out and sorted(out) == keys[1:]
    assert out == keys[:0:-1]


def test_lru_takes_the_least_recently_used_and_refreshes_head_last():
    lru = LruPolicy(8)
    lru.stored([1, 2, 3], [1, 2, 3])
    lru.stored([4, 5], [4, 5])
    lru.touched([1, 2])                     # 2, then 1: the head most recent
    lru.stored([5, 6], [6])                 # 5 held (refreshed), 6 new
    assert lru.victims(6) == [3, 4, 2, 1, 6, 5]


def test_arc_moves_a_reread_key_to_t2_and_a_ghost_hit_moves_the_target():
    arc = ArcPolicy(4)
    arc.stored([1, 2, 3], [1, 2, 3])
    arc.touched([1])                        # read again: T2
    assert list(arc.t2) == [1] and 1 not in arc.t1
    arc.stored([2], [])                     # a store of a held key is not a second access
    assert 2 in arc.t1
    assert arc.victims(1) == [3]            # T1 is above its target (0): T1's least recent
    assert 3 in arc.b1
    arc.stored([3], [3])                    # back from B1: T1's target grows
    assert arc.target_t1 >= 1 and 3 in arc.t1 and 3 not in arc.b1


def test_prefix_learns_which_class_comes_back():
    """Two kinds of chains, told apart by how many keys a call adds: conversations that start with 2 keys
    and are continued again and again (2 keys a turn), and one-shot chains of 20 keys that nothing asks for
    again. With a capacity that cannot hold both, the prefix policy evicts the one-shot keys first and keeps
    the conversations; LRU, blind to the difference, evicts whichever is older. The hit rates of the two
    differ by more than the margin (so the oracle can see the property)."""
    def run(policy):
        rng = np.random.default_rng(3)
        hits = asked = 0
        next_key, live = 1, []
        for _ in range(4000):
            roll = rng.random()
            if live and roll < 0.5:
                keys = live.pop(int(rng.integers(len(live))))
                asked += len(keys)
                n = 0
                while n < len(keys) and keys[n] in policy:
                    n += 1
                hits += n
                if n:
                    policy.touched(keys[:n])
                add = 2
            else:
                keys, add = [], 2 if roll < 0.7 else 20
            call = keys + list(range(next_key, next_key + add))
            next_key += add
            new = [k for k in call if k not in policy]
            over = len(new) - (policy.capacity - len(policy))
            if over > 0:
                protect = set(call)
                got = policy.victims(over, protect.__contains__)
                if len(got) < over:
                    drop = set(new[len(new) - (over - len(got)):])
                    new = [k for k in new if k not in drop]
                    call = [k for k in call if k not in drop]
            policy.stored(call, new)
            if add == 2 and len(call) < 24:
                live.append(call)
        return hits / asked
    prefix, lru = run(PrefixPolicy(300)), run(LruPolicy(300))
    assert prefix > lru + 0.02, (prefix, lru)         # seeded: 14.4% against 11.8%


def test_unknown_policy_and_bad_capacity_are_refused():
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'.*arc, lru, prefix"):
        make_policy("mru", 8)
    with pytest.raises(ValueError, match="positive capacity"):
        make_policy("lru", 0)
    assert DEFAULT_POLICY in POLICIES


def test_belady_is_a_ceiling_and_equals_the_infinite_cache_when_everything_fits():
    rng = np.random.default_rng(11)
    requests, roots = [], []
    for i in range(300):                # conversations: a chain continued later, under a shared root
        base = roots.pop(int(rng.integers(len(roots)))) if roots and rng.random() < 0.5 else [0]
        h = base + [1000 + 10 * i + j for j in range(int(rng.integers(1, 6)))]
        requests.append(h)
        if len(h) < 20:
            roots.append(h)
    total = sum(map(len, requests))
    rates = {p: simulate(requests, 24, 16, policy=p).rates()["hit_rate"] for p in (*POLICIES, "belady")}
    assert all(rates["belady"] >= rates[p] for p in POLICIES), rates
    assert rates["belady"] > rates["lru"], "the ceiling should see what LRU cannot (else the test cannot fail)"
    big = simulate(requests, 24, total, policy="belady").rates()["hit_rate"]
    assert big == pytest.approx(infinite(requests).rates()["hit_rate"])


def test_policy_report_compares_every_policy_with_the_ceiling(tmp_path, capsys):
    from fastcache.tools import policy_report, trace_gen
    path = tmp_path / "agent.jsonl"
    trace_gen.write(trace_gen.generate("agent", requests=400, seed=1), str(path))
    out = tmp_path / "report.json"
    assert policy_report.main(["--trace", str(path), "--capacities", "300,600", "--gpu-blocks", "200",
                               "--json", str(out)]) == 0
    import json
    result = json.loads(out.read_text())["agent.jsonl"]
    for rates in result["capacities"].values():
        assert set(rates) == {*POLICIES, "belady"}
        assert all(0 < rates[p] <= rates["belady"] <= result["infinite"] for p in POLICIES)
    assert "belady" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        policy_report.main(["--trace", str(path), "--capacities", "100", "--gpu-blocks", "200"])
