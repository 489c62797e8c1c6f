"""The task ring on its own (ipc/task_ring.py): the engine's writer and a transfer manager's reader over one
segment. A record gives the task a task message gives (bit for bit, random ids); a full ring refuses until
the reader says, under the token, that it read; a forged, foreign or destroyed record never passes, and is
named bad once the writer's signed count shows it was written."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from fastcache.ipc import protocol, task_ring
from fastcache.ipc.protocol import Fence
from fastcache.ipc.shm import SharedSegment
from fastcache.ipc.task_ring import (COUNT_BYTES, HEAD_BYTES, INLINE, RECORD_BYTES, RING_BYTES, SLOTS,
                                     TaskRingReader, TaskRingWriter, inline, ring_name)

TOKEN = bytes(range(16))


@pytest.fixture
def ring():
    """(writer, reader, raw bytes of the segment as another process of the user maps it) for rank 1."""
    suffix = f"test{os.getpid()}-{threading.get_ident() % 10_000}"
    writer = TaskRingWriter.create(suffix, TOKEN, 1, 3)
    reader = TaskRingReader(SharedSegment.attach(ring_name(suffix, 1, 3), suffix), TOKEN, 1, 3)
    other = SharedSegment.attach(ring_name(suffix, 1, 3), suffix)
    raw = other.array(np.uint8, (RING_BYTES,))
    try:
        yield writer, reader, raw
    finally:
        del raw
        other.close()
        reader.close()
        writer.close()
    assert not os.path.exists(f"/dev/shm{ring_name(suffix, 1, 3)}")


def task_args(rng, task_id, count=None, **extra):
    count = count or int(rng.integers(1, INLINE + 1))
    gpu = rng.choice(1 << 30, count, replace=False).astype(np.int64)
    cpu = rng.choice(1 << 30, count, replace=False).astype(np.int32)
    kind = protocol.TASK_KINDS[int(rng.integers(2))]
    return (task_id, kind, gpu, cpu), extra


def test_records_give_the_tasks_their_messages_give_bit_for_bit(ring):
    writer, reader, _ = ring
    rng = np.random.default_rng(60)
    sent = []
    for n in range(3 * SLOTS):           # around the ring three times, each record read before its slot is reused
        fence = [Fence(0, 5, 9), Fence(1, int(rng.integers(1, 1 << 62)), int(rng.integers(64)))] if n % 3 else []
        args, extra = task_args(rng, int(rng.integers(1 << 62)), layerwise=bool(n % 2), fence=fence)
        record = inline(*args, **extra)
        assert writer.put(100 + n, record)
        assert os.eventfd_read(writer.bell) == 1          # the doorbell, rung once per record
        sent.append((100 + n, protocol.decode(protocol.encode_task(*args, **extra))))
        if n % 7 == 6 or n == 3 * SLOTS - 1:
            records, bad, malformed = reader.read(reader.head())
            assert not bad and not malformed
            for record, (seq, (header, ids)) in zip(records, sent, strict=True):
                want = dict(header, dtype="int32", fence=[f for f in header["fence"] if f.rank == 1])
                assert record.seq == seq and record.header == want
                for got, expected in zip(record.ids, ids, strict=True):
                    assert got.dtype == np.int64
                    np.testing.assert_array_equal(got, expected)
            sent = []


def test_what_does_not_fit_a_record_goes_by_pipe():
    rng = np.random.default_rng(61)
    (task_id, kind, gpu, cpu), _ = task_args(rng, 1, count=INLINE)
    assert inline(task_id, kind, gpu, cpu) is not None
    big = np.arange(INLINE + 1)
    assert inline(task_id, kind, big, big) is None                                      # more ids than inline
    assert inline(task_id, kind, np.array([1 << 31]), np.array([0])) is None            # beyond int32
    assert inline(task_id, kind, gpu, cpu, group=protocol.WEIGHTS) is None              # a weights task
    assert inline(task_id, protocol.SWAP_TO_GPU, gpu, cpu, True, protocol.WEIGHTS, 2) is None


def test_a_full_ring_refuses_until_the_reader_says_under_the_token_that_it_read(ring):
    writer, reader, raw = ring
    rng = np.random.default_rng(62)
    records = [inline(*task_args(rng, i)[0]) for i in range(SLOTS + 1)]
    for i in range(SLOTS):
        assert writer.put(i + 1, records[i])
    assert not writer.put(SLOTS + 1, records[SLOTS])        # full: the task goes by pipe instead
    # another process of the user says every record was read: the count fails its MAC, the ring stays full
    raw[COUNT_BYTES:COUNT_BYTES + 8].view(np.uint64)[0] = SLOTS
    assert not writer.put(SLOTS + 1, records[SLOTS])
    got, bad, _ = reader.read(reader.head())
    assert [r.seq for r in got] == list(range(1, SLOTS + 1)) and not bad
    assert writer.put(SLOTS + 1, records[SLOTS])            # the reader's signed count frees the slots
    assert [r.seq for r in reader.read(reader.head())[0]] == [SLOTS + 1]


def test_a_forged_record_never_passes_and_is_named_bad_once_the_writer_s_count_says_it_was_written(ring):
    writer, reader, raw = ring
    for i in range(3):
        assert writer.put(i + 1, inline(i, protocol.SWAP_TO_CPU, np.array([i]), np.array([i])))
    at = HEAD_BYTES + RECORD_BYTES                          # record 1: its CPU id 1 made 7, its MAC kept
    ids_at = at + task_ring.IDS_AT
    raw[ids_at + 4:ids_at + 8].view(np.int32)[0] = 7
    forged = bytes(raw[at:at + RECORD_BYTES])
    # negative control: without its MAC check the forgery reads as a task, to be copied to CPU block 7
    assert reader._task(forged).ids[1].tolist() == [7]
    got, bad, _ = reader.read(reader.head())                # no signed count yet: record 1 may still be coming
    assert [r.seq for r in got] == [1] and not bad
    writer.publish()                                        # the engine's I/O thread: three written
    got, bad, _ = reader.read(reader.head())
    assert [r.seq for r in got] == [3] and bad == [1]       # record 1 skipped, named; its number 2 is missing
    assert 2 not in [r.seq for r in got]


def test_a_destroyed_record_and_a_forged_count_are_told_apart(ring):
    writer, reader, raw = ring
    for i in range(2):
        assert writer.put(i + 1, inline(i, protocol.SWAP_TO_GPU, np.array([i]), np.array([i])))
    words = raw.view(np.uint64)
    words[(HEAD_BYTES + RECORD_BYTES) // 8] = 0             # record 1's commit word destroyed
    got, bad, _ = reader.read(reader.head())
    assert [r.seq for r in got] == [1] and not bad          # not written yet, as far as the reader can tell
    words[0] = 5                                            # a forged count: fails its MAC, changes nothing
    assert reader.head() == (0, 0)
    assert reader.read(reader.head())[:2] == ([], [])
    writer.publish()
    assert reader.head() == (2, 2)
    assert reader.read(reader.head())[:2] == ([], [1])      # the signed count: record 1 was written, destroyed


def test_a_record_of_another_rank_or_an_earlier_process_does_not_pass():
    suffix = f"test{os.getpid()}-{threading.get_ident() % 10_000}x"
    writer = TaskRingWriter.create(suffix, TOKEN, 0, 1)
    try:
        task = inline(4, protocol.SWAP_TO_CPU, np.array([1]), np.array([2]))
        assert writer.put(1, task)
        writer.publish()
        for rank, incarnation, token in ((1, 1, TOKEN), (0, 0, TOKEN), (0, 1, bytes(16))):
            other = TaskRingReader(SharedSegment.attach(ring_name(suffix, 0, 1), suffix), token, rank, incarnation)
            try:
                assert other.head() == (0, 0)       # the count does not pass either
                assert other.read((1, 1))[:2] == ([], [0])
            finally:
                other.close()
        right = TaskRingReader(SharedSegment.attach(ring_name(suffix, 0, 1), suffix), TOKEN, 0, 1)
        try:
            assert [r.header["task_id"] for r in right.read(right.head())[0]] == [4]
        finally:
            right.close()
    finally:
        writer.close()


def test_the_usual_task_header_is_json_s_own_bytes():
    """encode_task's header is byte for byte the compact JSON of its fields (what encode_small_task formats by
    hand and the transfer manager parses), every kind, group, dtype and flag, random ids and numbers; a fenced
    task is the control that the oracle sees a difference in bytes."""
    rng = np.random.default_rng(64)
    for n in range(200):
        count = int(rng.integers(1, 40))
        dtype = (np.int32, np.int64)[n % 2]
        gpu, cpu = rng.integers(0, 1 << 20, count).astype(dtype), rng.integers(0, 1 << 20, count).astype(dtype)
        task_id, kind = int(rng.integers(1 << 62)), protocol.TASK_KINDS[n % 2]
        layerwise, group, ring = bool(n % 3), protocol.GROUPS[n % 2], int(rng.integers(3))
        frames = protocol.encode_task(task_id, kind, gpu, cpu, layerwise, group, ring)
        want = protocol.encode("task", task_id=task_id, kind=kind, dtype=np.dtype(dtype).name, count=count,
                               layerwise=layerwise, group=group, ring=ring, fence=[])
        assert frames[0] == want[0]
    fenced = protocol.encode_task(1, protocol.SWAP_TO_CPU, gpu, cpu, fence=[Fence(0, 2, 3)])
    assert fenced[0] != protocol.encode_task(1, protocol.SWAP_TO_CPU, gpu, cpu)[0]
    assert b'"fence":[[0,2,3]]' in fenced[0]
