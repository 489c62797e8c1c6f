"""The resharder's way into a SwapBackend (engine/resharder.py, ReshardHost): the backend's geometry, signals,
barrier, allocator and weight group, its phases, and the ranks' state that a step grows, shrinks and retires,
each changed through its owner's public methods (the rank supervisor, the task channel, the CPU tiers).
"""
from __future__ import annotations

import time
from typing import Callable


class BackendReshardHost:
    """A ReshardHost over one SwapBackend and its parts.

    backend: the SwapBackend, read through its public attributes only (a step changes its geometry);
    weights, phases, ranks, channel and tiers: its WeightGroup, Phases, RankSupervisor, TaskChannel and
    CpuTiers; take_geometry(spec, tp, device_ids) gives the backend the new geometry at a step's commit;
    submissions: its SubmitGate, which a step waits on once the status refuses new swaps.
    A list the I/O thread reads is replaced by its owner, never changed in length in place (the thread may be
    iterating it)."""

    def __init__(self, backend, weights, phases, ranks, channel, tiers,
                 take_geometry: Callable[[object, int, list], None], submissions):
        self._b = backend
        self.weights = weights
        self._phases, self._ranks, self._channel, self._tiers = phases, ranks, channel, tiers
        self._take_geometry = take_geometry
        self._submissions = submissions     # the backend's SubmitGate (engine/submit_gate.py)

    # what the backend has now (a step changes the geometry)
    spec = property(lambda self: self._b.spec)
    tp_size = property(lambda self: self._b.tp_size)
    device_ids = property(lambda self: self._b.device_ids)
    device = property(lambda self: self._b.device)
    suffix = property(lambda self: self._b.suffix)
    signals = property(lambda self: self._b.signals)
    barrier = property(lambda self: self._b.barrier)
    allocator = property(lambda self: self._b.allocator)
    running = property(lambda self: self._b.running)
    failed_ranks = property(lambda self: self._b.failed_ranks)

    # -- phases ----------------------------------------------------------------------------------
    def drain(self, deadline):
        self._phases.drain(deadline)

    def wait_submissions(self, deadline) -> bool:
        """Until every swap that read the status before it changed is sent; False on timeout."""
        return self._submissions.wait_idle(deadline - time.monotonic())

    def run_phase(self, phase, message, deadline):
        self._phases.run_phase(phase, message, deadline)

    def wait_signals(self, condition, deadline, what, detail=None):
        self._phases.wait_signals(condition, deadline, what, detail)

    def all_ready(self) -> bool:
        return self._phases.all_ready()

    def expect_reports(self, phase):
        """Collect the ranks' reports of `phase` from now on (before it is sent: a fast report is kept)."""
        self._channel.expect_reports(phase, copies=True)

    def collect_reports(self, phase, ranks, deadline) -> tuple[dict, dict]:
        """Until every rank in `ranks` has reported `phase`, one of them has failed, or the deadline: the reports
        ({rank: error or None}) and the ranks' copy seconds; stops collecting."""
        supervisor = self._ranks
        _, got, copies = self._channel.collect_reports(
            phase, lambda acks: set(ranks) <= set(acks) or supervisor.any_failed(ranks), deadline - time.monotonic())
        return got, copies

    # -- the ranks' processes and pipes ------------------------------------------------------------
    def spawn(self, rank, spec, tp, device_id, weights):
        self._ranks.spawn(rank, spec=spec, tp=tp, device_id=device_id, weights=weights)

    def registered(self, rank) -> bool:
        return self._ranks.registered(rank)

    def pid(self, rank) -> int:
        return self._ranks.pid(rank)

    def send_to(self, rank, message) -> bool:
        return self._channel.send_to(rank, message)

    def check_exit(self, rank) -> bool:
        return self._ranks.check_exit(rank)

    def take_out(self, rank):
        """Rank's process, taken out of service so that supervision does not report its (planned) exit."""
        return self._ranks.take_out(rank)

    def detach(self, ranks):
        """These ranks attach their caches again before they are ready."""
        self._ranks.detach(ranks)

    # -- the ranks' lists and CPU tiers ------------------------------------------------------------
    def add_ranks(self, tp):
        """Room for ranks up to tp (a scale-out's new ones), none in service yet."""
        self._ranks.grow(tp)
        self._tiers.grow(tp)
        self._b.signals.resize(tp)
        self._channel.add_pipes(tp)     # the rank supervisor's spawn binds the new ranks' task sockets

    def create_cpu_tier(self, rank, spec):
        self._tiers.create(rank, spec)

    def drop_rank(self, rank):
        """A retired rank's task pipe and CPU tier go."""
        self._channel.drop_pipe(rank)
        self._tiers.drop(rank)

    def keep_ranks(self, tp):
        """Ranks below tp only (a commit's or a rollback's): a rank from tp on that still has a pipe or a CPU
        tier (one a failed scale-out made before its rank started) loses it too."""
        self._ranks.keep(tp)                    # retired: None already; supervision sees None
        for r in range(tp, self._tiers.size):
            if self._channel.has_pipe(r) or self._tiers.has(r):
                self.drop_rank(r)
        self._tiers.keep(tp)
        self._channel.keep_pipes(tp)
        self._b.signals.resize(tp)

    def take_geometry(self, spec, tp, device_ids):
        self._take_geometry(spec, tp, device_ids)
