"""Hand-off between fastcache memory and the user's framework, zero-copy through DLPack.

No framework is imported unless a worker asks for it.
"""
from __future__ import annotations

import numpy as np

FRAMEWORKS = ("numpy", "paddle", "torch", "cupy")

# NumPy storage dtype of each element dtype (NumPy has no bfloat16: bf16 travels as uint16 bits)
NUMPY_STORAGE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "uint8": np.uint8}


def check_framework(framework: str):
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; expected one of {FRAMEWORKS}")


def wrap_host_array(array: np.ndarray, dtype: str, framework: str):
    """A framework tensor sharing `array`'s memory (the sim device's 'GPU' tensors)."""
    check_framework(framework)
    if framework == "numpy":
        return array
    if framework == "paddle":
        import paddle
        if dtype == "bfloat16":     # Paddle views int16 (not uint16) bits as bfloat16
            return paddle.utils.dlpack.from_dlpack(array.view(np.int16)).view(paddle.bfloat16)
        return paddle.utils.dlpack.from_dlpack(array)
    if framework == "torch":
        import torch
        tensor = torch.from_dlpack(array)
        return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor
    raise ValueError("framework 'cupy' needs device='cuda'")
