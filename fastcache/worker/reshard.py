"""A worker's part in a reshard (docs/design.md §9), run on its watch thread while kv_cache_status is RESHARDING.

The engine publishes the step in the reshard_state signal ([sequence, stage, from tp, to tp, attempt]) and
its details in the reshard plan segment (JSON). A worker takes part once in every attempt at a stage (the
engine bumps the attempt after resetting the barrier):

- PREPARE (ranks of the old tp): a kept rank allocates its staging buffer beside the cache and exports
  it; every old rank marks its export stale (cache_ready = 0); then the barrier. A failure (no memory for
  the staging buffer) aborts the barrier at once, naming this worker, before anything moves.
- COMMIT (ranks of the new tp): a kept rank re-views its tensors in the new shape, at the same addresses,
  and re-exports them; the staging buffer goes; cache_ready = 1; then the barrier. A rank started during
  the step (start_workers) has the new shape already and only meets the barrier.
- ABORT (ranks of the old tp; nothing was overwritten): the staging buffer goes, cache_ready = 1, barrier.

Weights (registered, every layer resident) follow the cache: PREPARE allocates the new allocations the plan
gives this rank (weight tensors whose new slice outgrows their own), exports them by name and marks the
weights' export stale (weights_ready[r, 0] = 0); COMMIT re-views the others in the new slice shapes in place,
switches those to their new allocations (sim leaves the old bytes unused in the arena, cuda frees the old
allocation), re-exports the manifest and sets weights_ready[r, 0] = 1; ABORT frees the new allocations and
sets it back.
"""
from __future__ import annotations

import logging

from ..config import CacheSpec
from ..ipc.manifest import read_json_segment, write_json_segment
from ..ipc.naming import device_memory_name, reshard_exports_name, reshard_plan_name, weights_name
from ..ipc.protocol import ABORT, COMMIT, PREPARE, STAGE_NAMES
from ..ipc.signal import read_stage
from ..weight_spec import WeightSpec

log = logging.getLogger("fastcache.worker")


def read_plan(suffix: str) -> dict:
    return read_json_segment(reshard_plan_name(suffix), suffix)


class ReshardFollower:
    """Follows the engine's reshard steps for one CacheWorker."""

    def __init__(self, worker):
        self.w = worker
        self.done = None            # the last attempt (reshard_state[4]) seen
        self.staging = None
        self.exports = None
        self.new_weights = {}           # tensor index -> this rank's new allocation (PREPARE to COMMIT)
        self.new_weight_exports = None
        self.memory_report = None       # this rank's device memory after the last commit (JSON segment)

    def poll(self):
        w = self.w
        published = read_stage(w.signals.reshard_state)
        if published is None or published[0] == self.done:
            return      # none yet, being rewritten (read whole on the next poll), or acted on
        attempt, seq, stage, from_tp, to_tp = published
        self.done = attempt
        if stage not in (PREPARE, COMMIT, ABORT):
            return
        old, new = w.rank < from_tp, w.rank < to_tp
        if stage in (PREPARE, ABORT) and not old or stage == COMMIT and not new:
            return      # not a party of this stage (started during the step, or retired)
        try:
            if stage == PREPARE:
                self._prepare(seq, new)
            elif stage == COMMIT:
                self._commit(seq, old)
            else:
                self._abort()
        except Exception as exc:
            log.error("rank %d: reshard %s failed: %s", w.rank, STAGE_NAMES[stage], exc)
            w.barrier.abort(w.party)       # everyone learns at once, naming this worker
            return
        try:
            w.barrier.wait(w.party, w.settings.phase_timeout)
        except Exception as exc:        # a failed stage leaves the cache as it is; the engine reports it
            log.error("rank %d: reshard %s failed: %s", w.rank, STAGE_NAMES[stage], exc)

    def _prepare(self, seq, kept):
        w = self.w
        plan = read_plan(w.suffix)
        if plan.get("seq") != seq:
            raise ValueError(f"reshard plan {plan.get('seq')} is not step {seq}")
        need = int(plan["staging"][w.rank]) if kept else 0
        if need and (self.staging is None or self.staging.nbytes != need):
            self.release()
            self.staging = w.ops.reshard_staging(need, w.suffix, w.rank, w.framework, w.device_id)
            self.exports = write_json_segment(reshard_exports_name(w.suffix, w.rank), self.staging.descriptor,
                                              w.suffix)
        w.signals.cache_ready[w.rank] = 0      # the export describes the old shape from now on
        if w.weights is not None and "new_weights" in plan:
            self._prepare_weights(plan, seq)

    def _prepare_weights(self, plan, seq):
        w = self.w
        mine = {int(i): int(n) for r, i, n in plan.get("weight_allocations", []) if int(r) == w.rank}
        if set(mine) != set(self.new_weights) or any(self.new_weights[i].nbytes != n for i, n in mine.items()):
            self.release_weights()
            dtypes = [dtype for _, _, dtype in WeightSpec.from_json(plan["new_weights"]).layer_tensors]
            for i, n in mine.items():
                self.new_weights[i] = w.ops.weight_allocation(n, w.suffix, w.rank, i, seq, w.framework, w.device_id,
                                                              dtypes[i])
            self.new_weight_exports = write_json_segment(
                weights_name(w.suffix, w.rank, "reshard_exports"),
                {str(i): a.descriptor for i, a in self.new_weights.items()}, w.suffix)
        w.signals.weights_ready[w.rank, 0] = 0      # the weights' export describes the old slices from now on

    def _commit(self, seq, kept):
        w = self.w
        plan = read_plan(w.suffix)
        if plan.get("seq") != seq:
            raise ValueError(f"reshard plan {plan.get('seq')} is not step {seq}")
        spec, tp = CacheSpec.from_json(plan["new_spec"]), int(plan["to_tp"])
        if kept and w.spec != spec:
            w.reshape(spec)
        if w.weights is not None and "new_weights" in plan:
            layout = WeightSpec.from_json(plan["new_weights"])
            if w.weights.layout != layout:      # a kept rank (a new one registered the new layout)
                # the new allocations stay the follower's until the weights have taken them over: a commit that
                # fails here leaves the step pending, and the same reshard again needs them (they hold the moved
                # bytes); dropped first, the retry re-viewed the tensors in place (too small) and they leaked
                w.weights.reshard(layout, self.new_weights)
                self.new_weights = {}
        w.spec, w.tp_size = spec, tp
        w.signals.resize(tp)
        self.release()
        self._report_memory()
        w.signals.cache_ready[w.rank] = 1

    def _report_memory(self):
        """Publish the device's memory as this process sees it (its framework's allocator is its own), for the
        engine's reshard report; a device that cannot say leaves no report, which costs the step nothing."""
        w = self.w
        self.close_report()
        try:
            report = w.ops.device_memory(w.framework, w.device_id)
        except Exception as exc:
            log.warning("rank %d: device memory not reported: %s", w.rank, exc)
            return
        if report:
            self.memory_report = write_json_segment(device_memory_name(w.suffix, w.rank), report, w.suffix)

    def close_report(self):
        report, self.memory_report = self.memory_report, None
        if report is not None:
            report.close()

    def _abort(self):
        w = self.w
        self.release()
        if w.ready:
            w.signals.cache_ready[w.rank] = 1
        if w.weights is not None and w.weights.allocated:
            w.signals.weights_ready[w.rank, 0] = 1

    @staticmethod
    def forget(cache):
        """Drop what a reshard kept of a cache that is being freed (the cuda device keeps its first tensors)."""
        for name in ("bases", "base_bytes"):
            cache.__dict__.pop(name, None)

    def release(self):
        """Free the staging buffer and its export (commit, abort, close)."""
        exports, staging, self.exports, self.staging = self.exports, self.staging, None, None
        if exports is not None:
            exports.close()
        if staging is not None:
            staging.close()
        self.release_weights()

    def release_weights(self):
        """Free new weight allocations nobody took over (abort, close) and their export."""
        exports, self.new_weight_exports = self.new_weight_exports, None
        if exports is not None:
            exports.close()
        allocations, self.new_weights = self.new_weights, {}
        for alloc in allocations.values():
            alloc.close()
