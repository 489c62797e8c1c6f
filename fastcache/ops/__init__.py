"""Device backends: `sim` (shared memory + NumPy, any machine) and `cuda` (cuda-python)."""
from .base import AttachedCache, Copier, DeviceOps, LocalCache, SwapSpace

DEVICES = ("sim", "cuda", "auto")


def cuda_device_count() -> int:
    """How many GPUs cuda-python sees (0 without cuda-python, a driver or a GPU)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return 0
    try:
        err, count = runtime.cudaGetDeviceCount()
    except Exception:
        return 0
    return int(count) if int(err) == 0 else 0


def cuda_usable() -> bool:
    """True if cuda-python is importable and sees at least one GPU."""
    return cuda_device_count() > 0


def round_robin_devices(device: str, tp_size: int, count: int | None = None) -> list[int] | None:
    """The launcher's placement of tp_size ranks: on cuda, rank r on GPU r modulo the GPU count (`count`,
    default what cuda-python sees), so one GPU holds every rank; None (the backend's default) on sim. An
    engine passes its own device_ids."""
    if device != "cuda":
        return None
    count = cuda_device_count() if count is None else count
    if count < 1:
        raise ValueError("no CUDA GPU is visible")
    return [rank % count for rank in range(tp_size)]


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
           "cuda_usable", "cuda_device_count", "round_robin_devices"]
