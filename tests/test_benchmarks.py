"""The development benchmarks under benchmarks/ run and report (on sim, with few samples): they use the
package's public names only, and a rename that breaks one fails here rather than on a GPU machine."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script,args,expect", [
    ("tier_bench.py", ["--samples", "20"], "store adds"),
    ("tier_bench.py", ["--samples", "5", "--policy", "lru,arc,probation"], "x lru's in the same run"),
    ("queue_floor.py", ["--samples", "100"], "round trip p50"),
    ("task_bench.py", ["--tp", "1", "--tasks", "200"], "wrong blocks 0"),
    ("index_floor.py", ["--samples", "10"], "TieredCache.store"),
    ("layer_bench.py", ["--layers", "4", "--blocks", "16", "--runs", "2"], "layer 0 in place"),
    ("offload_bench.py", ["--layers", "4", "--hidden", "64", "--batch", "4", "--runs", "1"], "50% offloaded"),
])
def test_benchmark_runs_and_reports(script, args, expect):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert expect in done.stdout
