"""What names an L3 object and what it carries: key, geometry fingerprint and the header checked on fetch.

An object holds one rank's CPU block of one hash: the block's bytes, then a 64-byte header (laid in the
CPU tier's slot after the block, so that a store moves the object as one buffer). The header
repeats everything the key says (namespace, geometry fingerprint, hash, rank) plus the payload's length
and checksum, so a fetch that finds a foreign, stale, truncated or corrupted object under the key sees a
mismatch and reports a miss: it never hands out wrong bytes.
"""
from __future__ import annotations

import functools
import hashlib
import json
import struct

import numpy as np
import xxhash

from ..config import CacheSpec, check_namespace
from .seal import SEALED_MAGIC

FORMAT = 2                                  # bump when the object layout or the fingerprint inputs change
MAGIC = b"FCL3OBJ%d" % FORMAT
# magic, rank, reserved, hash, payload length, payload checksum (xxh3-64), fingerprint, namespace digest
HEADER = struct.Struct("<8sIIQQQ8s16s")
HEADER_BYTES = 64
assert HEADER.size == HEADER_BYTES
# what a fetch makes of an object found under a key: this key's object; one this engine cannot authenticate
# (sealed under another key, or sealed while this engine has no key), never removed since it may well be
# another deployment's; or one that is provably not what its key names, removed so a put can replace it
OK, FOREIGN, CORRUPT = "ok", "foreign", "corrupt"


def as_hashes(hashes, label="hashes") -> np.ndarray:
    """Block hashes as a 1-D uint64 array: any integer sequence or array; negative values are taken as
    the bits of an int64 (engines often hash into signed 64-bit ints)."""
    if isinstance(hashes, (str, bytes, dict, set)):
        raise ValueError(f"{label} must be a sequence of ints, got {type(hashes).__name__}")
    if not isinstance(hashes, np.ndarray):
        values = list(hashes)
        if any(isinstance(h, bool) or not isinstance(h, (int, np.integer)) for h in values):
            raise ValueError(f"{label} must hold ints")
        if any(not -2**63 <= int(h) < 2**64 for h in values):
            raise ValueError(f"{label}: a hash lies outside the 64-bit range")
        return np.array([int(h) & (2**64 - 1) for h in values], dtype=np.uint64)
    if hashes.ndim != 1:
        raise ValueError(f"{label} must be one-dimensional, got shape {hashes.shape}")
    if hashes.size and hashes.dtype.kind not in "iu":
        raise ValueError(f"{label} must hold integers, got dtype {hashes.dtype}")
    if hashes.dtype.kind == "i":
        return hashes.astype(np.int64).view(np.uint64)
    return hashes.astype(np.uint64)


@functools.lru_cache(maxsize=64)        # asked on every store task and store lookup: ~200 us to compute
def fingerprint(spec: CacheSpec, tp_size: int) -> str:
    """16 hex digits naming what the bytes of one rank's CPU block mean: the per-rank geometry and the
    tensor-parallel size (which heads a rank holds). Block counts are capacity, not meaning: left out."""
    meaning = {
        "format": FORMAT, "tp_size": tp_size, "cpu_block_bytes": spec.cpu_block_bytes,
        **{f: getattr(spec, f) for f in ("num_layers", "num_extra_layers", "block_size", "num_kv_heads",
                                         "head_dim", "cache_dtype", "has_value", "scale_dtype")},
        "tensors": [(t.kind, t.layer, t.block_bytes, t.cpu_offset) for t in spec.tensors()],
    }
    return hashlib.sha256(json.dumps(meaning, sort_keys=True).encode()).hexdigest()[:16]


def checksum(payload) -> int:
    return xxhash.xxh3_64_intdigest(payload)


class ObjectKeys:
    """The keys and headers of one rank's objects in one namespace and geometry."""

    def __init__(self, namespace: str, fingerprint: str, rank: int, sealer=None):
        self.namespace = check_namespace(namespace)
        self.sealer = sealer            # store.seal.Sealer: objects sealed under the deployment key
        self.fingerprint = fingerprint
        self.rank = rank
        self._fp = bytes.fromhex(fingerprint)
        self._ns = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        self.prefix = f"fastcache/{namespace}/{fingerprint}/"

    def name(self, h: int) -> str:
        """Mooncake key; it begins with namespace and fingerprint, as docs/design.md §8 asks."""
        return f"{self.prefix}{int(h):016x}/r{self.rank}"

    def header(self, h: int, payload) -> bytes:
        return HEADER.pack(MAGIC, self.rank, 0, int(h), len(payload), checksum(payload), self._fp, self._ns)

    def write_header(self, out: np.ndarray, h: int, payload):
        out[:HEADER_BYTES] = np.frombuffer(self.header(h, payload), np.uint8)

    def object(self, h: int, payload) -> bytes:
        """The whole object of hash h as a store holds it: the payload (sealed with a key), then its header."""
        out = np.empty(len(payload) + HEADER_BYTES, np.uint8)
        self.write_object(out, h, payload)
        return out.tobytes()

    def write_object(self, out: np.ndarray, h: int, payload):
        """Lay the object of hash h into out (len(payload) + HEADER_BYTES bytes). Without a key, out may be
        the CPU block and its slot themselves: only the header is written."""
        n = len(payload)
        if self.sealer is not None:
            self.sealer.seal(out, self.rank, int(h), payload, self._fp, self._ns)
            return
        if out[:n].ctypes.data != payload.ctypes.data:
            out[:n] = payload
        self.write_header(out[n:], h, payload)

    def open(self, h: int, header, payload) -> bool:
        """Is this fetched object (payload, header) the one of hash h? With a key it is authenticated and
        decrypted in place; a False leaves payload undefined."""
        return self.verdict(h, header, payload) == OK

    def verdict(self, h: int, header, payload) -> str:
        """OK, FOREIGN or CORRUPT (see above) for a fetched object of the right size; OK decrypts in place."""
        if self.sealer is not None:
            return OK if self.sealer.open(self.rank, int(h), header, payload, self._fp, self._ns) else FOREIGN
        if bytes(header[:len(SEALED_MAGIC)]) == SEALED_MAGIC:
            return FOREIGN
        return OK if self.matches(h, header, payload) else CORRUPT

    def wrong_size(self) -> str:
        """The verdict on an object of the wrong size: with a key it cannot be authenticated, so it is left."""
        return FOREIGN if self.sealer is not None else CORRUPT

    def matches(self, h: int, header, payload) -> bool:
        """Does this header describe exactly this key, and does the payload have its length and checksum?"""
        try:
            magic, rank, _, got_hash, length, digest, fp, ns = HEADER.unpack(bytes(header[:HEADER_BYTES]))
        except struct.error:
            return False
        return (magic == MAGIC and rank == self.rank and got_hash == int(h) and fp == self._fp and ns == self._ns
                and length == len(payload) and digest == checksum(payload))
