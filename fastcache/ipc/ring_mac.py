"""The MACs of the shared-memory rings (done_ring, task_ring): a keyed BLAKE2b under the deployment's token, its
person naming what is signed (a record, a count) and bound to the ring's owner (`who`), so that nothing signed
for one purpose, process or rank passes for another (docs/design.md §12)."""
from __future__ import annotations

import hashlib

from .queue import MAC_BYTES


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
