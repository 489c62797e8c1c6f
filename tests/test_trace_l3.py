"""The trace replay with a store below the CPU tier (python -m fastcache.tools.trace --store ...), and its
model: with a store that never evicts, every block ever stored is somewhere below the GPU, so the replay
must reach the infinite-cache limit, and equal the model request by request."""
import importlib.util
import json
import os

import pytest

from fastcache.tools.trace_model import infinite, load_trace, simulate
from test_trace import REPLAY, TRACE, needs_trace, run_tool

needs_mooncake = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None
                                    and os.environ.get("FASTCACHE_REQUIRE_MOONCAKE") != "1",
                                    reason="Mooncake not installed (pip install 'fastcache[mooncake]')")


def test_model_with_a_store_by_hand():
    requests = [[1, 2], [3, 4], [1, 2]]
    # 3, 4 push 1, 2 off the GPU into the CPU tier of 2 blocks, and out of it when 3, 4 are stored: without a
    # store the third request misses, with one it finds both there and brings them back up
    assert simulate(requests, 2, 2).cpu == [0, 0, 0]
    hits = simulate(requests, 2, 2, l3=True)
    assert (hits.gpu, hits.cpu, hits.l3) == ([0, 0, 0], [0, 0, 0], [0, 0, 2])
    assert hits.rates()["hit_rate"] == infinite(requests).rates()["hit_rate"] == 2 / 6


@needs_trace
def test_model_with_a_store_reaches_the_infinite_cache_on_the_conversation_trace():
    trace = load_trace(TRACE)
    limit = infinite(trace.requests).rates()["hit_rate"]
    with_store = simulate(trace.requests, 1000, 2000, l3=True).rates()
    assert with_store["hit_rate"] == pytest.approx(limit, abs=1e-12) and round(limit, 3) == 0.366
    assert with_store["l3_hit_rate"] > 0.25 and simulate(trace.requests, 1000, 2000).rates()["hit_rate"] < 0.09


@pytest.mark.parametrize("store", ["file", pytest.param("mooncake", marks=needs_mooncake)])
def test_replay_with_a_store_equals_the_model_and_the_infinite_cache(tmp_path, store):
    out = tmp_path / "r.json"
    run = run_tool("--trace", REPLAY, "--requests", "400", "--gpu-blocks", "300", "--cpu-blocks", "400",
                   "--store", store, "--num-layers", "1", "--head-dim", "4", "--json", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["equal_to_model"] and report["verification_failures"] == 0 and report["shm_leftovers"] == []
    rates = report["replay"]
    assert rates["l3_hits"] > 0 and rates["hit_rate"] == pytest.approx(report["infinite_hit_rate"])
    tier = report["tier"]
    assert tier["l3_loaded_blocks"] == rates["l3_hits"] and tier["l3_written_blocks"] > 0 and tier["l3_errors"] == 0
    assert report["verified_blocks"] == rates["gpu_hits"] + rates["cpu_hits"] + rates["l3_hits"]
    assert report["store"].startswith(store) and f"store           {store}://" in run.stdout


def test_a_bad_store_url_is_refused_before_anything_starts():
    run = run_tool("--trace", REPLAY, "--store", "s3://bucket")
    assert run.returncode == 2 and "expected mooncake://HOST:PORT or file:///DIR" in run.stderr
