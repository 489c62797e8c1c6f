"""The launcher's verifying workload: random swaps, prefix reuse through a TieredCache, an L3 round,
latency and throughput against a memcpy, and clear/restore cycles."""
from __future__ import annotations

import time

import numpy as np

from ..engine import TieredCache
from .harness import shm_bytes
from .verify import HashBytes, mismatched, write_blocks


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
