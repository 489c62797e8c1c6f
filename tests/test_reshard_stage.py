"""The reshard_state signal is a seqlock (docs/design.md §9): a worker polling it while the engine publishes the
next stage reads either a whole stage or nothing, never the fields of two stages. Every interleaving of the
engine's six stores with a reader's six loads is tried; a reader without the recheck (the negative control)
acts on a mixed stage in some of them, as a worker once did ("reshard plan 1 is not step 0")."""
import itertools

import numpy as np
import pytest

from fastcache.ipc.protocol import COMMIT, PREPARE
from fastcache.ipc.signal import publish_stage, read_stage


class Interleaved:
    """reshard_state whose every element load first lets the writer make the stores scheduled before it."""

    def __init__(self, value, writer_ops, schedule):
        self.value, self.ops, self.schedule, self.loads, self.done = value, writer_ops, schedule, 0, 0

    def _tick(self):
        while self.done < len(self.ops) and self.schedule[self.done] <= self.loads:
            self.ops[self.done]()
            self.done += 1
        self.loads += 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return (self._load(i) for i in range(*index.indices(len(self.value))))
        return self._load(index)

    def _load(self, i):
        self._tick()
        return self.value[i]


def writer_ops(value, new):
    """publish_stage's stores, one at a time, in its order (recorded from the real function)."""
    stores = []

    class Recorder:
        def __setitem__(self, i, v):
            stores.append((i, v))
    publish_stage(Recorder(), *new)
    return [lambda i=i, v=v: value.__setitem__(i, v) for i, v in stores]


def naive_read(state):
    """The reader before the seqlock: the attempt first, then the fields, no recheck."""
    attempt = int(state[4])
    return (attempt, *(int(x) for x in state[:4])) if attempt > 0 else None


OLD = (1, PREPARE, 1, 2)            # step 1's PREPARE, attempt 1
NEW = (2, COMMIT, 2, 4)             # step 2's COMMIT, attempt 2


@pytest.mark.parametrize("reader,safe", [(read_stage, True), (naive_read, False)])
def test_a_reader_sees_a_whole_stage_or_none_in_every_interleaving(reader, safe):
    seen, mixed = set(), []
    loads = 6                       # the attempt, four fields, the attempt again
    for schedule in itertools.combinations_with_replacement(range(loads + 1), 6):
        value = np.zeros(5, np.int64)
        publish_stage(value, *OLD, 1)
        state = Interleaved(value, writer_ops(value, (*NEW, 2)), schedule)
        got = reader(state)
        seen.add(got)
        if got not in (None, (1, *OLD), (2, *NEW)):
            mixed.append((schedule, got))
    if safe:
        assert not mixed, mixed[:3]
        assert seen == {None, (1, *OLD), (2, *NEW)}        # the oracle sees both stages and the retry
    else:
        assert mixed                 # the control: without the recheck some interleaving mixes two stages


def test_nothing_is_read_before_the_first_stage_and_attempts_must_be_positive():
    value = np.zeros(5, np.int64)
    assert read_stage(value) is None            # a fresh deployment: no stage was ever published
    value[:4] = (1, PREPARE, 1, 2)              # fields without an attempt: still nothing
    assert read_stage(value) is None
    with pytest.raises(ValueError, match="positive"):
        publish_stage(value, *OLD, 0)
    publish_stage(value, *OLD, 3)
    assert read_stage(value) == (3, *OLD)

