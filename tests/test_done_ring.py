"""The completion ring on its own (ipc/done_ring.py): a transfer manager's writer and the engine's reader over
one segment this test creates, and another process of the user writing to it as a forger would."""
from __future__ import annotations

import secrets

import numpy as np
import pytest

from fastcache.ipc import done_ring
from fastcache.ipc.protocol import runs
from fastcache.ipc.done_ring import HEAD_BYTES, RECORD_BYTES, RING_BYTES, SLOTS, RingReader, RingWriter, ring_name
from fastcache.ipc.shm import SharedSegment

TOKEN = secrets.token_bytes(16)


@pytest.fixture
def ring():
    suffix = f"test{secrets.token_hex(4)}"
    name = ring_name(suffix, 1, 3)
    owner = SharedSegment.create(name, RING_BYTES, suffix)
    reader = RingReader(owner, TOKEN, 1, 3)
    writer = RingWriter(SharedSegment.attach(name, suffix), TOKEN, 1, 3)
    forger = SharedSegment.attach(name, suffix).array(np.uint8, (RING_BYTES,))
    yield reader, writer, forger
    writer.close()
    reader.close()      # the creator's close unlinks the name


def records(rng, n):
    return [(int(rng.integers(1, 1 << 62)), int(rng.integers(0, 1 << 40)), int(rng.integers(0, 9)),
             float(rng.random())) for _ in range(n)]


def slot(i):
    return HEAD_BYTES + (i % SLOTS) * RECORD_BYTES


def test_records_arrive_in_order_once_and_only_under_the_token(ring):
    reader, writer, _ = ring
    want = records(np.random.default_rng(1), 40)
    for r in want[:25]:
        assert writer.write(*r)
    got, bad = reader.read()
    assert (got, bad) == (want[:25], [])
    assert reader.read() == ([], [])        # read once
    for r in want[25:]:
        assert writer.write(*r)
    assert reader.read() == (want[25:], [])
    # the negative control: a reader keyed otherwise (another token, rank or process) believes none of them
    writer.write(*want[0])
    for token, rank, incarnation in ((bytes(16), 1, 3), (TOKEN, 0, 3), (TOKEN, 1, 2)):
        other = RingReader(SharedSegment.attach(reader.segment.name), token, rank, incarnation)
        other.next = 40
        assert other.read() == ([], []) and other.next == 40      # nor the writer's count: it waits for record 40
        other.close()


def test_a_full_ring_refuses_a_record_until_the_reader_says_it_read_and_loses_none(ring):
    reader, writer, forger = ring
    want = records(np.random.default_rng(2), SLOTS + 1)
    assert all(writer.write(*r) for r in want[:SLOTS])
    assert not writer.write(*want[SLOTS])         # full: the manager reports it over the reply socket instead
    # a forged read count (no MAC) and a replayed one change nothing
    counts = forger[done_ring.COUNT_BYTES:done_ring.COUNT_BYTES + 8].view(np.uint64)
    counts[0] = SLOTS
    assert not writer.write(*want[SLOTS])
    got, bad = reader.read()
    assert (got, bad) == (want[:SLOTS], [])
    assert writer.write(*want[SLOTS])
    assert reader.read() == ([want[SLOTS]], [])


def test_a_forged_or_destroyed_record_is_reported_by_index_and_the_others_arrive(ring):
    reader, writer, forger = ring
    want = records(np.random.default_rng(3), 6)
    for r in want:
        writer.write(*r)
    writer.publish()                           # the count the manager publishes before it sleeps
    forger[slot(2) + 30] ^= 0xFF               # a byte of record 2's body: its MAC fails
    forger[slot(5):slot(5) + 8] = 0            # record 5's commit word, the last written: destroyed
    got, bad = reader.read()
    assert got == [want[i] for i in (0, 1, 3, 4)] and bad == [2, 5]
    assert writer.again(2, 2) == [want[2]] and writer.again(5, 5) == [want[5]]     # sent again another way


def test_a_forged_count_makes_no_record_look_destroyed(ring):
    reader, writer, forger = ring
    want = records(np.random.default_rng(4), 2)
    writer.write(*want[0])
    forger[0:8].view(np.uint64)[0] = 100       # the writer's count, without its MAC
    assert reader.read() == ([want[0]], [])
    writer.write(*want[1])
    assert reader.read() == ([want[1]], [])


class RacingWords:
    """The reader's view of the commit words and counts, where the writer commits record `index` and publishes
    its count just after the reader has read that record's (still empty) commit word."""

    def __init__(self, words, writer, index, record):
        self.words, self.writer, self.at, self.record, self.raced = words, writer, slot(index) // 8, record, False

    def __getitem__(self, key):
        value = self.words[key]
        if key == self.at and not self.raced:
            self.raced = True
            self.writer.write(*self.record)
            self.writer.publish()       # as the manager may at once (it is about to sleep)
        return value

    def __setitem__(self, key, value):
        self.words[key] = value


def test_a_record_committed_while_the_reader_looks_at_its_slot_is_read_not_reported(ring):
    reader, writer, _ = ring
    want = records(np.random.default_rng(5), 2)
    writer.write(*want[0])
    assert reader.read() == ([want[0]], [])
    reader.words = RacingWords(reader.words, writer, 1, want[1])
    got, bad = reader.read()
    assert bad == [] and got in ([], [want[1]])
    reader.words = reader.words.words
    assert got + reader.read()[0] == [want[1]]


def test_a_reader_that_keeps_up_never_leaves_the_writer_a_full_ring(ring, monkeypatch):
    """The reader publishes its count only every PUBLISH_EVERY records; a writer whose reader keeps up still never
    finds the ring full. The negative control: a reader that never publishes fills it within one ring's records."""
    reader, writer, _ = ring
    want = records(np.random.default_rng(6), 4 * SLOTS)
    for r in want:
        assert writer.write(*r)
        assert reader.read() == ([r], [])
    monkeypatch.setattr(done_ring, "PUBLISH_EVERY", 1 << 40)
    wrote = 0
    for r in want:
        if not writer.write(*r):
            break
        wrote += 1
        assert reader.read() == ([r], [])
    assert wrote <= SLOTS


def test_a_record_forged_ahead_of_the_writer_does_not_lose_the_real_one(ring):
    """A forger commits a record in the slot the writer fills next, before the writer has: nothing says that
    record was written, so the reader waits for it instead of skipping its index (the writer could not send a
    record it has not written again, and the real one, written next, would never be read)."""
    reader, writer, forger = ring
    want = records(np.random.default_rng(7), 3)
    writer.write(*want[0])
    writer.publish()
    assert reader.read() == ([want[0]], [])
    forger[slot(1):slot(1) + 8].view(np.uint64)[0] = 2     # record 1's commit word, with no record behind it
    forger[slot(1) + 8:slot(1) + 40] = 0xAB
    got, bad = reader.read()
    again = [r for first, last in runs(bad) for r in writer.again(first, last)]    # what the manager resends
    writer.write(*want[1])
    writer.write(*want[2])
    writer.publish()
    more, bad = reader.read()
    again += [r for first, last in runs(bad) for r in writer.again(first, last)]
    assert sorted(got + more + again) == sorted(want[1:])
    # the control: a record the writer's signed count says was written, then forged over, is reported and
    # comes again, as before
    forger[slot(2) + 30] ^= 0xFF
    reader.next = 2
    assert reader.read() == ([], [2]) and writer.again(2, 2) == [want[2]]


def test_a_bad_record_can_still_be_sent_again_after_the_writer_has_filled_the_ring_meanwhile(ring):
    """The engine asks for a bad record over the task pipe, behind the tasks sent before; the manager may write
    a ring's worth of records before it reads that request. The reader does not publish its count past the bad
    record until the manager has read the request (its task_received reaches the request's number), so the
    writer has not dropped the record from what it can send again."""
    reader, writer, forger = ring
    want = records(np.random.default_rng(8), 2 * SLOTS)
    for r in want[:130]:
        assert writer.write(*r)
    writer.publish()
    forger[slot(100) + 30] ^= 0xFF              # record 100 forged over, after it was written
    got, bad = reader.read()
    assert bad == [100] and got == want[:100] + want[101:130]
    reader.asked(7)                             # the engine's request went as message 7 on the pipe
    wrote = 130
    while wrote < len(want) and writer.write(*want[wrote]):     # the tasks before the request, done meanwhile
        wrote += 1
        got, bad = reader.read()
        assert got == [want[wrote - 1]] and bad == []
    assert writer.again(100, 100) == [want[100]]            # the manager reads the request: its report again
    # once the manager has read the request the count is published again, and the writer has room
    reader.served(6)
    assert not writer.write(*want[wrote])
    reader.served(7)
    assert writer.write(*want[wrote])
    assert reader.read() == ([want[wrote]], [])
