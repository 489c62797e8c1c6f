"""A small model for the weight path (docs/design.md §11): a stack of matrix layers, x <- tanh(x @ w + b),
in NumPy (the sim device's framework), with weights drawn from a seed. Used by the worker processes of
`--offload-weights`, the tests and benchmarks/offload_bench.py; `forward` takes the layers from a callable,
so the same arithmetic runs on resident weights, streamed ones and a reference in the caller's process.
"""
from __future__ import annotations

import numpy as np

from ..weight_spec import WeightSpec


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


def forward(x: np.ndarray, layer_of, num_layers: int) -> np.ndarray:
    """Every layer in order; layer_of(l) returns {name: array} (and may wait for it)."""
    out = np.empty_like(x)
    for layer in range(num_layers):
        p = layer_of(layer)
        np.matmul(x, p["w"], out=out)
        out += p["b"]
        np.tanh(out, out=out)
        x, out = out, x
    return x


def reference(seed: int, rank: int, x: np.ndarray, num_layers: int, hidden: int) -> np.ndarray:
    """The forward over freshly drawn weights, in this process."""
    return forward(x.copy(), lambda layer: layer_weights(seed, rank, layer, hidden), num_layers)
