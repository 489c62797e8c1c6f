"""What the shared-memory rings (done_ring, task_ring) share: their MACs, a keyed BLAKE2b under the deployment's
token, its person naming what is signed (a record, a count) and bound to the ring's owner (`who`), so that
nothing signed for one purpose, process or rank passes for another (docs/design.md §12); and the segment of a
ring with its signed counts (SignedRing)."""
from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np

from .queue import MAC_BYTES

COUNT_BYTES = 32                        # a signed count: its value (a count first, 8 or 16 bytes) and its MAC
WORD = struct.Struct("<Q")


def keyed(token: bytes, person: bytes, who: bytes):
    """The state every MAC of (person, who) starts from: copied for each MAC (cheaper than keying a new one)."""
    digest = hashlib.blake2b(key=token, digest_size=MAC_BYTES, person=person)
    digest.update(who)
    return digest


def mac(state, *parts) -> bytes:
    """The MAC of parts, from a keyed() state."""
    digest = state.copy()
    for part in parts:
        digest.update(part)
    return digest.digest()


class SignedRing:
    """A ring's segment of `size` bytes, as bytes (buf) and as aligned 8-byte words (words: a commit word or a
    count is one load or store, no NumPy scalars), with a keyed() state per person in `persons`, bound to
    `who`. `what` names the ring in errors."""

    def __init__(self, segment, size: int, token: bytes, who: bytes, persons, what: str):
        if segment.size < size:
            raise ValueError(f"{what} {segment.name}: {segment.size} bytes, expected {size}")
        self.segment, self.token, self.who = segment, token, who
        self.buf = memoryview(segment.array(np.uint8, (size,)))
        self.words = self.buf.cast("Q")
        self.keyed = {person: keyed(token, person, who) for person in persons}

    def mac(self, person: bytes, *parts) -> bytes:
        return mac(self.keyed[person], *parts)

    def put_count(self, offset: int, person: bytes, value: bytes):
        """value (its first 8 bytes a count) and its MAC at offset; the count's word last, so a torn read fails
        the MAC."""
        self.buf[offset + 8:offset + COUNT_BYTES] = (value[8:] + self.mac(person, value)).ljust(COUNT_BYTES - 8,
                                                                                               b"\0")
        self.words[offset // 8] = WORD.unpack_from(value)[0]

    def get_count(self, offset: int, person: bytes, size: int = 8) -> bytes | None:
        """The `size` bytes of value at offset, None if they fail their MAC."""
        raw = bytes(self.buf[offset:offset + COUNT_BYTES])
        good = hmac.compare_digest(raw[size:size + MAC_BYTES], self.mac(person, raw[:size]))
        return raw[:size] if good else None

    def close(self):
        self.words.release()
        self.buf.release()
        self.buf = self.words = None
        self.segment.close()
