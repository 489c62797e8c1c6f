"""Two hosts sharing one Mooncake Store: two network namespaces joined by a veth pair play hosts A and B.

A runs the master and a memory server and a deployment, B a deployment; each names its own address as
`local_hostname`. Prefixes stored by A are loaded, verified, by B; then B's link goes down in the middle of
its traffic: its CPU tier keeps serving, its calls that need the store fail within a bound, nothing hangs,
and once the link is back the store serves B again. Needs root (CI has it); the namespaces and the veth
pair are removed afterwards, also when the test fails. Only addresses inside the namespaces are used.
"""
from __future__ import annotations

import json
import os
import queue
import secrets
import shutil
import subprocess
import sys
import threading
import time

import pytest

if os.environ.get("FASTCACHE_REQUIRE_MOONCAKE") == "1":
    import mooncake.store  # noqa: F401  (fail loudly: CI installs it)
else:
    pytest.importorskip("mooncake.store", reason="Mooncake not installed (pip install 'fastcache[mooncake]')")

PEER = os.path.join(os.path.dirname(__file__), "two_hosts_peer.py")
# seconds a call of B may take while its link is down: a get whose transfer was under way fails after Mooncake's
# transfer timeout (30 s), then its call to the master after the RPC timeout (30 s); and margin
CALL_BOUND = 75.0


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (network namespaces)")
    tag = secrets.token_hex(3)
    ns_a, ns_b, veth_a, veth_b = f"fc-a-{tag}", f"fc-b-{tag}", f"fca{tag}", f"fcb{tag}"
    subnet = f"10.213.{int(tag[:2], 16)}"
    made = []
    try:
        for ns in (ns_a, ns_b):
            ip("netns", "add", ns)
            made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("link", "add", veth_a, "netns", ns_a, "type", "veth", "peer", "name", veth_b, "netns", ns_b)
        for ns, veth, host in ((ns_a, veth_a, 1), (ns_b, veth_b, 2)):
            ip("-n", ns, "addr", "add", f"{subnet}.{host}/24", "dev", veth)
            ip("-n", ns, "link", "set", veth, "up")
        yield {"a": (ns_a, f"{subnet}.1"), "b": (ns_b, f"{subnet}.2"), "veth_b": veth_b}
    finally:
        for ns in made:         # deleting a namespace deletes the veth end in it, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
    assert not {ns_a, ns_b} & set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
                                  .stdout.split())


class Peer:
    """A two_hosts_peer.py process inside a namespace; ask() sends a command and waits for its answer."""

    def __init__(self, ns: str, args: dict):
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, PEER, json.dumps(args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=os.path.dirname(PEER))
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.hello = self.answer(120)
        assert self.hello.get("ready"), self.hello

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put({"error": f"peer exited with status {self.proc.wait()}"})

    def answer(self, timeout: float) -> dict:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no answer from the peer within {timeout} s: it hangs") from None

    def ask(self, timeout: float = 90, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.ask(timeout=60, cmd="quit")
            except (AssertionError, OSError):
                pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def hashes(first: int, n: int = 8) -> list[int]:
    return [(0x5EED << 40) + first + i for i in range(n)]


@pytest.mark.slow
def test_prefixes_stored_on_one_host_load_on_the_other_and_survive_a_link_outage(two_hosts):
    (ns_a, addr_a), (ns_b, addr_b) = two_hosts["a"], two_hosts["b"]
    a = b = None
    try:
        a = Peer(ns_a, {"address": addr_a, "serve": True})
        assert a.hello["url"].startswith(f"mooncake://{addr_a}:")
        b = Peer(ns_b, {"address": addr_b, "store": a.hello["url"]})

        # A's prefixes reach B through the store, every byte checked there
        shared = hashes(0)
        assert a.ask(cmd="store", hashes=shared).get("stored") == len(shared)
        got = b.ask(cmd="load", hashes=shared)
        assert got.get("held") == len(shared) and got["from_store"] == len(shared), got
        assert got["verified_bytes"] > 0
        own = hashes(100)
        assert b.ask(cmd="store", hashes=own).get("stored") == len(own)
        later = hashes(200)
        assert a.ask(cmd="store", hashes=later).get("stored") == len(later)

        # B's link goes down in the middle of its traffic
        answers = []

        def traffic():
            for _ in range(4):
                answers.append(b.ask(timeout=CALL_BOUND + 30, cmd="load", hashes=later + [1], load_timeout=CALL_BOUND + 15))
        loop = threading.Thread(target=traffic)
        loop.start()
        ip("-n", ns_b, "link", "set", two_hosts["veth_b"], "down")
        loop.join(4 * (CALL_BOUND + 30))
        assert not loop.is_alive(), "B's calls hang while its link is down"
        for ans in answers:                      # each call ended in time: loaded and verified, or failed
            assert ans["seconds"] < CALL_BOUND, answers
            assert "verified_bytes" in ans or "error" in ans, ans
        local = b.ask(cmd="load", hashes=own + shared)
        assert local.get("held") == len(own + shared) and local["from_store"] == 0, local   # the CPU tier serves
        assert local["seconds"] < CALL_BOUND, local

        # the link comes back: the store serves B again
        ip("-n", ns_b, "link", "set", two_hosts["veth_b"], "up")
        fresh = hashes(300)
        assert a.ask(cmd="store", hashes=fresh).get("stored") == len(fresh)
        deadline = time.monotonic() + 90
        while True:
            got = b.ask(cmd="load", hashes=fresh)
            if got.get("from_store") == len(fresh):
                break
            assert time.monotonic() < deadline, f"the store does not serve B again after its link is back: {got}"
            time.sleep(1)
        assert got["verified_bytes"] > 0
        assert b.ask(cmd="stats").get("l3_errors", 0) >= 1        # the outage was seen, and counted
    finally:
        for peer in (b, a):
            if peer is not None:
                peer.close()
