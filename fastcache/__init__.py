"""fastcache: moves paged LLM KV-cache blocks between GPU memory and pinned CPU memory."""
from .config import CacheSpec, Settings
from .engine import SwapBackend, TieredCache, TransferHandle
from .errors import RefusedError, TransferError

__all__ = ["CacheSpec", "Settings", "SwapBackend", "TieredCache", "TransferHandle", "TransferError", "RefusedError"]
__version__ = "0.1.0"
