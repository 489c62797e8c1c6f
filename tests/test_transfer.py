"""The transfer manager process: its CLI and its idle cost."""
import os
import subprocess
import sys
import time

from fastcache import CacheSpec
from fastcache.transfer.__main__ import build_parser, spec_from_args

from conftest import deployment, small_spec


def test_fastdeploy_style_arguments_build_the_spec():
    args = build_parser().parse_args(
        "--rank 1 --mp_num 2 --ipc_suffix s --socket_dir d --engine_pid 1 --num_layers 4 --num_cpu_blocks 32 "
        "--cache_dtype float16 --key_cache_shape 64,2,16,128 --value_cache_shape 64,2,16,128".split())
    assert spec_from_args(args) == CacheSpec(num_layers=4, num_gpu_blocks=64, num_cpu_blocks=32, block_size=16,
                                             num_kv_heads=2, head_dim=128, cache_dtype="float16")
    args = build_parser().parse_args(
        "--rank 0 --mp_num 1 --ipc_suffix s --socket_dir d --engine_pid 1 --num_layers 2 --num_cpu_blocks 8 "
        "--cache_dtype uint8 --key_cache_shape 16,1,16,576".split())
    assert spec_from_args(args).has_value is False          # MLA-style: no value cache


def test_cli_rejects_bad_arguments_clearly():
    run = subprocess.run([sys.executable, "-m", "fastcache.transfer", "--rank", "0", "--mp_num", "1",
                          "--ipc_suffix", "x", "--socket_dir", "/nonexistent", "--engine_pid", "1",
                          "--key_cache_shape", "1,2,3"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "num_blocks,num_kv_heads,block_size,head_dim" in run.stderr
    run = subprocess.run([sys.executable, "-m", "fastcache.transfer", "--rank", "0", "--mp_num", "1",
                          "--ipc_suffix", "x", "--socket_dir", "/nonexistent", "--engine_pid", "1"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "give --spec" in run.stderr


def run_time(pid):
    """(CPU-seconds, sleeps) of all of pid's threads, from the scheduler's own counts: the CPU time in nanoseconds
    (psutil's comes in 10 ms ticks, too coarse for an idle process), and the voluntary context switches, each a
    sleep and so a wake-up (preemptions on a busy machine are not counted)."""
    seconds = sleeps = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = f.read().split()[0]
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                switches = next(line for line in f if line.startswith("voluntary_ctxt_switches"))
        except FileNotFoundError:           # a thread that just ended
            continue
        seconds, sleeps = seconds + int(ns) / 1e9, sleeps + int(switches.split()[1])
    return seconds, sleeps


def idle_cost(pids, seconds):
    """(CPU-seconds, wake-ups per second) of each process over `seconds`. A wake-up of an idle thread costs this
    VM up to 6 ms of CPU (a bare thread waking once a second shows that), so the wake-ups are what tells a polling
    loop; a spin is told by awake_share, which a busy machine does not shrink."""
    before = [run_time(pid) for pid in pids]
    time.sleep(seconds)
    after = [run_time(pid) for pid in pids]
    return [(a[0] - b[0], (a[1] - b[1]) / seconds) for a, b in zip(after, before)]


def test_idle_transfer_managers_sleep():
    with deployment(small_spec(), tp=2) as (backend, _):
        backend.swap_out([1], [1]).result(timeout=10)
        for state in ("ready", "cleared"):
            cost = idle_cost(backend.transfer_pids, 3)
            assert all(cpu < 0.1 and wakeups < 5 for cpu, wakeups in cost), \
                f"{state} transfer managers (CPU-seconds in 3 s, wake-ups/s): {cost}"
            backend.clear_caches(timeout=30)        # a weight update can take minutes: sleep through it


def awake_share(pid, seconds, every=0.005):
    """The share of `seconds` in which pid's main thread is running or waiting for a core (state R), sampled from
    /proc: a spin shows there however busy the machine is, where its CPU time shrinks with the cores it gets."""
    samples = awake = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            awake += f.read().rpartition(")")[2].split()[0] == "R"
        samples += 1
        time.sleep(every)
    return awake / samples


def test_an_idle_wake_up_starts_no_spin(monkeypatch):
    """A transfer manager stays awake after work (FASTCACHE_SPIN_US), never after a wake-up that brought none.
    With the spin made a second long, the spin after a task shows (the oracle), and a spin on the idle wake-ups
    (one a second) would keep the process awake half the time."""
    monkeypatch.setenv("FASTCACHE_SPIN_US", "1000000")
    with deployment(small_spec(), tp=1) as (backend, _):
        pid = backend.transfer_pids[0]
        backend.swap_out([1], [1]).result(timeout=10)
        spun = awake_share(pid, 0.3)
        assert spun > 0.5, f"no spin after a task: awake {spun:.0%} of the next 0.3 s"
        deadline = time.monotonic() + 10
        while awake_share(pid, 0.2) > 0.1:              # the spin after the task ends within its second
            assert time.monotonic() < deadline, "the transfer manager never went back to sleep"
        idle = awake_share(pid, 3)
        assert idle < 0.2, f"idle with a 1 s spin: awake {idle:.0%} of 3 s"
