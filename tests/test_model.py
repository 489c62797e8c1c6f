"""The small model's forward over each framework's arrays (fastcache/launch/model.py) and the worker's reading
of streamed layers on a GPU (model_worker.py), without a GPU: NumPy always, torch CPU tensors where torch is
installed. The GPU run itself is in tests/test_gpu.py."""
from __future__ import annotations

import contextlib
import subprocess
import sys

import numpy as np
import pytest

from fastcache.launch.model import (NUMPY, arrays, forward, layer_weights, model_input, pick_framework,
                                    reference)
from fastcache.launch.model_worker import layer_reader, stream_ordered
from fastcache.launch.offload import timed_run
from fastcache.weight_spec import WeightSpec

LAYERS, HIDDEN, BATCH = 6, 48, 5


def plain_forward(x, weights, tanh):
    for p in weights:
        x = tanh(x @ p["w"] + p["b"])
    return x


def drawn(seed=3, rank=0):
    return [layer_weights(seed, rank, layer, HIDDEN) for layer in range(LAYERS)]


def test_numpy_arrays_forward_is_the_plain_numpy_forward_bit_for_bit():
    weights, x = drawn(), model_input(1, BATCH, HIDDEN)
    assert all(np.count_nonzero(a) == a.size for p in weights for a in p.values())      # random, never zeros
    want = plain_forward(x, weights, np.tanh)
    got = forward(NUMPY.to_device(x), lambda layer: weights[layer], LAYERS, NUMPY)
    assert got.dtype == np.float32 and got.tobytes() == want.tobytes()
    assert arrays("numpy", "sim") is NUMPY
    assert reference(3, 0, x, LAYERS, HIDDEN).tobytes() == want.tobytes()
    assert np.array_equal(x, model_input(1, BATCH, HIDDEN)), "the caller's input is left as it was"
    assert not np.allclose(want, 0) and np.isfinite(want).all()


@contextlib.contextmanager
def torch_threads(torch, n):
    """The worker processes compute with one thread: so does the reference here, on the same kernels."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_torch_cpu_arrays_forward_is_the_plain_torch_forward_bit_for_bit():
    torch = pytest.importorskip("torch")
    xp = arrays("torch", "sim")
    weights, x = drawn(), model_input(1, BATCH, HIDDEN)
    on_device = [{k: xp.to_device(a) for k, a in p.items()} for p in weights]
    got = forward(xp.to_device(x), lambda layer: on_device[layer], LAYERS, xp)
    want = plain_forward(torch.from_numpy(x.copy()), on_device, torch.tanh)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    assert xp.to_host(got).tobytes() == want.numpy().tobytes()
    assert reference(3, 0, x, LAYERS, HIDDEN, xp).tobytes() == want.numpy().tobytes()
    # another BLAS and another tanh: the same numbers up to float32 rounding, not bit for bit
    np.testing.assert_allclose(xp.to_host(got), reference(3, 0, x, LAYERS, HIDDEN), rtol=1e-4, atol=1e-5)


def test_torch_worker_processes_stream_bit_identical_to_resident_and_to_this_process():
    torch = pytest.importorskip("torch")
    resident = timed_run(0.0, 8, 64, 4, repeats=2, device="sim", framework="torch")
    streamed = timed_run(0.5, 8, 64, 4, repeats=2, device="sim", framework="torch", measure_copy=True)
    assert len(streamed.layout.streamed_layers) == 4 and streamed.copy_seconds > 0
    with torch_threads(torch, 1):
        want = reference(7, 0, model_input(8, 4, 64), 8, 64, arrays("torch", "sim"))   # timed_run's seeds
    assert streamed.outputs[0].tobytes() == resident.outputs[0].tobytes() == want.tobytes()


def test_the_framework_follows_the_device():
    assert pick_framework("sim") == "numpy"
    assert pick_framework("sim", "torch") == "torch"
    for device, framework in (("sim", "cupy"), ("cuda", "numpy"), ("sim", "paddle"), ("cuda", "paddle")):
        with pytest.raises(ValueError, match="does not compute with"):
            pick_framework(device, framework)
    with pytest.raises(ValueError, match="sim or cuda"):
        pick_framework("tpu")


class FakeGpu:
    """A GPU framework's arrays as far as the worker's layer reading sees them: it records the synchronizes."""
    on_gpu = True

    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("sync")


class FakeForward:
    def __init__(self, log):
        self.log = log

    def layer(self, index):
        self.log.append(index)
        return {}


def test_a_gpu_forward_with_host_waits_finishes_a_slots_kernels_before_freeing_it():
    """Reading streamed layer l frees the ring slots before it: with waits on the host the GPU's queued kernels
    that read them run to the end first; with stream-ordered waits (or no streamed layer, or on the host) the
    layers are read as they are."""
    layout = WeightSpec(5, {"w": ((2, 2), "float32")}, resident_layers=2, ring_slots=2)
    log = []
    read = layer_reader(FakeForward(log), layout, FakeGpu(log), ordered=False)
    for layer in range(5):
        read(layer)
    assert log == [0, 1, 2, "sync", 3, "sync", 4]
    for xp, ordered, placed in ((FakeGpu(log), True, layout), (NUMPY, False, layout),
                                (FakeGpu(log), False, WeightSpec(5, {"w": ((2, 2), "float32")}))):
        f = FakeForward(log)
        assert layer_reader(f, placed, xp, ordered) == f.layer


def test_the_stream_is_passed_only_to_a_forward_that_takes_it_on_a_gpu():
    class Old:
        def forward(self, task_id, timeout=None):
            pass

    class New:
        def forward(self, task_id, timeout=None, stream=None):
            pass
    assert stream_ordered(New(), FakeGpu([])) and not stream_ordered(Old(), FakeGpu([]))
    assert not stream_ordered(New(), NUMPY)


@pytest.mark.parametrize("args,message", [
    (["--device", "sim", "--framework", "paddle"], "does not compute with 'paddle'"),
    (["--device", "sim", "--framework", "cupy"], "does not run on device 'sim'"),
])
def test_launch_offload_weights_refuses_a_framework_the_model_cannot_use(args, message):
    done = subprocess.run([sys.executable, "-m", "fastcache.launch", *args, "--offload-weights", "0.5"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
