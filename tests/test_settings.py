"""FASTCACHE_* settings are checked at start: a bad value is refused with its variable named, before
anything is created or spawned."""
import os
import subprocess
import sys

import numpy as np
import pytest

from fastcache import Settings, SwapBackend
from fastcache.config import COPY_METHODS
from fastcache.ipc.shm import SHM_DIR, SegmentError, SharedSegment, read_creator

from conftest import small_spec

ALL = ("HEARTBEAT_INTERVAL", "WORKER_TIMEOUT", "TRANSFER_TIMEOUT", "PHASE_TIMEOUT", "CLEAR_SWAP_SPACE",
       "COPY_METHOD", "INLINE_BYTES", "SPIN_US", "STAGING_MB", "KERNEL_BLOCKS", "STAGED_BLOCKS", "FAIL_EVERY", "FAIL_ATTACH")

TIMEOUTS = ("WORKER_TIMEOUT", "TRANSFER_TIMEOUT", "PHASE_TIMEOUT")

BAD = [
    ("HEARTBEAT_INTERVAL", "0"), ("HEARTBEAT_INTERVAL", "-1"), ("HEARTBEAT_INTERVAL", "0.0001"),
    ("HEARTBEAT_INTERVAL", "fast"), ("HEARTBEAT_INTERVAL", "nan"),
    ("HEARTBEAT_INTERVAL", "10"),                 # == the default timeouts: every peer looks dead
    ("WORKER_TIMEOUT", "0"), ("WORKER_TIMEOUT", "-1"), ("WORKER_TIMEOUT", "inf"), ("WORKER_TIMEOUT", "10s"),
    ("WORKER_TIMEOUT", "0.5"),                    # below the default 1 s heartbeat interval
    ("TRANSFER_TIMEOUT", "-1"), ("TRANSFER_TIMEOUT", "0"), ("TRANSFER_TIMEOUT", "1"),   # 1 == the interval
    ("PHASE_TIMEOUT", "0"), ("PHASE_TIMEOUT", "-60"), ("PHASE_TIMEOUT", "a minute"),
    *((name, value) for name in TIMEOUTS for value in ("1e308", "86401", "inf", "-inf", "nan")),   # a day at most
    ("CLEAR_SWAP_SPACE", "2"), ("CLEAR_SWAP_SPACE", "maybe"),
    ("COPY_METHOD", "teleport"), ("COPY_METHOD", "Staged"), ("COPY_METHOD", "staged,kernel"),
    ("INLINE_BYTES", "-1"), ("INLINE_BYTES", "4MiB"), ("INLINE_BYTES", "1.5"),
    ("SPIN_US", "-1"), ("SPIN_US", "1000001"), ("SPIN_US", "1ms"), ("SPIN_US", "2.5"),
    ("STAGING_MB", "0"), ("STAGING_MB", "-32"), ("STAGING_MB", "big"),
    ("KERNEL_BLOCKS", "0"), ("KERNEL_BLOCKS", "-8"), ("KERNEL_BLOCKS", "2.5"), ("KERNEL_BLOCKS", "eight"),
    ("FAIL_EVERY", "3"), ("FAIL_EVERY", "0:0"), ("FAIL_EVERY", "a:1"), ("FAIL_EVERY", "0:-1"),
    ("FAIL_ATTACH", "1"), ("FAIL_ATTACH", "x:y"),
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Each test starts from the defaults, whatever the calling shell exported."""
    for name in ALL:
        monkeypatch.delenv(f"FASTCACHE_{name}", raising=False)


@pytest.mark.parametrize("name,value", BAD)
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(f"FASTCACHE_{name}", value)
    with pytest.raises(ValueError) as err:
        Settings.from_env()
    assert f"FASTCACHE_{name}=" in str(err.value)


def test_good_values_are_accepted(monkeypatch):
    good = {"HEARTBEAT_INTERVAL": "0.2", "WORKER_TIMEOUT": "1.5", "TRANSFER_TIMEOUT": "30",
            "PHASE_TIMEOUT": "5", "CLEAR_SWAP_SPACE": "1", "COPY_METHOD": "memcpy", "INLINE_BYTES": "0",
            "STAGING_MB": "0.05", "KERNEL_BLOCKS": "16", "FAIL_EVERY": "1:2", "FAIL_ATTACH": "0:1"}
    for name, value in good.items():
        monkeypatch.setenv(f"FASTCACHE_{name}", value)
    s = Settings.from_env()
    assert (s.heartbeat_interval, s.worker_timeout, s.transfer_timeout, s.phase_timeout) == (0.2, 1.5, 30, 5)
    assert s.clear_swap_space is True and s.copy_method == "memcpy" and s.inline_bytes == 0
    assert s.staging_mb == 0.05 and s.kernel_blocks == 16
    assert s.injected_fault("fail_every", 1) == 2 and s.injected_fault("fail_every", 0) == 0
    assert s.injected_fault("fail_attach", 0) == 1


@pytest.mark.parametrize("name", TIMEOUTS)
def test_a_timeout_is_at_most_a_day(monkeypatch, name):
    """Up to a day is a timeout; beyond it a typo or a way of saying "never", which waits would overflow on."""
    rng = np.random.default_rng(41)
    for seconds in (86400, *rng.uniform(1.5, 86400, 20)):
        monkeypatch.setenv(f"FASTCACHE_{name}", repr(float(seconds)))
        assert getattr(Settings.from_env(), name.lower()) == seconds
    for seconds in (86400.5, *10 ** rng.uniform(np.log10(86401), 308, 20)):
        monkeypatch.setenv(f"FASTCACHE_{name}", repr(float(seconds)))
        with pytest.raises(ValueError, match=f"^FASTCACHE_{name}=.*at most 86400"):
            Settings.from_env()
        with pytest.raises(ValueError, match=f"^FASTCACHE_{name}=.*at most 86400"):
            Settings(**{name.lower(): float(seconds)})


def test_unset_or_empty_means_the_default(monkeypatch):
    monkeypatch.setenv("FASTCACHE_TRANSFER_TIMEOUT", "")
    assert Settings.from_env() == Settings()


@pytest.mark.parametrize("method", COPY_METHODS)
def test_every_copy_method_is_accepted(monkeypatch, method):
    monkeypatch.setenv("FASTCACHE_COPY_METHOD", method)
    assert Settings.from_env().copy_method == method


@pytest.mark.parametrize("value,expected", [("0", False), ("false", False), ("1", True), ("True", True),
                                            ("yes", True), ("off", False)])
def test_clear_swap_space_spellings(monkeypatch, value, expected):
    monkeypatch.setenv("FASTCACHE_CLEAR_SWAP_SPACE", value)
    assert Settings.from_env().clear_swap_space is expected


@pytest.mark.parametrize("named,bad", [
    ("TRANSFER_TIMEOUT", dict(transfer_timeout=-1)), ("WORKER_TIMEOUT", dict(worker_timeout=0)),
    ("HEARTBEAT_INTERVAL", dict(heartbeat_interval=0)),
    ("WORKER_TIMEOUT", dict(heartbeat_interval=5, worker_timeout=5)),
    ("COPY_METHOD", dict(copy_method="dma")), ("INLINE_BYTES", dict(inline_bytes=-1)),
    ("KERNEL_BLOCKS", dict(kernel_blocks=True)), ("STAGING_MB", dict(staging_mb="32")),
    ("PHASE_TIMEOUT", dict(phase_timeout=1e308)), ("TRANSFER_TIMEOUT", dict(transfer_timeout=float("inf"))),
    ("WORKER_TIMEOUT", dict(worker_timeout=float("nan")))])
def test_settings_built_in_code_are_checked_too(named, bad):
    with pytest.raises(ValueError, match=f"FASTCACHE_{named}="):
        Settings(**bad)


def _created_here():
    """/dev/shm entries this process created (other programs may be using /dev/shm meanwhile)."""
    mine = set()
    for entry in os.listdir(SHM_DIR):
        if not entry.startswith("fastcache."):
            continue
        try:
            if read_creator(entry)[0] == os.getpid():
                mine.add(entry)
        except (OSError, SegmentError):
            pass
    return mine


@pytest.mark.parametrize("given", [False, True])
def test_swap_backend_refuses_before_creating_anything(monkeypatch, given):
    """Refused at construction: no segment created, not even created and removed (start() creates them
    before it spawns anything). The environment is checked even when Settings are given: the transfer
    managers read it."""
    created = []
    real_create = SharedSegment.create.__func__
    monkeypatch.setattr(SharedSegment, "create",
                        classmethod(lambda cls, *a, **k: created.append(a) or real_create(cls, *a, **k)))
    before = _created_here()
    monkeypatch.setenv("FASTCACHE_TRANSFER_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="FASTCACHE_TRANSFER_TIMEOUT=-1"):
        with SwapBackend(small_spec(), tp_size=1, device="sim", settings=Settings() if given else None):
            pass
    assert created == [] and _created_here() == before


def _run(module, *args, env):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))


@pytest.mark.parametrize("name,value", [("TRANSFER_TIMEOUT", "-1"), ("WORKER_TIMEOUT", "0"),
                                        ("HEARTBEAT_INTERVAL", "0"), ("COPY_METHOD", "teleport")])
def test_launch_refuses_a_bad_value_in_one_line(name, value):
    run = _run("fastcache.launch", "--tp", "1", "--duration", "0", env={f"FASTCACHE_{name}": value})
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"FASTCACHE_{name}={value}" in run.stderr and "Traceback" not in run.stderr
    assert "starting" not in run.stdout        # refused before the deployment starts


def test_transfer_manager_and_worker_processes_refuse_at_start():
    env = {"FASTCACHE_HEARTBEAT_INTERVAL": "0"}
    spec = small_spec().to_json()
    transfer = _run("fastcache.transfer", "--rank", "0", "--mp_num", "1", "--ipc_suffix", "nosuchdeployment",
                    "--socket_dir", "/nonexistent", "--engine_pid", str(os.getpid()), "--spec", spec, env=env)
    worker = _run("fastcache.worker", "--rank", "0", "--tp", "1", "--suffix", "nosuchdeployment", "--spec", spec,
                  "--engine-pid", str(os.getpid()), env=env)
    for run in (transfer, worker):
        assert run.returncode == 2, run.stdout + run.stderr
        assert "FASTCACHE_HEARTBEAT_INTERVAL=0" in run.stderr and "Traceback" not in run.stderr
