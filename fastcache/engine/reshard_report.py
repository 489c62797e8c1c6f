"""What a reshard step reports (docs/design.md §9): bytes moved by source, copy rates, the KV's and the
weights' parts, and each rank's device memory after the step. Pure reading: nothing here changes a rank."""
from __future__ import annotations

import os

from ..ipc.manifest import read_json_segment, read_manifest
from ..ipc.naming import device_memory_name, weights_name
from ..ipc.shm import SHM_DIR, SegmentError


def step_report(plan, times: dict, seconds: float, device_memory: list) -> dict:
    """The report of a finished step: `times` holds the step's timed parts ("waves": (role, ranks, seconds),
    "copies", "kv_copies", "weight_copies": seconds per wave's slowest rank)."""
    moved = {k: 0 for k in ("local", "remote", "cpu", "compaction")}
    for r in range(max(plan.old_tp, plan.new_tp)):
        for k, v in plan.moved_bytes(r).items():
            moved[k] += v
    total = sum(moved.values())
    move_seconds = sum(t for _, _, t in times.get("waves", []))
    copy_seconds = sum(times.get("copies", []))    # the waves' slowest ranks' copies alone
    return {"from_tp": plan.old_tp, "to_tp": plan.new_tp, "seconds": seconds, "move_seconds": move_seconds,
            "bytes_moved": total, "gbps": total / move_seconds / 1e9 if move_seconds else 0.0,
            "copy_seconds": copy_seconds, "copy_gbps": total / copy_seconds / 1e9 if copy_seconds else 0.0,
            "bytes_by_source": moved,
            "waves": [(role, ranks, t) for role, ranks, t in times.get("waves", [])],
            "gpu_blocks_per_rank": [plan.old_spec.num_gpu_blocks, plan.new_spec.num_gpu_blocks],
            "cpu_blocks_per_rank": [plan.old_spec.num_cpu_blocks, plan.new_spec.num_cpu_blocks],
            "live_gpu_blocks": len(plan.gpu_old), "live_cpu_blocks": len(plan.cpu_old),
            "block_map": plan.gpu_map, "cpu_block_map": plan.cpu_map,
            "staging_bytes": {r: plan.staging_bytes_for(r, "gpu") for r in plan.kept},
            "cpu_staging_bytes": {r: plan.staging_bytes_for(r, "cpu") for r in plan.kept},
            **weights_report(plan, total, sum(times.get("kv_copies", [])), sum(times.get("weight_copies", []))),
            "device_memory": device_memory}


def weights_report(plan, total, kv_seconds, weights_seconds) -> dict:
    """The KV's and the weights' parts of the moves: bytes, and copy seconds (a rank's program builds its
    KV rows, then its weight rows, timed apart; per wave the slowest rank's part, summed over waves)."""
    weights = sum(sum(plan.moved_weight_bytes(r).values()) for r in range(plan.new_tp))
    kv = total - weights
    out = {"weights_bytes": weights, "kv_bytes": kv, "weights_share": weights / total if total else 0.0,
           "kv_seconds": kv_seconds, "weights_seconds": weights_seconds,
           "kv_gbps": kv / kv_seconds / 1e9 if kv_seconds else 0.0,
           "weights_gbps": weights / weights_seconds / 1e9 if weights_seconds else 0.0}
    if plan.weights is not None:
        summary = plan.summary()
        out["weight_moves"], out["weight_allocations"] = summary["weight_moves"], summary["weight_allocations"]
    return out


def rank_device_memory(device: str, suffix: str, rank: int, spec, weights_layout, weight_capacities) -> dict:
    """Rank's device memory after the step: its GPU blocks, and what its worker reported at COMMIT (cuda: the
    driver's free and total bytes, its framework allocator's allocated, reserved and fragmented bytes), or on
    sim what its shared-memory segments show (sim_device_memory)."""
    out = {"rank": rank, "gpu_blocks": spec.num_gpu_blocks}
    if device == "sim":
        out.update(sim_device_memory(suffix, rank, spec, weights_layout, weight_capacities))
    try:
        out.update(read_json_segment(device_memory_name(suffix, rank), suffix))
    except (SegmentError, ValueError):
        pass        # the worker's device reports nothing of its own (sim), or could not say
    return out


def sim_device_memory(suffix: str, rank: int, spec, weights_layout, weight_capacities) -> dict:
    """sim: allocated: bytes of the segments the rank's cache and weights lie in; reserved: its allocations
    (the cache's arena, each weight tensor's allocation); in_use: the tensors of the current geometry; free =
    reserved - in_use (room a later step may grow into, e.g. a weight allocation larger than its slice after
    a scale-out); fragmented = allocated - reserved (bytes no allocation covers: a weight tensor's old place
    after it moved to a new allocation, alignment, segment headers)."""
    try:
        cache = read_manifest(suffix, rank)
        weights = read_json_segment(weights_name(suffix, rank, "exports"), suffix) \
            if weights_layout is not None else []
    except (SegmentError, ValueError):
        return {}
    sizes = {e["segment"]: os.stat(os.path.join(SHM_DIR, e["segment"].lstrip("/"))).st_size
             for e in cache + weights if "segment" in e}
    kv_arenas = {e["segment"] for e in cache if "segment" in e}
    reserved = sum(sizes[s] for s in kv_arenas) + (sum(weight_capacities[rank]) if weights else 0)
    in_use = spec.gpu_cache_bytes + (weights_layout.gpu_cache_bytes if weights else 0)
    allocated = sum(sizes.values())
    return {"allocated_bytes": allocated, "reserved_bytes": reserved, "in_use_bytes": in_use,
            "free_bytes": reserved - in_use, "fragmented_bytes": allocated - reserved}
