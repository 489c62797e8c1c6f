"""Liquid resharding under a verifying workload (docs/design.md §9): `python -m fastcache.launch --reshard 1,2,4,2,1`.

One worker process and one transfer manager per rank, as in a real deployment. Between steps: random data
written into live GPU blocks, swaps out to the CPU tier and back in elsewhere. After every step: every live
GPU block and every used CPU block compared bit for bit, on every rank, with what it held before (the
ranks' head slices concatenated), and with weights registered (the default: `liquid_weights`, column-split,
row-split and replicated tensors) every weight byte of every rank against its slice of the full random
tensors; then a swap round and a clear/restore cycle. During every step /dev/shm is
sampled: the deployment may hold no more than its caches and CPU tiers before or after the step (whichever
is more, the new ranks' included) plus the staging buffers.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np

from ..engine import TieredCache
from ..ipc.manifest import read_json_segment, read_manifest
from ..ipc.naming import PREFIX, weights_name
from ..ipc.shm import SHM_DIR
from ..ops import get_ops, round_robin_devices
from ..ops.frameworks import NUMPY_STORAGE
from ..weight_spec import WeightSpec
from .harness import WorkerProcesses, conclude, shm_bytes, wait_until_ready


def full_rows(rows_per_rank):
    """The full-head row of a block from each rank's slice (rows are head-major: ranks concatenate)."""
    return np.concatenate(rows_per_rank, axis=-1)


def weight_dtype(cache_dtype: str) -> str:
    """The dtype of a model's linear weights beside a KV cache of `cache_dtype`: the cache's own for a
    plain dtype; bfloat16 beside block_wise_fp8, since quantizing the KV cache leaves the weights as the
    checkpoint has them (an fp8 KV cache is most often served with bf16 weights)."""
    return "bfloat16" if cache_dtype == "block_wise_fp8" else cache_dtype


def liquid_weights(spec, tp: int) -> WeightSpec:
    """A model for a deployment of `spec` at tp: per layer a column-parallel qkv (split dim 0), a row-parallel
    o (split dim 1) and a replicated norm, the attention's sizes, so every tp that divides the KV heads
    divides their split dims too; the linears in weight_dtype(the cache's dtype)."""
    hidden = spec.num_kv_heads * tp * spec.head_dim
    dtype = weight_dtype(spec.cache_dtype)
    return WeightSpec(spec.num_layers, {"qkv": ((3 * hidden, hidden), dtype, 0), "o": ((hidden, hidden), dtype, 1),
                                        "norm": ((hidden,), "float32")}, tp_size=tp)


class WeightModel:
    """Full random weight tensors (never zero bytes), and each rank's slice of them against the ranks' memory
    (attached by the weights' export, as a transfer manager does)."""

    def __init__(self, backend, rng):
        self.b = backend
        self.ops = get_ops(backend.device)
        layout = backend.weight_layout
        self.full = {}
        for name, _, dtype in layout.layer_tensors:
            shape = (layout.num_gpu_blocks, *layout.full_shape(name))
            storage = np.dtype(NUMPY_STORAGE[dtype])
            raw = rng.integers(1, 256, int(np.prod(shape)) * storage.itemsize, dtype=np.uint8)
            self.full[name] = raw.view(storage).reshape(shape)

    def _views(self):
        b, layout = self.b, self.b.weight_layout
        return [self.ops.attach(read_json_segment(weights_name(b.suffix, r, "exports"), b.suffix),
                                layout.tensors(r, b.device_ids[r]), b.suffix) for r in range(b.tp_size)]

    def _slice(self, name, rank) -> np.ndarray:
        part = self.full[name][(slice(None), *self.b.weight_layout.rank_slice(name, rank))]
        return np.ascontiguousarray(part).view(np.uint8).reshape(part.shape[0], -1)

    def load(self):
        for r, view in enumerate(self._views()):
            for i, (name, _, _) in enumerate(self.b.weight_layout.layer_tensors):
                view.write(i, self._slice(name, r))
            view.close()

    def check(self) -> list:
        """(rank, tensor) whose bytes differ from the slice of the full tensor."""
        bad = []
        for r, view in enumerate(self._views()):
            for i, (name, _, _) in enumerate(self.b.weight_layout.layer_tensors):
                if not np.array_equal(view.read(i), self._slice(name, r)):
                    bad.append((r, name))
            view.close()
        return bad

    def corrupt(self, rank, index, byte):
        view = self._views()[rank]
        rows = view.read(index)
        rows.reshape(-1)[byte] ^= 0xFF
        view.write(index, rows)
        view.close()


class BlockModel:
    """What every live GPU block and every used CPU block must hold, per tensor, all heads, independent of
    tp; and the checks against the ranks' memory (attached by name, as a transfer manager does)."""

    def __init__(self, backend, rng):
        self.b, self.rng = backend, rng
        self.ops = get_ops(backend.device)
        self.gpu: dict[int, list] = {}      # GPU block id -> per tensor full-head row
        self.cpu: dict[int, list] = {}      # CPU block id -> per tensor full-head row
        self.views = []

    def attach(self):
        b = self.b
        self.detach()
        self.views = [self.ops.attach(read_manifest(b.suffix, r), b.spec.tensors(r, b.device_ids[r]), b.suffix)
                      for r in range(b.tp_size)]

    def detach(self):
        for v in self.views:
            v.close()
        self.views = []

    def fill(self, blocks):
        """Fresh random bytes (never zeros) in these GPU blocks of every tensor of every rank."""
        blocks = np.asarray(sorted(blocks), np.int64)
        for t, info in enumerate(self.b.spec.tensors()):
            mine = blocks[blocks < info.num_blocks]
            parts = []
            for view in self.views:
                rows = self.rng.integers(1, 256, (len(mine), info.block_bytes), np.uint8)
                view.write(t, rows, mine)
                parts.append(rows)
            whole = full_rows(parts)
            for i, blk in enumerate(mine.tolist()):
                self.gpu.setdefault(blk, [None] * len(self.b.spec.tensors()))[t] = whole[i]
        for blk in blocks.tolist():
            self.gpu.setdefault(blk, [None] * len(self.b.spec.tensors()))

    def check(self) -> list:
        """What differs: ('gpu', block, tensor) / ('cpu', block, tensor)."""
        bad = []
        spec = self.b.spec
        ids = np.asarray(sorted(self.gpu), np.int64)
        for t, info in enumerate(spec.tensors()):
            mine = ids[ids < info.num_blocks]
            if not len(mine):
                continue
            got = full_rows([v.read(t, mine) for v in self.views])
            for i, blk in enumerate(mine.tolist()):
                want = self.gpu[blk][t]
                if want is not None and not np.array_equal(got[i], want):
                    bad.append(("gpu", blk, t))
        cpu_ids = np.asarray(sorted(self.cpu), np.int64)
        if len(cpu_ids):
            tiers = [self.b.cpu_tier(r)[cpu_ids] for r in range(self.b.tp_size)]
            for t, info in enumerate(spec.tensors()):
                cols = slice(info.cpu_offset, info.cpu_offset + info.block_bytes)
                got = full_rows([tier[:, cols] for tier in tiers])
                for i, blk in enumerate(cpu_ids.tolist()):
                    want = self.cpu[blk][t]
                    if want is not None and not np.array_equal(got[i], want):
                        bad.append(("cpu", blk, t))
        return bad

    def swapped_out(self, gpu_ids, cpu_ids):
        for g, c in zip(gpu_ids, cpu_ids):
            self.cpu[int(c)] = list(self.gpu[int(g)])

    def swapped_in(self, gpu_ids, cpu_ids):
        spec = self.b.spec
        for g, c in zip(gpu_ids, cpu_ids):
            rows = list(self.cpu[int(c)])
            for t, info in enumerate(spec.tensors()):
                if int(g) >= info.num_blocks:
                    rows[t] = None          # a draft layer lacks this block
            self.gpu[int(g)] = rows

    def touch(self):
        """Random bytes in every block nobody uses (GPU blocks that are not live, CPU blocks not allocated), so
        that every page of the caches and CPU tiers is in /dev/shm: a second cache would show."""
        b = self.b
        for t, info in enumerate(b.spec.tensors()):
            idle = np.setdiff1d(np.arange(info.num_blocks), np.fromiter(self.gpu, np.int64))
            for view in self.views:
                view.write(t, self.rng.integers(1, 256, (len(idle), info.block_bytes), np.uint8), idle)
        idle = np.setdiff1d(np.arange(b.spec.num_cpu_blocks), np.fromiter(b.allocator.used_ids(), np.int64))
        for r in range(b.tp_size):
            b.cpu_tier(r)[idle] = self.rng.integers(1, 256, (len(idle), b.spec.cpu_block_bytes), np.uint8)

    def remap(self, gpu_map, cpu_map):
        self.gpu = {gpu_map[b]: rows for b, rows in self.gpu.items()}
        self.cpu = {cpu_map[c]: rows for c, rows in self.cpu.items()}

    def swap_round(self, n: int):
        """Swap n live blocks out to newly allocated CPU blocks (kept: they are checked through later steps),
        then back into other GPU blocks, which become live."""
        b = self.b
        live = sorted(self.gpu)
        n = min(n, len(live), b.allocator.num_free)
        if n == 0:
            return 0
        src = self.rng.choice(live, n, replace=False)
        cpu = np.array(b.allocate_cpu_blocks(n))
        b.swap_out(src, cpu).result(timeout=60)
        self.swapped_out(src, cpu)
        dst = self.rng.choice(b.spec.num_gpu_blocks, n, replace=False)
        self.fill(dst)                      # fresh bytes at the destination: a missed copy must show
        b.swap_in(dst, cpu).result(timeout=60)
        self.swapped_in(dst, cpu)
        return n

    def swap_out_more(self, n: int):
        """Swap n more live blocks out to CPU blocks scattered over the tier (twice as many allocated, a
        random half given back), so that a scale-in has CPU blocks to compact."""
        b = self.b
        n = min(n, len(self.gpu), b.allocator.num_free // 2)
        if n <= 0:
            return 0
        held = b.allocate_cpu_blocks(2 * n)
        keep = sorted(self.rng.choice(held, n, replace=False).tolist())
        b.free_cpu_blocks(sorted(set(held) - set(keep)))
        src = self.rng.choice(sorted(self.gpu), n, replace=False)
        b.swap_out(src, keep).result(timeout=60)
        self.swapped_out(src, keep)
        return n

    def trim(self, gpu_keep: int, cpu_keep: int):
        """Forget (and free) blocks so that at most gpu_keep GPU and cpu_keep CPU blocks stay live."""
        for blk in self.rng.permutation(sorted(self.gpu))[:max(0, len(self.gpu) - gpu_keep)].tolist():
            del self.gpu[blk]
        drop = self.rng.permutation(sorted(self.cpu))[:max(0, len(self.cpu) - cpu_keep)].tolist()
        for c in drop:
            del self.cpu[c]
        if drop:
            self.b.free_cpu_blocks(drop)


class ShmSampler:
    """Peak of a deployment's /dev/shm bytes, sampled on a thread while a step runs."""

    def __init__(self, suffix, every: float = 0.002):
        self._bytes, self.suffix, self.every = shm_bytes, suffix, every
        self.peak, self.samples = 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._bytes(self.suffix))
            self.samples += 1
            self._stop.wait(self.every)

    def __enter__(self):
        self.peak = self._bytes(self.suffix)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._bytes(self.suffix))


class CacheCheck:
    """A TieredCache over the deployment through the steps: entries stored before a step must be found and load
    the same bytes after it (their CPU blocks were resharded and renamed under the cache)."""

    def __init__(self, backend, model: BlockModel, capacity: int):
        self.model, self.rng, self.b = model, model.rng, backend
        self.generation = 0
        self.cache = TieredCache(backend, namespace=self._namespace(), capacity=capacity)
        self.stored = {}            # hash -> per tensor full-head rows
        self.loaded = 0

    def _namespace(self):
        return f"liquid/{self.b.suffix}/{self.generation}"

    def store(self, n):
        live = sorted(self.model.gpu)
        n = min(n, len(live), self.cache.capacity)
        blocks = self.rng.choice(live, n, replace=False).tolist()
        hashes = [int(h) for h in self.rng.integers(1, 2**62, n)]
        self.cache.store(hashes, blocks).result(timeout=60)
        self.stored.update({h: list(self.model.gpu[b]) for h, b in zip(hashes, blocks)})

    def load_and_check(self) -> bool:
        """Load every entry still held into fresh GPU blocks (which become live in the model)."""
        held = [h for h in self.stored if self.cache.lookup([h]) == 1]
        self.stored = {h: self.stored[h] for h in held}
        if not held:
            return True
        dst = self.rng.choice(self.b.spec.num_gpu_blocks, len(held), replace=False).tolist()
        self.cache.load(held, dst).result(timeout=60)
        for h, g in zip(held, dst):
            rows = list(self.stored[h])
            for t, info in enumerate(self.b.spec.tensors()):
                if g >= info.num_blocks:
                    rows[t] = None
            self.model.gpu[g] = rows
        self.loaded += len(held)
        return not self.model.check()

    def cleared(self):
        self.generation += 1
        self.cache.namespace = self._namespace()        # new weights: a namespace never used before
        self.stored = {}

    def close(self):
        self.cache.close()


def blocks_at(backend, tp):
    """(GPU, CPU) blocks a rank holds at tp."""
    spec = backend.spec_at(tp)
    return spec.num_gpu_blocks, spec.num_cpu_blocks


def liquid(backend, workers: WorkerProcesses, tps, cycles, rng, checks, report, swap_blocks=8, clear=True,
           log=print):
    """Reshard through tps (tps[0] is the current tp) `cycles` times, verifying after every step."""
    model = BlockModel(backend, rng)
    model.attach()
    weights = WeightModel(backend, rng) if backend.weight_layout is not None else None
    if weights is not None:
        weights.load()
        checks.check(not weights.check(), "every rank's weights hold their slice of the random full tensors")
    heads = backend.spec.num_kv_heads * backend.tp_size
    # live blocks: half of what a rank holds at the smallest tp of the cycle (a scale-in must compact)
    gpu_keep = max(1, min(blocks_at(backend, tp)[0] for tp in tps) // 2)
    cpu_keep = max(1, min(blocks_at(backend, tp)[1] for tp in tps) // 2)
    model.fill(range(backend.spec.num_gpu_blocks))     # every page of the cache written, random
    model.swap_round(min(swap_blocks, cpu_keep))
    tiered = CacheCheck(backend, model, capacity=max(1, cpu_keep // 2))
    steps = []
    path = list(tps[1:]) * cycles
    for k, tp in enumerate(path):
        model.trim(max(1, gpu_keep - tiered.cache.capacity), cpu_keep)
        model.swap_out_more(cpu_keep - len(model.cpu))
        tiered.store(tiered.cache.capacity // 2)
        model.touch()
        model.detach()
        before, before_nominal = shm_now(backend), shm_now(backend, nominal=True)
        with ShmSampler(backend.suffix) as sampler:
            t0 = time.perf_counter()
            new, block_map = backend.reshard(tp, live_blocks=sorted(model.gpu), start_workers=workers.start,
                                             stop_workers=workers.stop, timeout=300,
                                             device_ids=round_robin_devices(backend.device, tp))
            seconds = time.perf_counter() - t0
        r = backend.last_reshard
        model.remap(block_map, r["cpu_block_map"])
        model.attach()
        after, after_nominal = shm_now(backend), shm_now(backend, nominal=True)
        staging = sum(r["staging_bytes"].values()) + sum(r["cpu_staging_bytes"].values())
        # every page was written before the step: the caches' and CPU tiers' full size, before or after it,
        # plus the staging buffers (and a page or two of signals and step descriptions)
        limit = max(before_nominal, after_nominal) + staging + (256 << 10)
        bad = model.check()
        checks.check(not bad, f"step {k + 1} (tp {r['from_tp']} -> {tp}): every live GPU block and used CPU "
                              f"block holds its bytes ({len(bad)} differ: {bad[:4]})")
        checks.check(sampler.peak <= limit, f"step {k + 1}: /dev/shm peak {sampler.peak / 2**20:.2f} MiB within "
                                            f"the caches ({max(before_nominal, after_nominal) / 2**20:.2f} MiB) "
                                            f"plus staging ({staging / 2**20:.2f} MiB)")
        checks.check(all(len(v.infos) for v in model.views) and len(model.views) == tp,
                     f"step {k + 1}: {tp} ranks serve the new shape")
        if weights is not None:
            bad = weights.check()
            checks.check(not bad, f"step {k + 1}: every weight byte of every rank equals its slice of the full "
                                  f"tensors at tp {tp} ({len(bad)} (rank, tensor) differ: {bad[:4]})")
        moved = model.swap_round(swap_blocks)
        bad = model.check()
        checks.check(not bad and moved > 0, f"step {k + 1}: swaps after the step ({moved} blocks each way)")
        entries = len(tiered.stored)
        checks.check(tiered.load_and_check() and entries > 0,
                     f"step {k + 1}: the TieredCache's {entries} entries load their bytes after the step")
        if clear:
            model.detach()
            backend.clear_caches(timeout=60)
            backend.restore_caches(timeout=60)
            model.gpu, model.cpu = {}, {}        # a clear drops every cached block (and the allocator)
            tiered.cleared()
            model.attach()
            model.fill(rng.choice(new.num_gpu_blocks, min(gpu_keep, new.num_gpu_blocks), replace=False))
            moved = model.swap_round(min(swap_blocks, cpu_keep))
            checks.check(not model.check() and moved > 0, f"step {k + 1}: clear/restore and swaps after it")
        step = {"from_tp": r["from_tp"], "to_tp": tp, "seconds": seconds, "move_seconds": r["move_seconds"],
                "memcpy_gbps": memcpy_gbps(r["bytes_moved"]),
                "bytes_moved": r["bytes_moved"], "gbps": r["gbps"], "bytes_by_source": r["bytes_by_source"],
                "gpu_blocks_per_rank": r["gpu_blocks_per_rank"], "cpu_blocks_per_rank": r["cpu_blocks_per_rank"],
                "live_gpu_blocks": r["live_gpu_blocks"], "live_cpu_blocks": r["live_cpu_blocks"],
                "shm_before_mib": before / 2**20, "shm_after_mib": after / 2**20,
                "shm_nominal_mib": max(before_nominal, after_nominal) / 2**20, "shm_limit_mib": limit / 2**20,
                "shm_peak_mib": sampler.peak / 2**20, "staging_mib": staging / 2**20, "shm_samples": sampler.samples,
                **{key: r[key] for key in ("kv_bytes", "kv_seconds", "kv_gbps", "weights_bytes", "weights_seconds",
                                           "weights_gbps", "weight_moves", "weight_allocations", "device_memory")
                   if key in r}}
        steps.append(step)
        log(f"  step {k + 1}: tp {r['from_tp']} -> {tp}: {r['bytes_moved'] / 2**20:.1f} MiB moved in "
            f"{r['move_seconds'] * 1e3:.1f} ms ({r['gbps']:.2f} GB/s, one memcpy {step['memcpy_gbps']:.2f}; step "
            f"{seconds * 1e3:.0f} ms), GPU blocks per rank "
            f"{r['gpu_blocks_per_rank'][0]} -> {r['gpu_blocks_per_rank'][1]}, /dev/shm peak {sampler.peak / 2**20:.1f} "
            f"MiB (limit {limit / 2**20:.1f})")
        if weights is not None:
            log("           " + step_weights_line(step))
    model.detach()
    tiered.close()
    report["reshard_tiered_loaded"] = tiered.loaded
    report["reshard_steps"] = steps
    report["reshard_heads"] = heads
    return steps


def step_weights_line(step: dict) -> str:
    """The seed log's fields of a step: KV and weights moved (bytes, seconds, GB/s), which weight shards went
    from which ranks to which, and each rank's device memory after it."""
    moves = {}
    for m in step["weight_moves"]:
        moves[(m["from"], m["to"])] = moves.get((m["from"], m["to"]), 0) + m["bytes"]
    shards = ", ".join(f"{a}->{b} {n / 2**20:.2f}" for (a, b), n in sorted(moves.items()))
    memory = "; ".join(
        f"rank {d['rank']}: {d['gpu_blocks']} blocks" + (
            f", allocated {d['allocated_bytes'] / 2**20:.1f} reserved {d['reserved_bytes'] / 2**20:.1f} "
            f"free {d['free_bytes'] / 2**20:.1f} frag {d['fragmented_bytes'] / 2**20:.1f} MiB"
            if "allocated_bytes" in d else "") for d in step["device_memory"])
    return (f"kv {step['kv_bytes'] / 2**20:.1f} MiB in {step['kv_seconds'] * 1e3:.1f} ms ({step['kv_gbps']:.2f} GB/s), "
            f"weights {step['weights_bytes'] / 2**20:.1f} MiB in {step['weights_seconds'] * 1e3:.1f} ms "
            f"({step['weights_gbps']:.2f} GB/s); weight shards moved (MiB) {shards or 'none'}; {memory}")


def memcpy_gbps(nbytes: int) -> float:
    """GB/s of one host memcpy of nbytes (pages touched first), the sim device's reference rate."""
    src = np.ones(max(1, nbytes), np.uint8)
    dst = np.ones_like(src)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, src.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def shm_now(backend, nominal=False):
    """The deployment's /dev/shm bytes: pages held, or (nominal) the segments' sizes."""
    if not nominal:
        return shm_bytes(backend.suffix)
    total = 0
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(f"{PREFIX}.{backend.suffix}."):
            try:
                total += os.stat(os.path.join(SHM_DIR, entry)).st_size
            except FileNotFoundError:
                pass
    return total


def parse_tps(text: str, cycles: int, heads_per_rank: int | None = None) -> list[int]:
    """The --reshard tp sizes; ValueError (the launcher exits 2) for ones a reshard would refuse."""
    try:
        tps = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"expected comma-separated tp sizes, got {text!r}") from None
    if len(tps) < 2 or any(t < 1 for t in tps):
        raise ValueError("give at least two tp sizes >= 1")
    if any(a == b for a, b in zip(tps, tps[1:])):
        raise ValueError("consecutive tp sizes must differ")
    if cycles < 1:
        raise ValueError("--reshard-cycles must be >= 1")
    if cycles > 1 and tps[-1] != tps[0]:
        raise ValueError("to repeat the cycle it must end at the tp it starts with")
    if heads_per_rank is not None:
        heads = heads_per_rank * tps[0]
        wrong = [t for t in tps if heads % t]
        if wrong:
            raise ValueError(f"tp sizes {wrong} do not divide the {heads} KV heads ({heads_per_rank} per rank at "
                             f"tp {tps[0]})")
    return tps


def run_liquid(backend, args, framework, rng, checks, report) -> int:
    """The launcher's --reshard mode: a deployment of worker processes resharded through args.reshard."""

    with backend:
        suffix = backend.suffix
        workers = WorkerProcesses(backend, framework)
        try:
            workers.start(range(backend.tp_size))
            wait_until_ready(backend, [workers.procs[r] for r in range(backend.tp_size)], timeout=120)
            heads = backend.spec.num_kv_heads * backend.tp_size
            print(f"  ready: {heads} KV heads, tp {args.reshard[0]}; resharding through "
                  f"{' -> '.join(map(str, args.reshard))}, {args.reshard_cycles} cycle(s)", flush=True)
            liquid(backend, workers, args.reshard, args.reshard_cycles, rng, checks, report,
                   clear=bool(args.rl_cycles))
        except Exception as exc:     # any failure is a failed check, reported, never a hang
            checks.check(False, f"workload aborted: {type(exc).__name__}: {exc}")
        finally:
            workers.close()
    return conclude(report, checks, suffix, args.json, print_liquid)


def print_liquid(report, checks):
    print("\nfastcache liquid reshard report")
    print(f"  deployment      device={report['device']} framework={report['framework']}, "
          f"{report.get('reshard_heads', '?')} KV heads, per rank at the start: {report['gpu_cache_mib']:.1f} MiB "
          f"GPU, {report['cpu_cache_mib']:.1f} MiB CPU tier, {report['tensors']} tensors")
    print("  step  tp      moved MiB  move ms    GB/s  (memcpy)  step ms  GPU blocks/rank  CPU blocks/rank  "
          "live GPU/CPU  shm peak/limit MiB")
    for k, s in enumerate(report.get("reshard_steps", [])):
        limit = s["shm_limit_mib"]
        print(f"  {k + 1:>4}  {s['from_tp']}->{s['to_tp']:<4} {s['bytes_moved'] / 2**20:>9.1f}  "
              f"{s['move_seconds'] * 1e3:>7.1f}  {s['gbps']:>6.2f}  ({s['memcpy_gbps']:>5.2f})  "
              f"{s['seconds'] * 1e3:>7.0f}  "
              f"{s['gpu_blocks_per_rank'][0]:>6} -> {s['gpu_blocks_per_rank'][1]:<6}  "
              f"{s['cpu_blocks_per_rank'][0]:>6} -> {s['cpu_blocks_per_rank'][1]:<6}  "
              f"{s['live_gpu_blocks']:>5}/{s['live_cpu_blocks']:<5}  {s['shm_peak_mib']:.1f}/{limit:.1f}")
    for k, s in enumerate(report.get("reshard_steps", [])):
        if "weight_moves" in s:
            print(f"  {k + 1:>4}  {step_weights_line(s)}")
    status = "PASSED" if not checks.failed else "FAILED"
    print(f"  checks          {checks.passed} passed, {len(checks.failed)} failed: {status}")
