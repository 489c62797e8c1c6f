"""A rank's completion ring (docs/design.md §4): its transfer manager's reports of tasks done, as fixed records
in a shared-memory segment the engine creates for that process, read by the engine's I/O thread after a
doorbell (an eventfd the engine hands the process at spawn).

One writer (the transfer manager's main thread) and one reader (the engine's I/O thread). Record i (from 0)
lives in slot i % SLOTS: its commit word, its body, then the MAC of both (so the reader hashes one contiguous
run). The writer fills the body and MAC first and the commit word (i + 1) last, so a reader that sees the
commit word sees the body (x86 orders stores; the commit word is one aligned 8-byte store).
The writer publishes how many it has written before it sleeps, every PUBLISH_EVERY records and when the ring is
full (publish(): a MAC per record would cost more than the record), and the reader, every PUBLISH_EVERY records,
how many it has read, each with its own MAC: a slot is reused only once the reader has said, under the token,
that it read it.

Everything in the segment can be written by any process of the user (§12), so nothing in it is believed
without its MAC under the deployment's token, keyed with the direction, the rank and the writer's pid. A
record that fails its MAC or is missing, once the writer's signed count says it was written, is reported
by the reader (bad; before that, one failing its MAC may be a forger's ahead of the writer's, and the reader
looks at the slot again rather than skip the writer's record); the engine then asks the transfer manager over
its pipe to send those reports again over the reply socket, and the reader's count stays at the first bad
record until the transfer manager has read that request (asked, served: the writer forgets what the count
says was read). A forged count only makes the ring look fuller: the writer then reports over the
reply socket, as it does whenever the ring is full.
"""
from __future__ import annotations

import hmac
import struct

from .naming import segment_name
from .queue import MAC_BYTES
from .ring_mac import COUNT_BYTES, WORD, SignedRing

SLOTS = 256
PUBLISH_EVERY = SLOTS // 2              # the reader publishes its count after this many records: the writer sees
#                                         the ring full only with more than SLOTS - PUBLISH_EVERY records unread
RECORD = struct.Struct("<QQQd")         # task id, bytes moved, puts skipped, seconds
RECORD_BYTES = 64                       # commit word, body, MAC (of the two), padding
SIGNED = 8 + RECORD.size                # the commit word and the body: what the MAC after them covers
HEAD_BYTES = 2 * COUNT_BYTES            # the writer's count, then the reader's
RING_BYTES = HEAD_BYTES + SLOTS * RECORD_BYTES
DONE, WRITTEN, READ = b"fastcache>done", b"fastcache>wrote", b"fastcache>read"     # MAC personalisations
ID = struct.Struct("<QI")               # the writer's pid and rank, in every MAC


def ring_name(suffix: str, rank: int, incarnation: int) -> str:
    """The completion ring of one process of rank (its incarnation, as its task endpoint)."""
    return segment_name(suffix, f"done_rank{rank}.{incarnation}")


class _Ring(SignedRing):
    def __init__(self, segment, token: bytes, rank: int, pid: int):
        super().__init__(segment, RING_BYTES, token, ID.pack(pid, rank), (DONE, WRITTEN, READ), "completion ring")
        self.rank = rank

    def _count(self, offset: int, person: bytes) -> int | None:
        raw = self.get_count(offset, person)
        return None if raw is None else WORD.unpack(raw)[0]


class RingWriter(_Ring):
    """The transfer manager's end: write(task_id, nbytes, skipped, seconds) -> False when the ring is full."""

    def __init__(self, segment, token: bytes, rank: int, pid: int):
        super().__init__(segment, token, rank, pid)
        self.written = 0
        self.published = 0      # the written count last published to the reader
        self.read = 0           # the reader's last count that passed its MAC
        self.log = {}           # index -> record body, of those the reader may still ask for again

    def write(self, task_id: int, nbytes: int, skipped: int, seconds: float) -> bool:
        i = self.written
        if i - self.read >= SLOTS:
            read = self._count(COUNT_BYTES, READ)
            if read is not None and self.read <= read <= i:
                self.read = read
                for old in [k for k in self.log if k < read]:
                    del self.log[old]
            if i - self.read >= SLOTS:
                return False
        body = RECORD.pack(task_id, nbytes, skipped, seconds)
        at = HEAD_BYTES + (i % SLOTS) * RECORD_BYTES
        self.buf[at + 8:at + SIGNED + MAC_BYTES] = body + self.mac(DONE, WORD.pack(i + 1) + body)
        self.words[at // 8] = i + 1         # the commit word, last
        self.written = i + 1
        self.log[i] = (task_id, nbytes, skipped, seconds)
        if i + 1 - self.published >= PUBLISH_EVERY or i + 1 - self.read >= SLOTS:
            self.publish()
        return True

    def publish(self):
        """Say, under the token, how many records were written (before this process sleeps, every PUBLISH_EVERY
        records, and when the ring is full): the reader then knows a record missing below it was destroyed, not
        late."""
        if self.published != self.written:
            self.published = self.written
            self.put_count(0, WRITTEN, WORD.pack(self.written))

    def again(self, first: int, last: int) -> list[tuple]:
        """The records first..last that the reader found bad, to send again another way."""
        return [self.log[i] for i in range(first, last + 1) if i in self.log]


class RingReader(_Ring):
    """The engine's end, for the process `pid` spawned for rank."""

    def __init__(self, segment, token: bytes, rank: int, pid: int):
        super().__init__(segment, token, rank, pid)
        self.next = 0
        self.published = 0      # the read count last published to the writer
        # the first bad record whose report the writer must still be able to send again, and the number of the
        # engine's message that asked for it: the published count stays at that record until the writer has
        # read the message (the writer forgets what the count says was read)
        self.hold = self.hold_seq = None

    def unread(self) -> bool:
        """Is there anything for read() to look at: the next record's commit word, or a count of the writer's
        beyond what was read (two loads, where read() takes a lock's worth of work)?"""
        i, words = self.next, self.words
        return words[(HEAD_BYTES + (i % SLOTS) * RECORD_BYTES) >> 3] == i + 1 or words[0] > i

    def read(self) -> tuple[list[tuple], list[int]]:
        """(records, bad): the (task_id, nbytes, skipped, seconds) of each record written since the last call,
        and the indices of records that failed their MAC or were overwritten (to be asked for again)."""
        records, bad = [], []
        i = self.next
        words, buf, done = self.words, self.buf, self.keyed[DONE]
        while True:
            at = HEAD_BYTES + (i % SLOTS) * RECORD_BYTES
            committed = words[at >> 3] == i + 1
            if committed:
                raw = bytes(buf[at:at + SIGNED + MAC_BYTES])
                digest = done.copy()
                digest.update(raw[:SIGNED])
                if WORD.unpack_from(raw)[0] == i + 1 and hmac.compare_digest(raw[SIGNED:], digest.digest()):
                    records.append(RECORD.unpack_from(raw, 8))
                    i += 1
                    continue
            # missing or failing its MAC: bad only once the writer says, under the token, that it wrote record i
            # (a record forged before the writer's is not skipped: the writer's, written next, is read then)
            if words[0] <= i:
                break
            written = self._count(0, WRITTEN)
            if written is None or written <= i:
                break
            if not committed and words[at >> 3] == i + 1:
                continue        # committed since its word was read (the count is published after the record)
            bad.append(i)       # written, and now missing or failing its MAC: destroyed or forged over
            i += 1
        if bad:
            self.hold = bad[0] if self.hold is None else self.hold
            self.hold_seq = None        # until asked() says which message asks for them
        if i != self.next:
            self.next = i
            self._publish()
        return records, bad

    def _publish(self):
        top = self.next if self.hold is None else self.hold
        if top - self.published >= PUBLISH_EVERY:      # a MAC per record read would cost more than the rest
            self.published = top
            self.put_count(COUNT_BYTES, READ, WORD.pack(top))

    def asked(self, seq: int):
        """The bad records read so far were asked for again in the engine's message number seq."""
        if self.hold is not None:
            self.hold_seq = seq

    def served(self, received: int):
        """The writer's process has read the engine's messages up to number `received`: once that includes the
        request for the bad records, their reports are on their way, and the count may pass them."""
        if self.hold_seq is not None and received >= self.hold_seq:
            self.hold = self.hold_seq = None
            self._publish()
