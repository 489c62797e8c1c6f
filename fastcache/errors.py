"""Exceptions shared by the engine, the transfer managers and the workers."""


class TransferError(RuntimeError):
    """A swap, or a clear/restore phase, failed on some rank (the message names it and says why)."""
