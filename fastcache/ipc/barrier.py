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


class RankBarrier:
    POLL = 0.002   # seconds between checks while waiting; only phase changes wait here

    def __init__(self, suffix: str, parties: int, create: bool = False, party_names=None):
        self.parties = parties
        self.party_names = list(party_names) if party_names else [f"party {i}" for i in range(parties)]
        if parties > 63:
            raise ValueError("a RankBarrier holds at most 63 parties")
        nbytes = 8 * (2 * parties + 3)
        name = barrier_name(suffix)
        self._seg = SharedSegment.create(name, nbytes, suffix) if create else SharedSegment.attach(name, suffix)
        table = self._seg.array(np.int64, (2 * parties + 3,))
        self._arrived = table[:parties]            # generation each party has reached
        self._pids = table[parties:2 * parties]    # pid registered by each party (0 = none)
        self._broken = table[2 * parties:]         # [highest generation that broke, missing-party mask, died?]
        if create:
            table[...] = 0

    def register(self, party: int, pid: int | None = None):
        """Claim a slot; a restarted party carries on from the generation its slot reached."""
        self._pids[party] = os.getpid() if pid is None else pid

    def reset(self):
        """Align every slot after a broken generation; call only while no party waits (between phases)."""
        self._arrived[...] = max(int(self._arrived.max()), int(self._broken[0]))

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
            missing = [p for p in range(self.parties) if self._arrived[p] < gen]
            if not missing:
                return gen
            dead = [p for p in missing if not self._alive(p)]
            if dead or time.monotonic() > deadline:
                # record who and why before the generation, so every waiter reports the same cause
                self._broken[1] = sum(1 << p for p in (dead or missing))
                self._broken[2] = 1 if dead else 0
                self._broken[0] = max(int(self._broken[0]), gen)
                raise self._error(gen, timeout)
            time.sleep(self.POLL)

    def _error(self, gen, timeout) -> BrokenBarrierError:
        mask, died = int(self._broken[1]), bool(self._broken[2])
        culprits = [p for p in range(self.parties) if mask >> p & 1]
        why = "died" if died else f"did not arrive in time (timeout {timeout:g} s)"
        names = ", ".join(self.party_names[p] for p in culprits) or "another party"
        return BrokenBarrierError(f"{names} {why} (phase barrier generation {gen})", culprits)

    def _alive(self, party: int) -> bool:
        pid = int(self._pids[party])
        return pid == 0 or process_alive(pid)    # unregistered: only the timeout can rule it out

    def close(self):
        self._arrived = self._pids = self._broken = None
        self._seg.close()
