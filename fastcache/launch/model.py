"""A small model for the weight path (docs/design.md §11): a stack of matrix layers, x <- tanh(x @ w + b), with
weights drawn from a seed. Used by the worker processes of `--offload-weights`, the tests and
benchmarks/offload_bench.py; `forward` takes the layers from a callable, so the same arithmetic runs on resident
weights, streamed ones and a reference in the caller's process.

The forward is written once over a few array operations (`arrays(framework, device)`): NumPy on the sim device,
torch (CPU tensors on sim, device tensors on cuda) or CuPy on cuda. Inputs and weights are drawn in NumPy and
moved to the framework's device, so every framework computes on the same numbers.
"""
from __future__ import annotations

import importlib.util
import time

import numpy as np

from ..weight_spec import WeightSpec

MODEL_FRAMEWORKS = {"sim": ("numpy", "torch"), "cuda": ("torch", "cupy")}


def model_spec(num_layers: int, hidden: int) -> WeightSpec:
    return WeightSpec(num_layers, {"w": ((hidden, hidden), "float32"), "b": ((hidden,), "float32")})


def layer_weights(seed: int, rank: int, layer: int, hidden: int) -> dict:
    """Layer `layer`'s weights on `rank` for weight version `seed` (random, never zeros)."""
    rng = np.random.default_rng([seed, rank, layer])
    scale = np.float32(1.0 / np.sqrt(hidden))
    return {"w": (rng.standard_normal((hidden, hidden), np.float32) * scale),
            "b": rng.standard_normal(hidden, np.float32)}


def model_input(seed: int, batch: int, hidden: int) -> np.ndarray:
    return np.random.default_rng([seed, 1 << 20]).standard_normal((batch, hidden), np.float32)


def pick_framework(device: str, requested: str | None = None) -> str:
    """The framework the model computes with: `requested` if it runs on `device`, else numpy on sim and on
    cuda torch when importable, else CuPy. ValueError when none fits."""
    if device not in MODEL_FRAMEWORKS:
        raise ValueError(f"the model runs on device sim or cuda, not {device!r}")
    if requested is not None:
        if requested not in MODEL_FRAMEWORKS[device]:
            raise ValueError(f"the model does not compute with {requested!r} on {device} "
                             f"(choose from {', '.join(MODEL_FRAMEWORKS[device])})")
        return requested
    if device == "sim":
        return "numpy"
    for name in MODEL_FRAMEWORKS["cuda"]:
        if importlib.util.find_spec(name) is not None:
            return name
    raise ValueError("the model on cuda needs torch or cupy, and neither is installed")


class NumpyArrays:
    """Host arrays (the sim device's tensors): what the forward needs, and what it costs to copy a layer."""
    framework, on_gpu = "numpy", False

    def to_device(self, a: np.ndarray):
        return np.array(a, np.float32)          # a copy: the forward reuses its input as a buffer

    def to_host(self, a) -> np.ndarray:
        return np.ascontiguousarray(a, np.float32)

    def empty_like(self, a):
        return np.empty_like(a)

    def matmul(self, a, b, out):
        np.matmul(a, b, out=out)

    def add_(self, out, b):
        np.add(out, b, out=out)

    def tanh_(self, out):
        np.tanh(out, out=out)

    def synchronize(self):
        pass

    def stream(self):
        return None

    def copy_seconds(self, nbytes: int, repeats: int = 3) -> float:
        """Best time of copying `nbytes` into the device's memory (on sim: a memcpy between host buffers, as
        the sim transfer manager's copy is)."""
        src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        return _best(lambda: np.copyto(dst, src), self.synchronize, repeats)


class TorchArrays(NumpyArrays):
    """torch tensors: CPU ones on sim, on GPU `device_id` on cuda (the worker's current stream)."""
    framework = "torch"

    def __init__(self, device: str, device_id: int = 0):
        import torch
        self.torch, self.on_gpu = torch, device == "cuda"
        self.device = torch.device(f"cuda:{device_id}" if self.on_gpu else "cpu")
        if self.on_gpu:
            torch.cuda.set_device(self.device)
            # full float32 products (torch's default): TF32 would change the numbers and the arithmetic of the
            # benchmark's defaults
            torch.backends.cuda.matmul.allow_tf32 = False

    def to_device(self, a: np.ndarray):
        return self.torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(self.device, copy=True)

    def to_host(self, a) -> np.ndarray:
        return np.ascontiguousarray(a.cpu().numpy(), np.float32)

    def empty_like(self, a):
        return self.torch.empty_like(a)

    def matmul(self, a, b, out):
        self.torch.matmul(a, b, out=out)

    def add_(self, out, b):
        out.add_(b)

    def tanh_(self, out):
        out.tanh_()

    def synchronize(self):
        if self.on_gpu:
            self.torch.cuda.synchronize(self.device)

    def stream(self):
        return self.torch.cuda.current_stream(self.device) if self.on_gpu else None

    def copy_seconds(self, nbytes: int, repeats: int = 3) -> float:
        """Best time of one host-to-device copy of `nbytes` from pinned memory (CPU tensors: a memcpy)."""
        torch = self.torch
        src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=self.on_gpu)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return _best(lambda: dst.copy_(src, non_blocking=True), self.synchronize, repeats)


class CupyArrays(NumpyArrays):
    """CuPy arrays on GPU `device_id` (cuda only), on its current stream."""
    framework, on_gpu = "cupy", True

    def __init__(self, device_id: int = 0):
        import cupy
        self.cupy = cupy
        cupy.cuda.Device(device_id).use()

    def to_device(self, a: np.ndarray):
        return self.cupy.array(np.ascontiguousarray(a, np.float32))

    def to_host(self, a) -> np.ndarray:
        return np.ascontiguousarray(self.cupy.asnumpy(a), np.float32)

    def empty_like(self, a):
        return self.cupy.empty_like(a)

    def matmul(self, a, b, out):
        self.cupy.matmul(a, b, out=out)

    def add_(self, out, b):
        self.cupy.add(out, b, out=out)

    def tanh_(self, out):
        self.cupy.tanh(out, out=out)

    def synchronize(self):
        self.cupy.cuda.get_current_stream().synchronize()

    def stream(self):
        return self.cupy.cuda.get_current_stream()

    def copy_seconds(self, nbytes: int, repeats: int = 3) -> float:
        """Best time of one host-to-device copy of `nbytes` from pinned memory."""
        import cupyx
        src = cupyx.empty_pinned((nbytes,), np.uint8)
        src[...] = 1
        dst = self.cupy.empty(nbytes, np.uint8)
        return _best(lambda: dst.set(src, stream=self.stream()), self.synchronize, repeats)


def arrays(framework: str = "numpy", device: str = "sim", device_id: int = 0):
    """The array operations of `framework` on `device` (see pick_framework)."""
    framework = pick_framework(device, framework)
    if framework == "numpy":
        return NUMPY
    if framework == "torch":
        return TorchArrays(device, device_id)
    return CupyArrays(device_id)


def _best(copy, synchronize, repeats: int) -> float:
    copy()                          # the first one pays for page faults and lazy set-up
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        copy()
        synchronize()
        best = min(best, time.perf_counter() - began)
    return best


NUMPY = NumpyArrays()


def forward(x, layer_of, num_layers: int, xp=NUMPY):
    """Every layer in order; layer_of(l) returns {name: array} (and may wait for it). x and the layers are
    arrays of `xp` (arrays()); x is reused as a buffer. On a GPU the kernels are only enqueued on the current
    stream: xp.synchronize() before reading the time or the result on the host."""
    out = xp.empty_like(x)
    for layer in range(num_layers):
        p = layer_of(layer)
        xp.matmul(x, p["w"], out)
        xp.add_(out, p["b"])
        xp.tanh_(out)
        x, out = out, x
    return x


def reference(seed: int, rank: int, x: np.ndarray, num_layers: int, hidden: int, xp=NUMPY) -> np.ndarray:
    """The forward over freshly drawn weights, in this process, with `xp`'s framework; a host array."""
    def layer_of(layer):
        return {name: xp.to_device(a) for name, a in layer_weights(seed, rank, layer, hidden).items()}
    out = forward(xp.to_device(x), layer_of, num_layers, xp)
    xp.synchronize()
    return xp.to_host(out)
