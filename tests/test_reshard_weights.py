"""Weights in a reshard step (docs/design.md §9, §11), the plan alone: weight slices (column split, row split,
split in the middle, replicated) and KV head slices move together. A NumPy executor runs the plan over
every rank's memory, sized as allocated, in the waves' order (ranks of a wave in random order, in-place
programs cut short and resumed from their journal), and every rank's new weight slices are compared bit for
bit with the slices of the full tensors; the KV cache's live blocks are checked as in test_reshard.py.
Negative controls show that the check catches a skipped copy, a wrong piece offset and a wrong order."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import MemoryJournal
from fastcache.config import CacheSpec
from fastcache.ops.host_memory import numpy_copy
from fastcache.reshard_plan import Capacity, Plan, resharded_spec, run_chunks
from fastcache.weight_spec import WeightSpec

HEADS = 12                  # KV heads in all; tp 1, 2, 3, 4 and 6 divide them and every split dim below
LAYERS = 4
TENSORS = {"qkv": ((12, 16), "float16", 0),         # column-parallel: a row is a layer's whole slice
           "o": ((16, 12), "float16", 1),           # row-parallel: 16 rows per layer
           "mlp": ((4, 12, 3), "uint8", 1),         # split in the middle: outer 4, 3 bytes per index
           "norm": ((16,), "float32")}              # replicated
STORAGE = {1: np.uint8, 2: np.uint16, 4: np.uint32}   # integers: every bit pattern survives a comparison
ITEM = {"float16": 2, "float32": 4, "uint8": 1}


def kv_spec(tp: int) -> CacheSpec:
    return CacheSpec(num_layers=2, num_gpu_blocks=4 * tp + 4, num_cpu_blocks=2 * tp + 2, block_size=2,
                     num_kv_heads=HEADS // tp, head_dim=2, cache_dtype="float16")


class Deployment:
    """What the plan moves and what survives a step: the full weight tensors (the truth), every rank's weight
    allocations (bytes, sized as allocated) and the per-rank KV spec."""

    def __init__(self, tp: int, rng, tensors=TENSORS):
        self.tp, self.rng = tp, rng
        self.weights = WeightSpec(LAYERS, tensors, tp_size=tp)
        self.full = {name: rng.integers(1, np.iinfo(STORAGE[ITEM[d]]).max, (LAYERS, *shape), dtype=STORAGE[ITEM[d]],
                                        endpoint=True)
                     for name, (shape, d, *_) in tensors.items()}
        self.kv = kv_spec(tp)
        self.mem = {}                # ("weights", rank, i) -> the allocation's bytes
        for r in range(tp):
            for i, (name, _, _) in enumerate(self.weights.layer_tensors):
                self.mem["weights", r, i] = self.slice_bytes(self.weights, name, r).copy()

    def slice_bytes(self, spec: WeightSpec, name: str, rank: int) -> np.ndarray:
        part = self.full[name][(slice(None), *spec.rank_slice(name, rank))]
        return np.ascontiguousarray(part).view(np.uint8).ravel()

    def capacities(self):
        return [[len(self.mem["weights", r, i]) for i in range(len(self.weights.layer_tensors))]
                for r in range(self.tp)]

    def weight_errors(self) -> list:
        """(rank, tensor) whose bytes are not the slice of the full tensor this rank holds now."""
        bad = []
        for r in range(self.tp):
            for i, (name, _, _) in enumerate(self.weights.layer_tensors):
                want = self.slice_bytes(self.weights, name, r)
                if not np.array_equal(self.mem["weights", r, i][:len(want)], want):
                    bad.append((r, name))
        return bad


def plan_for(dep: Deployment, n: int, rng, staging=None) -> Plan:
    new = resharded_spec(dep.kv, dep.tp, n, Capacity.of(dep.kv))
    blocks = dep.kv.num_gpu_blocks
    live = np.sort(rng.choice(blocks, int(rng.integers(0, min(new.num_gpu_blocks, blocks) + 1)), replace=False))
    cpu = np.sort(rng.choice(dep.kv.num_cpu_blocks, int(rng.integers(0, min(new.num_cpu_blocks,
                                                                            dep.kv.num_cpu_blocks) + 1)),
                             replace=False))
    if staging is None:         # from one row of the largest kind up: weight tensors take several chunks
        row = max(t.block_bytes for t in dep.weights.resharded(min(dep.tp, n)).tensors())
        staging = int(rng.integers(1, 4)) * max(new.cpu_block_stride, dep.kv.cpu_block_stride, row)
    return Plan(dep.kv, dep.tp, n, [Capacity.of(dep.kv)] * dep.tp, live, cpu, staging,
                weights=dep.weights, weight_capacities=dep.capacities())


def memories(dep: Deployment, plan: Plan, rng) -> dict:
    """Every rank's memory by the plan's refs: KV and CPU tiers random (old ranks) or empty (fresh ranks), the
    weights as allocated, new weight allocations and staging buffers exactly as large as the plan says."""
    m, n = plan.old_tp, plan.new_tp
    mem = dict(dep.mem)
    for r in range(max(m, n)):
        for sp in plan.spaces:
            ref = ("cpu", r) if sp.key == ("cpu",) else ("gpu", r, sp.key[1])
            size = plan.region_bytes(sp, r)
            mem[ref] = rng.integers(1, 256, size, dtype=np.uint8) if r < m else np.zeros(size, np.uint8)
        for sp in plan.weight_spaces:
            ref = ("weights", r, sp.key[1])
            if r < m:
                assert plan.region_bytes(sp, r) <= len(mem[ref])      # in place: within the allocation
            else:
                mem[ref] = np.zeros(plan.region_bytes(sp, r), np.uint8)
        for kind in ("gpu", "cpu"):
            mem["staging", r, kind] = np.zeros(plan.staging_bytes_for(r, kind), np.uint8)
    for (r, i), nbytes in plan.weight_allocations().items():
        mem["weights_new", r, i] = np.zeros(nbytes, np.uint8)
    return mem


def kv_blocks(plan: Plan, mem: dict, new: bool) -> dict:
    """{(space key, block id): all heads of the block} for the live blocks, before (old ids) or after."""
    spec, tp = (plan.new_spec, plan.new_tp) if new else (plan.old_spec, plan.old_tp)
    out = {}
    for sp in plan.spaces:
        row = sp.new_row if new else sp.old_row
        for old, nb in zip(*plan_pairs(plan, sp)):
            b = nb if new else old
            if sp.key[0] == "gpu":
                parts = [mem["gpu", r, sp.key[1]][b * row:(b + 1) * row] for r in range(tp)]
            else:
                parts = [mem["cpu", r][b * row + t.cpu_offset:b * row + t.cpu_offset + t.block_bytes]
                         for t in spec.tensors() for r in range(tp)]
            out[sp.key, nb] = np.concatenate(parts)
    return out


def plan_pairs(plan: Plan, sp):
    """The live (old id, new id) pairs of a KV space, from the plan's public block maps."""
    old, new = (plan.cpu_old, plan.cpu_new) if sp.key == ("cpu",) else (plan.gpu_old, plan.gpu_new)
    keep = (old < sp.old_blocks) & (new < sp.new_blocks)
    return old[keep], new[keep]


def execute_plan(plan: Plan, mem: dict, rng, crash=False, skip=None, reverse_waves=False):
    """Compaction on every old rank, then the waves (each wave's ranks in random order); with crash, every
    journaled program is cut short at a random copy and resumed from its journal. skip(copy) -> True drops
    the first copy it names (a negative control)."""
    copy = numpy_copy(lambda ref: mem[ref])
    skipped = []

    def execute(c):
        if skip is not None and not skipped and skip(c):
            skipped.append(c)
            return
        copy(c)
    for r in range(plan.old_tp):
        run_chunks(plan.compaction(r), execute)
    for wave in (plan.waves[::-1] if reverse_waves else plan.waves):
        for r in rng.permutation(wave).tolist():
            chunks, journaled = plan.program(r)
            if not journaled or not crash:
                run_chunks(chunks, execute)
                continue
            total = sum(len(c.gather) + len(c.write) for c in chunks)
            budget = int(rng.integers(0, total + 1))

            def dying(c):
                nonlocal budget
                if budget == 0:
                    raise InterruptedError
                budget -= 1
                execute(c)
            journal = MemoryJournal()
            try:
                run_chunks(chunks, dying, journal)
            except InterruptedError:
                assert budget == 0
            run_chunks(chunks, execute, journal)          # the replacement resumes from the journal
    assert skip is None or skipped, "the negative control skipped nothing"


def reshard(dep: Deployment, n: int, rng, crash=False, staging=None, tamper=None, skip=None, reverse_waves=False):
    """One step on the deployment; returns (plan, KV blocks that differ). dep then describes tp n."""
    plan = plan_for(dep, n, rng, staging)
    if tamper is not None:
        tamper(plan)
    mem = memories(dep, plan, rng)
    before = kv_blocks(plan, mem, new=False)
    execute_plan(plan, mem, rng, crash, skip, reverse_waves)
    after = kv_blocks(plan, mem, new=True)
    kv_bad = [key for key, want in before.items() if not np.array_equal(after[key], want)]
    allocated = plan.weight_allocations()
    dep.mem = {("weights", r, i): mem["weights_new" if (r, i) in allocated else "weights", r, i]
               for r in range(n) for i in range(len(dep.weights.layer_tensors))}
    dep.tp, dep.weights, dep.kv = n, plan.new_weights, plan.new_spec
    return plan, kv_bad


def assert_reads_precede_overwrites(plan: Plan):
    """No rank overwrites memory another rank reads unless the reader's wave comes first; a replicated tensor
    is never overwritten; the split tensors' reader relation is the KV heads' (what `readers` uses)."""
    wave_of = {r: k for k, wave in enumerate(plan.waves) for r in wave}
    overwritten = {r: {c.dst for chunk in plan.program(r)[0] for c in chunk.write} for r in range(plan.new_tp)}
    for r in range(plan.new_tp):
        for chunk in plan.program(r)[0]:
            for c in chunk.gather:
                s = c.src[1]
                if s != r and c.src in overwritten.get(s, ()):
                    assert wave_of[r] < wave_of[s], (r, c.src, plan.waves)
    kv = {(s, r) for s in range(plan.old_tp) for r in plan.readers(s)}
    for sp in plan.weight_spaces:
        i = sp.key[1]
        if plan.weights.split_dims[i] is None:
            assert not any(("weights", s, i) in refs for s, refs in overwritten.items())
        else:
            pairs = {(p.src_rank, r) for r, mine in enumerate(sp.pieces) for p in mine if p.src_rank != r}
            assert pairs == kv, (plan.weights.layer_tensors[i][0], pairs, kv)


# -- the bytes land ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tps", [[1, 2, 4, 2, 1], [3, 1], [1, 3], [1, 4, 2, 1], [2, 3, 6, 4, 1], [4, 2]])
def test_every_weight_slice_and_kv_block_lands_bit_for_bit(tps):
    rng = np.random.default_rng(sum(t * 10 ** k for k, t in enumerate(tps)))
    for crash in (False, True):
        dep = Deployment(tps[0], rng)
        assert dep.weight_errors() == []
        for n in tps[1:]:
            m = dep.tp
            plan, kv_bad = reshard(dep, n, rng, crash=crash)
            assert kv_bad == [], (m, n, kv_bad[:3])
            assert dep.weight_errors() == [], (m, n)
            assert_reads_precede_overwrites(plan)


def test_a_skipped_copy_a_wrong_offset_and_a_wrong_order_are_caught():
    rng = np.random.default_rng(1)
    # a fresh rank's copy of a replicated tensor, skipped
    dep = Deployment(1, rng)
    reshard(dep, 2, rng, skip=lambda c: c.src == ("weights", 0, 3) and c.dst[1] == 1)
    assert (1, "norm") in dep.weight_errors()
    # a kept rank's in-place gather of the column-split tensor, skipped
    dep = Deployment(2, rng)
    reshard(dep, 1, rng, skip=lambda c: c.src == ("weights", 1, 0))
    assert dep.weight_errors() == [(0, "qkv")]
    # one piece of the row-split tensor read a byte early
    dep = Deployment(1, rng)

    def early(plan):
        sp = plan.weight_spaces[1]
        bad = (dataclasses.replace(sp.pieces[1][0], src_off=sp.pieces[1][0].src_off - 1),)
        plan.weight_spaces[1] = dataclasses.replace(sp, pieces=(sp.pieces[0], bad))
    reshard(dep, 2, rng, tamper=early)
    assert dep.weight_errors() == [(1, "o")]
    # the waves run backwards: rank 0 overwrites its rows before rank 1 has read them
    dep = Deployment(1, rng)
    reshard(dep, 2, rng, reverse_waves=True)
    assert {name for _, name in dep.weight_errors()} == {"qkv", "o", "mlp"}


# -- in place or a new allocation -----------------------------------------------------------------
def weight_chunks(plan: Plan, rank: int):
    return [c for c in plan.program(rank)[0] if c.gather[0].src[0] == "weights"]


def test_a_slice_that_outgrows_its_allocation_is_rebuilt_into_a_new_one():
    rng = np.random.default_rng(2)
    dep = Deployment(1, rng)
    reshard(dep, 4, rng)
    split = [i for i, d in enumerate(dep.weights.split_dims) if d is not None]
    # rank 0 was born at tp 1 (its allocations hold the whole tensors), rank 1 at tp 4 (a quarter)
    plan, kv_bad = reshard(dep, 2, rng)
    assert kv_bad == [] and dep.weight_errors() == []
    assert plan.weight_allocations() == {(1, i): plan.weight_spaces[i].new_bytes() for i in split}
    for chunk in weight_chunks(plan, 1):            # straight into the new allocation: no staging, no write
        assert not chunk.write and all(c.dst[0] == "weights_new" for c in chunk.gather)
    assert all(c.dst[0] == "staging" for chunk in weight_chunks(plan, 0) for c in chunk.gather)
    assert all(c.dst[:2] == ("weights", 0) for chunk in weight_chunks(plan, 0) for c in chunk.write)
    assert [a["rank"] for a in plan.summary()["weight_allocations"]] == [1] * len(split)
    # rank 0 goes back to tp 1 inside the allocation it was born with; rank 1's new one is now its own
    plan, kv_bad = reshard(dep, 1, rng)
    assert kv_bad == [] and dep.weight_errors() == [] and plan.weight_allocations() == {}
    assert weight_chunks(plan, 0) and all(chunk.write for chunk in weight_chunks(plan, 0))
    # every rank born at tp 4: both kept ranks outgrow every split tensor
    dep = Deployment(4, rng)
    plan, kv_bad = reshard(dep, 2, rng)
    assert kv_bad == [] and dep.weight_errors() == []
    assert sorted(plan.weight_allocations()) == [(r, i) for r in (0, 1) for i in split]
    assert plan.region_bytes(plan.weight_spaces[0], 0) == plan.weight_spaces[0].old_bytes()


def test_rows_are_rewritten_in_place_in_the_safe_order_and_staging_holds_the_largest_weight_chunk():
    rng = np.random.default_rng(3)
    big = {"up": ((64, 16), "float32", 0), "norm": ((16,), "float32")}    # a row: a layer's 4 KiB slice at tp 1
    dep = Deployment(1, rng, big)
    plan, _ = reshard(dep, 2, rng, staging=4096)
    assert plan.staging_bytes_for(0, "gpu") == 4096 and dep.weight_errors() == []     # two 2 KiB rows
    firsts = [c.write[0].dst_rows[0] for c in weight_chunks(plan, 0)]
    assert firsts == [0, 2]                                                   # rows shrink: ascending
    plan, _ = reshard(dep, 1, rng, staging=8192)                              # rank 0 fits: in place
    firsts = [c.write[0].dst_rows[0] for c in weight_chunks(plan, 0)]
    assert firsts == [2, 0]             # rows grow: descending (chunks [2, 3] then [0, 1])
    assert plan.staging_bytes_for(0, "gpu") == 8192 and dep.weight_errors() == []
    assert plan.staging_bytes_for(0, "gpu") > max(sp.new_row for sp in plan.spaces if sp.key[0] == "gpu")
    dep = Deployment(2, rng, big)
    whole = [[LAYERS * 4096, LAYERS * 64]] * 2          # allocations that hold the whole tensors: in place
    with pytest.raises(ValueError, match="one row of weight 'up' \\(4096 bytes\\)"):
        Plan(dep.kv, 2, 1, [Capacity.of(dep.kv)] * 2, [], staging_bytes=4095, weights=dep.weights,
             weight_capacities=whole)
    # rows that go to a new allocation are not staged: a staging buffer below them is fine
    plan = Plan(dep.kv, 2, 1, [Capacity.of(dep.kv)] * 2, [], staging_bytes=2048, weights=dep.weights)
    assert plan.weight_allocations() == {(0, 0): LAYERS * 4096} and plan.staging_bytes_for(0, "gpu") < 2048


def test_a_kept_ranks_replicated_weight_stays_and_is_not_staged():
    """A kept rank's replicated tensor is neither copied nor rewritten in place: a staging buffer below its
    row (above every split row) is enough, and its bytes stay. Control: the same tensor split is refused."""
    rng = np.random.default_rng(5)
    tensors = {"up": ((64, 16), "float32", 0), "norm": ((4096,), "float32")}     # rows: up 4 KiB whole, norm 16 KiB
    for tp, n in ((2, 1), (1, 2)):
        dep = Deployment(tp, rng, tensors)
        for r in range(tp):       # allocations that hold the whole tensor: up's rows are rewritten in place
            dep.mem["weights", r, 0] = np.concatenate([dep.mem["weights", r, 0], np.zeros(LAYERS * 4096, np.uint8)])
        norm = dep.mem["weights", 0, 1]
        kept = norm.copy()
        plan, kv_bad = reshard(dep, n, rng, staging=4096)
        assert plan.weight_allocations() == {} and kv_bad == [] and dep.weight_errors() == []
        assert plan.staging_bytes_for(0, "gpu") == 4096                  # up's rows, in place, through staging
        assert all(c.gather[0].src[2] == 0 for c in weight_chunks(plan, 0))      # only up moves on rank 0
        assert dep.mem["weights", 0, 1] is norm and np.array_equal(norm, kept)
        split = Deployment(tp, rng, {**tensors, "norm": ((4096,), "float32", 0)})
        whole = [[LAYERS * 4096, LAYERS * 16384]] * tp
        with pytest.raises(ValueError, match="one row of weight 'norm'"):
            Plan(split.kv, tp, n, [Capacity.of(split.kv)] * tp, [], staging_bytes=4096, weights=split.weights,
                 weight_capacities=whole)


# -- figures -----------------------------------------------------------------------------------------
def test_moved_bytes_split_kv_and_weights_and_the_summary_names_the_shards():
    rng = np.random.default_rng(4)
    dep = Deployment(1, rng)
    plan = plan_for(dep, 2, rng)
    size = {name: int(np.prod(shape)) * ITEM[d] * LAYERS for name, (shape, d, *_) in TENSORS.items()}
    w0, w1 = plan.moved_weight_bytes(0), plan.moved_weight_bytes(1)
    half = (size["qkv"] + size["o"] + size["mlp"]) // 2
    assert w0 == {"local": half, "remote": 0}                   # rank 0 rebuilds its half; norm stays
    assert w1 == {"local": 0, "remote": half + size["norm"]}    # rank 1 copies the other half, and norm whole
    kv_only = Plan(plan.old_spec, 1, 2, plan.capacities, plan.gpu_old, plan.cpu_old, plan.staging_bytes)
    for r, weights in ((0, w0), (1, w1)):      # moved_bytes counts both; the KV part is what it was
        kv_part = kv_only.moved_bytes(r)
        assert plan.moved_bytes(r) == {k: kv_part[k] + weights.get(k, 0) for k in kv_part}
    moves = plan.summary()["weight_moves"]
    assert {(m["tensor"], m["from"], m["to"]) for m in moves} == \
        {(t, 0, r) for t in ("qkv", "o", "mlp") for r in (0, 1)} | {("norm", 0, 1)}
    assert sum(m["bytes"] for m in moves) == sum(w0.values()) + sum(w1.values())
    assert plan.summary()["weight_allocations"] == []
    # 2 -> 4: fresh ranks 2 and 3 read old rank 1's split slices, and norm from ranks 0 and 1 (r % 2)
    dep = Deployment(2, rng)
    plan = plan_for(dep, 4, rng)
    assert {(m["from"], m["to"]) for m in plan.summary()["weight_moves"] if m["tensor"] == "norm"} == {(0, 2), (1, 3)}
    assert plan.readers(0) == {1} and plan.waves == [[2, 3], [1], [0]]     # rank 2 reads rank 0's norm only
    assert_reads_precede_overwrites(plan)
    # a plan without weights: as before
    kv = Plan(dep.kv, 2, 4, [Capacity.of(dep.kv)] * 2, range(4))
    assert kv.weight_spaces == [] and kv.weight_allocations() == {} and "weight_moves" not in kv.summary()
    assert kv.moved_weight_bytes(0) == {"local": 0, "remote": 0}


# -- refusals ----------------------------------------------------------------------------------------
def test_weights_the_plan_cannot_move_are_refused():
    spec = kv_spec(2)
    caps = [Capacity.of(spec)] * 2
    weights = WeightSpec(LAYERS, TENSORS, tp_size=2)
    held = [t.num_blocks * t.block_bytes for t in weights.tensors()]
    bad = [
        (dict(weights=WeightSpec(LAYERS, TENSORS, tp_size=1)), "sliced for tp 1"),
        (dict(weights=WeightSpec(LAYERS, TENSORS, tp_size=2).placed(offload_fraction=0.5)), "offloaded"),
        (dict(weights="qkv"), "must be a WeightSpec"),
        (dict(weight_capacities=[held] * 2), "without weights"),
        (dict(weights=weights, weight_capacities=[held]), "for each of the 2 old ranks"),
        (dict(weights=weights, weight_capacities=[held[:-1]] * 2), "each of the 4 weight tensors"),
        (dict(weights=weights, weight_capacities=[held, [held[0] - 1, *held[1:]]]),
         "rank 1's allocation of weight 'qkv'"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            Plan(spec, 2, 4, caps, range(4), **kwargs)
    odd = WeightSpec(LAYERS, {"qkv": ((6, 4), "float16", 0), "o": ((4, 12), "float16", 1)}, tp_size=2)
    with pytest.raises(ValueError, match="weight 'qkv': dim 0 \\(6\\) does not divide over tp_size 4"):
        Plan(spec, 2, 4, caps, range(4), weights=odd)          # 12 KV heads divide over 4 ranks, qkv does not
