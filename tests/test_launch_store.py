"""python -m fastcache.launch --store: the launcher's prefix-reuse workload over a store below the CPU tier
(write-back of evicted entries, store hits fetched and verified) and a bulk put/get of CPU blocks."""
import json

import pytest

from test_launch import launch
from test_trace_l3 import needs_mooncake


@pytest.mark.parametrize("store", ["file", pytest.param("mooncake", marks=needs_mooncake)])
def test_launch_with_a_store_serves_and_verifies_store_hits(tmp_path, store):
    out = tmp_path / "r.json"
    run = launch("--store", store, "--duration", "0.3", "--prefix-requests", "150", "--latency-samples", "20",
                 "--rl-cycles", "0", "--json", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["store"].startswith(store) and report["checks_failed"] == []
    assert report["prefix_l3_loaded"] > 0 and report["prefix_l3_written"] > 0
    assert report["l3_put_gbps"] > 0 and report["l3_get_gbps"] > 0
    assert "store (L3)" in run.stdout and "PASSED" in run.stdout


def test_launch_refuses_a_bad_store_url():
    run = launch("--store", "ftp://host/x")
    assert run.returncode == 2 and "expected mooncake://HOST:PORT or file:///DIR" in run.stderr
