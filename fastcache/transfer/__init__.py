"""The cache transfer manager daemon (one process per rank)."""
from .manager import EXIT_REASONS, TransferManager

__all__ = ["TransferManager", "EXIT_REASONS"]
