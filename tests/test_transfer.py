"""The transfer manager process: its CLI and its idle cost."""
import subprocess
import sys
import time

import psutil

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


def idle_cost(pids, seconds):
    """(CPU-seconds, wake-ups per second) of each process over `seconds` of idling. Wake-ups (voluntary
    context switches) show a polling loop long before the CPU clock's 10 ms ticks do."""
    procs = [psutil.Process(pid) for pid in pids]

    def sample(p):
        return sum(p.cpu_times()[:2]), p.num_ctx_switches().voluntary

    before = [sample(p) for p in procs]
    time.sleep(seconds)
    after = [sample(p) for p in procs]
    return [(a[0] - b[0], (a[1] - b[1]) / seconds) for a, b in zip(after, before)]


def test_idle_transfer_managers_sleep():
    with deployment(small_spec(), tp=2) as (backend, _):
        backend.swap_out([1], [1]).result(timeout=10)
        for state in ("ready", "cleared"):
            cost = idle_cost(backend.transfer_pids, 3)
            assert all(cpu < 0.03 and wakeups < 20 for cpu, wakeups in cost), \
                f"{state} transfer managers (CPU-seconds in 3 s, wake-ups/s): {cost}"
            backend.clear_caches(timeout=30)        # a weight update can take minutes: sleep through it
