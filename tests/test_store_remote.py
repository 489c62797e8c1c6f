"""The engine's store client in a child process (fastcache/store/remote.py): the same answers as the store,
a bound on every call whatever the child does, and no child left behind by an engine that dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

from conftest import small_spec, wait_for
from fastcache.store import ObjectKeys, StoreError, as_hashes, fingerprint, open_store
from fastcache.store import remote as remote_module
from fastcache.store.remote import RemoteStore

SPEC = small_spec(num_cpu_blocks=16)


def keys(rank, namespace="remote/0"):
    return ObjectKeys(namespace, fingerprint(SPEC, 2), rank)


@pytest.fixture
def filled(tmp_path):
    """A directory store holding random hashes for rank 0 and some of them for rank 1."""
    rng = np.random.default_rng(80)
    url = f"file://{tmp_path}/l3"
    store = open_store(url)
    store.attach(rng.integers(0, 256, (SPEC.num_cpu_blocks, SPEC.cpu_block_stride), dtype=np.uint8),
                 SPEC.cpu_block_bytes)
    hashes = as_hashes(rng.integers(0, 2**63, 12))
    store.put(keys(0), hashes, np.arange(12))
    store.put(keys(1), hashes[::2], np.arange(6))
    yield url, store, hashes
    store.close()


def test_answers_are_the_stores_own(filled):
    url, store, hashes = filled
    remote = RemoteStore(url)
    try:
        both = [keys(0), keys(1)]
        np.testing.assert_array_equal(remote.exists_every_rank(both, hashes), store.exists_every_rank(both, hashes))
        assert remote.exists_every_rank([keys(0)], hashes).all()
        remote.remove(keys(0), hashes[:3])
        np.testing.assert_array_equal(store.exists(keys(0), hashes), [False] * 3 + [True] * 9)
        assert not remote.exists_every_rank([keys(0, "remote/other")], hashes).any()
    finally:
        remote.close()


def test_each_rank_is_asked_in_its_own_namespace(filled):
    """A vLLM engine names each rank's objects in a namespace of its own (with one rank per key)."""
    url, store, hashes = filled
    ours, other = keys(0, "remote/r0"), keys(0, "remote/r1")
    store.put(ours, hashes[:6], np.arange(6))
    store.put(other, hashes[3:9], np.arange(6))
    remote = RemoteStore(url)
    try:
        want = store.exists_every_rank([ours, other], hashes)
        assert want.tolist() == [False] * 3 + [True] * 3 + [False] * 6       # the oracle tells them apart
        np.testing.assert_array_equal(remote.exists_every_rank([ours, other], hashes), want)
        np.testing.assert_array_equal(remote.exists_every_rank([other, ours], hashes), want)
        remote.remove(other, hashes[3:4])
        assert store.exists(ours, hashes[3:4]).all() and not store.exists(other, hashes[3:4]).any()
    finally:
        remote.close()


def test_a_stopped_client_costs_a_call_its_bound_and_the_next_call_starts_afresh(filled):
    url, _, hashes = filled
    remote = RemoteStore(url, timeout=3.0)      # the bound includes starting a fresh child, on a loaded machine too
    try:
        assert remote.exists_every_rank([keys(0)], hashes).all()
        stuck = remote._proc
        os.kill(stuck.pid, signal.SIGSTOP)                  # a child stuck in a call, as on a hung master
        began = time.monotonic()
        with pytest.raises(StoreError, match=f"store {url}: no answer within 3 s"):
            remote.exists_every_rank([keys(0)], hashes)
        assert time.monotonic() - began < 4.0
        assert stuck.poll() is not None                     # killed, not left behind
        os.kill(remote._started(time.monotonic() + 5).pid, signal.SIGSTOP)
        many = as_hashes(np.arange(1 << 17))                # 1 MiB: more than a pipe holds
        began = time.monotonic()
        with pytest.raises(StoreError, match="no answer within 3 s"):
            remote.exists_every_rank([keys(0)], many)
        assert time.monotonic() - began < 4.0
        assert remote.exists_every_rank([keys(0)], hashes).all()    # a fresh child answers
    finally:
        remote.close()


def test_an_unusable_store_is_a_store_error_naming_it(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    url = f"file://{tmp_path}/file/l3"                      # a file where the directory must be
    remote = RemoteStore(url)
    try:
        with pytest.raises(StoreError, match=f"store {url}: cannot create"):
            remote.exists_every_rank([keys(0)], as_hashes([1]))
    finally:
        remote.close()


def test_the_client_exits_with_an_engine_that_is_killed(filled):
    url, _, hashes = filled
    engine = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, numpy as np
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_store_remote import keys
        from fastcache.store.remote import RemoteStore
        remote = RemoteStore({url!r})
        assert remote.exists_every_rank([keys(0)], np.array({hashes.tolist()!r}, np.uint64)).all()
        print(remote._proc.pid, flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = int(engine.stdout.readline())
        assert psutil.pid_exists(child)
        engine.kill()
        engine.wait()
        wait_for(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE,
                 10, "the store client's exit")
    finally:
        engine.kill()
        engine.wait()
        engine.stdin.close()
        engine.stdout.close()


@pytest.fixture
def faulty(monkeypatch):
    """fault(name): RemoteStore's children from now on are tests/querier_faults.py with that fault."""
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(remote_module, "QUERIER", "querier_faults")
    return lambda name: monkeypatch.setenv("QUERIER_FAULT", name)


def test_the_fault_injection_reaches_the_child(filled, faulty):
    """The negative control of the tests below: a child with no fault answers as the store does."""
    url, store, hashes = filled
    faulty("")
    remote = RemoteStore(url)
    try:
        np.testing.assert_array_equal(remote.exists_every_rank([keys(1)], hashes), store.exists(keys(1), hashes))
        assert "querier_faults" in " ".join(psutil.Process(remote._proc.pid).cmdline())
    finally:
        remote.close()


def test_an_answer_byte_other_than_0_or_1_is_an_error_never_a_hit(filled, faulty):
    url, _, hashes = filled
    faulty("two")
    remote = RemoteStore(url)
    try:
        with pytest.raises(StoreError, match=f"store {url}: the store client's answer is not one 0 or 1 per hash"):
            remote.exists_every_rank([keys(1)], hashes)
        assert remote._proc is None                          # stopped: the next call starts a new one
    finally:
        remote.close()


def test_a_stray_reply_fails_its_call_and_never_shifts_a_later_answer(filled, faulty):
    url, store, hashes = filled
    faulty("extra")
    first, second = hashes[[0, 2, 4]], hashes[[1, 3, 6]]      # rank 1 holds the even ones
    want = store.exists(keys(1), second)
    assert want.tolist() != store.exists(keys(1), first).tolist()     # a shifted answer would show
    remote = RemoteStore(url)
    try:
        np.testing.assert_array_equal(remote.exists_every_rank([keys(1)], first), store.exists(keys(1), first))
        with pytest.raises(StoreError, match="answered question 1 when asked question 2"):
            remote.exists_every_rank([keys(1)], second)
        np.testing.assert_array_equal(remote.exists_every_rank([keys(1)], second), want)   # a fresh child
    finally:
        remote.close()


def test_a_child_that_prints_as_it_starts_still_answers(filled, faulty, capfd):
    url, store, hashes = filled
    faulty("banner")
    remote = RemoteStore(url)
    try:
        np.testing.assert_array_equal(remote.exists_every_rank([keys(1)], hashes), store.exists(keys(1), hashes))
    finally:
        remote.close()
    assert "a library says hello on stdout" in capfd.readouterr().err     # printed, on the engine's stderr


def test_opening_the_store_that_hangs_costs_a_call_its_bound(filled, faulty):
    url, _, hashes = filled
    faulty("hang_open")
    remote = RemoteStore(url, timeout=2.0)
    try:
        began = time.monotonic()
        with pytest.raises(StoreError, match=f"store {url}: no answer within 2 s \\(opening it"):
            remote.exists_every_rank([keys(0)], hashes)
        assert time.monotonic() - began < 3.0
        assert remote._proc is None
    finally:
        remote.close()


def test_the_client_exits_with_its_engine_while_another_process_holds_its_questions_open(filled):
    """A process the engine started (a fork, a pool worker) keeps the child's stdin open, so the child sees
    no end of its questions: it must exit on its own once the engine is gone."""
    url, _, hashes = filled
    engine = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, numpy as np
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_store_remote import keys
        from fastcache.store.remote import RemoteStore
        remote = RemoteStore({url!r})
        assert remote.exists_every_rank([keys(0)], np.array({hashes.tolist()!r}, np.uint64)).all()
        fd = remote._proc.stdin.fileno()
        holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(fd,),
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        print(remote._proc.pid, holder.pid, flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    holder = None
    try:
        child, holder = (int(pid) for pid in engine.stdout.readline().split())
        holder = psutil.Process(holder)
        engine.kill()
        engine.wait()
        wait_for(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE,
                 10, "the store client's exit")
        assert holder.is_running() and holder.status() != psutil.STATUS_ZOMBIE   # its questions were still open
    finally:
        engine.kill()
        engine.wait()
        engine.stdin.close()
        engine.stdout.close()
        if holder is not None:
            holder.kill()
            holder.wait(10)
