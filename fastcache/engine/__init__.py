"""The engine side: SwapBackend and its helpers."""
from .allocator import CpuBlockAllocator
from .backend import SwapBackend
from .handle import TransferHandle
from .tiered import TieredCache

__all__ = ["SwapBackend", "TransferHandle", "CpuBlockAllocator", "TieredCache"]
