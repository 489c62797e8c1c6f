"""CacheWorker: allocates and exports one rank's KV cache inside the engine's GPU worker."""
from .cache_worker import CacheWorker

__all__ = ["CacheWorker"]
