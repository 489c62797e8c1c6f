"""RankBarrier: a cross-process barrier in shared memory that breaks instead of hanging.

Each party writes the generation it has reached into its slot and waits until every slot has reached
it. A party that is dead (its registered pid is gone) or late (the timeout passes) breaks the barrier
for everyone waiting at that generation, with a message naming the missing parties.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np

from .heartbeat import process_alive
from .naming import barrier_name
from .shm import SharedSegment


class BrokenBarrierError(threading.BrokenBarrierError):
    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


LATE, DIED, ABORTED = 0, 1, 2       # why a generation broke (the barrier's shared cause word)


class RankBarrier:
    POLL = 0.002   # seconds between checks while waiting; only phase changes wait here

    def __init__(self, suffix: str, parties: int | None, create: bool = False, party_names=None):
        """parties=None (attach only): as many as the creator made room for."""
        name = barrier_name(suffix)
        self._seg = None if create else SharedSegment.attach(name, suffix)
        if parties is None:
            if self._seg is None:
                raise ValueError("creating a RankBarrier needs its number of parties")
            parties = (self._seg.size // 8 - 5) // 2
        self.parties = parties
        self.party_names = list(party_names) if party_names else [f"party {i}" for i in range(parties)]
        if parties > 63:
            if self._seg is not None:
                self._seg.close()
            raise ValueError("a RankBarrier holds at most 63 parties")
        nbytes = 8 * (2 * parties + 5)
        if create:
            self._seg = SharedSegment.create(name, nbytes, suffix)
        elif self._seg.size < nbytes:
            self._seg.close()
            raise ValueError(f"barrier segment {name} holds {self._seg.size} bytes, expected {nbytes}")
        table = self._seg.array(np.int64, (2 * parties + 5,))
        self._arrived = table[:parties]            # generation each party has reached
        self._pids = table[parties:2 * parties]    # pid registered by each party (0 = none)
        self._broken = table[2 * parties:2 * parties + 3]  # [highest broken generation, culprit mask, cause]
        self._epoch = table[2 * parties + 3:2 * parties + 4]   # counts resets: a new attempt at a phase
        self._active = table[2 * parties + 4:]     # mask of the parties a generation waits for
        if create:
            table[...] = 0
            self._active[0] = (1 << parties) - 1

    def register(self, party: int, pid: int | None = None):
        """Claim a slot; a restarted party carries on from the generation its slot reached."""
        self._pids[party] = os.getpid() if pid is None else pid

    def reset(self):
        """Align every slot after a broken generation and start a new epoch; call only while no party
        waits (between phases)."""
        self._arrived[...] = max(int(self._arrived.max()), int(self._broken[0]))
        self._epoch[0] += 1

    @property
    def active(self) -> list[int]:
        mask = int(self._active[0])
        return [p for p in range(self.parties) if mask >> p & 1]

    def set_active(self, parties):
        """Wait only for these parties from the next generation on (a reshard adds and retires ranks); a party
        that joins starts at the generation the others have reached. Call only while no party waits."""
        parties = sorted(set(parties))
        if any(not 0 <= p < self.parties for p in parties):
            raise ValueError(f"parties out of range 0..{self.parties - 1}: {parties}")
        now = max([int(self._arrived[p]) for p in self.active] + [int(self._broken[0])])
        for p in parties:
            if not int(self._active[0]) >> p & 1:
                self._arrived[p] = now
        self._active[0] = sum(1 << p for p in parties)

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def generation(self, party: int) -> int:
        return int(self._arrived[party])

    def wait(self, party: int, timeout: float) -> int:
        """Arrive at the next generation and wait for every party; returns the generation."""
        gen = int(self._arrived[party]) + 1
        self._arrived[party] = gen
        deadline = time.monotonic() + timeout
        while True:
            if self._broken[0] >= gen:
                raise self._error(gen, timeout)
            active = int(self._active[0])
            missing = [p for p in range(self.parties) if active >> p & 1 and self._arrived[p] < gen]
            if not missing:
                return gen
            dead = [p for p in missing if not self._alive(p)]
            if dead or time.monotonic() > deadline:
                # record who and why before the generation, so every waiter reports the same cause
                self._broken[1] = sum(1 << p for p in (dead or missing))
                self._broken[2] = DIED if dead else LATE
                self._broken[0] = max(int(self._broken[0]), gen)
                raise self._error(gen, timeout)
            time.sleep(self.POLL)

    def settle(self, timeout: float) -> list[int]:
        """After a generation broke: wait until every active party has reached it (and so learned that it
        broke), has died, or is the party that aborted it; returns the parties still short of it when the
        timeout passes. Reset before then, a party that was merely slow would arrive in the next generation as
        if the broken one had passed, and the next phase would wait for it in vain."""
        gen, culprits, cause = int(self._broken[0]), int(self._broken[1]), int(self._broken[2])
        aborted = culprits if cause == ABORTED else 0     # an aborting party never arrives at that generation
        deadline = time.monotonic() + timeout
        while True:
            active = int(self._active[0])
            short = [p for p in range(self.parties) if active >> p & 1 and not aborted >> p & 1
                     and int(self._arrived[p]) < gen and self._alive(p)]
            if not short or time.monotonic() > deadline:
                return short
            time.sleep(self.POLL)

    def abort(self, party: int):
        """Break the generation `party` would arrive at next, naming it: a party that cannot take part
        (its attach failed) says so at once instead of leaving the others to wait for the timeout."""
        gen = int(self._arrived[party]) + 1
        self._broken[1] = 1 << party
        self._broken[2] = ABORTED
        self._broken[0] = max(int(self._broken[0]), gen)

    def _error(self, gen, timeout) -> BrokenBarrierError:
        mask, cause = int(self._broken[1]), int(self._broken[2])
        culprits = [p for p in range(self.parties) if mask >> p & 1]
        why = {DIED: "died", ABORTED: "reported a failure"}.get(cause, f"did not arrive in time (timeout {timeout:.1f} s)")
        names = ", ".join(self.party_names[p] for p in culprits) or "another party"
        return BrokenBarrierError(f"{names} {why} (phase barrier generation {gen})", culprits)

    def _alive(self, party: int) -> bool:
        pid = int(self._pids[party])
        return pid == 0 or process_alive(pid)    # unregistered: only the timeout can rule it out

    def close(self):
        self._arrived = self._pids = self._broken = self._epoch = self._active = None
        self._seg.close()


# The deployment's phase barrier: the engine, then one party per transfer manager, then one per worker.
ENGINE_PARTY = 0


def transfer_party(rank: int) -> int:
    return 1 + rank


def worker_party(capacity: int, rank: int) -> int:
    """The worker of rank's party: after the transfer managers of all `capacity` ranks (barrier.capacity)."""
    return 1 + capacity + rank


def phase_barrier(suffix: str, tp_size: int, create: bool = False, capacity: int | None = None) -> RankBarrier:
    """The deployment's barrier. The creator makes room for `capacity` ranks (default tp_size) and waits for
    the first tp_size; an attacher finds the capacity in the segment (`barrier.capacity`)."""
    if create:
        capacity = max(tp_size, capacity or tp_size)
        barrier = RankBarrier(suffix, 1 + 2 * capacity, create=True, party_names=_party_names(capacity))
        barrier.set_active([ENGINE_PARTY] + [transfer_party(r) for r in range(tp_size)]
                           + [worker_party(capacity, r) for r in range(tp_size)])
    else:
        barrier = RankBarrier(suffix, None)
        capacity = (barrier.parties - 1) // 2
        barrier.party_names = _party_names(capacity)
    barrier.capacity = capacity
    return barrier


def _party_names(capacity):
    return (["engine"] + [f"transfer manager rank {r}" for r in range(capacity)]
            + [f"worker rank {r}" for r in range(capacity)])
