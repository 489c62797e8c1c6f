"""CacheWorker: allocates and exports one rank's KV cache inside the engine's GPU worker."""
from ..ipc.protocol import Fence
from .cache_worker import CacheWorker

__all__ = ["CacheWorker", "Fence"]
