"""Store URLs: `mooncake://HOST:PORT[?options]` and `file:///DIR`.

Mooncake options (all optional): `protocol=tcp|rdma`, `device=mlx5_0,mlx5_1` (RDMA devices),
`local_hostname=ADDR` (the address other hosts reach this process on; 127.0.0.1 only works on one
machine), `segment_mb=N` (memory this process lends to the pool; 0, the default, lends none and leaves
the objects to the store's own memory servers, so they outlive a deployment), `batch_mb=N` (the most
one Mooncake call moves, default 256; a larger task goes in parts). Sizes are whole MiB up to MAX_MB; the
master's port is 1 to 65535. A bad value is refused when the URL is parsed, naming the port or option.

Both schemes take `key_file=PATH`: a file holding the deployment key that seals every object (seal.py);
the key is checked when the URL is parsed, and only its path ever travels.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote_plus, urlsplit

from .base import BlockStore
from .seal import Sealer, load_key

MOONCAKE_OPTIONS = ("protocol", "device", "local_hostname", "segment_mb", "batch_mb", "key_file")
FILE_OPTIONS = ("key_file",)
# options in MiB -> the least allowed
MIB_OPTIONS = {"segment_mb": 0, "batch_mb": 1}
MAX_MB = 1 << 30            # 1 PiB: beyond any machine's memory, and its bytes fit a 64-bit count
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
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"store {url!r}: expected file:///ABSOLUTE/DIR")
        options = _options(url, parts.query)
        _check_known(url, options, FILE_OPTIONS)
        return StoreURL(url, "file", os.path.normpath(parts.path), _checked_key(options))
    if parts.scheme == "mooncake":
        try:
            port = parts.port
        except ValueError:          # not a number, or above 65535
            port = -1
        if not parts.hostname or port is None or parts.path not in ("", "/"):
            raise ValueError(f"store {url!r}: expected mooncake://HOST:PORT (the master's address)")
        if not 1 <= port <= MAX_PORT:
            raise ValueError(f"store {url!r}: port must be a number from 1 to {MAX_PORT} (the master's port)")
        options = _options(url, parts.query)
        _check_known(url, options, MOONCAKE_OPTIONS)
        _checked_key(options)
        if options.get("protocol", "tcp") not in ("tcp", "rdma"):
            raise ValueError(f"store {url!r}: protocol must be tcp or rdma")
        for name, least in MIB_OPTIONS.items():
            if name in options:
                options[name] = str(_mib(url, name, options[name], least))
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return StoreURL(url, "mooncake", f"{host}:{port}", options)
    raise ValueError(f"store {url!r}: expected mooncake://HOST:PORT or file:///DIR")


def _check_known(url, options, known):
    unknown = set(options) - set(known)
    if unknown:
        raise ValueError(f"store {url!r}: unknown options {sorted(unknown)}; known: {', '.join(known)}")


def _checked_key(options) -> dict:
    """The options, with a key_file that holds a usable key (ValueError naming key_file otherwise)."""
    if "key_file" in options:
        load_key(options["key_file"])
    return options


def _options(url, query) -> dict:
    """The NAME=VALUE options of a query, each given at most once."""
    for part in query.split("&") if query else ():
        if "=" not in part:
            what = f"{unquote_plus(part)} has no value" if part else "an option is empty"
            raise ValueError(f"store {url!r}: {what}; options are NAME=VALUE joined by &")
    pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    options = {}
    for name, value in pairs:
        if name in options:
            raise ValueError(f"store {url!r}: {name} is given twice")
        options[name] = value
    return options


def _mib(url, name, text, least) -> int:
    """A size option: a whole number of MiB from `least` to MAX_MB, in ASCII digits."""
    digits = text.lstrip("0") or "0"    # int() refuses more than 4300 digits, with a message naming no option
    if text.isascii() and text.isdigit() and len(digits) <= len(str(MAX_MB)) and least <= int(digits) <= MAX_MB:
        return int(digits)
    raise ValueError(f"store {url!r}: {name} must be a whole number of MiB from {least} to {MAX_MB}, got {text!r}")


def open_store(url) -> BlockStore:
    """Open (connect to) the store a URL names; StoreError if it cannot be reached."""
    parsed = url if isinstance(url, StoreURL) else parse_store_url(url)
    opts = parsed.options
    if parsed.scheme == "file":
        from .local import FileStore
        store = FileStore(parsed.url, parsed.location, sealed="key_file" in opts)
    else:
        from .mooncake import MooncakeStore
        store = MooncakeStore(parsed.url, parsed.location, protocol=opts.get("protocol", "tcp"),
                              devices=opts.get("device", ""), local_hostname=opts.get("local_hostname", "127.0.0.1"),
                              segment_bytes=int(opts.get("segment_mb", "0")) << 20,
                              batch_bytes=int(opts.get("batch_mb", "256")) << 20)
    if "key_file" in opts:
        store.sealer = Sealer.from_file(opts["key_file"])
    return store
