"""One deployment that shares blocks through an L3 store, run as its own process by the store tests.

    python tests/store_peer.py '{"url": ..., "namespace": ..., "spec": {...}, "tp": 2, "mode": "put"|"get",
                                 "hashes": [...]}'

"put" writes each hash's bytes into GPU blocks, swaps them out and puts them into the store; "get" fetches
them into fresh CPU blocks, swaps them in at other GPU blocks and checks every byte of every rank. The
bytes of (hash, rank) are random but derived from both, so the two processes agree without talking.
Prints one JSON line: {"present": [...], "verified_bytes": n} or {"error": "..."}.
"""
from __future__ import annotations

import json
import sys

import numpy as np


def block_bytes(h: int, rank: int, nbytes: int) -> np.ndarray:
    """The CPU-block image of hash h on rank: random, never all zeros, the same in every process."""
    rng = np.random.default_rng([h & 0xFFFFFFFF, h >> 32, rank])
    return rng.integers(1, 256, nbytes, dtype=np.uint8)


def run(args: dict) -> dict:
    from fastcache import CacheSpec, SwapBackend, TransferError
    from fastcache.worker import CacheWorker

    spec = CacheSpec(**args["spec"])
    tp, hashes, ns = args["tp"], [int(h) for h in args["hashes"]], args["namespace"]
    rng = np.random.default_rng(len(hashes))
    with SwapBackend(spec, tp_size=tp, device="sim", store=args["url"]) as backend:
        workers = [CacheWorker(spec, rank=r, tp_size=tp, device="sim", suffix=backend.suffix,
                               framework="numpy").start() for r in range(tp)]
        try:
            backend.wait_ready(timeout=30)
            gpu = rng.choice(spec.num_gpu_blocks, len(hashes), replace=False)
            cpu = backend.allocate_cpu_blocks(len(hashes))
            if args["mode"] == "put":
                for rank, w in enumerate(workers):
                    for i, h in enumerate(hashes):
                        _write_gpu_block(w, gpu[i], block_bytes(h, rank, spec.cpu_block_bytes))
                backend.swap_out(gpu, cpu).result(timeout=30)
                backend.cpu_to_store(ns, hashes, cpu).result(timeout=60)
                return {"present": backend.store_contains(ns, hashes).tolist()}
            present = backend.store_contains(ns, hashes).tolist()
            try:
                backend.store_to_cpu(ns, hashes, cpu).result(timeout=60)
            except TransferError as exc:
                return {"present": present, "error": str(exc)}
            backend.swap_in(gpu, cpu).result(timeout=30)
            verified = 0
            for rank, w in enumerate(workers):
                for i, h in enumerate(hashes):
                    got = _read_gpu_block(w, gpu[i])
                    if not np.array_equal(got, block_bytes(h, rank, spec.cpu_block_bytes)):
                        return {"present": present, "error": f"rank {rank} hash {h:#x}: wrong bytes"}
                    verified += got.size
            return {"present": present, "verified_bytes": verified}
        finally:
            for w in workers:
                w.close()


def _tensor_rows(worker):
    for info, tensor in zip(worker.spec.tensors(worker.rank, worker.device_id), worker._cache.tensors.values()):
        yield info, np.asarray(tensor).view(np.uint8).reshape(info.num_blocks, info.block_bytes)


def _write_gpu_block(worker, g, image):
    for info, rows in _tensor_rows(worker):
        rows[g] = image[info.cpu_offset:info.cpu_offset + info.block_bytes]


def _read_gpu_block(worker, g):
    out = np.empty(worker.spec.cpu_block_bytes, np.uint8)
    for info, rows in _tensor_rows(worker):
        out[info.cpu_offset:info.cpu_offset + info.block_bytes] = rows[g]
    return out


def run_peer(**args) -> dict:
    """Run one peer in its own process (from a test) and return its JSON answer."""
    import subprocess
    proc = subprocess.run([sys.executable, __file__, json.dumps(args)], capture_output=True, text=True,
                          timeout=180)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"peer exited {proc.returncode}: {proc.stdout[-2000:]} {proc.stderr[-3000:]}")
    return json.loads(lines[-1])


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
