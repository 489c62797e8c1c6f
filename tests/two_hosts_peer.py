"""One "host" of the two-host test, run inside a network namespace: a deployment with a TieredCache over a
shared Mooncake Store, driven by JSON commands on stdin (one per line), answering one JSON line each.

    python tests/two_hosts_peer.py '{"address": "10.213.7.1", "serve": true}'      # host A: master + memory
    python tests/two_hosts_peer.py '{"address": "10.213.7.2", "store": "mooncake://10.213.7.1:PORT"}'

Commands: {"cmd": "store", "hashes": [...]} writes each hash's bytes into GPU blocks, stores them
(write-through) and waits until the store holds them; {"cmd": "load", "hashes": [...], "load_timeout": s}
looks the hashes up and loads the leading ones held, verifying every byte of every rank;
{"cmd": "stats"}; {"cmd": "quit"}. The bytes of (hash, rank) are derived from both (store_peer), so two
hosts agree on them without talking. Every answer carries the seconds the command took.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time

import numpy as np

from store_peer import _read_gpu_block, _write_gpu_block, block_bytes

SPEC = dict(num_layers=2, num_gpu_blocks=64, num_cpu_blocks=32, block_size=16, num_kv_heads=2, head_dim=64,
            cache_dtype="bfloat16")
NAMESPACE = "two-hosts/step-0"


def serve(args: dict):
    from fastcache import CacheSpec, SwapBackend, TieredCache, TransferError
    from fastcache.store.service import MooncakeService
    from fastcache.worker import CacheWorker

    spec = CacheSpec(**SPEC)
    with contextlib.ExitStack() as stack:
        url = args.get("store")
        if args.get("serve"):
            url = stack.enter_context(MooncakeService(segment_mb=64, host=args["address"])).url
        backend = stack.enter_context(SwapBackend(spec, tp_size=1, device="sim",
                                                  store=f"{url}?local_hostname={args['address']}"))
        worker = CacheWorker(spec, rank=0, tp_size=1, device="sim", suffix=backend.suffix, framework="numpy")
        stack.callback(worker.close)
        worker.start()
        backend.wait_ready(timeout=60)
        cache = TieredCache(backend, NAMESPACE, write="through")
        stack.callback(cache.close)
        reply({"ready": True, "url": url})
        rng = np.random.default_rng(7)
        for line in sys.stdin:
            cmd = json.loads(line)
            began = time.monotonic()
            try:
                if cmd["cmd"] == "quit":
                    reply({"bye": True})
                    return
                out = run(cmd, spec, backend, worker, cache, rng)
            except (TransferError, TimeoutError, ValueError) as exc:
                out = {"error": f"{type(exc).__name__}: {exc}"}
            reply({**out, "seconds": time.monotonic() - began})


def run(cmd, spec, backend, worker, cache, rng) -> dict:
    hashes = [int(h) for h in cmd.get("hashes", [])]
    gpu = rng.choice(spec.num_gpu_blocks, len(hashes), replace=False).tolist()
    if cmd["cmd"] == "store":
        for g, h in zip(gpu, hashes):
            _write_gpu_block(worker, g, block_bytes(h, 0, spec.cpu_block_bytes))
        cache.store(hashes, gpu).result(timeout=30)
        deadline = time.monotonic() + 30          # write-through puts run after the swap-out
        while not backend.store_contains(NAMESPACE, hashes).all():
            if time.monotonic() > deadline:
                return {"error": "the store does not hold the stored hashes after 30 s"}
            time.sleep(0.05)
        return {"stored": len(hashes)}
    if cmd["cmd"] == "load":
        held, only_store = cache.lookup_tiers(hashes)
        cache.load(hashes[:held], gpu[:held]).result(timeout=cmd.get("load_timeout", 30))
        wrong = [h for g, h in zip(gpu[:held], hashes) if
                 not np.array_equal(_read_gpu_block(worker, g), block_bytes(h, 0, spec.cpu_block_bytes))]
        if wrong:
            return {"error": f"wrong bytes for hashes {wrong}"}
        return {"held": held, "from_store": only_store, "verified_bytes": held * spec.cpu_block_bytes}
    if cmd["cmd"] == "stats":
        return {k: v for k, v in cache.stats().items() if isinstance(v, (int, float))}
    raise ValueError(f"unknown command {cmd['cmd']!r}")


def reply(obj: dict):
    print(json.dumps(obj), flush=True)


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
