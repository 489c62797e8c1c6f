"""python -m fastcache.launch as a user runs it: exit status, report, nothing left behind."""
import json
import subprocess
import sys

import pytest


def launch(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "fastcache.launch", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_default_run_passes_every_check_and_reports(tmp_path):
    out = tmp_path / "report.json"
    run = launch("--duration", "1", "--rl-cycles", "2", "--latency-samples", "50", "--json", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["device"] == "sim" and report["tp"] == 2 and report["checks_failed"] == []
    assert report["checks_passed"] > 10 and report["random_rounds"] > 0
    for key in ("latency_p50_ms", "latency_p99_ms", "swap_out_gbps", "swap_in_vs_memcpy", "clear_ms",
                "restore_ms"):
        assert report[key] > 0
    assert report["memory_returned_mib"] >= 2 * report["gpu_cache_mib"] * 0.99
    # prefix reuse: cached prefixes were loaded (each verified) and the cache had to evict
    assert report["prefix_requests"] == 200 and report["prefix_loaded"] == report["prefix_hits"] > 0
    assert report["prefix_stored"] + report["prefix_hits"] == report["prefix_blocks"]
    assert report["prefix_evicted"] > 0 and "prefix reuse    200 requests" in run.stdout
    assert "checks" in run.stdout and "0 failed: PASSED" in run.stdout


def test_a_failed_check_makes_the_exit_status_nonzero():
    run = launch("--duration", "0", "--rl-cycles", "0", "--latency-samples", "5", "--tp", "1",
                 "--num-gpu-blocks", "64", "--num-cpu-blocks", "32")
    assert run.returncode == 0, run.stdout + run.stderr
    bad = launch("--duration", "0", "--rl-cycles", "0", "--latency-samples", "5", "--tp", "1",
                 "--num-gpu-blocks", "64", "--num-cpu-blocks", "32", "--inject-corruption")
    assert bad.returncode == 1 and "CHECK FAILED: CPU tier holds" in bad.stdout


@pytest.mark.parametrize("args,message", [(["--num-layers", "0"], "num_layers"),
                                          (["--num-cpu-blocks", str(10**9)], "GiB"),
                                          (["--framework", "cupy"], "does not run on device 'sim'")])
def test_bad_geometry_is_a_clear_error(args, message):
    run = launch(*args)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr


def test_help_explains_the_options():
    run = launch("--help")
    assert run.returncode == 0
    for option in ("--tp", "--device", "--framework", "--duration", "--rl-cycles", "--num-gpu-blocks"):
        assert option in run.stdout


def test_paddle_worker_processes():
    pytest.importorskip("paddle")
    run = launch("--framework", "paddle", "--duration", "0.5", "--rl-cycles", "1", "--latency-samples", "20")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "framework=paddle" in run.stdout and "0 failed: PASSED" in run.stdout


def test_a_worker_that_dies_before_ready_fails_the_wait_at_once():
    import time

    from fastcache import SwapBackend
    from fastcache.launch.harness import wait_until_ready

    from conftest import small_spec
    with SwapBackend(small_spec(), tp_size=1, device="sim") as backend:
        dead = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
        dead.wait()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="worker rank 0 .* exited with status 3 before"):
            wait_until_ready(backend, [dead], timeout=60)
        assert time.monotonic() - t0 < 5


def test_ranks_share_the_gpus_round_robin_when_there_are_fewer_than_tp():
    from fastcache.ops import round_robin_devices
    assert round_robin_devices("cuda", 2, count=1) == [0, 0]          # a one-GPU machine runs tp=2
    assert round_robin_devices("cuda", 4, count=2) == [0, 1, 0, 1]
    assert round_robin_devices("cuda", 2, count=8) == [0, 1]          # enough GPUs: rank r on GPU r
    assert round_robin_devices("sim", 2, count=1) is None            # the backend's default
    with pytest.raises(ValueError, match="no CUDA GPU"):
        round_robin_devices("cuda", 2, count=0)


def test_launch_on_cuda_without_a_gpu_is_a_clear_error():
    from fastcache.ops import cuda_usable
    if cuda_usable():
        pytest.skip("a GPU is visible: the GPU suite runs the launcher on it")
    run = launch("--device", "cuda")
    assert run.returncode == 2 and "no CUDA GPU is visible" in run.stderr and "Traceback" not in run.stderr


def test_liquid_resharding_with_weights_beside_an_fp8_cache(tmp_path):
    """--cache-dtype block_wise_fp8 with weights (the default): the linears are bfloat16 (an fp8 KV cache
    leaves the weights as the checkpoint has them), and every byte of both is checked after every step."""
    from fastcache import CacheSpec
    from fastcache.launch.liquid import liquid_weights
    spec = CacheSpec(num_layers=2, num_gpu_blocks=32, num_cpu_blocks=16, block_size=16, num_kv_heads=4,
                     head_dim=16, cache_dtype="block_wise_fp8")
    assert [t[2] for t in liquid_weights(spec, 2).layer_tensors] == ["bfloat16", "bfloat16", "float32"]
    out = tmp_path / "report.json"
    run = launch("--reshard", "1,2,4,2,1", "--cache-dtype", "block_wise_fp8", "--reshard-cycles", "1",
                 "--num-layers", "2", "--num-gpu-blocks", "32", "--num-cpu-blocks", "16", "--num-kv-heads", "4",
                 "--head-dim", "16", "--json", str(out), timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "0 failed: PASSED" in run.stdout
    steps = json.loads(out.read_text())["reshard_steps"]
    assert [(s["from_tp"], s["to_tp"]) for s in steps] == [(1, 2), (2, 4), (4, 2), (2, 1)]
    assert all(s["weights_bytes"] > 0 and s["bytes_moved"] > s["weights_bytes"] for s in steps)
