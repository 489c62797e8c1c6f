"""The GPU benchmark's machinery, without a GPU: the GEMM load process (run on the CPU through NumPy),
the statistics, the byte checks (against the fake CUDA runtime of test_cuda_logic) and the report."""
import ctypes
import time

import numpy as np
import pytest

from fastcache.tools import bench
from fastcache.tools.gemm_load import GemmLoad

from conftest import small_spec, wait_for


def test_gemm_load_runs_in_another_process_pauses_and_reports_its_rate():
    with GemmLoad("numpy", n=128, timeout=60) as gemm:
        idle = gemm.mark()
        time.sleep(0.2)
        assert gemm.mark() == idle, "a paused load must not run"
        gemm.run()
        start = gemm.mark()
        wait_for(lambda: gemm.mark()[0] > start[0], 30, "a batch of the running load")   # however busy the machine
        end = gemm.mark()
        assert end[0] > start[0] and end[1] > start[1]
        assert gemm.tflops(start, end) > 0
        gemm.pause()
        with pytest.raises(RuntimeError, match="no batch"):
            gemm.tflops(end, end)
        proc = gemm._proc
    assert proc.poll() == 0          # stopped cleanly; conftest checks that nothing is left behind


def test_gemm_load_that_fails_is_reported_not_waited_for():
    with pytest.raises(RuntimeError, match="failed before it could warm up"):
        GemmLoad("torch", n=64, device_id=999, timeout=60)   # no torch or no such device: either way it fails


def test_summary_is_median_and_spread():
    assert bench.summary([3, 1, 2, 10, 4]) == {"median": 3.0, "min": 1.0, "max": 10.0, "runs": 5}


pytest.importorskip("cuda.bindings.runtime")
from test_cuda_logic import fake_cuda  # noqa: E402,F401  (the fixture)
import fastcache.ops.cuda as cuda_ops  # noqa: E402
import fastcache.ops.cuda_copiers as copiers  # noqa: E402
import fastcache.ops.cuda_swap_space as swap_space  # noqa: E402
from fastcache.ipc.naming import new_suffix, segment_name  # noqa: E402
from fastcache.ipc.shm import SharedSegment  # noqa: E402
from cuda.bindings import runtime  # noqa: E402


@pytest.fixture
def fake_rig(fake_cuda):
    """A bench Rig over fake device memory: random tensors and tier, ids as the real one draws them."""
    def memset(ptr, value, n):
        ctypes.memset(ptr, value, n)
        return (runtime.cudaError_t.cudaSuccess,)
    fake_cuda.cudaMemset = memset
    spec = small_spec(num_gpu_blocks=40, num_cpu_blocks=20, num_extra_layers=1, num_extra_gpu_blocks=25)
    rng = np.random.default_rng(3)
    arrays = [rng.integers(1, 256, (i.num_blocks, i.block_bytes), dtype=np.uint8) for i in spec.tensors()]
    suffix = new_suffix()
    segment = SharedSegment.create(segment_name(suffix, "swap"), spec.cpu_cache_bytes, suffix)
    rig = bench.Rig.__new__(bench.Rig)
    rig.spec, rig.device_id = spec, 0
    rig.view = cuda_ops.DeviceTensors(spec.tensors(), [a.ctypes.data for a in arrays], 0)
    rig.swap = swap_space.CudaSwapSpace(segment, spec, 0)
    rig.swap.rows[...] = rng.integers(1, 256, rig.swap.rows.shape, dtype=np.uint8)
    gpu, cpu = rng.permutation(40), rng.permutation(20)
    rig.out_ids, rig.in_ids = (gpu[:10], cpu[:10]), (gpu[10:20], cpu[10:])
    rig.nbytes = 10 * spec.cpu_block_bytes
    rig.verifier = bench.Verifier(rig.view, rig.swap.rows)
    yield rig
    rig.swap.close()


@pytest.mark.parametrize("method", copiers.METHODS)
def test_every_method_run_is_verified(fake_rig, method):
    fig = bench.bench_method(method, fake_rig, gemm=None)
    assert fig["wrong_tensors"] == {"out": [], "in": []}, fig
    assert fig["d2h"]["runs"] == bench.RUNS and fig["d2h"]["min"] <= fig["d2h"]["median"] <= fig["d2h"]["max"]


def test_a_method_that_skips_rows_fails_the_byte_check(fake_rig, monkeypatch):
    """The check must be able to fail: a copier that drops the last tensor leaves the poison there."""
    real = copiers.MemcpyCopier._rows

    def rows_but_the_last_tensor(self, gpu_ids, cpu_ids, to_host):
        infos, self.infos = self.infos, self.infos[:-1]
        try:
            return real(self, gpu_ids, cpu_ids, to_host)
        finally:
            self.infos = infos
    monkeypatch.setattr(copiers.MemcpyCopier, "_rows", rows_but_the_last_tensor)
    fig = bench.bench_method("memcpy", fake_rig, gemm=None)
    last = fake_rig.spec.tensors()[-1].name
    assert fig["wrong_tensors"]["out"] == [last] and fig["wrong_tensors"]["in"] == [last]
    result = {"block_kib": 8, "methods": {"memcpy": fig}}
    assert bench.failures([result]) == [f"8 KiB / memcpy / out: {last}", f"8 KiB / memcpy / in: {last}"]


def test_report_prints_medians_spread_and_verdicts(capsys):
    fig = lambda m: {"median": m, "min": m - 1, "max": m + 1, "runs": 5}     # noqa: E731
    result = {"block_kib": 32, "tensors": 64, "swap_bytes": 2**29, "pin_seconds": 1.5, "pinned_bytes": 2**32,
              "ceiling": {"d2h": fig(55), "h2d": fig(54), "duplex": fig(94),
                          "beside_gemm": {"swap": fig(50), "gemm": fig(650)}},
              "gemm_alone_tflops": fig(700),
              "methods": {"staged": {"d2h": fig(53), "h2d": fig(52), "duplex": fig(90),
                                     "beside_gemm": {"swap": fig(45), "gemm": fig(680)},
                                     "wrong_tensors": {"out": [], "in": []}}},
              "e2e": {"d2h": fig(50), "h2d": fig(49), "wrong_tensors": {"out": [], "in": []},
                      "one_block_us": {"out": {"p50": 120, "p99": 300, "tasks": 300, "run_p50": 41},
                                       "in": {"p50": 110, "p99": 280, "tasks": 300, "run_p50": 39},
                                       "wrong_tensors": []}}}
    bench.print_report("H100", [result])
    out = capsys.readouterr().out
    assert "53.0  96% (52.0-54.0)" in out and "verified" in out
    assert "GEMM  680 TFLOP/s  97%" in out and " 90% of bulk" in out
    assert "out p50 120 us p99 300 us" in out and "every swap verified" in out
    assert "own run p50 41 / 39 us" in out
