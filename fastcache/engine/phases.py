"""The deployment's phases (docs/design.md §6, §11): clear/restore and sleep/wake, what they share (tasks in
flight drained, a phase command sent to every transfer manager, the barrier, the ranks' reports) and the
readiness they wait for.

A part of SwapBackend, which delegates its clear, restore, sleep, wake and readiness methods here. It owns the
phase lock, which serialises the phases with each other and with a reshard (SwapBackend.reshard takes it too),
and reaches the rest through what its constructor is given (see Phases); the resharder runs its own phases
through the drain, run_phase and wait_signals here (engine/reshard_host.py).
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

from ..errors import TransferError
from ..ipc import protocol
from ..ipc.barrier import ENGINE_PARTY, BrokenBarrierError
from ..ipc.layers import SlotClaims
from ..ipc.signal import CLEARED, CLEARING, NORMAL, STATUS_NAMES, UPDATING

SLEEP_LEVELS = (1, 2)       # 1: the resident weights are saved to the CPU regions first; 2: nothing is saved


class Phases:
    """The phases of one deployment.

    signals(), barrier() and tp_size() give the deployment's signals, phase barrier and tp now (the first two
    exist once it has started; a reshard changes the tp); ranks is its RankSupervisor, channel its TaskChannel,
    weights its WeightGroup, tiers its CpuTiers, allocator its CpuBlockAllocator; spec() gives the spec now (the
    CPU tiers a restore re-creates), reshard_pending() the reshard step left pending, if any (no clear or
    sleep then), caches_quiet(deadline) waits until no TieredCache call holds CPU blocks it has yet to submit,
    submissions_idle(deadline) until no swap past its status check is still to be sent (False at the deadline),
    running() says the backend is started and not closed."""

    def __init__(self, settings, signals: Callable, barrier: Callable, tp_size: Callable[[], int],
                 spec: Callable, ranks, channel, weights, tiers, allocator, reshard_pending: Callable,
                 caches_quiet: Callable[[float], None], submissions_idle: Callable[[float], bool],
                 running: Callable[[], bool]):
        self._settings = settings
        self._signals, self._barrier, self._tp_size, self._spec = signals, barrier, tp_size, spec
        self._ranks, self._channel, self._weights, self._tiers = ranks, channel, weights, tiers
        self._allocator, self._reshard_pending, self._caches_quiet = allocator, reshard_pending, caches_quiet
        self._submissions_idle, self._running = submissions_idle, running
        self.lock = threading.Lock()            # one phase (or reshard) at a time

    # -- readiness -------------------------------------------------------------------------------
    def wait_ready(self, timeout: float):
        """Until every worker has exported its cache and every transfer manager has attached it; TransferError as
        soon as a rank fails, TimeoutError (saying what is missing) at the timeout."""
        deadline = time.monotonic() + timeout
        while not self.all_ready():
            self._ranks.raise_if_failed()
            if time.monotonic() > deadline:
                raise TimeoutError(f"deployment not ready after {timeout} s: {self.readiness()}")
            time.sleep(0.002)

    def all_ready(self) -> bool:
        signals = self._signals()
        return (self._ranks.all_attached(self._tp_size()) and bool(signals.cache_ready[:self._tp_size()].all())
                and bool(signals.swap_space_ready[:self._tp_size()].all()) and self._weights.ready())

    def readiness(self) -> str:
        """Every rank's readiness, for an error that says what is missing."""
        signals = self._signals()
        return "; ".join(
            f"rank {r}: cache_ready={int(signals.cache_ready[r])} "
            f"swap_space_ready={int(signals.swap_space_ready[r])} "
            f"transfer manager {self._ranks.connection(r)}"
            + (f" weights exported={int(signals.weights_ready[r, 0])} attached={int(signals.weights_ready[r, 1])}"
               if self._weights.layout is not None else "")
            for r in range(self._tp_size()))

    def wait_signals(self, condition, deadline, what, detail=None):
        """Until condition() holds; TransferError naming what is missing (detail(), or every rank's readiness)
        past the deadline."""
        while not condition():
            self._ranks.raise_if_failed()
            if time.monotonic() > deadline:
                raise TransferError(f"{what} timed out: {(detail or self.readiness)()}")
            time.sleep(0.001)

    # -- sleep / wake (docs/design.md §11) ----------------------------------------------------------
    def sleep(self, level: int, timeout: float):
        """Free every rank's KV cache and weights (status CLEARED), level 1 saving the resident weights first."""
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        with self._serving(), self.lock:
            signals = self._signals()
            asleep, status = int(signals.sleep_level[0]), signals.status
            if asleep and asleep != level:
                raise TransferError(f"sleep({level}) refused: a sleep({asleep}) is under way or done")
            if status == CLEARED and asleep:
                return
            if status not in (NORMAL, CLEARING) or (status == CLEARING and not asleep):
                raise TransferError(f"sleep refused: kv_cache_status is {STATUS_NAMES.get(status, status)}")
            if self._reshard_pending() is not None:
                raise TransferError("sleep refused: a reshard is pending")
            self._ranks.raise_if_failed()
            deadline = time.monotonic() + timeout
            self._barrier().reset()
            signals.status = CLEARING               # refuses new swaps from here on
            with self._before_barrier():
                try:
                    self.drain(deadline, "sleep")
                    if level == 1:
                        self._weights.save_resident(deadline)
                except BaseException:
                    if not asleep:  # nothing was freed: the deployment serves on, and the same call again sleeps
                        signals.status = NORMAL
                    raise
            signals.sleep_level[0] = level          # workers and transfer managers let go of the weights too
            self._clear_phase(deadline)

    def wake(self, timeout: float):
        """Re-create every rank's weights and KV cache (status NORMAL), after sleep(1) copying the weights back."""
        with self._serving(), self.lock:
            signals = self._signals()
            level, status = int(signals.sleep_level[0]), signals.status
            if not level:
                if status == NORMAL:
                    return
                raise TransferError(f"wake needs a sleeping deployment; kv_cache_status is "
                                    f"{STATUS_NAMES.get(status, status)}")
            if status not in (CLEARED, UPDATING):
                raise TransferError(f"wake refused: the sleep has not finished (kv_cache_status is "
                                    f"{STATUS_NAMES.get(status, status)}); call sleep({level}) again")
            self._ranks.raise_if_failed()
            deadline = time.monotonic() + timeout
            self._restore_phase(deadline, "wake")
            self._weights.restore_resident(level, deadline)
            signals.sleep_level[0] = 0
            signals.status = NORMAL

    # -- clear / restore (docs/design.md §6) ---------------------------------------------------------------
    def clear(self, timeout: float):
        """Release every rank's cache memory (status CLEARED)."""
        with self._serving(), self.lock:
            signals = self._signals()
            if signals.status == CLEARED:
                return
            if self._reshard_pending() is not None:
                raise TransferError("clear refused: a reshard is pending (restart_rank the failed rank, then "
                                    "reshard again)")
            self._ranks.raise_if_failed()
            deadline = time.monotonic() + timeout
            self._barrier().reset()
            signals.status = CLEARING                   # refuses new swaps from here on
            with self._before_barrier():
                self.drain(deadline, "clear")           # a clear never pulls memory from under a copy
            self._clear_phase(deadline)

    def _clear_phase(self, deadline):
        """The clear itself, once nothing is in flight (a sleep frees the weights too: sleep_level is set)."""
        signals = self._signals()
        # a cache call past its checks (or a write-through put queued) may hold CPU blocks it has yet to submit
        # a put of: it is refused now, but one held up past the allocator's reset and a restore would read a
        # block the reset gave to someone else; so wait for none to be left, then for what they sent
        with self._before_barrier():
            self._caches_quiet(deadline)
            self.drain(deadline)
        # every layer-by-layer task is over (drained), and its layers go with the memory: a wait for one of them
        # is refused from here on, never answered as in place in the restored cache (or the woken weights' ring)
        for claims in ("layer_claims", "weight_claims") if signals.sleep_level[0] else ("layer_claims",):
            SlotClaims.open(signals.whole(claims))
        release = self._settings.clear_swap_space
        self.run_phase("clear", protocol.encode("clear", release_swap_space=release), deadline)
        weights = bool(signals.sleep_level[0]) and self._weights.layout is not None
        self.wait_signals(lambda: not signals.cache_ready.any() and
                          (not release or not signals.swap_space_ready.any()) and
                          (not weights or not signals.weights_ready.any()), deadline, "release")
        self._ranks.detach(range(self._tp_size()))
        if release:
            self._tiers.release()
        self._allocator.reset()
        signals.status = CLEARED

    def restore(self, timeout: float):
        """Re-create every rank's cache (status NORMAL once all ranks are ready again)."""
        with self._serving(), self.lock:
            signals = self._signals()
            if signals.status == NORMAL:
                return
            if signals.status not in (CLEARED, UPDATING):      # UPDATING: a failed restore, retried
                raise TransferError(f"restore needs a cleared cache; kv_cache_status is "
                                    f"{STATUS_NAMES.get(signals.status)}")
            if signals.sleep_level[0]:
                raise TransferError("restore refused: the deployment sleeps; call wake()")
            self._ranks.raise_if_failed()
            self._restore_phase(time.monotonic() + timeout, "restore")
            signals.status = NORMAL

    def _restore_phase(self, deadline, what):
        """Every rank re-creates its cache (and weights a sleep freed) and is attached again (status UPDATING)."""
        self._barrier().reset()
        self._tiers.create_all(self._spec(), self._tp_size())
        self._signals().status = UPDATING
        self.run_phase("restore", protocol.encode("restore"), deadline)
        self.wait_signals(self.all_ready, deadline, what)

    # -- what every phase does -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _serving(self):
        """A phase of a running backend: refused as a swap is when it is not running, and failed as closed when
        close() (on another thread) tears down under it what it was using (the pipes, the barrier, the signals)."""
        if not self._running():
            raise TransferError("the backend is not running")
        try:
            yield
        except Exception as exc:
            if not self._running():
                raise TransferError(f"the backend was closed during the phase ({type(exc).__name__}: {exc})") \
                    from exc
            raise

    @contextlib.contextmanager
    def _before_barrier(self):
        """A step of a clear or sleep between publishing CLEARING and meeting the others at the barrier. The workers
        follow the status and may wait at the barrier already: if the step fails, the engine breaks that
        generation, so they keep their caches; a retry's reset would otherwise let them through it, freeing the
        cache under a copy the retry is still draining."""
        try:
            yield
        except BaseException:
            self._barrier().abort(ENGINE_PARTY)
            raise

    def drain(self, deadline, what="clear"):
        """Until every task in flight has finished (or failed): a phase never pulls memory from under a copy. A swap
        past its status check but not yet sent is in flight too: sent after the phase (a restore), it would copy
        blocks the phase freed."""
        if not self._submissions_idle(deadline):
            raise TransferError(f"{what} timed out waiting for a swap being submitted")
        for handle in self._channel.pending_handles():
            try:
                handle.result(max(0.0, deadline - time.monotonic()))
            except TransferError:
                pass                                    # its owner sees the failure
            except TimeoutError:
                raise TransferError(f"{what} timed out waiting for task {handle.task_id} in flight") from None

    def run_phase(self, phase, message, deadline):
        """Send a phase to every transfer manager, meet everyone at the barrier, collect the acks."""
        channel = self._channel
        channel.expect_reports(phase)
        channel.send_phase_command(phase, message)
        try:
            self._barrier().wait(ENGINE_PARTY, max(0.0, deadline - time.monotonic()))
        except BrokenBarrierError as exc:
            self._settle_phase(phase, deadline)
            failed = "".join(f"; rank {r}: {why}" for r, why in sorted(self._ranks.failed_ranks.items()))
            raise TransferError(f"{phase} failed: {channel.end_phase_command() or exc}{failed}") from None
        channel.end_phase_command()
        ok, acks, _ = channel.collect_reports(phase, lambda acks: len(acks) == self._tp_size() or
                                              self._ranks.any_failed(), deadline - time.monotonic())
        self._ranks.raise_if_failed()
        errors = {r: e for r, e in acks.items() if e}
        if errors or not ok:
            detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())) or \
                f"no report from ranks {sorted(set(range(self._tp_size())) - set(acks))}"
            raise TransferError(f"{phase} failed: {detail}")

    def _settle_phase(self, phase, deadline):
        """After a phase's barrier broke, until every live transfer manager has reported the phase (it failed at
        the same generation) and every party has reached that generation: a report or an arrival of this attempt
        that came later would be taken for the next attempt's (a retry's phase failing on the old generation, or
        a slow party passing the new one unprepared). Up to the phase's deadline, at least 1 s and at most 10 s
        (a party that hangs is not waited for: the next attempt names it)."""
        now = time.monotonic()
        until = min(now + 10.0, max(deadline, now + 1.0))
        lost = self._channel.lost_phase_ranks()     # will not report

        def settled(acks):
            return all(r in acks or r in lost or self._ranks.gone(r)
                       for r in range(min(self._tp_size(), self._ranks.size)))
        self._channel.collect_reports(phase, settled, until - time.monotonic())
        self._barrier().settle(max(0.0, until - time.monotonic()))
