"""A rank's task ring (docs/design.md §4): the engine's small swap tasks for one transfer-manager process, as
fixed records in a shared-memory segment the engine creates for that process, announced by a doorbell (an
eventfd the engine makes with the ring and the process inherits at spawn). The completion ring
(ipc/done_ring.py) is its model, in the other direction.

One writer (the engine's submitting thread, under its submit lock) and one reader (the transfer manager's main
thread). Record i (from 0) lives in slot i % SLOTS: its commit word, body and ids, then (at the slot's end) the
MAC of those (one contiguous run for the reader to hash). The writer fills the body, ids and MAC first and the
commit word (i + 1) last (x86 orders stores; the commit word is one aligned 8-byte store). A record carries the
task inline: its sequence number (one numbering per rank, shared with the task pipe), task id, kind, flags, the
rank's fence and up to INLINE GPU and CPU block ids (int32). The reader publishes how many records it has
read, under the token, every PUBLISH_EVERY records: the writer reuses a slot only after that. The engine's
I/O thread publishes, under the token, how many records were written and the number of the last, so that the
reader can tell a record that was destroyed from one not yet written.

Everything in the segment can be written by any process of the user (§12), so nothing in it is believed
without its MAC under the deployment's token, keyed with the direction, the rank and the process's
incarnation: a record of another rank or of an earlier process does not pass. A record that fails its MAC
(or is missing) below the writer's signed count is reported bad; its task is then missing from the rank's
numbers, and fails as lost (the transfer manager reports the gap, as for a message taken off its pipe).
"""
from __future__ import annotations

import hmac
import os
import struct
from typing import NamedTuple

import numpy as np

from .naming import segment_name
from .protocol import FENCE_SLOTS, KV, SWAP_TO_CPU, SWAP_TO_GPU, Fence
from .queue import MAC_BYTES
from .ring_mac import COUNT_BYTES, WORD, SignedRing
from .shm import SharedSegment

SLOTS = 256
PUBLISH_EVERY = SLOTS // 2              # the reader publishes its count after this many records: the writer sees
#                                         the ring full only with more than SLOTS - PUBLISH_EVERY records unread
INLINE = 24                             # block ids of each side a record holds
BODY = struct.Struct("<QQQHBBB3x")      # seq, task id, fence generation (62 bits: cuda_events), count, kind,
#                                         flags, fence slot
RECORD_BYTES = 256                      # commit word, body, the ids, padding, MAC
IDS_AT = 8 + BODY.size                  # the ids: count GPU ids, then count CPU ids (int32)
MAC_AT = RECORD_BYTES - MAC_BYTES       # the MAC of the commit word, the body and the ids
assert IDS_AT + 2 * 4 * INLINE <= MAC_AT
HEAD_BYTES = 2 * COUNT_BYTES            # the writer's count, then the reader's
RING_BYTES = HEAD_BYTES + SLOTS * RECORD_BYTES
TASK, WRITTEN, READ = b"fastcache>task", b"fastcache>tasks", b"fastcache>taken"     # MAC personalisations
PAIR = struct.Struct("<QQ")
ID = struct.Struct("<QI")               # the process's incarnation and rank, in every MAC
KINDS = {SWAP_TO_CPU: 1, SWAP_TO_GPU: 2}
KIND_NAMES = {code: kind for kind, code in KINDS.items()}
LAYERWISE, FENCED = 1, 2                # flags
IDS = [struct.Struct(f"<{2 * n}i") for n in range(INLINE + 1)]


def ring_name(suffix: str, rank: int, incarnation: int) -> str:
    """The task ring of one process of rank (its incarnation, as its task endpoint)."""
    return segment_name(suffix, f"task_rank{rank}.{incarnation}")


class Inline(NamedTuple):
    """A task as a record holds it, less what differs by rank (the number and the rank's fence)."""
    task_id: int
    kind: int
    flags: int
    count: int
    ids: bytes
    fences: dict | None     # rank -> (generation, slot); None without a fence


def inline(task_id, kind, gpu_ids, cpu_ids, layerwise=False, group=KV, ring=0, fence=()) -> Inline | None:
    """The task (protocol.encode_task's arguments, or encode_small_task's with lists of ints) as record contents, or None if it does not fit one: a
    weights task, more than INLINE ids a side, or an id beyond int32. Those go over the task pipe."""
    count = len(gpu_ids)
    if group != KV or ring or not 0 < count <= INLINE or len(cpu_ids) != count:
        return None
    try:
        ids = IDS[count].pack(*(gpu_ids if type(gpu_ids) is list else gpu_ids.tolist()),
                              *(cpu_ids if type(cpu_ids) is list else cpu_ids.tolist()))
    except struct.error:
        return None
    return Inline(task_id, KINDS[kind], LAYERWISE if layerwise else 0, count, ids,
                  {f.rank: (f.generation, f.slot) for f in fence} if fence else None)


class Record(NamedTuple):
    """A task read from the ring, as protocol.decode gives a task message: (header, [gpu ids, cpu ids])."""
    seq: int
    header: dict
    ids: list


class RingError(ValueError):
    """A record that passed its MAC holds a task the protocol does not allow (the text says what)."""


class _Ring(SignedRing):
    def __init__(self, segment, token: bytes, rank: int, incarnation: int):
        super().__init__(segment, RING_BYTES, token, ID.pack(incarnation, rank), (TASK, WRITTEN, READ), "task ring")
        self.rank = rank


class TaskRingWriter(_Ring):
    """The engine's end, for the process `incarnation` of rank; bell is its doorbell (an eventfd, inherited by
    that process at spawn). Used under the engine's submit lock only."""

    def __init__(self, segment, token: bytes, rank: int, incarnation: int, bell: int):
        super().__init__(segment, token, rank, incarnation)
        self.bell = bell
        self.written = self.read = self.published = 0
        self.last_seq = 0
        self.seqs = [0] * SLOTS     # the number of each slot's last record

    @classmethod
    def create(cls, suffix: str, token: bytes, rank: int, incarnation: int) -> "TaskRingWriter":
        segment = SharedSegment.create(ring_name(suffix, rank, incarnation), RING_BYTES, suffix)
        try:
            bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except BaseException:
            segment.close()
            raise
        return cls(segment, token, rank, incarnation, bell)

    def put(self, seq: int, task: Inline) -> bool:
        """Write the task as record `written`, numbered seq, and ring the doorbell; False when the ring is
        full (the reader has not said, under the token, that it read the slot's last record)."""
        i = self.written
        if i - self.read >= SLOTS and not self._room(i):
            return False
        at = HEAD_BYTES + (i % SLOTS) * RECORD_BYTES
        buf = self.buf
        gen, slot = task.fences.get(self.rank, (0, 0)) if task.fences else (0, 0)
        BODY.pack_into(buf, at + 8, seq, task.task_id, gen, task.count, task.kind, task.flags | (FENCED if gen else 0),
                       slot)
        end = at + IDS_AT + len(task.ids)
        buf[at + IDS_AT:end] = task.ids
        digest = self.keyed[TASK].copy()
        digest.update(WORD.pack(i + 1))
        digest.update(buf[at + 8:end])
        buf[at + MAC_AT:at + RECORD_BYTES] = digest.digest()
        self.words[at >> 3] = i + 1         # the commit word, last
        self.written, self.last_seq = i + 1, seq
        self.seqs[i % SLOTS] = seq
        os.eventfd_write(self.bell, 1)
        return True

    def _room(self, i: int) -> bool:
        read = self.get_count(COUNT_BYTES, READ)
        if read is not None and self.read <= WORD.unpack(read)[0] <= i:
            self.read = WORD.unpack(read)[0]
        return i - self.read < SLOTS

    def holds(self, first: int, last: int) -> set:
        """Which of the numbers first..last went as records (of the last SLOTS)."""
        return {seq for seq in self.seqs if first <= seq <= last}

    def publish(self):
        """Say, under the token, how many records were written and the number of the last (the engine's I/O
        thread, every 100 ms, under the submit lock): the reader then knows a record missing below it was
        destroyed, not late."""
        if self.published != self.written:
            self.put_count(0, WRITTEN, PAIR.pack(self.written, self.last_seq))
            self.published = self.written

    def close(self):
        super().close()
        os.close(self.bell)


class TaskRingReader(_Ring):
    """The transfer manager's end: head() first, then (after the task pipe is drained) read(head)."""

    def __init__(self, segment, token: bytes, rank: int, incarnation: int):
        super().__init__(segment, token, rank, incarnation)
        self.next = 0
        self.published = 0      # the read count last published to the writer
        self.last_head, self.head_value = None, (0, 0)

    def pending(self) -> bool:
        """Is the next record's commit word there (one load: what a spinning reader looks at)?"""
        i = self.next
        return int(self.words[(HEAD_BYTES + (i % SLOTS) * RECORD_BYTES) >> 3]) == i + 1

    def head(self) -> tuple[int, int]:
        """(records written, the number of the last) as the engine last published them under the token; (0, 0)
        if it has not, or what is there fails its MAC."""
        raw = bytes(self.buf[:COUNT_BYTES])
        if raw != self.last_head:       # checked once per value the engine publishes
            good = hmac.compare_digest(raw[PAIR.size:PAIR.size + MAC_BYTES], self.mac(WRITTEN, raw[:PAIR.size]))
            self.last_head, self.head_value = raw, PAIR.unpack_from(raw) if good else (0, 0)
        return self.head_value

    def read(self, head: tuple[int, int]) -> tuple[list[Record], list[int], list[str]]:
        """(records, bad, malformed): each record written since the last call that passes its MAC, in order; the
        indices of records below head's count that fail it or are missing (forged or destroyed); and what is
        wrong with authentic records the protocol does not allow (none, from this deployment's engine)."""
        records, bad, malformed = [], [], []
        i, written = self.next, head[0]
        words, buf, keyed = self.words, self.buf, self.keyed[TASK]
        while True:
            at = HEAD_BYTES + (i % SLOTS) * RECORD_BYTES
            if words[at >> 3] == i + 1:
                raw = bytes(buf[at:at + RECORD_BYTES])
                digest = keyed.copy()
                digest.update(raw[:IDS_AT + 8 * min(BODY.unpack_from(raw, 8)[3], INLINE)])
                if WORD.unpack_from(raw)[0] == i + 1 and hmac.compare_digest(raw[MAC_AT:], digest.digest()):
                    try:
                        records.append(self._task(raw))
                    except RingError as exc:
                        malformed.append(str(exc))
                    i += 1
                    continue
            if i < written:         # the engine says it wrote record i: it was destroyed or forged over
                bad.append(i)
                i += 1
                continue
            break
        if i != self.next:
            self.next = i
            if i - self.published >= PUBLISH_EVERY:     # a MAC per record read would cost more than the read
                self.published = i
                self.put_count(COUNT_BYTES, READ, WORD.pack(i))
        return records, bad, malformed

    def _task(self, raw: bytes) -> Record:
        seq, task_id, gen, count, kind, flags, slot = BODY.unpack_from(raw, 8)
        if kind not in KIND_NAMES or flags & ~(LAYERWISE | FENCED) or not 0 < count <= INLINE or \
                (flags & FENCED and (not gen or slot >= FENCE_SLOTS)):
            raise RingError(f"task ring record {seq}: kind {kind}, flags {flags}, {count} ids, fence ({gen}, {slot})")
        ids = np.array(IDS[count].unpack_from(raw, IDS_AT), np.int64)
        header = {"type": "task", "task_id": task_id, "kind": KIND_NAMES[kind], "dtype": "int32", "count": count,
                  "layerwise": bool(flags & LAYERWISE), "group": KV, "ring": 0,
                  "fence": [Fence(self.rank, gen, slot)] if flags & FENCED else []}
        return Record(seq, header, [ids[:count], ids[count:]])
