"""The cache transfer manager daemon (one process per rank)."""
from .manager import TransferManager

__all__ = ["TransferManager"]
