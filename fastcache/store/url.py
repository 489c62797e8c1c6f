"""Store URLs: `mooncake://HOST:PORT[?options]` and `file:///DIR`.

Mooncake options (all optional): `protocol=tcp|rdma`, `device=mlx5_0,mlx5_1` (RDMA devices),
`local_hostname=ADDR` (the address other hosts reach this process on; 127.0.0.1 only works on one
machine), `segment_mb=N` (memory this process lends to the pool; 0, the default, lends none and leaves
the objects to the store's own memory servers, so they outlive a deployment), `batch_mb=N` (the most
one Mooncake call moves, default 256; a larger task goes in parts).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

from .base import BlockStore

MOONCAKE_OPTIONS = ("protocol", "device", "local_hostname", "segment_mb", "batch_mb")
MAX_PORT = 65535


@dataclass(frozen=True)
class StoreURL:
    url: str
    scheme: str                 # "mooncake" | "file"
    location: str               # HOST:PORT of the master, or the directory
    options: dict = field(default_factory=dict)


def parse_store_url(url) -> StoreURL:
    """Check a store URL without connecting; ValueError says what is wrong."""
    if not isinstance(url, str):
        raise ValueError(f"store must be a URL string, got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/") or parts.query:
            raise ValueError(f"store {url!r}: expected file:///ABSOLUTE/DIR")
        return StoreURL(url, "file", os.path.normpath(parts.path))
    if parts.scheme == "mooncake":
        try:
            port = parts.port
        except ValueError:          # not a number, or above 65535
            port = -1
        if not parts.hostname or port is None or parts.path not in ("", "/"):
            raise ValueError(f"store {url!r}: expected mooncake://HOST:PORT (the master's address)")
        if not 1 <= port <= MAX_PORT:
            raise ValueError(f"store {url!r}: port must be a number from 1 to {MAX_PORT} (the master's port)")
        options = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)))
        unknown = set(options) - set(MOONCAKE_OPTIONS)
        if unknown:
            raise ValueError(f"store {url!r}: unknown options {sorted(unknown)}; known: {', '.join(MOONCAKE_OPTIONS)}")
        if options.get("protocol", "tcp") not in ("tcp", "rdma"):
            raise ValueError(f"store {url!r}: protocol must be tcp or rdma")
        if not options.get("segment_mb", "0").isdigit():
            raise ValueError(f"store {url!r}: segment_mb must be a whole number of MiB")
        if not options.get("batch_mb", "1").isdigit() or int(options.get("batch_mb", "1")) < 1:
            raise ValueError(f"store {url!r}: batch_mb must be a whole number of MiB >= 1")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return StoreURL(url, "mooncake", f"{host}:{port}", options)
    raise ValueError(f"store {url!r}: expected mooncake://HOST:PORT or file:///DIR")


def open_store(url) -> BlockStore:
    """Open (connect to) the store a URL names; StoreError if it cannot be reached."""
    parsed = url if isinstance(url, StoreURL) else parse_store_url(url)
    if parsed.scheme == "file":
        from .local import FileStore
        return FileStore(parsed.url, parsed.location)
    from .mooncake import MooncakeStore
    opts = parsed.options
    return MooncakeStore(parsed.url, parsed.location, protocol=opts.get("protocol", "tcp"),
                         devices=opts.get("device", ""), local_hostname=opts.get("local_hostname", "127.0.0.1"),
                         segment_bytes=int(opts.get("segment_mb", "0")) << 20,
                         batch_bytes=int(opts.get("batch_mb", "256")) << 20)
