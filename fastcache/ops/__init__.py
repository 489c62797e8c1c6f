"""Device backends: `sim` (shared memory + NumPy, any machine) and `cuda` (cuda-python)."""
from .base import AttachedCache, Copier, DeviceOps, LocalCache, SwapSpace

DEVICES = ("sim", "cuda", "auto")


def cuda_usable() -> bool:
    """True if cuda-python is importable and sees at least one GPU."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return False
    try:
        err, count = runtime.cudaGetDeviceCount()
    except Exception:
        return False
    return int(err) == 0 and count > 0


def resolve_device(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected one of {DEVICES}")
    if device == "auto":
        return "cuda" if cuda_usable() else "sim"
    return device


def get_ops(device: str) -> DeviceOps:
    device = resolve_device(device)
    if device == "sim":
        from .sim import SimOps
        return SimOps()
    from .cuda import CudaOps
    return CudaOps()


__all__ = ["AttachedCache", "Copier", "DeviceOps", "LocalCache", "SwapSpace", "get_ops", "resolve_device",
           "cuda_usable"]
