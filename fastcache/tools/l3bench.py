"""python -m fastcache.tools.l3bench: L3 put and get of whole CPU blocks, against the store's own API.

For each store it starts a deployment (sim device) with random bytes in every CPU block, then, in rounds
that alternate the order, times
  - fastcache: `cpu_to_store` / `store_to_cpu` of N blocks (submission to every rank's report: the queue,
    the transfer managers, headers and checksums, and the store I/O), every fetched byte verified;
  - Mooncake's own `batch_put_from` / `batch_get_into` of the same CPU blocks (without a header) from
    this process, one client per rank, registered the same way (the ceiling fastcache's path is measured
    against);
and reports GB/s (bytes over all ranks per second, median of the rounds, with min and max) and the ratio
of the two, taken per round (the two sides run back to back, so a busy machine slows both alike).
`--store mooncake` starts a local master and memory server for the run; a `mooncake://` URL uses yours.
`--sealed` runs each store a second time with objects sealed under a temporary deployment key (AES-GCM)
and reports sealed over plain per operation.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from ..config import CacheSpec
from ..engine.backend import SwapBackend
from ..worker import CacheWorker


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fastcache.tools.l3bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", action="append", default=None,
                   help="mooncake (a local store for the run), mooncake://HOST:PORT, file:///DIR or file "
                        "(a temporary directory); repeat for several (default: mooncake and file)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--blocks", type=int, default=128, help="blocks per put/get")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--heads", type=int, default=4, help="KV heads per rank")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--segment-mb", type=int, default=1024, help="memory of the local Mooncake store")
    p.add_argument("--sealed", action="store_true", help="also run sealed (a temporary deployment key)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def with_key(url: str, key_dir: str) -> str:
    """url with a fresh deployment key: a 32-byte key file, owner-only, in key_dir."""
    import os
    path = os.path.join(key_dir, "deployment.key")
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
    return f"{url}{'&' if '?' in url else '?'}key_file={path}"


def summary(rates):
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


class RawMooncake:
    """Mooncake's own zero-copy API over the deployment's CPU tiers: one client per rank, in parallel."""

    def __init__(self, master: str, tiers):
        from mooncake.store import MooncakeDistributedStore
        from ..store.mooncake import set_environment
        set_environment("tcp", "127.0.0.1")
        self.clients, self.tiers = [], tiers
        for tier in tiers:      # a view of the blocks without their slots: register the whole tier
            client = MooncakeDistributedStore()
            if client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master) != 0:
                raise RuntimeError(f"cannot reach the Mooncake master at {master}")
            client.register_buffer(tier.ctypes.data, len(tier) * tier.strides[0])
            self.clients.append(client)

    def _each_rank(self, fn):
        errors = []

        def run(rank):
            try:
                fn(rank, self.clients[rank], self.tiers[rank])
            except Exception as exc:
                errors.append(exc)
        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(self.clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _args(self, prefix, rank, tier, cpu):
        stride, size = tier.strides[0], tier.shape[1]
        return ([f"{prefix}/{c}/r{rank}" for c in cpu], [tier.ctypes.data + int(c) * stride for c in cpu],
                [size] * len(cpu))

    def put(self, prefix, cpu):
        def one(rank, client, tier):
            codes = client.batch_put_from(*self._args(prefix, rank, tier, cpu))
            assert all(c == 0 for c in codes), codes
        self._each_rank(one)

    def get(self, prefix, src, dst):
        def one(rank, client, tier):
            names, _, sizes = self._args(prefix, rank, tier, src)
            _, ptrs, _ = self._args(prefix, rank, tier, dst)
            codes = client.batch_get_into(names, ptrs, sizes)
            assert all(c == sizes[0] for c in codes), codes
        self._each_rank(one)

    def remove(self, prefix, cpu):
        self._each_rank(lambda rank, client, tier: client.batch_remove(self._args(prefix, rank, tier, cpu)[0], True))

    def close(self):
        for client, tier in zip(self.clients, self.tiers):
            client.unregister_buffer(tier.ctypes.data)
            client.close()


def bench_store(url: str, spec: CacheSpec, args) -> dict:
    rng = np.random.default_rng(0)
    n, tp = args.blocks, args.tp
    nbytes = n * spec.cpu_block_bytes * tp
    rates = {"fastcache_put": [], "fastcache_get": [], "store_put": [], "store_get": []}
    with SwapBackend(spec, tp_size=tp, device="sim", store=url) as backend:
        workers = [CacheWorker(spec, rank=r, tp_size=tp, device="sim", suffix=backend.suffix,
                               framework="numpy").start() for r in range(tp)]
        raw = None
        try:
            backend.wait_ready(timeout=60)
            tiers = [backend.cpu_tier(r) for r in range(tp)]
            for tier in tiers:
                tier[:n] = rng.integers(1, 256, (n, spec.cpu_block_bytes), dtype=np.uint8)
            src, dst = np.arange(n), np.arange(n, 2 * n)
            want = [tier[src].copy() for tier in tiers]
            raw = RawMooncake(backend.store_url.location, tiers) if backend.store_url.scheme == "mooncake" else None
            backend.cpu_to_store("bench/warm-up", rng.integers(0, 2**63, 2), src[:2]).result(timeout=120)
            for rnd in range(args.rounds):
                hashes = rng.integers(0, 2**63, n)
                ns = f"bench/{rnd}"
                order = ["fastcache", "store"] if rnd % 2 == 0 else ["store", "fastcache"]
                for who in order:       # alternating order: neither side always runs on a warmer cache
                    if who == "fastcache":
                        h = backend.cpu_to_store(ns, hashes, src).result(timeout=300)
                        rates["fastcache_put"].append(nbytes / h.elapsed / 1e9)
                        for tier in tiers:
                            tier[dst] = 0
                        h = backend.store_to_cpu(ns, hashes, dst).result(timeout=300)
                        rates["fastcache_get"].append(nbytes / h.elapsed / 1e9)
                        for tier, w in zip(tiers, want):
                            if not np.array_equal(tier[dst], w):
                                raise AssertionError(f"{url}: fetched bytes differ from the stored ones")
                        backend.store_remove(ns, hashes)
                    elif raw is not None:
                        prefix = f"bench-raw/{rnd}"
                        t = time.perf_counter()
                        raw.put(prefix, src)
                        rates["store_put"].append(nbytes / (time.perf_counter() - t) / 1e9)
                        t = time.perf_counter()
                        raw.get(prefix, src, dst)
                        rates["store_get"].append(nbytes / (time.perf_counter() - t) / 1e9)
                        raw.remove(prefix, src)
        finally:
            if raw is not None:
                raw.close()
            for w in workers:
                w.close()
    out = {"url": url, "blocks": n, "tp": tp, "cpu_block_bytes": spec.cpu_block_bytes, "bytes": nbytes,
           "rounds": args.rounds, **{k: summary(v) for k, v in rates.items() if v}}
    if rates["store_put"]:      # per round, fastcache against the store measured right beside it
        for op in ("put", "get"):
            out[f"ratio_{op}"] = summary([a / b for a, b in zip(rates[f"fastcache_{op}"], rates[f"store_{op}"])])
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = CacheSpec(num_layers=args.layers, num_gpu_blocks=8, num_cpu_blocks=2 * args.blocks,
                     block_size=args.block_size, num_kv_heads=args.heads, head_dim=args.head_dim)
    results = []
    key_dir = tempfile.TemporaryDirectory(prefix="fastcache-l3bench-key-")

    def bench(url):
        results.append(bench_store(url, spec, args))
        if args.sealed:
            sealed = bench_store(with_key(url, key_dir.name), spec, args)
            for op in ("put", "get"):
                sealed[f"sealed_over_plain_{op}"] = (sealed[f"fastcache_{op}"]["median"]
                                                     / results[-1][f"fastcache_{op}"]["median"])
            results.append(sealed)
    with key_dir:
        for name in args.store or ["mooncake", "file"]:
            if name == "mooncake":
                from ..store.service import MooncakeService
                need_mb = 4 * args.blocks * spec.cpu_block_bytes * args.tp // 2**20 + 64
                with MooncakeService(segment_mb=max(args.segment_mb, need_mb)) as svc:
                    bench(svc.url)
            elif name == "file":
                with tempfile.TemporaryDirectory(prefix="fastcache-l3bench-") as d:
                    bench(f"file://{d}")
            else:
                bench(name)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    for r in results:
        print(f"{r['url']}: {r['blocks']} blocks x {r['cpu_block_bytes'] / 2**10:.0f} KiB x tp {r['tp']} "
              f"= {r['bytes'] / 2**20:.0f} MiB per operation, {r['rounds']} rounds (median [min..max] GB/s)")
        for op in ("put", "get"):
            line = f"  {op}: fastcache {_fmt(r['fastcache_' + op])}"
            if f"store_{op}" in r:
                line += f", Mooncake's own {_fmt(r['store_' + op])}, ratio {_fmt(r['ratio_' + op])}"
            if f"sealed_over_plain_{op}" in r:
                line += f"; sealed over plain {r['sealed_over_plain_' + op]:.2f}"
            print(line)
    return 0


def _fmt(s):
    return f"{s['median']:.2f} [{s['min']:.2f}..{s['max']:.2f}]"


if __name__ == "__main__":
    sys.exit(main())
