"""Sealed L3 objects: AES-GCM under a deployment key (docs/design.md §12).

A store such as Mooncake has no authentication: whoever reaches it can read every object and write any
key. With a deployment key, an object's payload is encrypted and authenticated: the store sees no
plaintext, and a forged, altered or replayed object (another key's object copied under this one, another
namespace's, geometry's or rank's) fails authentication, which is a miss, never wrong bytes.

The sealed object is the ciphertext (as long as the payload) and a 64-byte header in the same slot the
plain header takes: magic, rank, a random 96-bit nonce per object, hash, payload length, the 128-bit tag
and the geometry fingerprint. The associated data binds magic, rank, hash, length, fingerprint and the
namespace's digest, so none of them can be swapped without the tag failing. Random nonces are safe for
about 2**32 objects per key: rotate the key (and the namespace) well before that.

The key lives in a file (`key_file=PATH` in the store URL): 32 random bytes, raw or as 64 hex digits
(`head -c 32 /dev/urandom > key`), readable by its owner only. A key that is plainly not random is
refused: 32 raw bytes that are all printable text (a password, or hex digits of 16 bytes), or a key with
fewer than MIN_DISTINCT_BYTES distinct byte values (zeros, a repeated pattern), which random keys have
with a probability below 1e-14. Its path travels in the URL; the key itself never appears in a URL, an
argument or a log.
"""
from __future__ import annotations

import os
import stat
import struct

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 32
MIN_DISTINCT_BYTES = 16     # 32 random bytes hold about 30 distinct values; fewer than 16: not random
NONCE_BYTES = 12
TAG_BYTES = 16
SEALED_FORMAT = 1
SEALED_MAGIC = b"FCL3SEA%d" % SEALED_FORMAT
# magic, rank, nonce, hash, payload length, tag, fingerprint
SEALED_HEADER = struct.Struct("<8sI12sQQ16s8s")
# what the tag authenticates besides the ciphertext: magic, rank, hash, length, fingerprint, namespace digest
ASSOCIATED = struct.Struct("<8sIQQ8s16s")


def load_key(path: str) -> bytes:
    """The deployment key in the file at path; ValueError (naming key_file, never the key) if unusable."""
    try:
        info = os.stat(path)
        with open(path, "rb") as f:
            raw = f.read(4 * KEY_BYTES)
    except OSError as exc:
        raise ValueError(f"key_file {path!r} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"key_file {path!r} is not a regular file")
    if info.st_mode & 0o077:
        raise ValueError(f"key_file {path!r} is readable by others (mode {stat.S_IMODE(info.st_mode):o}); "
                         f"chmod 600 it")
    text = raw.strip()
    if len(raw) == KEY_BYTES:
        return _random_looking(path, raw)
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"key_file {path!r} must hold {KEY_BYTES} bytes, raw or as {2 * KEY_BYTES} hex digits")
    return _random_looking(path, key)


def _random_looking(path, key: bytes) -> bytes:
    if all(0x20 <= b < 0x7f for b in key):
        raise ValueError(f"key_file {path!r} holds {KEY_BYTES} characters of text, not a key: write "
                         f"{KEY_BYTES} random bytes (head -c {KEY_BYTES} /dev/urandom) or their "
                         f"{2 * KEY_BYTES} hex digits")
    if len(set(key)) < MIN_DISTINCT_BYTES:
        raise ValueError(f"key_file {path!r} holds a low-entropy key ({len(set(key))} distinct byte values): "
                         f"write {KEY_BYTES} random bytes (head -c {KEY_BYTES} /dev/urandom)")
    return key


class Sealer:
    """Seals and opens object payloads under one deployment key."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a deployment key has {KEY_BYTES} bytes")
        self._aead = AESGCM(key)

    @classmethod
    def from_file(cls, path: str) -> "Sealer":
        return cls(load_key(path))

    def __repr__(self):
        return "Sealer(<key>)"          # never the key

    def seal(self, out, rank: int, h: int, payload, fp: bytes, ns: bytes):
        """Write the sealed object of payload into out (a uint8 array of len(payload) + 64 bytes)."""
        n = len(payload)
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, memoryview(payload), ASSOCIATED.pack(SEALED_MAGIC, rank, h, n, fp, ns))
        out[:n] = np.frombuffer(sealed, np.uint8, n)
        out[n:n + SEALED_HEADER.size] = np.frombuffer(SEALED_HEADER.pack(SEALED_MAGIC, rank, nonce, h, n, sealed[n:], fp),
                                                      np.uint8)

    def open(self, rank: int, h: int, header, payload, fp: bytes, ns: bytes) -> bool:
        """Authenticate a fetched object (payload holds its ciphertext) and decrypt it in place. False, with
        payload undefined, if it is not this key's object of (rank, h, fingerprint, namespace)."""
        try:
            magic, got_rank, nonce, got_hash, length, tag, got_fp = SEALED_HEADER.unpack(
                bytes(header[:SEALED_HEADER.size]))
        except struct.error:
            return False
        if (magic, got_rank, got_hash, length, got_fp) != (SEALED_MAGIC, rank, h, len(payload), fp):
            return False
        try:
            plain = self._aead.decrypt(nonce, bytes(payload) + tag,
                                       ASSOCIATED.pack(SEALED_MAGIC, rank, h, length, fp, ns))
        except InvalidTag:
            return False
        payload[:] = np.frombuffer(plain, np.uint8)
        return True
