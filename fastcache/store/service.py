"""A Mooncake Store on this machine: a master and one memory server, on free ports of one address
(loopback unless `host` names another of this machine's addresses).

Tests, `python -m fastcache.launch --store mooncake` and the trace tool start one for their run. The
memory server is Mooncake's own `mooncake_client` (shipped in the wheel): it lends `segment_mb` of its
memory to the pool, so objects outlive the deployments that put them, as in a real cluster where memory
servers run beside the master. Both processes die with the process that started them (PDEATHSIG).
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from .base import StoreError

LOOPBACK = "127.0.0.1"
MISSING_LIBRARY = re.compile(r"error while loading shared libraries: ([^:\s]+): cannot open shared object file")
# Debian/Ubuntu packages of the system libraries Mooncake's binaries link that a slim image may lack
LIBRARY_PACKAGES = {"libnuma.so.1": "libnuma1", "libibverbs.so.1": "libibverbs1", "librdmacm.so.1": "librdmacm1",
                    "libjsoncpp.so.25": "libjsoncpp25", "libunwind.so.8": "libunwind8",
                    "libgflags.so.2.2": "libgflags2.2", "libglog.so.0": "libgoogle-glog0v6",
                    "libcurl.so.4": "libcurl4", "libssl.so.3": "libssl3", "libzstd.so.1": "libzstd1"}


def mooncake_binary(name: str) -> str:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise StoreError("Mooncake is not installed; pip install 'fastcache[mooncake]'")
    for where in spec.submodule_search_locations:
        path = os.path.join(where, name)
        if os.access(path, os.X_OK):
            return path
    raise StoreError(f"Mooncake's {name} binary is missing from the installed package")


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent():
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), 0.2).close()
        return True
    except OSError:
        return False


def missing_library(log: str) -> str | None:
    """What to install, if a binary's log says the dynamic loader found no such system library."""
    found = MISSING_LIBRARY.search(log)
    if found is None:
        return None
    library = found.group(1)
    package = LIBRARY_PACKAGES.get(library)
    how = f"apt-get install {package}" if package else \
        f"install the system package that provides it (apt-file search {library}; dnf provides '*/{library}')"
    return f"the system library {library} is missing: {how}"


class MooncakeService:
    """`with MooncakeService(segment_mb=256) as svc: SwapBackend(..., store=svc.url)`; segment_mb=0 starts
    the master alone, a pool with no memory lent to it (every put finds no room)."""

    def __init__(self, segment_mb: int = 256, start_timeout: float = 30.0, host: str = LOOPBACK):
        self.segment_mb, self.start_timeout, self.host = segment_mb, start_timeout, host
        self.master = self.server = None
        self.port = self.metrics_port = self.server_port = None
        self.log_dir = None

    @property
    def url(self) -> str:
        return f"mooncake://{self.host}:{self.port}"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        self.log_dir = tempfile.mkdtemp(prefix="mooncake-service-")
        self.port, self.metrics_port, self.server_port = (free_port(self.host) for _ in range(3))
        try:
            self.start_master()
            if not self.segment_mb:
                return self
            self.server = self._spawn("server", [
                mooncake_binary("mooncake_client"), f"--master_server_address={self.host}:{self.port}",
                "--metadata_server=P2PHANDSHAKE", f"--global_segment_size={self.segment_mb << 20}",
                f"--host={self.host}", f"--port={self.server_port}", "--protocol=tcp", "--logtostderr"])
            self._wait_listening(self.server, self.server_port, "memory server")
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self):
        """Start (or restart, after kill_master) the master on the same port."""
        self.master = self._spawn("master", [
            mooncake_binary("mooncake_master"), f"--rpc_port={self.port}", f"--rpc_address={self.host}",
            f"--metrics_port={self.metrics_port}", f"--metrics_host={LOOPBACK}",
            "--enable_metric_reporting=false", "--logtostderr"])
        self._wait_listening(self.master, self.port, "master")

    def kill_master(self):
        if self.master is not None:
            self.master.kill()
            self.master.wait()
            self.master = None

    def suspend(self, which: str):
        """SIGSTOP the master or the memory server ("master" | "server"): a hung host, as tests need one."""
        os.kill(self._process(which).pid, signal.SIGSTOP)

    def resume(self, which: str):
        os.kill(self._process(which).pid, signal.SIGCONT)

    def _process(self, which):
        proc = {"master": self.master, "server": self.server}[which]
        if proc is None:
            raise StoreError(f"this service runs no {which}")
        return proc

    def _spawn(self, name, cmd):
        env = {**os.environ, "MC_FORCE_TCP": "true", "MC_TCP_BIND_ADDRESS": self.host}
        with open(os.path.join(self.log_dir, f"{name}.log"), "ab") as log:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=_die_with_parent)

    def _wait_listening(self, proc, port, what):
        deadline = time.monotonic() + self.start_timeout
        while not _listening(self.host, port):
            if proc.poll() is not None or time.monotonic() > deadline:
                log = self.log_tail(what)
                raise StoreError(f"Mooncake {what} did not start on port {port}: {missing_library(log) or log}")
            time.sleep(0.02)

    def log_tail(self, what: str, n: int = 1500) -> str:
        name = "master" if what == "master" else "server"
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self):
        for proc in (self.server, self.master):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)        # a suspended process handles SIGTERM only once resumed
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.server = self.master = None
        if self.log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.log_dir = None


@contextlib.contextmanager
def store_for_run(store: str | None, segment_mb: int = 256):
    """The store URL a tool runs with: `mooncake` starts a local Mooncake (master and memory server of
    segment_mb) for the run, `file` a temporary directory; a URL is used as given; None: no store."""
    if store == "mooncake":
        with MooncakeService(segment_mb=segment_mb) as service:
            yield service.url
    elif store == "file":
        with tempfile.TemporaryDirectory(prefix="fastcache-l3-") as root:
            yield f"file://{root}"
    else:
        yield store
