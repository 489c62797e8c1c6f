"""The resharder behind SwapBackend.reshard (docs/design.md §9): liquid scale-out and scale-in of a running
deployment.

A part of SwapBackend. It owns each rank's allocation, the step in progress or pending, the last report and
the TieredCaches a step remaps; it reaches the ranks (their processes, pipes, CPU tiers and phases), which
other parts own, only through the ReshardHost the backend gives it.

The step, as the engine drives it (the plan itself is in reshard_plan.py):

1. Validate everything (ValueError, nothing changed): tp, live blocks and whether they fit, the CPU tier's
   used blocks, the callbacks, shared memory for new ranks.
2. Status RESHARDING (swaps refused), tasks in flight finish.
3. prepare: every old rank's transfer manager and worker meet at the phase barrier; kept workers allocate
   their staging buffers (the engine makes the CPU tier's).
4. New ranks (scale-out): CPU tiers, task sockets, transfer managers, then start_workers(ranks, spec).
5. Moves, wave by wave (compaction first on a scale-in): each transfer manager runs its rank's program.
6. commit: retired ranks' transfer managers stop, then stop_workers(ranks); the engine takes the new
   geometry (spec, tp, CPU block allocator and TieredCaches remapped); every rank re-attaches and meets at
   the barrier; status NORMAL.

A failure before any rank has overwritten old rows (steps 3-5 up to the first in-place wave) rolls back:
new ranks go, the old layout is still in service. After that point the step is pending: swaps stay refused,
and the documented recovery is `restart_rank(r)` for a dead or stalled rank, then the same `reshard(tp)`
again, which resumes where it stopped (each in-place program resumes from its journal).
"""
from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from ..errors import TransferError
from ..ipc import protocol
from ..ipc.barrier import ENGINE_PARTY, transfer_party, worker_party
from ..ipc.manifest import write_json_segment
from ..ipc.naming import reshard_plan_name, reshard_staging_name
from ..ipc.protocol import ABORT, COMMIT, MOVE, PREPARE
from ..ipc.shm import SharedSegment, check_shm_room
from ..ipc.signal import NORMAL, RESHARDING, STATUS_NAMES, publish_stage
from ..config import CacheSpec
from .reshard_report import rank_device_memory, step_report
from ..reshard_plan import DEFAULT_STAGING_BYTES, MAX_RANKS, Capacity, Plan, check_tp, least, resharded_spec

log = logging.getLogger("fastcache.engine")


@dataclass
class ReshardStep:
    """One reshard in progress (or pending after a failure past its point of no return)."""
    plan: Plan
    seq: int
    device_ids: list
    start_workers: object
    stop_workers: object
    destructive: bool = False        # some rank has begun overwriting old rows: no way back
    fresh_started: bool = False
    compaction_done: bool = False
    waves_done: int = 0
    wave_ranks_done: set = field(default_factory=set)
    committed_state: bool = False    # the engine has taken the new geometry
    retired_stopped: bool = False
    cpu_staging: dict = field(default_factory=dict)
    quota_free: dict = field(default_factory=dict)   # TieredCache -> its free quota blocks at planning
    plan_segment: object = None
    times: dict = field(default_factory=dict)

    @property
    def from_tp(self):
        return self.plan.old_tp

    @property
    def weights(self):
        """The weight layout at the new tp (None without weights): what start_workers' new ranks register."""
        return self.plan.new_weights

    @property
    def to_tp(self):
        return self.plan.new_tp


class ReshardHost(Protocol):
    """What the resharder needs of the deployment it reshards: its geometry, signals, barrier, allocator and
    weight group, its phases, and the per-rank state (processes, task pipes, CPU tiers) that a step grows,
    shrinks and retires, each changed by its owner."""
    spec: CacheSpec
    tp_size: int
    device_ids: list
    device: str
    suffix: str
    signals: object         # DeploymentSignals
    barrier: object         # the phase barrier
    allocator: object       # CpuBlockAllocator
    weights: object         # WeightGroup
    running: bool
    failed_ranks: dict      # rank -> why it is out of service

    def drain(self, deadline: float): ...
    def wait_submissions(self, deadline: float) -> bool: ...
    def run_phase(self, phase: str, message, deadline: float): ...
    def wait_signals(self, condition: Callable[[], bool], deadline: float, what: str, detail=None): ...
    def all_ready(self) -> bool: ...
    def spawn(self, rank: int, spec: CacheSpec, tp: int, device_id: int, weights): ...
    def registered(self, rank: int) -> bool: ...
    def pid(self, rank: int) -> int: ...
    def send_to(self, rank: int, message) -> bool: ...
    def check_exit(self, rank: int) -> bool: ...
    def expect_reports(self, phase: str): ...
    def collect_reports(self, phase: str, ranks, deadline: float) -> tuple[dict, dict]: ...
    def add_ranks(self, tp: int): ...
    def create_cpu_tier(self, rank: int, spec: CacheSpec): ...
    def keep_ranks(self, tp: int): ...
    def detach(self, ranks): ...
    def take_out(self, rank: int): ...
    def drop_rank(self, rank: int): ...
    def take_geometry(self, spec: CacheSpec, tp: int, device_ids: list): ...


class Resharder:
    """Reshards one deployment, reached through `host` (a ReshardHost), and keeps what outlives a step: each
    rank's allocation, the step left pending by a failure, the report of the last one, and the TieredCaches
    a step remaps. The caller serialises it with the deployment's other phases (SwapBackend's phase lock)."""

    def __init__(self, host: ReshardHost):
        self._host = host
        spec, tp, layout = host.spec, host.tp_size, host.weights.layout
        self.capacities = [Capacity.of(spec)] * tp      # each rank's allocation, head-blocks
        # each rank's allocation per weight tensor, bytes: a kept rank keeps it, so a later step may fit in it
        self._weight_capacities = [slice_bytes(layout)] * tp if layout is not None else None
        self._seq = self._attempts = 0
        self.pending: ReshardStep | None = None     # a step a failure left unfinished: the same reshard resumes it
        self._caches = weakref.WeakSet()            # TieredCaches over the deployment: a reshard remaps them
        self.last_reshard = None                    # the report of the last completed reshard
        self.resharding = None                      # the step in progress (start_workers may read it)

    @property
    def rank_capacity(self) -> int:
        """The most ranks this deployment can reshard to: its total KV heads, at most 31."""
        return min(self._host.spec.num_kv_heads * self._host.tp_size, MAX_RANKS)

    def spec_at(self, tp: int):
        """Each rank's CacheSpec after a reshard to tp from here (ValueError if tp is not one it can reach)."""
        host = self._host
        tp = check_tp(host.spec, host.tp_size, tp)
        return resharded_spec(host.spec, host.tp_size, tp, least(self.capacities[:host.tp_size]))

    # -- the API -----------------------------------------------------------------------------------
    def reshard(self, tp_size, live_blocks=None, start_workers=None, stop_workers=None, timeout: float = 120.0,
                *, device_ids=None, staging_bytes: int = DEFAULT_STAGING_BYTES):
        """SwapBackend.reshard (its docstring says what it takes and returns): a pending step resumed, or a new
        one planned and run."""
        step = self.pending
        if step is not None:
            if isinstance(tp_size, bool) or tp_size != step.to_tp:
                raise TransferError(f"a reshard from tp {step.from_tp} to {step.to_tp} is pending after a failure: "
                                    f"restart_rank the failed rank, then call reshard({step.to_tp}) again")
            if start_workers is not None:
                step.start_workers = start_workers
            if stop_workers is not None:
                step.stop_workers = stop_workers
            log.info("resuming the reshard from tp %d to %d", step.from_tp, step.to_tp)
        else:
            step = self._plan_reshard(tp_size, live_blocks, start_workers, stop_workers, device_ids,
                                      staging_bytes)
            if step is None:
                identity = {int(b): int(b) for b in self._live_gpu(live_blocks)}
                return self._host.spec, identity
        return self._run_reshard(step, timeout)

    # -- planning (ValueError, nothing changed) ----------------------------------------------------
    def _live_gpu(self, live_blocks):
        return np.arange(self._host.spec.num_gpu_blocks) if live_blocks is None else live_blocks

    def _plan_reshard(self, tp_size, live_blocks, start_workers, stop_workers, device_ids, staging_bytes):
        host = self._host
        if not host.running:
            raise TransferError("the backend is not running")
        old_tp, layout = host.tp_size, host.weights.layout
        tp = check_tp(host.spec, old_tp, tp_size)
        if layout is not None and tp != old_tp:
            self._check_weights_movable()
        status = host.signals.status
        if status != NORMAL:
            raise TransferError(f"reshard refused: kv_cache_status is {STATUS_NAMES.get(status, status)} "
                                f"(it needs NORMAL)")
        spare, quota_free = self._quota_snapshot()
        cpu_live = sorted(host.allocator.used_ids() - spare)
        plan = Plan(host.spec, old_tp, tp, self.capacities[:old_tp], self._live_gpu(live_blocks), cpu_live,
                    staging_bytes, weights=layout, weight_capacities=self._weight_capacities)
        if tp == old_tp:
            return None
        if plan.fresh and not callable(start_workers):
            raise ValueError(f"start_workers(ranks, spec) is needed: ranks {plan.fresh} appear at tp {tp}")
        if plan.retired and not callable(stop_workers):
            raise ValueError(f"stop_workers(ranks) is needed: ranks {plan.retired} go at tp {tp}")
        if device_ids is None:
            device_ids = host.device_ids[:tp] + list(range(old_tp, tp))
        device_ids = [int(d) for d in device_ids]
        if len(device_ids) != tp or any(d < 0 for d in device_ids):
            raise ValueError(f"device_ids must list {tp} devices (>= 0), got {device_ids}")
        if device_ids[:min(tp, old_tp)] != host.device_ids[:min(tp, old_tp)]:
            raise ValueError("a kept rank keeps its device: device_ids may only choose the new ranks' devices")
        self._check_reshard_fits(plan)
        self._seq += 1
        return ReshardStep(plan, self._seq, device_ids, start_workers, stop_workers, quota_free=quota_free)

    def _check_weights_movable(self):
        """The plan moves resident weights of an awake deployment only: an offloaded layer's bytes live in the
        CPU region (and a ring), which the step does not move, so it is refused (ValueError, nothing changed)."""
        layout = self._host.weights.layout
        if layout.resident_layers != layout.num_layers:
            raise ValueError(f"reshard refused: {layout.num_layers - layout.resident_layers} of {layout.num_layers} "
                             f"weight layers are offloaded (streamed through a ring); a reshard moves resident "
                             f"weights only: place every layer on the device (docs/design.md §9)")
        asleep = int(self._host.signals.sleep_level[0])
        if asleep:
            raise ValueError(f"reshard refused: the deployment sleeps (level {asleep}); its weights are in the CPU "
                             f"region, which a reshard does not move: wake() first")

    def _check_reshard_fits(self, plan):
        """Shared memory for the new ranks' CPU tiers (and on sim their caches) and the CPU staging buffers."""
        new = plan.new_spec
        need = len(plan.fresh) * new.cpu_cache_bytes
        if self._host.device == "sim":
            need += len(plan.fresh) * new.gpu_cache_bytes
            need += sum(plan.staging_bytes_for(r, "gpu") for r in plan.kept)
            if plan.new_weights is not None:
                need += len(plan.fresh) * plan.new_weights.gpu_cache_bytes + sum(plan.weight_allocations().values())
        if plan.new_weights is not None:        # the fresh ranks' CPU weight regions
            need += len(plan.fresh) * plan.new_weights.cpu_cache_bytes
        need += sum(plan.staging_bytes_for(r, "cpu") for r in plan.kept)
        check_shm_room(need, f"the reshard (new ranks' CPU tiers{' and caches' if self._host.device == 'sim' else ''}, "
                             f"staging)")

    # -- the step ----------------------------------------------------------------------------------
    def _run_reshard(self, step: ReshardStep, timeout: float):
        self._raise_if_failed_for(step)
        deadline = time.monotonic() + timeout
        began = time.perf_counter()
        self.resharding = step
        plan = step.plan
        try:
            self._host.signals.status = RESHARDING     # refuses new swaps from here on
            self._host.allocator.freeze("a reshard is in progress")
            try:
                # a swap that read NORMAL checked its ids against the old geometry: it is sent
                # (and drained below) before anything changes; later ones read RESHARDING and are refused
                if not self._host.wait_submissions(deadline):
                    raise TransferError("reshard refused: a swap being submitted was not sent in time")
                self.wait_caches_quiet(deadline)
                self._host.drain(deadline)
                if step is not self.pending:
                    self._replan(step)                 # what the CPU tier holds may have changed meanwhile
            except Exception:
                if self.pending is None:
                    self._host.allocator.thaw()
                    self._host.signals.status = NORMAL
                raise
            if not step.destructive:
                try:
                    self._reshard_prepare(step, deadline)
                    self._reshard_start_fresh(step, deadline)
                    step.times["prepared"] = time.perf_counter() - began
                    self._reshard_moves(step, deadline, stop_before_destructive=True)
                except Exception as exc:
                    self.pending = None
                    problems = self._reshard_rollback(step, deadline, exc)
                    if self.pending is None:
                        self._host.allocator.thaw()
                    if problems:
                        raise TransferError(f"{exc}; the rollback to tp {plan.old_tp} went on to its end, but "
                                            f"{'; '.join(problems)}") from exc
                    raise
            moving = time.perf_counter()
            try:
                self._reshard_moves(step, deadline)
            except Exception:
                self.pending = step
                raise
            step.times["move"] = step.times.get("move", 0.0) + time.perf_counter() - moving
            try:
                self._reshard_commit(step, deadline)
            except Exception:
                self.pending = step
                raise
        finally:
            self.resharding = None
        self.pending = None
        report = self._reshard_report(step, time.perf_counter() - began)
        self.last_reshard = report
        self._host.allocator.thaw()
        self._host.signals.status = NORMAL
        log.info("resharded tp %d -> %d: %s", step.from_tp, step.to_tp, report)
        return plan.new_spec, plan.gpu_map

    def _replan(self, step):
        """Plan again from the CPU tier's blocks as they are now that nothing can allocate or swap."""
        spare_now, quota_free = self._quota_snapshot()
        cpu_live = sorted(self._host.allocator.used_ids() - spare_now)
        if np.array_equal(cpu_live, step.plan.cpu_old):
            step.quota_free = quota_free
            return
        old = step.plan
        step.plan = Plan(old.old_spec, old.old_tp, old.new_tp, old.capacities, old.gpu_old, cpu_live,
                         old.staging_bytes, weights=old.weights,
                         weight_capacities=old.weight_capacities if old.weights is not None else None)
        step.quota_free = quota_free
        self._check_reshard_fits(step.plan)

    def register_cache(self, cache):
        """A TieredCache over this backend: a reshard renames its entries' CPU blocks (remap_blocks)."""
        self._caches.add(cache)

    def close_caches(self, timeout: float = 30.0):
        """Before the transfer managers stop: each cache's puts in flight land (within timeout seconds, all
        caches together) or are reported."""
        deadline = time.monotonic() + timeout
        for cache in list(self._caches):
            cache.close(max(0.0, deadline - time.monotonic()))

    def close(self):
        """The deployment closes: a pending step's staging memory goes."""
        if self.pending is not None:
            self._drop_step_memory(self.pending)

    def wait_caches_quiet(self, deadline, what: str = "reshard"):
        """A TieredCache call past its checks may hold CPU block ids it has yet to submit (its submission is
        refused now): a reshard counts and renames the blocks, and a clear resets them, only once no such call
        is left."""
        for cache in list(self._caches):
            if not cache.wait_quiet(max(0.0, deadline - time.monotonic())):
                raise TransferError(f"{what} refused: a TieredCache call did not finish in time")

    def _quota_snapshot(self):
        quota_free = {}
        for cache in list(self._caches):
            free = cache.free_quota()
            if free is not None:
                quota_free[cache] = free
        return {b for free in quota_free.values() for b in free}, quota_free

    def _raise_if_failed_for(self, step):
        """Every rank the step needs must be in service (restart_rank a failed one first)."""
        failed = self._host.failed_ranks
        if failed:
            raise TransferError("reshard refused: " + "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
                                + " (restart_rank it first)")

    def _body(self, step: ReshardStep, **extra) -> str:
        plan = step.plan
        body = {"seq": step.seq, "from_tp": plan.old_tp, "to_tp": plan.new_tp, "old_spec": plan.old_spec.to_json(),
                "new_spec": plan.new_spec.to_json(), "capacities": [c.to_list() for c in plan.capacities],
                "staging_bytes": plan.staging_bytes, **extra}
        if plan.weights is not None:        # transfer managers plan the weights' moves too
            body["weights"], body["weight_capacities"] = plan.weights.to_json(), plan.weight_capacities
        text = json.dumps(body, separators=(",", ":"))
        if len(text) > protocol.MAX_HEADER_BYTES - 200:
            raise TransferError(f"the reshard step's description ({len(text)} bytes) does not fit in a message header")
        return text

    def _set_stage(self, step, stage):
        """Publish a stage to the workers (after barrier.reset(): they act once per attempt)."""
        self._attempts += 1
        publish_stage(self._host.signals.reshard_state, step.seq, stage, step.from_tp, step.to_tp, self._attempts)

    def _reshard_prepare(self, step, deadline):
        plan = step.plan
        if step.plan_segment is None:
            staging = [plan.staging_bytes_for(r, "gpu") for r in range(max(plan.old_tp, plan.new_tp))]
            described = {"seq": step.seq, "from_tp": plan.old_tp, "to_tp": plan.new_tp,
                         "new_spec": plan.new_spec.to_json(), "staging": staging}
            if plan.new_weights is not None:    # workers re-view their weights and allocate what outgrows its own
                described["new_weights"] = plan.new_weights.to_json()
                described["weight_allocations"] = [[r, i, n] for (r, i), n in plan.weight_allocations().items()]
            step.plan_segment = write_json_segment(reshard_plan_name(self._host.suffix), described, self._host.suffix)
        for r in plan.kept:
            need = plan.staging_bytes_for(r, "cpu")
            if need and r not in step.cpu_staging:
                step.cpu_staging[r] = SharedSegment.create(reshard_staging_name(self._host.suffix, r, "cpu"), need,
                                                           self._host.suffix)
        self._host.barrier.reset()
        self._set_stage(step, PREPARE)
        self._host.run_phase("reshard_prepare", protocol.encode_reshard("prepare", self._body(step)), deadline)

    def _reshard_start_fresh(self, step, deadline):
        plan = step.plan
        if not plan.fresh or step.fresh_started:
            return
        new = plan.new_spec
        self._host.add_ranks(plan.new_tp)
        for r in plan.fresh:
            for name in ("cache_ready", "swap_space_ready", "worker_heartbeat", "transfer_heartbeat"):
                getattr(self._host.signals, name)[r] = 0
            self._host.signals.reshard_progress[r] = 0
            self._host.create_cpu_tier(r, new)
            if plan.new_weights is not None:
                self._host.signals.weights_ready[r] = 0
        if plan.new_weights is not None:
            self._host.weights.resize_regions(plan.new_tp, plan.new_weights, plan.fresh)
        cap = self._host.barrier.capacity
        self._host.barrier.set_active(self._host.barrier.active + [transfer_party(r) for r in plan.fresh]
                                + [worker_party(cap, r) for r in plan.fresh])
        step.fresh_started = True
        for r in plan.fresh:
            self._host.spawn(r, spec=new, tp=plan.new_tp, device_id=step.device_ids[r], weights=plan.new_weights)

        def worker_ready(r):
            return self._host.signals.cache_ready[r] == 1 and (plan.new_weights is None or
                                                         self._host.signals.weights_ready[r, 0] == 1)

        def ready(r):
            return self._host.registered(r) and worker_ready(r)

        def missing():
            return "; ".join(f"rank {r}: worker {'ready' if worker_ready(r) else 'not ready'}, "
                             f"transfer manager {'registered' if self._host.registered(r) else 'not connected'}"
                             for r in plan.fresh if not ready(r)) or "every new rank ready"
        try:
            call_bounded(step.start_workers, (list(plan.fresh), new), deadline, f"start_workers({plan.fresh})")
        except TransferError as exc:
            raise TransferError(f"{exc} ({missing()})") from exc.__cause__
        self._host.wait_signals(lambda: all(ready(r) for r in plan.fresh), deadline, f"start of ranks {plan.fresh}",
                           detail=missing)

    def _reshard_moves(self, step, deadline, stop_before_destructive=False):
        plan = step.plan
        maps = [plan.gpu_old, plan.gpu_new, plan.cpu_old, plan.cpu_new]
        if plan.scale_in and not step.compaction_done:
            self._set_stage(step, MOVE)
            self._reshard_wave(step, list(range(plan.old_tp)), "compact", maps, deadline)
            step.compaction_done = True
        while step.waves_done < len(plan.waves):
            wave = plan.waves[step.waves_done]
            if any(plan.destructive(r) for r in wave):
                if stop_before_destructive:
                    return
                step.destructive = True      # from here on the old layout is gone
            self._set_stage(step, MOVE)
            self._reshard_wave(step, [r for r in wave if r not in step.wave_ranks_done], "program", maps, deadline)
            step.waves_done += 1
            step.wave_ranks_done = set()

    def _reshard_wave(self, step, ranks, role, maps, deadline):
        """Send one wave's moves and wait for every rank of it; TransferError naming the ranks that failed."""
        if not ranks:
            return
        host = self._host
        message = protocol.encode_reshard("move", self._body(step, role=role), maps)
        host.expect_reports("reshard_move")
        began = time.perf_counter()
        for r in ranks:
            failed = host.failed_ranks
            if r in failed:
                raise TransferError(f"reshard {role} failed: rank {r}: {failed[r]}")
            if not host.send_to(r, message):
                host.check_exit(r)
                raise TransferError(f"reshard {role} failed: rank {r}: "
                                    f"{host.failed_ranks.get(r, 'transfer manager not connected')}")
        got, copies = host.collect_reports("reshard_move", ranks, deadline)
        done = {r for r, e in got.items() if e is None and r in ranks}
        if role == "program":
            step.wave_ranks_done |= done
        step.times.setdefault("waves", []).append((role, ranks, time.perf_counter() - began))
        # the wave lasts as long as its slowest rank: the slowest KV part and the slowest weights part
        times = [copies.get(r, (0.0, 0.0)) for r in done]
        step.times.setdefault("copies", []).append(max((c for c, _ in times), default=0.0))
        step.times.setdefault("kv_copies", []).append(max((c - w for c, w in times), default=0.0))
        step.times.setdefault("weight_copies", []).append(max((w for _, w in times), default=0.0))
        failed = host.failed_ranks
        problems = [f"rank {r}: {failed[r]}" for r in ranks if r in failed]
        problems += [f"rank {r}: {e}" for r, e in sorted(got.items()) if e is not None and r in ranks]
        late = sorted(set(ranks) - set(got) - set(failed))
        problems += [f"rank {r}: its transfer manager (pid {host.pid(r)}) did not finish within the "
                     f"timeout (stalled? restart_rank({r}))" for r in late]
        if problems:
            raise TransferError(f"reshard {role} failed: " + "; ".join(problems))

    def _reshard_rollback(self, step, deadline, cause) -> list[str]:
        """Nothing was overwritten: retire the new ranks and put the old layout back in service. Always goes
        on to the end; returns what failed on the way (a callback that raised or did not return)."""
        plan = step.plan
        problems = []
        log.error("reshard to tp %d failed before any rank overwrote its old rows (%s); rolling back",
                  plan.new_tp, cause)
        try:
            if step.fresh_started:
                try:
                    self._retire(plan.fresh, step.stop_workers if callable(step.stop_workers) else None,
                                 max(deadline, time.monotonic() + 10))
                except TransferError as exc:        # its cleanup is done: go on with the rollback
                    problems.append(str(exc))
                step.fresh_started = False
            # the waves done so far filled only new ranks' memory (a kept rank's wave is past the point of no
            # return), which went with them: a resumed step starts new ones, whose programs must run again
            step.waves_done, step.wave_ranks_done = 0, set()
            m = plan.old_tp
            if plan.new_weights is not None:
                self._host.weights.resize_regions(m, self._host.weights.layout, [])
            self._host.keep_ranks(m)
            barrier = self._host.barrier
            barrier.set_active([ENGINE_PARTY] + [transfer_party(r) for r in range(m)]
                               + [worker_party(barrier.capacity, r) for r in range(m)])
            self._host.detach(range(m))
            if not self._host.failed_ranks:
                # a broken PREPARE was settled by its phase (every party reached it, every report came); the
                # abort is published only after the reset: a worker that saw ABORT first would spend its one
                # try at it in the broken generation
                self._host.barrier.reset()
                self._set_stage(step, ABORT)
                self._host.run_phase("reshard_abort", protocol.encode_reshard("abort", self._body(step)),
                                     max(deadline, time.monotonic() + 10))
                self._host.wait_signals(self._host.all_ready, max(deadline, time.monotonic() + 10),
                                        "reshard rollback")
                self._host.signals.status = NORMAL
            else:       # a dead rank: restart_rank it, then restore_caches-like retry: reshard again
                self._set_stage(step, ABORT)
                self.pending = step
        except Exception as exc:
            log.error("rollback of the reshard to tp %d did not complete: %s", plan.new_tp, exc)
            problems.append(f"the rollback did not complete: {exc}")
            self.pending = step
        finally:
            if self.pending is None:
                self._drop_step_memory(step)
        return problems

    def _retire(self, ranks, stop_workers, deadline):
        """Stop these ranks' transfer managers (and, through the callback, their workers); drop their CPU
        tiers and task sockets; take them out of the barrier. A callback that raises or does not return by
        the deadline is reported (TransferError) once everything else is done."""
        procs = []
        for r in ranks:
            proc = self._host.take_out(r)       # supervision must not report a planned exit
            if proc is not None:
                procs.append(proc)
                self._host.send_to(r, protocol.encode("stop"))
        end = time.monotonic() + 5
        for proc in procs:
            try:
                proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        failed = None
        if stop_workers is not None:
            try:
                call_bounded(stop_workers, (list(ranks),), deadline, f"stop_workers({list(ranks)})")
            except TransferError as exc:
                failed = exc
        for r in ranks:
            self._host.drop_rank(r)
        cap = self._host.barrier.capacity
        gone = {transfer_party(r) for r in ranks} | {worker_party(cap, r) for r in ranks}
        self._host.barrier.set_active([p for p in self._host.barrier.active if p not in gone])
        if failed is not None:
            raise failed

    def _reshard_commit(self, step, deadline):
        plan = step.plan
        if not step.retired_stopped:
            if plan.retired:
                self._retire(plan.retired, step.stop_workers, deadline)
            step.retired_stopped = True
        if not step.committed_state:
            self._take_new_geometry(step)
            step.committed_state = True
        self._host.detach(range(plan.new_tp))
        self._host.barrier.reset()
        self._set_stage(step, COMMIT)
        self._host.run_phase("reshard_commit", protocol.encode_reshard("commit", self._body(step)), deadline)
        self._host.wait_signals(self._host.all_ready, deadline, "reshard commit")
        self._drop_step_memory(step)

    def _take_new_geometry(self, step):
        plan = step.plan
        n = plan.new_tp
        self.capacities = [self.capacities[r] for r in plan.kept] + [Capacity.of(plan.new_spec)] * len(plan.fresh)
        self._host.take_geometry(plan.new_spec, n, list(step.device_ids))
        if plan.new_weights is not None:
            self._take_new_weights(plan)
        self._host.keep_ranks(n)
        cpu_map = plan.cpu_map
        self._host.allocator.remap(cpu_map, plan.new_spec.num_cpu_blocks)
        self._host.allocator.thaw()
        for cache, free in step.quota_free.items():
            cache.remap_blocks(cpu_map, free, self._host.allocator)

    def _take_new_weights(self, plan):
        """The weights' new layout and allocations; every rank's CPU region in the new slice size (a region's
        bytes matter only while the deployment sleeps, and a reshard refuses a sleeping one)."""
        moved = plan.weight_allocations()
        fresh = slice_bytes(plan.new_weights)
        self._weight_capacities = [[moved.get((r, i), cap) for i, cap in enumerate(self._weight_capacities[r])]
                                   for r in plan.kept] + [fresh] * len(plan.fresh)
        self._host.weights.take_layout(plan.new_weights, plan.new_tp, plan.kept)

    def _drop_step_memory(self, step):
        for seg in step.cpu_staging.values():
            seg.close()
        step.cpu_staging = {}
        if step.plan_segment is not None:
            step.plan_segment.close()
            step.plan_segment = None

    def _reshard_report(self, step, seconds):
        device_memory = [rank_device_memory(self._host.device, self._host.suffix, r, self._host.spec,
                                            self._host.weights.layout, self._weight_capacities)
                         for r in range(step.plan.new_tp)]
        return step_report(step.plan, step.times, seconds, device_memory)


def slice_bytes(layout) -> list:
    """Bytes of each weight tensor of a rank's slice (all its device blocks): a new allocation's size."""
    return [t.num_blocks * t.block_bytes for t in layout.tensors()]


def call_bounded(fn, args, deadline, what):
    """fn(*args) on a thread of its own, waited for until the deadline: the reshard's timeout holds while an
    engine's callback blocks (the callback's thread is left to finish, or not, by itself). TransferError
    naming `what` if it raises or has not returned by then."""
    outcome = []

    def run():
        try:
            fn(*args)
            outcome.append(None)
        except BaseException as exc:        # reported to the caller, whatever it is
            outcome.append(exc)
    thread = threading.Thread(target=run, name="fastcache-reshard-callback", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if not outcome:
        raise TransferError(f"{what} did not return within the reshard's timeout")
    if outcome[0] is not None:
        exc = outcome[0]
        raise TransferError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
