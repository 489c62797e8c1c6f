"""Exceptions shared by the engine, the transfer managers and the workers."""


class TransferError(RuntimeError):
    """A swap, or a clear/restore phase, failed on some rank (the message names it and says why)."""


class RefusedError(TransferError):
    """The deployment refused a request in its current state (being cleared, restored or resharded, or a
    rank not ready yet): nothing was sent, and the same request can succeed once it is back in service."""
