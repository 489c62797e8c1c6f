"""Liquid resharding, the plan (docs/design.md §9): pure functions over geometry and block ids, no I/O.

Total KV heads H = num_kv_heads * tp are fixed; under tp=n rank r holds heads [r*H/n, (r+1)*H/n) of every
block. A reshard from tp=m to tp=n rebuilds every live block row of every rank from head slices of the
old ranks' rows, in place: each rank keeps its allocation, so with fewer heads per row it holds more rows.

Everything here is deterministic, so the engine and every transfer manager compute the same plan from
the same inputs (the specs, the tp sizes, the ranks' allocations and the block maps):

- **Geometry.** A rank's allocation is counted in head-blocks (`Capacity`): a rank that held B blocks of h
  heads holds B*h/h' blocks of h' heads (rounded down when that does not divide).
- **Block maps.** Live blocks keep their ids where they fit; on a scale-in the others are compacted into
  free ids below the new block count (blocks with draft-layer rows below the new draft count). The CPU
  tier's used blocks are mapped the same way.
- **Row spaces.** Every GPU tensor of a rank is a space of rows (one row per block: heads x tokens x dim),
  and so is the CPU tier (one row per CPU block: every tensor's row side by side, docs/design.md §3). A new row is
  assembled from pieces: contiguous head slices of old rows, on this rank or others.
- **Safe order.** A rank that is also a source (kept) rebuilds its own rows in place: with smaller rows
  (scale-out) in ascending block order, with larger rows (scale-in) in descending order, a chunk at a time
  through one bounded staging buffer. A new row then only ever overwrites old rows that were read already
  (lower rows on a scale-out, higher rows on a scale-in: both were consumed by earlier chunks) or rows of
  its own chunk (in staging already). Before rows grow (scale-in), live blocks that move are copied into
  free ids of the old geometry (compaction), so that the growing pass has the identity map and the order
  above holds. Across ranks, a rank rewrites its memory only after every other rank that reads from it
  has finished (`waves`): data flows to higher ranks on a scale-out and to lower ranks on a scale-in, so
  the order always exists.
- **Weights** (docs/design.md §11), optional: every layer resident, moved in the same step. A tensor TP
  splits along dim d is a space of rows (device block b, outer index o), row = b * outer + o with outer =
  prod(full shape[:d]), whose "heads" are the indices of dim d: the same head-slice pieces as KV, over
  full_shape[d]. Rows keep their ids (no compaction). A replicated tensor is one row per block, the whole
  tensor: a kept rank keeps it, a fresh rank r copies old rank r % old_tp's. A kept rank rewrites a tensor in
  place through the GPU staging buffer like KV rows, unless its new slice outgrows the tensor's allocation:
  then it gathers into a new allocation ("weights_new", rank, i), which nobody reads yet (no staging).
- **Crash safety.** An in-place chunk is journaled (staged, then written): a transfer manager that dies
  mid-chunk is replaced and resumes from the journal, rewriting the chunk from the staging buffer, which
  its worker owns. Everything else is idempotent (it writes only memory nobody reads yet).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .config import ELEMENT_BYTES, CacheSpec
from .weight_spec import WeightSpec

MAX_STAGING_BYTES = 256 << 20       # docs/design.md §9: one staging buffer of at most 256 MiB beside each cache
DEFAULT_STAGING_BYTES = 64 << 20
MAX_RANKS = 31                      # the phase barrier holds 63 parties: the engine, 31 transfer managers, 31 workers


@dataclass(frozen=True)
class Capacity:
    """One rank's allocation in head-blocks: per main-layer tensor, per draft-layer tensor, and its CPU tier."""
    main: int
    extra: int
    cpu: int

    @classmethod
    def of(cls, spec: CacheSpec) -> "Capacity":
        h = spec.num_kv_heads
        return cls(spec.num_gpu_blocks * h, spec.num_extra_gpu_blocks * h, spec.num_cpu_blocks * h)

    def to_list(self):
        return [self.main, self.extra, self.cpu]


def least(capacities) -> Capacity:
    """What every rank can hold (the spec is the same on every rank)."""
    capacities = list(capacities)
    return Capacity(min(c.main for c in capacities), min(c.extra for c in capacities),
                    min(c.cpu for c in capacities))


def check_tp(spec: CacheSpec, old_tp: int, new_tp) -> int:
    """ValueError unless new_tp is a whole number >= 1 that divides the total KV heads."""
    if isinstance(new_tp, bool) or not isinstance(new_tp, (int, np.integer)):
        raise ValueError(f"tp_size must be an int, got {new_tp!r}")
    new_tp = int(new_tp)
    heads = spec.num_kv_heads * old_tp
    if new_tp < 1:
        raise ValueError(f"tp_size must be >= 1, got {new_tp}")
    if heads % new_tp:
        raise ValueError(f"tp_size {new_tp} does not divide the {heads} KV heads "
                         f"({spec.num_kv_heads} per rank at tp {old_tp}); KV heads are split evenly over the ranks")
    if new_tp > MAX_RANKS:
        raise ValueError(f"tp_size {new_tp} exceeds {MAX_RANKS}, the most ranks a deployment's phase barrier holds")
    return new_tp


def resharded_spec(spec: CacheSpec, old_tp: int, new_tp: int, capacity: Capacity) -> CacheSpec:
    """The per-rank spec under new_tp when every rank can hold `capacity` head-blocks."""
    heads = spec.num_kv_heads * old_tp // new_tp
    blocks = capacity.main // heads
    extra = min(blocks, capacity.extra // heads)
    cpu = capacity.cpu // heads
    if blocks < 1 or cpu < 1 or extra < 1:
        raise ValueError(f"at tp {new_tp} a rank's memory holds {blocks} GPU blocks, {extra} draft-layer blocks and "
                         f"{cpu} CPU blocks of {heads} heads: each needs at least one")
    return dataclasses.replace(spec, num_kv_heads=heads, num_gpu_blocks=blocks, num_extra_gpu_blocks=extra,
                               num_cpu_blocks=cpu)


def as_live(ids, bound: int, label: str) -> np.ndarray:
    """Sorted unique int64 block ids in [0, bound); ValueError for anything else."""
    if isinstance(ids, (str, bytes, dict)):
        raise ValueError(f"{label} must be a sequence of ints, got {type(ids).__name__}")
    try:
        arr = np.asarray(sorted(ids) if isinstance(ids, (set, frozenset)) else ids)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{label} is not a sequence of ints: {exc}") from None
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{label} must be a 1-D sequence of ints, got {arr.dtype} of shape {arr.shape}")
    if arr.min() < 0 or arr.max() >= bound:
        bad = arr[(arr < 0) | (arr >= bound)][0]
        raise ValueError(f"{label}: block id {int(bad)} out of range 0..{bound - 1}")
    out = np.unique(arr.astype(np.int64))
    if len(out) != len(arr):
        raise ValueError(f"{label} lists a block more than once")
    return out


def compact_map(live: np.ndarray, new_blocks: int, old_draft: int | None = None, new_draft: int | None = None,
                what: str = "GPU") -> np.ndarray:
    """New id of each live block (live: sorted unique old ids): the identity where it fits, else the lowest
    free id. With draft layers (old_draft/new_draft: blocks that have draft-layer rows before and after), a
    live block that has draft rows keeps them: it goes below new_draft. ValueError if the blocks cannot fit."""
    live = np.asarray(live, np.int64)
    if len(live) > new_blocks:
        raise ValueError(f"{len(live)} live {what} blocks cannot fit in the {new_blocks} blocks a rank holds after "
                         f"the reshard; free blocks first")
    new = live.copy()
    if old_draft is None or new_draft is None or new_draft >= new_blocks:
        new_draft = old_draft = None
    taken = np.zeros(new_blocks, bool)
    if old_draft is None:
        keep = live < new_blocks
        taken[live[keep]] = True
        free = np.flatnonzero(~taken)
        new[~keep] = free[:int((~keep).sum())]
        return new
    draft = live < old_draft                         # blocks with draft-layer rows
    if int(draft.sum()) > new_draft:
        raise ValueError(f"{int(draft.sum())} live blocks hold draft-layer rows but only {new_draft} blocks have "
                         f"draft-layer rows after the reshard; free blocks first")
    keep = np.where(draft, live < new_draft, live < new_blocks)
    # every live id is taken, moving ones too: compaction copies into free ids only, never over a source
    taken[live[live < new_blocks]] = True
    move_draft = draft & ~keep
    free_low = np.flatnonzero(~taken[:new_draft])
    rest = ~draft & ~keep
    free_high = np.flatnonzero(~taken[new_draft:]) + new_draft     # non-draft slots first, then any
    if move_draft.sum() > len(free_low) or move_draft.sum() + rest.sum() > len(free_low) + len(free_high):
        raise ValueError(f"the {len(live)} live GPU blocks cannot be compacted below {new_blocks} blocks with the "
                         f"{int(draft.sum())} that hold draft-layer rows below {new_draft}; free blocks first")
    new[move_draft] = free_low[:int(move_draft.sum())]
    free_any = np.concatenate([free_high, free_low[int(move_draft.sum()):]])
    new[rest] = free_any[:int(rest.sum())]
    return new


def head_ranges(total_heads: int, tp: int):
    per = total_heads // tp
    return [(r * per, (r + 1) * per) for r in range(tp)]


@dataclass(frozen=True)
class Piece:
    """Bytes [src_off, src_off + length) of an old row of src_rank go to [dst_off, ...) of the new row."""
    src_rank: int
    src_off: int
    dst_off: int
    length: int


@dataclass(frozen=True)
class Space:
    """Rows of one kind on every rank: a GPU tensor (key ("gpu", tensor index)), the CPU tier (("cpu",)) or a
    weight tensor (("weights", tensor index))."""
    key: tuple
    old_row: int
    new_row: int
    old_blocks: int      # rows that exist in the old geometry (a draft tensor has fewer)
    new_blocks: int
    pieces: tuple        # per new rank: tuple of Pieces that assemble its new row

    def old_bytes(self):
        return self.old_blocks * self.old_row

    def new_bytes(self):
        return self.new_blocks * self.new_row


@dataclass(frozen=True, eq=False)
class Copy:
    """`width` bytes of rows: from src at src_rows[i] * src_pitch + src_off to dst at dst_rows[i] * dst_pitch +
    dst_off. src and dst name memory: ("gpu", rank, tensor), ("cpu", rank), ("staging", rank, "gpu" | "cpu"),
    ("weights", rank, tensor) or a kept rank's new allocation ("weights_new", rank, tensor)."""
    src: tuple
    src_pitch: int
    src_off: int
    src_rows: np.ndarray
    dst: tuple
    dst_pitch: int
    dst_off: int
    dst_rows: np.ndarray
    width: int

    @property
    def nbytes(self):
        return self.width * len(self.src_rows)

    def runs(self):
        """(src byte offset, dst byte offset, rows) of each run of rows consecutive on both sides: a strided
        (2-D) copy each."""
        for start, length in _runs(self.src_rows, self.dst_rows):
            yield (int(self.src_rows[start]) * self.src_pitch + self.src_off,
                   int(self.dst_rows[start]) * self.dst_pitch + self.dst_off, length)


@dataclass(frozen=True)
class Chunk:
    """A unit of a rank's program. Journaled chunks gather into staging, then write staging into place."""
    gather: tuple
    write: tuple = ()

    @property
    def of_weights(self) -> bool:
        """Does it build weight rows (every chunk builds rows of one space: KV or one weight tensor)?"""
        return bool(self.gather) and self.gather[0].src[0] == "weights"


def _pieces(total_heads, old_tp, new_tp, head_bytes):
    """Per new rank, the (src_rank, src_off, dst_off, length) head slices of one tensor's row."""
    old, new = head_ranges(total_heads, old_tp), head_ranges(total_heads, new_tp)
    out = []
    for lo, hi in new:
        mine = []
        for s, (slo, shi) in enumerate(old):
            a, b = max(lo, slo), min(hi, shi)
            if a < b:
                mine.append(Piece(s, (a - slo) * head_bytes, (a - lo) * head_bytes, (b - a) * head_bytes))
        out.append(mine)
    return out


def _merge(pieces):
    """Join pieces that continue each other on both sides (the CPU tier's tensors sit side by side)."""
    out = []
    for p in pieces:
        if out and out[-1].src_rank == p.src_rank and out[-1].src_off + out[-1].length == p.src_off \
                and out[-1].dst_off + out[-1].length == p.dst_off:
            q = out.pop()
            p = Piece(q.src_rank, q.src_off, q.dst_off, q.length + p.length)
        out.append(p)
    return tuple(out)


def _runs(ids: np.ndarray, other: np.ndarray | None = None):
    """(start index, length) of runs where ids (and `other`, if given) count up by one."""
    if len(ids) == 0:
        return []
    step = np.diff(ids) != 1
    if other is not None:
        step |= np.diff(other) != 1
    breaks = np.flatnonzero(step) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), len(ids)]
    return list(zip(starts, (e - s for s, e in zip(starts, ends))))


class Plan:
    """Everything a reshard from old_tp to new_tp does, rank by rank."""

    def __init__(self, old_spec: CacheSpec, old_tp: int, new_tp: int, capacities, gpu_live, cpu_live=(),
                 staging_bytes: int = DEFAULT_STAGING_BYTES, gpu_new=None, cpu_new=None,
                 weights: WeightSpec | None = None, weight_capacities=None):
        """capacities: each old rank's allocation (new ranks allocate what the new spec says). gpu_live/
        cpu_live: old ids that must survive. gpu_new/cpu_new: their new ids, if already decided (a transfer
        manager is given the engine's). weights: the placed WeightSpec at old_tp (every layer resident), moved
        too; weight_capacities: per old rank, per tensor, the bytes of its allocation (default: the slice's)."""
        self.old_spec, self.old_tp, self.new_tp = old_spec, old_tp, new_tp
        self.heads = old_spec.num_kv_heads * old_tp
        self.capacities = [c if isinstance(c, Capacity) else Capacity(*c) for c in capacities]
        if len(self.capacities) != old_tp:
            raise ValueError(f"a Capacity is needed for each of the {old_tp} old ranks")
        self.new_spec = resharded_spec(old_spec, old_tp, new_tp, least(self.capacities))
        new = self.new_spec
        if not isinstance(staging_bytes, (int, np.integer)) or isinstance(staging_bytes, bool) \
                or not 0 < staging_bytes <= MAX_STAGING_BYTES:
            raise ValueError(f"staging_bytes must be an int in 1..{MAX_STAGING_BYTES}, got {staging_bytes!r}")
        self.gpu_old = as_live(gpu_live, old_spec.num_gpu_blocks, "live_blocks")
        self.cpu_old = as_live(cpu_live, old_spec.num_cpu_blocks, "live CPU blocks")
        self.gpu_new = (compact_map(self.gpu_old, new.num_gpu_blocks, old_spec.num_extra_gpu_blocks,
                                    new.num_extra_gpu_blocks) if old_spec.num_extra_layers else
                        compact_map(self.gpu_old, new.num_gpu_blocks)) if gpu_new is None \
            else np.asarray(gpu_new, np.int64)
        self.cpu_new = compact_map(self.cpu_old, new.num_cpu_blocks, what="CPU") if cpu_new is None \
            else np.asarray(cpu_new, np.int64)
        if self.gpu_new.shape != self.gpu_old.shape or self.cpu_new.shape != self.cpu_old.shape:
            raise ValueError("block maps must give one new id per live block")
        if len(self.gpu_new) and (self.gpu_new.min() < 0 or self.gpu_new.max() >= new.num_gpu_blocks
                                  or len(np.unique(self.gpu_new)) != len(self.gpu_new)):
            raise ValueError("the GPU block map is not a one-to-one map into the new blocks")
        if len(self.cpu_new) and (self.cpu_new.min() < 0 or self.cpu_new.max() >= new.num_cpu_blocks
                                  or len(np.unique(self.cpu_new)) != len(self.cpu_new)):
            raise ValueError("the CPU block map is not a one-to-one map into the new blocks")
        self.spaces = self._spaces()
        biggest = max(s.new_row for s in self.spaces)
        if staging_bytes < biggest:
            raise ValueError(f"staging_bytes ({staging_bytes}) is smaller than one row ({biggest} bytes: a CPU block "
                             f"of every tensor, with its slot)")
        self.staging_bytes = int(staging_bytes)
        self.kept = list(range(min(old_tp, new_tp)))
        self.fresh = list(range(old_tp, new_tp))
        self.retired = list(range(new_tp, old_tp))
        self.weights = weights
        self.new_weights = self._check_weights(weights)
        self.weight_capacities = self._weight_capacities(weight_capacities)
        self.weight_spaces = self._weight_spaces()
        self._new_allocations = self._outgrown()
        self._check_weight_staging()
        self.waves = self._waves()

    # -- geometry ----------------------------------------------------------------------------------
    @property
    def scale_in(self) -> bool:
        return self.new_tp < self.old_tp

    @property
    def gpu_map(self) -> dict:
        return dict(zip(self.gpu_old.tolist(), self.gpu_new.tolist()))

    @property
    def cpu_map(self) -> dict:
        return dict(zip(self.cpu_old.tolist(), self.cpu_new.tolist()))

    def _spaces(self):
        old, new = self.old_spec, self.new_spec
        out = []
        cpu = [[] for _ in range(self.new_tp)]
        for index, (ti, tn) in enumerate(zip(old.tensors(), new.tensors())):
            head_bytes = ti.block_bytes // old.num_kv_heads
            pieces = _pieces(self.heads, self.old_tp, self.new_tp, head_bytes)
            out.append(Space(("gpu", index), ti.block_bytes, tn.block_bytes, ti.num_blocks, tn.num_blocks,
                             tuple(tuple(p) for p in pieces)))
            for r, mine in enumerate(pieces):
                cpu[r] += [Piece(p.src_rank, ti.cpu_offset + p.src_off, tn.cpu_offset + p.dst_off, p.length)
                           for p in mine]
        # CPU rows are whole blocks with their slots (scratch: rewritten with whatever staging held)
        out.append(Space(("cpu",), old.cpu_block_stride, new.cpu_block_stride, old.num_cpu_blocks, new.num_cpu_blocks,
                         tuple(_merge(sorted(mine, key=lambda p: p.dst_off)) for mine in cpu)))
        return out

    def _check_weights(self, weights):
        """The weights at new_tp (None without weights); ValueError for what this plan cannot move."""
        if weights is None:
            return None
        if not isinstance(weights, WeightSpec):
            raise ValueError(f"weights must be a WeightSpec, got {type(weights).__name__}")
        if weights.tp_size != self.old_tp:
            raise ValueError(f"the weights are sliced for tp {weights.tp_size}, the deployment runs tp {self.old_tp}")
        if weights.resident_layers != weights.num_layers:
            raise ValueError(f"weights with offloaded layers ({weights.resident_layers} of {weights.num_layers} "
                             f"resident) cannot be resharded")
        return weights.resharded(self.new_tp)

    def _weight_capacities(self, given):
        """Per old rank, per tensor, the bytes allocated: at least the old slice."""
        if self.weights is None:
            if given is not None:
                raise ValueError("weight_capacities without weights")
            return []
        held = [t.num_blocks * t.block_bytes for t in self.weights.tensors()]
        out = [list(held) for _ in range(self.old_tp)] if given is None else [list(c) for c in given]
        if len(out) != self.old_tp or any(len(c) != len(held) for c in out):
            raise ValueError(f"weight_capacities needs, for each of the {self.old_tp} old ranks, the bytes of each "
                             f"of the {len(held)} weight tensors")
        for r, caps in enumerate(out):
            for (name, _, _), cap, need in zip(self.weights.layer_tensors, caps, held):
                if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < need:
                    raise ValueError(f"rank {r}'s allocation of weight {name!r} ({cap!r} bytes) is below the "
                                     f"{need} bytes it holds")
        return [[int(c) for c in caps] for caps in out]

    def _weight_spaces(self):
        """A space per weight tensor (see the module's docstring), in layer_tensors order."""
        w = self.weights
        if w is None:
            return []
        out = []
        for i, (name, _, dtype) in enumerate(w.layer_tensors):
            full, d, blocks = w.full_shape(name), w.split_dims[i], w.num_gpu_blocks
            if d is None:
                row = int(np.prod(full)) * ELEMENT_BYTES[dtype]
                pieces = tuple(() if r < self.old_tp else (Piece(r % self.old_tp, 0, 0, row),)
                               for r in range(self.new_tp))
                out.append(Space(("weights", i), row, row, blocks, blocks, pieces))
                continue
            outer = int(np.prod(full[:d]))
            inner = int(np.prod(full[d + 1:])) * ELEMENT_BYTES[dtype]
            pieces = _pieces(full[d], self.old_tp, self.new_tp, inner)
            out.append(Space(("weights", i), full[d] // self.old_tp * inner, full[d] // self.new_tp * inner,
                             blocks * outer, blocks * outer, tuple(tuple(p) for p in pieces)))
        return out

    def _outgrown(self) -> set:
        """(rank, tensor) of kept ranks whose new slice needs more bytes than the tensor's allocation."""
        if self.old_tp == self.new_tp:
            return set()
        return {(r, sp.key[1]) for sp in self.weight_spaces for r in self.kept
                if sp.new_bytes() > self.weight_capacities[r][sp.key[1]]}

    def _check_weight_staging(self):
        """A weight row rewritten in place goes through staging whole: staging must hold one."""
        for sp in self.weight_spaces:
            if sp.new_row > self.staging_bytes and any(self._in_place(sp, r) for r in self.kept):
                name = self.weights.layer_tensors[sp.key[1]][0]
                raise ValueError(f"staging_bytes ({self.staging_bytes}) is smaller than one row of weight {name!r} "
                                 f"({sp.new_row} bytes), which is rewritten in place")

    def _in_place(self, space: Space, rank: int) -> bool:
        """Does kept `rank` rewrite this space in its own memory, through staging? (Not a kept rank's
        replicated weights, which stay; not a weight tensor that moves to a new allocation.)"""
        if rank not in self.kept:
            return False
        if space.key[0] != "weights":
            return True
        return bool(space.pieces[rank]) and (rank, space.key[1]) not in self._new_allocations

    def weight_allocations(self) -> dict:
        """{(rank, tensor index): bytes}: the kept ranks' weight tensors that outgrow their allocation and are
        rebuilt into a new one, ("weights_new", rank, i), to be allocated before the step and swapped in after
        it (fresh ranks allocate the new layout anyway)."""
        return {(r, i): self.weight_spaces[i].new_bytes() for r, i in sorted(self._new_allocations)}

    def _pairs(self, space: Space):
        """(old ids, new ids) of the live rows this space moves (a draft tensor has only its first rows; a
        weight tensor has every row, where it was)."""
        if space.key[0] == "weights":
            rows = np.arange(space.old_blocks, dtype=np.int64)
            return rows, rows
        old, new = (self.cpu_old, self.cpu_new) if space.key[0] == "cpu" else (self.gpu_old, self.gpu_new)
        keep = (old < space.old_blocks) & (new < space.new_blocks)
        return old[keep], new[keep]

    def region_bytes(self, space: Space, rank: int) -> int:
        """Bytes of rank's memory this space touches: old rows as a source, new rows as a destination (a weight
        tensor moving to a new allocation: its old rows only; see weight_allocations)."""
        need = space.old_bytes() if rank < self.old_tp else 0
        if rank < self.new_tp and (space.key[0] != "weights" or (rank, space.key[1]) not in self._new_allocations):
            need = max(need, space.new_bytes())
        return need

    def readers(self, rank: int) -> set:
        """The other ranks that read rank's old rows. KV tensor 0 stands for every space: a weight tensor's split
        ranges are proportional to the heads' ([r/tp, (r+1)/tp) of the split dim), so the same ranks overlap.
        A fresh rank's copy of a replicated weight tensor reads a kept rank that is not always among these,
        but it reads rows their owner never rewrites (a kept rank's replicated rows stay, and its other
        tensors are other memory), so no order is needed there."""
        return {r for r in range(self.new_tp) if r != rank
                for p in self.spaces[0].pieces[r] if p.src_rank == rank}

    def sources(self, rank: int) -> set:
        return {p.src_rank for p in self.spaces[0].pieces[rank]} if rank < self.new_tp else set()

    def _waves(self):
        """Ranks that rewrite memory (kept and fresh), in waves: a rank goes once every other rank that reads
        its old rows has finished."""
        if self.old_tp == self.new_tp:
            return []
        remaining = set(self.kept) | set(self.fresh)
        waves = []
        while remaining:
            wave = sorted(r for r in remaining if not (self.readers(r) & remaining))
            if not wave:
                raise AssertionError("reshard waves have a cycle")     # data flows one way: cannot happen
            waves.append(wave)
            remaining -= set(wave)
        return waves

    def destructive(self, rank: int) -> bool:
        """Does rank's program overwrite old rows (so the old layout is gone once it starts)?"""
        return rank in self.kept and self.old_tp != self.new_tp

    # -- programs ----------------------------------------------------------------------------------
    def compaction(self, rank: int) -> list:
        """Scale-in, every old rank: copy live rows whose id changes into their (free) new ids, in the old
        geometry. Idempotent: sources are never written."""
        if not self.scale_in or rank >= self.old_tp:
            return []
        chunks = []
        for space in self.spaces:
            old, new = self._pairs(space)
            moving = old != new
            old, new = old[moving], new[moving]
            if not len(old):
                continue
            ref, row = self._ref(space, rank), space.old_row
            limit = max(1, self.staging_bytes // row)
            for s in range(0, len(old), limit):
                chunks.append(Chunk((Copy(ref, row, 0, old[s:s + limit], ref, row, 0, new[s:s + limit], row),)))
        return chunks

    def program(self, rank: int) -> tuple[list, bool]:
        """(chunks, journaled) of the rank that builds new rows: kept ranks in place through staging, fresh
        ranks straight into their empty memory."""
        if rank >= self.new_tp or self.old_tp == self.new_tp:
            return [], False
        kept = rank < self.old_tp
        chunks = []
        for space in self.spaces + self.weight_spaces:
            ids = np.sort(self._pairs(space)[1])    # after compaction the new ids hold the rows on every old rank
            pieces = space.pieces[rank]
            if not len(ids) or not pieces:          # no pieces: a kept rank's replicated weights stay
                continue
            staged = self._in_place(space, rank)
            own = self._dst_ref(space, rank)
            stage = ("staging", rank, "cpu" if space.key[0] == "cpu" else "gpu")
            limit = max(1, self.staging_bytes // space.new_row)
            ascending = space.new_row <= space.old_row
            order = ids if ascending else ids[::-1]
            for c in range(0, len(order), limit):
                part = np.sort(order[c:c + limit])
                slots = np.arange(len(part))
                gather = tuple(Copy(self._ref(space, p.src_rank), space.old_row, p.src_off, part,
                                    stage if staged else own, space.new_row, p.dst_off, slots if staged else part,
                                    p.length) for p in pieces)
                write = (Copy(stage, space.new_row, 0, slots, own, space.new_row, 0, part, space.new_row),) \
                    if staged else ()
                chunks.append(Chunk(gather, write))
        return chunks, kept

    def staging_bytes_for(self, rank: int, kind: str) -> int:
        """Staging a kept rank needs for its GPU tensors (kind "gpu") or its CPU tier ("cpu"): its largest
        chunk (0 for other ranks)."""
        if not self.destructive(rank):
            return 0
        need = 0
        for space in self.spaces + self.weight_spaces:
            if ("cpu" if space.key[0] == "cpu" else "gpu") != kind or not self._in_place(space, rank):
                continue
            rows = min(len(self._pairs(space)[1]), max(1, self.staging_bytes // space.new_row))
            need = max(need, rows * space.new_row)
        return need

    @staticmethod
    def _ref(space: Space, rank: int) -> tuple:
        if space.key[0] == "cpu":
            return ("cpu", rank)
        return (space.key[0], rank, space.key[1])

    def _dst_ref(self, space: Space, rank: int) -> tuple:
        """Where rank's new rows go: its own memory, or a kept rank's new weight allocation."""
        if space.key[0] == "weights" and (rank, space.key[1]) in self._new_allocations:
            return ("weights_new", rank, space.key[1])
        return self._ref(space, rank)

    # -- figures -----------------------------------------------------------------------------------
    def moved_bytes(self, rank: int) -> dict:
        """Bytes rank's programs copy into place, by where they come from: its own rows (local), other ranks'
        GPU rows (remote; KV and weights), CPU tiers (cpu), and compaction."""
        out = {"local": 0, "remote": 0, "cpu": 0, "compaction": 0}
        for chunk in self.compaction(rank):
            out["compaction"] += sum(c.nbytes for c in chunk.gather)
        for c in self._gathers(rank):
            kind = "cpu" if c.src[0] == "cpu" else "local" if c.src[1] == rank else "remote"
            out[kind] += c.nbytes
        return out

    def moved_weight_bytes(self, rank: int) -> dict:
        """The weights' part of moved_bytes(rank): {"local": ..., "remote": ...}."""
        out = {"local": 0, "remote": 0}
        for c in self._gathers(rank):
            if c.src[0] == "weights":
                out["local" if c.src[1] == rank else "remote"] += c.nbytes
        return out

    def _gathers(self, rank: int):
        for chunk in self.program(rank)[0]:
            yield from chunk.gather

    def weight_moves(self) -> list:
        """[{"tensor": name, "from": old rank, "to": new rank, "bytes": n}]: which weight shards go where
        (from == to: a rank rebuilding its own slice)."""
        moved = {}
        for rank in range(self.new_tp):
            for c in self._gathers(rank):
                if c.src[0] == "weights":
                    key = (c.src[2], rank, c.src[1])
                    moved[key] = moved.get(key, 0) + c.nbytes
        names = [n for n, _, _ in self.weights.layer_tensors] if self.weights is not None else []
        return [{"tensor": names[i], "from": src, "to": dst, "bytes": n} for (i, dst, src), n in sorted(moved.items())]

    def summary(self) -> dict:
        out = {"from_tp": self.old_tp, "to_tp": self.new_tp, "waves": self.waves,
               "gpu_blocks_per_rank": [self.old_spec.num_gpu_blocks, self.new_spec.num_gpu_blocks],
               "cpu_blocks_per_rank": [self.old_spec.num_cpu_blocks, self.new_spec.num_cpu_blocks],
               "live_gpu_blocks": len(self.gpu_old), "live_cpu_blocks": len(self.cpu_old)}
        if self.weights is not None:
            names = [n for n, _, _ in self.weights.layer_tensors]
            out["weight_moves"] = self.weight_moves()
            out["weight_allocations"] = [{"tensor": names[i], "rank": r, "bytes": n}
                                         for (r, i), n in self.weight_allocations().items()]
        return out


def run_chunks(chunks, execute, journal=None, flush=lambda: None, before=lambda i: None):
    """Execute a program's chunks with `execute(copy)`. With a journal (get() -> int, set(int)), progress is
    recorded per chunk (2i+1: chunk i staged, 2i+2: written) and a program that was cut short resumes where
    it stopped: a staged chunk is written again from the staging buffer, whose sources may be gone.
    `flush()` must return once every copy issued so far has landed (a device stream's synchronize).
    `before(i)` runs before chunk i is executed (a timer's mark)."""
    done = journal.get() if journal is not None else 0
    first, staged = divmod(done, 2)
    for i, chunk in enumerate(chunks):
        if i < first:
            continue
        before(i)
        if journal is None:
            for c in chunk.gather:
                execute(c)
            if chunk.write:
                flush()
                for c in chunk.write:
                    execute(c)
            continue
        if not (i == first and staged):
            for c in chunk.gather:
                execute(c)
            flush()
            journal.set(2 * i + 1)
        for c in chunk.write:
            execute(c)
        flush()
        journal.set(2 * i + 2)
    flush()
