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


def share_host_memory(tensor) -> tuple[int, int, int]:
    """Move a torch CPU tensor's storage into shared memory in place and say where it lies: (descriptor of
    the shared file, its size, the tensor's byte offset in it). The storage object stays the same, so every
    view of it (an engine's own KV cache, adopted) follows; the file is unlinked at once and lives as long as
    the storage. torch's own multiprocessing sharing does this (`_share_fd_cpu_`)."""
    import torch
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise ValueError(f"only torch CPU tensors can be adopted on the sim device, got {type(tensor).__name__}"
                         f"{' on ' + str(tensor.device) if hasattr(tensor, 'device') else ''}")
    storage = tensor.untyped_storage()
    fd, size = storage._share_fd_cpu_()
    return fd, size, tensor.data_ptr() - storage.data_ptr()


# -- device tensors (the cuda device) --------------------------------------------------------------
def empty_device(framework: str, shape: tuple, dtype: str, device_id: int):
    """An uninitialised device tensor of the framework."""
    if framework == "torch":
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{device_id}")
    if framework == "cupy":
        import cupy
        with cupy.cuda.Device(device_id):
            return cupy.empty(shape, dtype=NUMPY_STORAGE[dtype])     # CuPy has no bfloat16: uint16 bits
    if framework == "paddle":
        import paddle
        return paddle.empty(shape, dtype=dtype, device=f"gpu:{device_id}")
    raise ValueError(f"framework {framework!r} holds host memory: it needs device='sim'")


def device_pointer(tensor) -> int:
    """Device address of a tensor's first element: data_ptr() (torch, paddle) or the CUDA array interface."""
    if hasattr(tensor, "data_ptr"):
        return int(tensor.data_ptr())
    return int(tensor.__cuda_array_interface__["data"][0])


def free_cached(framework: str):
    """Hand the framework's cached blocks back to the driver, so cudaMemGetInfo sees them free."""
    if framework == "torch":
        import torch
        torch.cuda.empty_cache()
    elif framework == "cupy":
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
    elif framework == "paddle":
        import paddle
        paddle.device.cuda.empty_cache()


def allocator_memory(framework: str, device_id: int) -> dict:
    """The framework's caching allocator on device_id, in this process: `allocated_bytes` (its live tensors) and
    `reserved_bytes` (what it holds from the driver, cached blocks included); {} for one without an allocator."""
    if framework == "torch":
        import torch
        return {"allocated_bytes": int(torch.cuda.memory_allocated(device_id)),
                "reserved_bytes": int(torch.cuda.memory_reserved(device_id))}
    if framework == "cupy":
        import cupy
        with cupy.cuda.Device(device_id):       # the default pool answers for the current device
            pool = cupy.get_default_memory_pool()
            return {"allocated_bytes": int(pool.used_bytes()), "reserved_bytes": int(pool.total_bytes())}
    if framework == "paddle":
        import paddle
        return {"allocated_bytes": int(paddle.device.cuda.memory_allocated(device_id)),
                "reserved_bytes": int(paddle.device.cuda.memory_reserved(device_id))}
    return {}


def view_as(base, numel: int, shape: tuple):
    """A view of base's first numel elements in shape, sharing its memory (torch, cupy, paddle)."""
    if hasattr(base, "view") and hasattr(base, "data_ptr") and not hasattr(base, "place"):   # torch
        return base.view(-1)[:numel].view(shape)
    if hasattr(base, "ravel"):                                                               # cupy
        return base.ravel()[:numel].reshape(shape)
    return base.flatten()[:numel].reshape(shape)                                             # paddle
