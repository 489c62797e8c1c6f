"""A transfer manager's part in a reshard (docs/design.md §9): the steps the engine sends it.

- prepare: finish the tasks in flight, meet everyone at the phase barrier (the old layout stays attached).
- move: let go of the cache and the CPU tier, then run this rank's part of the plan: compaction of its old
  rows (scale-in), or building its new rows from head slices of the old ranks' rows (kept ranks in place
  through the staging buffer, journaled; fresh ranks straight into their empty memory). The plan is
  computed here from the same inputs the engine used, so both agree chunk by chunk.
- commit: take the new spec and tp, re-attach the cache (its worker re-exports it in the new shape) and
  the CPU tier (re-pinned in the new geometry on CUDA), and the weights in their new layout, meet at the
  barrier.
- abort: re-attach what the old layout had and meet at the barrier (nothing was overwritten yet).
"""
from __future__ import annotations

import json
import logging
import os
import time

from ..config import CacheSpec
from ..reshard_plan import Capacity, Plan, run_chunks
from ..ipc import protocol
from ..weight_spec import WeightSpec

log = logging.getLogger("fastcache.transfer")


class Journal:
    """This rank's progress through its in-place program, in the engine's reshard_progress signal: a
    replacement transfer manager resumes from it."""

    def __init__(self, slots, rank: int, seq: int):
        self.slots, self.rank, self.seq = slots, rank, seq
        if int(self.slots[rank, 0]) != seq:
            self.slots[rank, 1] = 0
            self.slots[rank, 0] = seq

    def get(self) -> int:
        return int(self.slots[self.rank, 1])

    def set(self, value: int):
        self.slots[self.rank, 1] = value


def decode_step(header, ids):
    """(body dict, Plan or None) of a reshard message; ValueError if anything is off."""
    try:
        body = json.loads(header["body"])
    except ValueError as exc:
        raise ValueError(f"reshard body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError("reshard body is not a JSON object")
    plan = None
    if header["step"] == "move":
        if len(ids) != protocol.RESHARD_FRAMES:
            raise ValueError("a reshard move carries the GPU and CPU block maps")
        try:
            old_spec = CacheSpec.from_json(body["old_spec"])
            capacities = [Capacity(*map(int, c)) for c in body["capacities"]]
            weights = WeightSpec.from_json(body["weights"]) if "weights" in body else None
            plan = Plan(old_spec, int(body["from_tp"]), int(body["to_tp"]), capacities, ids[0], ids[2],
                        int(body["staging_bytes"]), gpu_new=ids[1], cpu_new=ids[3], weights=weights,
                        weight_capacities=body.get("weight_capacities"))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"reshard move body is incomplete: {exc!r}") from None
    return body, plan


class ReshardRunner:
    def __init__(self, manager):
        self.m = manager

    def on_message(self, header, ids):
        m = self.m
        step = header["step"]
        began = time.perf_counter()
        try:
            body, plan = decode_step(header, ids)
        except ValueError as exc:
            phase = "reshard_move" if step == "move" else f"reshard_{step}"
            m.send("phase_failed", phase=phase, rank=m.rank, error=str(exc)[:protocol.MAX_ERROR_CHARS])
            return
        if step == "prepare":
            m.phase = "reshard_prepare"         # _advance meets the barrier once no task is in flight
        elif step == "move":
            self._move(body, plan, time.perf_counter() - began)
        elif step == "commit":
            try:
                spec = CacheSpec.from_json(body["new_spec"])
                tp = int(body["to_tp"])
                weights = WeightSpec.from_json(body["weights"]).resharded(tp) if "weights" in body else None
            except (KeyError, ValueError, TypeError) as exc:
                m.send("phase_failed", phase="reshard_commit", rank=m.rank, error=f"bad commit: {exc}")
                return
            self._detach_all()
            if m.weights is not None and weights is not None and m.weights.layout != weights:
                m.weights.detach(region=True)       # re-attached in the new layout (the engine made a new region)
                m.weights.layout = weights
            m.spec, m.tp_size, m.infos = spec, tp, spec.tensors(m.rank, m.device_id)
            m.signals.resize(tp)
            self._restore("reshard_commit")
        elif step == "abort":
            self._restore("reshard_abort")

    def advance(self) -> bool:
        """Called from the main loop; True if it handled the phase."""
        m = self.m
        if m.phase == "reshard_prepare":
            if not m.scheduler:
                m.pass_phase_barrier("reshard_prepare", next_phase="resharding")
            return True
        return m.phase == "resharding"

    def _restore(self, name):
        m = self.m
        m.restore_phase, m.phase, m.attach_error = name, "restoring", None

    def _detach_all(self):
        """Drop every mapping of the cache, the CPU tier and the weights (on CUDA: IPC handles closed, tier unpinned:
        a move opens the weights itself, CUDA maps an allocation once per process, and a worker frees a weight
        tensor's old allocation at commit)."""
        m = self.m
        saved, m.release_swap = m.release_swap, True
        try:
            m.detach()
            if m.weights is not None:
                m.weights.detach()
        finally:
            m.release_swap = saved

    def _move(self, body, plan, planned: float = 0.0):
        m = self.m
        start = time.perf_counter()
        copying = 0.0
        role = body.get("role")
        try:
            if role not in ("compact", "program"):
                raise ValueError(f"unknown reshard role {role!r}")
            if m.scheduler:
                raise ValueError("tasks are still in flight")
            self._detach_all()
            memory = m.ops.reshard_memory(m.suffix, plan, m.device_id)
            execute, flush = _paced(memory.execute, m.rank), _paced(memory.flush, m.rank)
            copying = time.perf_counter()
            weights_began = None
            try:
                if role == "compact":
                    run_chunks(plan.compaction(m.rank), execute, flush=flush)
                else:
                    chunks, journaled = plan.program(m.rank)
                    journal = Journal(m.signals.reshard_progress, m.rank, int(body["seq"])) if journaled else None

                    def before(i):      # a program builds the KV rows, then the weights': time each part
                        nonlocal weights_began
                        if weights_began is None and chunks[i].of_weights:
                            flush()
                            weights_began = time.perf_counter()
                    run_chunks(chunks, execute, journal, flush=flush, before=before)
            finally:
                ended = time.perf_counter()
                weights_seconds = ended - weights_began if weights_began is not None else 0.0
                copying = ended - copying
                memory.close()
        except Exception as exc:        # a failed step fails this rank's part, never the process
            log.error("rank %d: reshard %s failed: %s", m.rank, role, exc)
            m.send("phase_failed", phase="reshard_move", rank=m.rank,
                    error=f"{type(exc).__name__}: {exc}"[:protocol.MAX_ERROR_CHARS])
            return
        log.info("rank %d: reshard %s done in %.3f s (plan %.3f s, programs and copies %.3f s)", m.rank, role,
                 time.perf_counter() - start + planned, planned, copying)
        m.send("phase_done", phase="reshard_move", rank=m.rank, copy_seconds=copying, weights_seconds=weights_seconds)


TEST_PACE = "FASTCACHE_TEST_RESHARD_PACE"     # RANK:SECONDS, tests only: rank sleeps after every copy and flush


def _paced(call, rank: int):
    """call, slowed down for fault-injection tests (a rank killed or stalled in the middle of its program)."""
    raw = os.environ.get(TEST_PACE, "")
    try:
        target, seconds = raw.split(":")
        target, seconds = int(target), float(seconds)
    except ValueError:
        return call
    if target != rank:
        return call

    def paced(*args):
        call(*args)
        time.sleep(seconds)
    return paced
