"""python -m fastcache.launch: start a whole deployment on this machine and prove it works.

It starts the engine (this process), one worker process and one transfer manager per rank, then runs a
verifying workload: random data in every cache tensor, random block mappings, swap out, overwrite,
swap in elsewhere, and every byte compared with what it must be. Then prefix reuse: multi-turn
conversations through a TieredCache (lookup, load of the cached prefix, store of the rest), every loaded
block compared with the bytes its hash implies. It measures one-block latency and
bulk throughput against a plain memcpy of the same bytes, runs clear/restore cycles (RL weight
updates) and prints a report. Exit status 0 only if every check passed; nothing is left running and
nothing is left in /dev/shm.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

import numpy as np

from .config import CACHE_DTYPES, CacheSpec, Settings
from .engine import SwapBackend, TieredCache
from .ipc.naming import PREFIX
from .ipc.shm import SHM_DIR
from .ops import get_ops, resolve_device, round_robin_devices
from .ops.frameworks import FRAMEWORKS
from .store import StoreError, parse_store_url
from .store.service import store_for_run
from .tools.hashbytes import HashBytes, mismatched, write_blocks
from .transfer.manager import read_manifest


# host-memory frameworks hold the sim device's tensors; GPU frameworks the cuda device's
DEVICE_FRAMEWORKS = {"sim": ("numpy", "paddle", "torch"), "cuda": ("torch", "cupy", "paddle")}


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m fastcache.launch", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("deployment")
    g.add_argument("--tp", type=int, default=2, help="tensor-parallel size: workers and transfer managers")
    g.add_argument("--device", default="auto", choices=("auto", "sim", "cuda"),
                   help="auto = cuda when a GPU is usable, else sim (shared memory)")
    g.add_argument("--framework", default=None, choices=FRAMEWORKS,
                   help="framework the workers allocate with (default: numpy on sim, torch on cuda)")
    g.add_argument("--store", default=None,
                   help="an L3 store below the CPU tier: mooncake (a local master and memory server for the run), "
                        "file (a temporary directory), or a mooncake://HOST:PORT or file:///DIR URL")
    g = p.add_argument_group("cache geometry (per rank)")
    g.add_argument("--num-layers", type=int, default=8)
    g.add_argument("--num-gpu-blocks", type=int, default=512)
    g.add_argument("--num-cpu-blocks", type=int, default=256)
    g.add_argument("--block-size", type=int, default=16, help="tokens per block")
    g.add_argument("--num-kv-heads", type=int, default=4)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--cache-dtype", default="bfloat16", choices=CACHE_DTYPES)
    g = p.add_argument_group("workload")
    g.add_argument("--duration", type=float, default=3.0, help="seconds of random verified swaps")
    g.add_argument("--prefix-requests", type=int, default=200,
                   help="requests of the prefix-reuse workload (multi-turn conversations over a TieredCache)")
    g.add_argument("--rl-cycles", type=int, default=1, help="clear/restore cycles (RL weight updates)")
    g.add_argument("--latency-samples", type=int, default=300, help="one-block round trips timed")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    g.add_argument("--reshard", metavar="TPS", default=None,
                   help="liquid resharding instead of the swap workload: tp sizes to go through, e.g. 1,2,4,2,1 "
                        "(the first is the starting tp; --num-kv-heads is per rank at it); every block verified "
                        "after every step (DESIGN §9)")
    g.add_argument("--reshard-cycles", type=int, default=2, help="times to go through the --reshard tp sizes")
    g.add_argument("--inject-corruption", action="store_true",
                   help="flip one byte behind fastcache's back, to see a check fail (exit status 1)")
    return p


class Checks:
    def __init__(self):
        self.passed, self.failed = 0, []

    def check(self, ok: bool, what: str):
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
            print(f"  CHECK FAILED: {what}", flush=True)


class Verifier:
    """Keeps the expected bytes of every GPU and CPU block of every rank and compares them after swaps."""

    def __init__(self, backend: SwapBackend, device: str, rng):
        self.backend, self.spec, self.rng = backend, backend.spec, rng
        self.ops = get_ops(device)
        self.infos = [self.spec.tensors(r, backend.device_ids[r]) for r in range(backend.tp_size)]
        self.layout = self.spec.tensors()     # geometry, the same on every rank
        self.attached = []
        self.gpu = []      # rank -> tensor -> expected uint8 rows
        self.cpu = [np.zeros((self.spec.num_cpu_blocks, self.spec.cpu_block_bytes), np.uint8)
                    for _ in range(backend.tp_size)]

    def attach(self):
        suffix = self.backend.suffix
        self.attached = [self.ops.attach(read_manifest(suffix, r), self.infos[r], suffix)
                         for r in range(self.backend.tp_size)]

    def detach(self):
        for cache in self.attached:
            cache.close()
        self.attached = []

    def fill_all(self):
        """Random bytes in every block of every tensor (never zeros: a missed copy must show)."""
        self.gpu = []
        for cache in self.attached:
            rows = [self.rng.integers(0, 256, (i.num_blocks, i.block_bytes), np.uint8) for i in cache.infos]
            for index, r in enumerate(rows):
                cache.write(index, r)
            self.gpu.append(rows)

    def overwrite(self, blocks):
        for cache, expected in zip(self.attached, self.gpu):
            for index, info in enumerate(cache.infos):
                mine = blocks[blocks < info.num_blocks]
                fresh = self.rng.integers(0, 256, (len(mine), info.block_bytes), np.uint8)
                cache.write(index, fresh, mine)
                expected[index][mine] = fresh

    def swapped_out(self, gpu_ids, cpu_ids):
        for expected, cpu in zip(self.gpu, self.cpu):
            for rows, info in zip(expected, self.layout):
                keep = gpu_ids < info.num_blocks
                cpu[cpu_ids[keep], info.cpu_offset:info.cpu_offset + info.block_bytes] = rows[gpu_ids[keep]]

    def swapped_in(self, gpu_ids, cpu_ids):
        for expected, cpu in zip(self.gpu, self.cpu):
            for rows, info in zip(expected, self.layout):
                keep = gpu_ids < info.num_blocks
                rows[gpu_ids[keep]] = cpu[cpu_ids[keep], info.cpu_offset:info.cpu_offset + info.block_bytes]

    def cpu_matches(self, cpu_ids) -> bool:
        return all(np.array_equal(self.backend.cpu_tier(r)[cpu_ids], self.cpu[r][cpu_ids])
                   for r in range(self.backend.tp_size))

    def gpu_matches(self, gpu_ids) -> bool:
        for cache, expected in zip(self.attached, self.gpu):
            for index, info in enumerate(cache.infos):
                mine = gpu_ids[gpu_ids < info.num_blocks]
                if not np.array_equal(cache.read(index, mine), expected[index][mine]):
                    return False
        return True


def shm_bytes(suffix: str) -> int:
    """Bytes this deployment holds in /dev/shm (allocated blocks, not the nominal size)."""
    total = 0
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(f"{PREFIX}.{suffix}."):
            try:
                total += os.stat(os.path.join(SHM_DIR, entry)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def random_swap_round(backend, verifier, checks, rng, max_blocks, corrupt=False):
    """Swap out random blocks, overwrite them, swap them in elsewhere; verify CPU and GPU bytes."""
    spec = backend.spec
    n = int(rng.integers(1, max_blocks + 1))
    src = rng.choice(spec.num_gpu_blocks, n, replace=False)
    cpu_ids = np.array(backend.allocate_cpu_blocks(n))
    backend.swap_out(src, cpu_ids).result(timeout=60)
    verifier.swapped_out(src, cpu_ids)
    if corrupt:
        backend.cpu_tier(0)[cpu_ids[0], 0] ^= 0xFF
    checks.check(verifier.cpu_matches(cpu_ids), f"CPU tier holds the swapped-out bytes of {n} blocks")
    verifier.overwrite(src)
    dst = rng.choice(spec.num_gpu_blocks, n, replace=False)
    backend.swap_in(dst, cpu_ids).result(timeout=60)
    verifier.swapped_in(dst, cpu_ids)
    checks.check(verifier.gpu_matches(dst), f"GPU blocks hold the swapped-in bytes of {n} blocks")
    backend.free_cpu_blocks(cpu_ids.tolist())
    return n


def run_workload(backend, verifier, checks, args, rng, report):
    spec = backend.spec
    max_blocks = min(spec.num_cpu_blocks, spec.num_gpu_blocks, 64)
    rounds = blocks = 0
    start = last = time.monotonic()
    while time.monotonic() - start < args.duration or rounds == 0:
        blocks += random_swap_round(backend, verifier, checks, rng, max_blocks,
                                    corrupt=args.inject_corruption and rounds == 0)
        rounds += 1
        if time.monotonic() - last >= 1.0:
            last = time.monotonic()
            print(f"  ... {rounds} verified rounds, {blocks} blocks each way, {len(checks.failed)} failures",
                  flush=True)
    report["random_rounds"], report["random_blocks"] = rounds, blocks
    # concurrent opposite-direction tasks on disjoint blocks
    half = max(1, min(spec.num_cpu_blocks, spec.num_gpu_blocks) // 4)
    out_ids = np.arange(half)
    cpu_out = np.array(backend.allocate_cpu_blocks(half))
    backend.swap_out(out_ids, cpu_out).result(timeout=60)
    verifier.swapped_out(out_ids, cpu_out)
    cpu_in = np.array(backend.allocate_cpu_blocks(half))
    backend.swap_out(out_ids + half, cpu_in).result(timeout=60)
    verifier.swapped_out(out_ids + half, cpu_in)
    handles = [backend.swap_out(out_ids + 2 * half, cpu_out), backend.swap_in(out_ids + 3 * half, cpu_in)]
    for h in handles:
        h.result(timeout=60)
    verifier.swapped_out(out_ids + 2 * half, cpu_out)
    verifier.swapped_in(out_ids + 3 * half, cpu_in)
    checks.check(verifier.cpu_matches(cpu_out) and verifier.gpu_matches(out_ids + 3 * half),
                 "concurrent swap-out and swap-in on disjoint blocks")
    backend.free_cpu_blocks(cpu_out.tolist() + cpu_in.tolist())


def conversations(rng, n, longest):
    """Prompts as hash chains: conversations that grow turn by turn from a few shared system prompts."""
    systems = [[int(x) for x in rng.integers(1, 2**63, 2)] for _ in range(4)]
    active, prompts = [], []
    while len(prompts) < n:
        if len(active) < 12 or rng.random() < 0.1:          # a new conversation
            active.append(list(systems[int(rng.integers(len(systems)))]))
        chat = active[int(rng.integers(len(active)))]
        for _ in range(int(rng.integers(1, 4))):          # this turn's new blocks, chained to the prefix
            chat.append(hash((chat[-1], int(rng.integers(2**62)))) & (2**64 - 1))
        if len(chat) > longest:
            active.remove(chat)
            continue
        prompts.append(list(chat))
    return prompts


def set_gpu_blocks(verifier, data, hashes, blocks):
    """Write each hash's bytes into its GPU block on every rank (what the model would compute)."""
    for rank, (cache, expected) in enumerate(zip(verifier.attached, verifier.gpu)):
        images = data.images(hashes, rank)
        write_blocks(cache, blocks, images)
        for rows, info in zip(expected, cache.infos):
            keep = blocks < info.num_blocks
            rows[blocks[keep]] = images[keep, info.cpu_offset:info.cpu_offset + info.block_bytes]


def prefix_reuse(backend, verifier, checks, args, rng, report):
    """Conversations over a TieredCache holding half the CPU tier: per request, lookup, load of the
    cached prefix (every loaded block verified on every rank), compute and store of the rest."""
    spec = backend.spec
    data = HashBytes(spec, seed=args.seed)
    longest = min(spec.num_gpu_blocks, 64)
    prompts = conversations(rng, args.prefix_requests, longest)
    # a namespace of this run's own: a store that outlives runs must not answer from an earlier one
    with TieredCache(backend, namespace=f"launch/{backend.suffix}/step-0",
                     capacity=max(1, spec.num_cpu_blocks // 2)) as cache:
        bad = blocks = 0
        for h in prompts:
            gpu = rng.permutation(spec.num_gpu_blocks)[:len(h)]
            n = cache.lookup(h)
            if n:
                cache.load(h[:n], gpu[:n]).result(timeout=60)
                bad += sum(len(mismatched(c, gpu[:n], data.images(h[:n], r)))
                           for r, c in enumerate(verifier.attached))
            set_gpu_blocks(verifier, data, h, gpu)     # the loaded prefix holds these bytes already
            cache.store(h, gpu).result(timeout=60)
            blocks += len(h)
        stats = cache.stats()
    checks.check(bad == 0, f"prefix reuse: every loaded block holds its hash's bytes ({bad} differ)")
    checks.check(stats["loaded_blocks"] > 0, "prefix reuse served blocks from the CPU tier")
    if backend.store_url is not None:
        checks.check(stats["l3_loaded_blocks"] > 0 and stats["l3_errors"] == 0,
                     f"prefix reuse served blocks from the store ({stats['l3_loaded_blocks']} fetched, "
                     f"{stats['l3_errors']} store errors)")
        report.update(prefix_l3_hits=stats["l3_hits"], prefix_l3_loaded=stats["l3_loaded_blocks"],
                      prefix_l3_written=stats["l3_written_blocks"])
    report.update(prefix_requests=len(prompts), prefix_blocks=blocks, prefix_hits=stats["hits"],
                  prefix_hit_rate=stats["hits"] / blocks, prefix_loaded=stats["loaded_blocks"],
                  prefix_stored=stats["stored_blocks"], prefix_evicted=stats["evicted"],
                  prefix_capacity=stats["capacity"])


def measure(backend, verifier, checks, args, rng, report):
    spec = backend.spec
    lat = []
    cpu_id = backend.allocate_cpu_blocks(1)
    for i in range(args.latency_samples):
        gpu_id = [int(rng.integers(spec.num_gpu_blocks))]
        t0 = time.perf_counter()
        backend.swap_out(gpu_id, cpu_id).result(timeout=30)
        lat.append(time.perf_counter() - t0)
        verifier.swapped_out(np.array(gpu_id), np.array(cpu_id))
    checks.check(verifier.cpu_matches(np.array(cpu_id)), "one-block round trips")
    backend.free_cpu_blocks(cpu_id)
    report["one_block_bytes"] = spec.task_bytes([0]) * backend.tp_size
    report["latency_p50_ms"] = float(np.percentile(lat, 50) * 1e3)
    report["latency_p99_ms"] = float(np.percentile(lat, 99) * 1e3)

    n = min(spec.num_cpu_blocks, spec.num_gpu_blocks)
    gpu_ids = rng.permutation(spec.num_gpu_blocks)[:n]
    cpu_ids = np.array(backend.allocate_cpu_blocks(n))
    best = {}
    for kind, submit in (("out", backend.swap_out), ("in", backend.swap_in)):
        times = []
        for _ in range(3):
            h = submit(gpu_ids, cpu_ids).result(timeout=120)
            times.append(h.elapsed)
        best[kind] = (h.nbytes, min(times))
    verifier.swapped_out(gpu_ids, cpu_ids)      # the last swap-in wrote back what the swap-out read
    checks.check(verifier.cpu_matches(cpu_ids) and verifier.gpu_matches(gpu_ids), f"bulk swap of {n} blocks")
    backend.free_cpu_blocks(cpu_ids.tolist())
    nbytes = best["out"][0]
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    copies = []
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t0)
    memcpy = nbytes / min(copies) / 1e9
    report["bulk_bytes"] = nbytes
    report["memcpy_gbps"] = memcpy
    for kind, (nb, secs) in best.items():
        report[f"swap_{kind}_gbps"] = nb / secs / 1e9
        report[f"swap_{kind}_vs_memcpy"] = nb / secs / 1e9 / memcpy


def store_round(backend, checks, rng, report):
    """Whole CPU blocks of random bytes into the store and back into other blocks, every byte compared."""
    spec = backend.spec
    n = max(1, min(64, spec.num_cpu_blocks // 4))
    src, dst = backend.allocate_cpu_blocks(n), backend.allocate_cpu_blocks(n)
    namespace = f"launch/{backend.suffix}/bulk"
    hashes = [int(h) for h in rng.integers(0, 2**63, n)]
    try:
        want = []
        for rank in range(backend.tp_size):
            tier = backend.cpu_tier(rank)
            tier[src] = rng.integers(1, 256, (n, spec.cpu_block_bytes), np.uint8)
            tier[dst] = 0
            want.append(tier[src].copy())
        put = backend.cpu_to_store(namespace, hashes, src).result(timeout=120)
        get = backend.store_to_cpu(namespace, hashes, dst).result(timeout=120)
        checks.check(all(np.array_equal(backend.cpu_tier(r)[dst], want[r]) for r in range(backend.tp_size)),
                     f"{n} CPU blocks went to the store and came back unchanged")
        report.update(l3_bytes=put.nbytes, l3_put_gbps=put.nbytes / put.elapsed / 1e9,
                      l3_get_gbps=get.nbytes / get.elapsed / 1e9)
        backend.store_remove(namespace, hashes)
    finally:
        backend.free_cpu_blocks(src + dst)


def cache_memory_in_use(backend, ops) -> int:
    """Bytes the caches hold: /dev/shm on sim, device memory taken (cudaMemGetInfo) on CUDA."""
    if backend.device == "sim":
        return shm_bytes(backend.suffix)
    return -sum(ops.device_memory_free(d) for d in set(backend.device_ids))


def rl_cycles(backend, verifier, checks, args, rng, report):
    clears, restores, freed = [], [], []
    need = backend.spec.gpu_cache_bytes * backend.tp_size
    for cycle in range(args.rl_cycles):
        verifier.detach()                       # the engine's own view must let go too
        before = cache_memory_in_use(backend, verifier.ops)
        t0 = time.perf_counter()
        backend.clear_caches(timeout=60)
        clears.append(time.perf_counter() - t0)
        returned = before - cache_memory_in_use(backend, verifier.ops)
        freed.append(returned)
        checks.check(returned >= need - (64 << 20) * backend.tp_size * (backend.device == "cuda"),
                     f"clear {cycle + 1} returned the cache's memory "
                     f"({returned / 2**20:.1f} of {need / 2**20:.1f} MiB)")
        t0 = time.perf_counter()
        backend.restore_caches(timeout=60)
        restores.append(time.perf_counter() - t0)
        verifier.attach()
        verifier.fill_all()
        random_swap_round(backend, verifier, checks, rng, 8)
    if clears:
        report["clear_ms"] = float(np.median(clears) * 1e3)
        report["restore_ms"] = float(np.median(restores) * 1e3)
        report["memory_returned_mib"] = float(np.median(freed) / 2**20)


def start_workers(backend, args, framework):
    procs = []
    for rank in range(backend.tp_size):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "fastcache.worker", "--rank", str(rank), "--tp", str(backend.tp_size),
             "--suffix", backend.suffix, "--spec", backend.spec.to_json(), "--engine-pid", str(os.getpid()),
             "--device", backend.device, "--framework", framework, "--device-id", str(backend.device_ids[rank])],
            stdin=subprocess.DEVNULL))
    return procs


def wait_until_ready(backend, workers, timeout):
    """backend.wait_ready, but a worker process that dies on the way fails it at once."""
    deadline = time.monotonic() + timeout
    while True:
        for rank, proc in enumerate(workers):
            if proc.poll() is not None:
                raise RuntimeError(f"worker rank {rank} (pid {proc.pid}) exited with status {proc.returncode} "
                                   f"before the deployment was ready (its error is above)")
        try:
            backend.wait_ready(timeout=0.05)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


def stop_workers(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def print_report(report, checks):
    print("\nfastcache launch report")
    print(f"  deployment      tp={report['tp']} device={report['device']} framework={report['framework']}")
    print(f"  cache per rank  {report['gpu_cache_mib']:.1f} MiB GPU, {report['cpu_cache_mib']:.1f} MiB CPU tier, "
          f"{report['tensors']} tensors, {report['cpu_block_kib']:.1f} KiB per block (all layers)")
    if "random_rounds" in report:
        print(f"  verified swaps  {report['random_rounds']} random rounds, {report['random_blocks']} blocks each way")
    if "prefix_requests" in report:
        print(f"  prefix reuse    {report['prefix_requests']} requests, {report['prefix_blocks']} blocks: "
              f"{report['prefix_hits']} hits ({report['prefix_hit_rate']:.1%}) loaded from the CPU tier and "
              f"verified, {report['prefix_stored']} computed and stored, {report['prefix_evicted']} evicted "
              f"(cache of {report['prefix_capacity']} CPU blocks)")
    if "prefix_l3_hits" in report:
        print(f"  store (L3)      {report['store']}: {report['prefix_l3_hits']} prefix hits only the store held, "
              f"{report['prefix_l3_loaded']} blocks fetched and verified, {report['prefix_l3_written']} written back")
    if "l3_put_gbps" in report:
        print(f"  store bulk      put {report['l3_put_gbps']:.2f} GB/s, get {report['l3_get_gbps']:.2f} GB/s of "
              f"{report['l3_bytes'] / 2**20:.0f} MiB (whole CPU blocks, every byte verified)")
    if "latency_p50_ms" in report:
        print(f"  one-block task  p50 {report['latency_p50_ms']:.3f} ms, p99 {report['latency_p99_ms']:.3f} ms "
              f"({report['one_block_bytes'] / 1024:.0f} KiB over all ranks)")
        print(f"  bulk swap       out {report['swap_out_gbps']:.2f} GB/s ({report['swap_out_vs_memcpy']:.2f} x memcpy), "
              f"in {report['swap_in_gbps']:.2f} GB/s ({report['swap_in_vs_memcpy']:.2f} x memcpy); "
              f"memcpy {report['memcpy_gbps']:.2f} GB/s, task {report['bulk_bytes'] / 2**20:.0f} MiB")
    if "clear_ms" in report:
        print(f"  RL cycles       {report['rl_cycles']}: clear {report['clear_ms']:.1f} ms, restore "
              f"{report['restore_ms']:.1f} ms, memory returned {report['memory_returned_mib']:.1f} MiB")
    status = "PASSED" if not checks.failed else "FAILED"
    print(f"  checks          {checks.passed} passed, {len(checks.failed)} failed: {status}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()      # a bad FASTCACHE_* value: refused before anything starts
    except ValueError as exc:
        print(f"fastcache.launch: {exc}", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    framework = args.framework or ("numpy" if device == "sim" else "torch")
    if framework not in DEVICE_FRAMEWORKS[device]:
        print(f"fastcache.launch: framework {framework!r} does not run on device {device!r} "
              f"(choose from {', '.join(DEVICE_FRAMEWORKS[device])})", file=sys.stderr)
        return 2
    try:
        spec = CacheSpec(num_layers=args.num_layers, num_gpu_blocks=args.num_gpu_blocks,
                         num_cpu_blocks=args.num_cpu_blocks, block_size=args.block_size,
                         num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, cache_dtype=args.cache_dtype)
    except ValueError as exc:
        print(f"fastcache.launch: {exc}", file=sys.stderr)
        return 2
    if args.reshard:        # liquid resharding (fastcache/tools/liquid.py): the first tp size is the start
        from .tools.liquid import parse_tps
        try:
            args.reshard = parse_tps(args.reshard, args.reshard_cycles, spec.num_kv_heads)
        except ValueError as exc:
            print(f"fastcache.launch: --reshard: {exc}", file=sys.stderr)
            return 2
        args.tp = args.reshard[0]
    rng = np.random.default_rng(args.seed)
    checks = Checks()
    report = {"tp": args.tp, "device": device, "framework": framework, "tensors": len(spec.tensors()),
              "gpu_cache_mib": spec.gpu_cache_bytes / 2**20, "cpu_cache_mib": spec.cpu_cache_bytes / 2**20,
              "cpu_block_kib": spec.cpu_block_bytes / 1024, "rl_cycles": args.rl_cycles}
    print(f"fastcache: starting tp={args.tp} on {device} ({framework} workers)", flush=True)
    workers = []
    with contextlib.ExitStack() as stack:
        try:
            if args.store not in (None, "mooncake", "file"):
                parse_store_url(args.store)
            store = stack.enter_context(store_for_run(args.store))
            if store:
                report["store"] = store
                print(f"  store {store}", flush=True)
            # on a machine with fewer GPUs than ranks, ranks share them (a one-GPU machine runs tp=2 on GPU 0)
            backend = SwapBackend(spec, tp_size=args.tp, device=device, settings=settings, store=store,
                                  device_ids=round_robin_devices(device, args.tp))
        except (ValueError, StoreError) as exc:
            print(f"fastcache.launch: {exc}", file=sys.stderr)
            return 2
        if args.reshard:
            from .tools.liquid import run_liquid
            return run_liquid(backend, args, framework, rng, checks, report)
        return run(backend, args, spec, device, framework, rng, checks, report, workers)


def run(backend, args, spec, device, framework, rng, checks, report, workers) -> int:
    with backend:
        suffix = backend.suffix
        try:
            workers = start_workers(backend, args, framework)
            wait_until_ready(backend, workers, timeout=120)
            print(f"  ready: transfer managers {backend.transfer_pids}, workers {[w.pid for w in workers]}",
                  flush=True)
            verifier = Verifier(backend, device, rng)
            verifier.attach()
            verifier.fill_all()
            print("  random verified swaps ...", flush=True)
            run_workload(backend, verifier, checks, args, rng, report)
            if args.prefix_requests:
                print("  prefix reuse ...", flush=True)
                prefix_reuse(backend, verifier, checks, args, rng, report)
            print("  latency and throughput ...", flush=True)
            measure(backend, verifier, checks, args, rng, report)
            if backend.store_url is not None:
                store_round(backend, checks, rng, report)
            if args.rl_cycles:
                print(f"  {args.rl_cycles} clear/restore cycle(s) ...", flush=True)
                rl_cycles(backend, verifier, checks, args, rng, report)
            verifier.detach()
        except Exception as exc:     # any failure is a failed check, reported, never a hang
            checks.check(False, f"workload aborted: {type(exc).__name__}: {exc}")
        finally:
            stop_workers(workers)
    leftovers = [e for e in os.listdir(SHM_DIR) if e.startswith(f"{PREFIX}.{suffix}.")]
    checks.check(not leftovers, f"nothing left in /dev/shm (found {leftovers})")
    report["checks_passed"], report["checks_failed"] = checks.passed, checks.failed
    print_report(report, checks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if not checks.failed else 1


if __name__ == "__main__":
    sys.exit(main())
