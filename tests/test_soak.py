"""python -m fastcache.tools.soak: a few seconds of the soak run, its summary and its exit status."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

from fastcache.tools.soak import MIB, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def soak(tmp_path, *args, env=None, timeout=120):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "fastcache.tools.soak", "--json", str(out), *args], cwd=ROOT,
                          env=dict(os.environ, **(env or {})), capture_output=True, text=True, timeout=timeout)
    summary = json.loads(out.read_text()) if out.exists() else None
    return proc, summary


def test_a_short_soak_with_clears_and_restarts_passes(tmp_path):
    proc, summary = soak(tmp_path, "--seconds", "6", "--report-every", "1", "--clear-every", "2",
                         "--restart-every", "2.5", "--seed", "7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["passed"] and summary["errors"] == 0 and summary["failures"] == []
    assert summary["tp"] == 2 and 6 <= summary["elapsed_s"] < 20
    # every kind of operation ran, each round verified
    assert summary["swap_rounds"] > 20 and summary["blocks"] >= summary["swap_rounds"]
    assert summary["clears"] >= 2 and summary["restarts"] >= 2      # warm-up + at least one more each
    assert summary["ops"] == summary["swap_rounds"] + summary["clears"] + summary["restarts"]
    assert summary["checks_passed"] >= 2 * summary["swap_rounds"]
    # one report line about every second, with growing op counts
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[") and "ops" in line]
    assert len(lines) >= 5 and len(summary["samples"]) == len(lines)
    ops = [s["ops"] for s in summary["samples"]]
    assert ops == sorted(ops) and ops[-1] == summary["ops"]
    # memory was measured and held steady; the deployment used /dev/shm while it ran and left nothing
    for key in ("engine_rss", "transfer_rss"):
        assert summary[key]["first"] > 10 * MIB and summary[key]["max"] >= summary[key]["last"] > 0
        assert summary["rss_growth_mib"][key] < 20
    assert summary["shm_bytes"]["max"] > 0 and summary["leftovers"] == []
    assert "result          PASSED" in proc.stdout and "errors          0" in proc.stdout


def test_a_failing_soak_exits_1_reports_the_error_and_still_cleans_up(tmp_path):
    proc, summary = soak(tmp_path, "--seconds", "20", "--report-every", "1",
                         env={"FASTCACHE_FAIL_EVERY": "0:40"})       # rank 0's 40th task fails
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert not summary["passed"] and summary["errors"] >= 1
    assert any("injected fault" in m and "rank 0" in m for m in summary["error_messages"]), summary["error_messages"]
    assert summary["elapsed_s"] < 10            # it stops at the first error instead of running on
    assert summary["leftovers"] == []
    assert "FAILED" in proc.stdout and "injected fault" in proc.stdout


def test_the_verdict_gates_on_rss_growth_errors_and_leftovers():
    args = SimpleNamespace(tp=2, seed=0, max_rss_growth_mib=20.0)

    def run(engine, transfer, errors=(), leftovers=(), ops=10):
        samples = [{"elapsed_s": float(i), "ops": ops, "engine_rss": e, "transfer_rss": t, "shm_bytes": 1}
                   for i, (e, t) in enumerate(zip(engine, transfer))]
        fake = SimpleNamespace(samples=samples, ops=ops, counts={"swap_rounds": ops},
                               checks=SimpleNamespace(failed=[], passed=ops))
        return summarize(fake, list(errors), list(leftovers), args, False)

    ok = run([100 * MIB, 130 * MIB, 110 * MIB], [200 * MIB, 190 * MIB, 205 * MIB])
    assert ok["passed"], ok["failures"]
    assert ok["engine_rss"] == {"first": 100 * MIB, "last": 110 * MIB, "max": 130 * MIB}
    grew = run([100 * MIB, 125 * MIB], [200 * MIB, 200 * MIB])
    assert not grew["passed"] and "engine rss grew by 25.0 MiB" in grew["failures"][0]
    grew = run([100 * MIB, 100 * MIB], [200 * MIB, 221 * MIB])
    assert not grew["passed"] and "transfer rss" in grew["failures"][0]
    assert not run([MIB, MIB], [MIB, MIB], errors=["boom"])["passed"]
    assert not run([MIB, MIB], [MIB, MIB], leftovers=["fastcache.x.barrier"])["passed"]
    assert not run([MIB, MIB], [MIB, MIB], ops=0)["passed"]
