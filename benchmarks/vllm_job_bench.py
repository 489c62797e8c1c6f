"""One-block vLLM store and load jobs through fastcache's vLLM worker side (fastcache/integrations/vllm/worker.py),
submitted the way vLLM's offloading worker submits them (`submit_store` / `submit_load`, then `wait` and
`get_finished`), on the sim device and without vLLM's engine (its own spec classes are used, so vLLM must be
installed: run it with the vllm environment):

  - round trip (submit -> the job's TransferResult) p50/p99 of store and load jobs;
  - engine CPU per job: the CPU time of the submitting thread (the worker's own bookkeeping included) and of
    the engine's I/O thread, each read from its thread's CPU clock; each job's vLLM spec objects are built
    before the clocks start, as vLLM's scheduler side builds them, not the worker;
  - both as multiples of benchmarks/queue_floor.py's floors at tp=1, measured in the same run (the round trip,
    and the floor's own engine CPU per round trip).

The worker is a one-rank deployment (each vLLM worker process runs its own). Every stored chunk and every loaded
block is checked bit for bit against the random bytes it came from.

    python benchmarks/vllm_job_bench.py [--jobs 1000] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from task_bench import thread_clock  # noqa: E402
import queue_floor  # noqa: E402

NUM_BLOCKS, NUM_CHUNKS = 512, 256
TENSORS, PAGE = 16, 8192            # 128 KiB per block, as task_bench's geometry per rank


def kv_caches(seed: int):
    """vLLM's CanonicalKVCaches: one KV cache group over TENSORS int8 (NUM_BLOCKS, PAGE) tensors of random bytes."""
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen) for _ in range(TENSORS)]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in range(TENSORS)]])


def image(tensors, block: int) -> np.ndarray:
    return np.concatenate([t.numpy().view(np.uint8)[block] for t in tensors])


class Jobs:
    """submit_store / submit_load of one block, as vLLM's worker-side connector calls them."""

    def __init__(self, worker):
        from vllm.v1.kv_offload.base import GPULoadStoreSpec
        from fastcache.integrations.vllm.jobs import FastcacheLoadSpec, FastcacheStoreSpec
        self.w, self.gpu_spec, self.load_spec, self.store_spec = worker, GPULoadStoreSpec, FastcacheLoadSpec, \
            FastcacheStoreSpec
        self.next_id = 1

    def prepare(self, load: bool, block: int, chunk: int):
        """A job as vLLM's worker receives it: its id and spec objects, built by vLLM's scheduler side."""
        job_id, self.next_id = self.next_id, self.next_id + 1
        gpu = self.gpu_spec([block], group_sizes=[1], block_indices=[0])
        if load:
            cpu = self.load_spec([chunk], np.zeros(1, bool), np.zeros(1, np.uint64), np.zeros(1, np.uint64), 0)
        else:
            cpu = self.store_spec([chunk], np.array([job_id], np.uint64), np.zeros(0, np.uint64), 0)
        return load, job_id, gpu, cpu

    def run(self, job):
        load, job_id, gpu, cpu = job
        if load:
            self.w.submit_load(job_id, cpu, gpu)
        else:
            self.w.submit_store(job_id, gpu, cpu)
        self.w.wait({job_id})
        results = [r for r in self.w.get_finished() if r.job_id == job_id]
        if len(results) != 1 or not results[0].success:
            raise RuntimeError(f"job {job_id} ({'load' if load else 'store'}) failed: {results}")


def measure(jobs: int) -> dict:
    from fastcache.integrations.vllm.options import VllmOptions
    from fastcache.integrations.vllm.worker import FastcacheWorker
    caches = kv_caches(seed=1)
    tensors = [t.tensor for t in caches.tensors]
    w = FastcacheWorker(caches, engine_id=f"bench-{uuid.uuid4().hex[:12]}", rank=0, world_size=1,
                        num_chunks=NUM_CHUNKS, blocks_per_chunk=1, namespace="bench/jobs",
                        options=VllmOptions(cpu_bytes_to_use=NUM_CHUNKS * TENSORS * PAGE, transfer_timeout=60))
    try:
        run = Jobs(w)
        io_clock = thread_clock("fastcache-engine-io")
        for i in range(50):             # warm
            run.run(run.prepare(False, i, i))
        # as vLLM's engine core does once it has started: a collection of the oldest generation would otherwise
        # walk vLLM's whole import heap (about 0.2 s here) inside whichever jobs it lands in
        from vllm.utils.gc_utils import freeze_gc_heap
        freeze_gc_heap()
        out = {}
        half = NUM_BLOCKS // 2          # stores read blocks [0, half), loads write blocks [half, NUM_BLOCKS)
        want = {}
        for load in (False, True):
            latencies, todo = [], []
            for i in range(jobs):
                block = half + i % half if load else i % half
                chunk = i % NUM_CHUNKS
                if not load:
                    want[chunk] = block
                todo.append(run.prepare(load, block, chunk))
            cpu0, io0 = time.thread_time(), time.clock_gettime(io_clock)
            for job in todo:
                began = time.perf_counter()
                run.run(job)
                latencies.append(time.perf_counter() - began)
            submit_cpu, io_cpu = time.thread_time() - cpu0, time.clock_gettime(io_clock) - io0
            steady = np.array(latencies[len(latencies) // 10:]) * 1e6
            out["load" if load else "store"] = {
                "p50_us": float(np.percentile(steady, 50)), "p99_us": float(np.percentile(steady, 99)),
                "submit_cpu_us": submit_cpu / jobs * 1e6, "io_cpu_us": io_cpu / jobs * 1e6,
                "engine_cpu_us": (submit_cpu + io_cpu) / jobs * 1e6}
        # every chunk holds the block last stored into it; each loaded block holds its chunk's bytes
        tier = w.backend.cpu_tier(0)
        wrong = sum(not np.array_equal(tier[c], image(tensors, b)) for c, b in want.items())
        for i in range(max(0, jobs - half), jobs):
            chunk, block = i % NUM_CHUNKS, half + i % half
            wrong += not np.array_equal(image(tensors, block), tier[chunk])
        out["wrong_blocks"] = int(wrong)
        return out
    finally:
        w.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    floors = queue_floor.measure(1, args.jobs)
    fig = measure(args.jobs)
    fig["floors"] = floors
    for kind in ("store", "load"):
        f = fig[kind]
        f["x_floor"] = {name: f["p50_us"] / floor["p50_us"] for name, floor in floors.items()}
        f["cpu_x_floor"] = {name: f["engine_cpu_us"] / floor["engine_cpu_us"] for name, floor in floors.items()}
    if args.json:
        print(json.dumps(fig))
    else:
        for kind in ("store", "load"):
            f = fig[kind]
            print(f"vLLM {kind} job (one block): p50 {f['p50_us']:.0f} µs, p99 {f['p99_us']:.0f} µs; engine CPU per job "
                  f"{f['engine_cpu_us']:.0f} µs (submitting thread {f['submit_cpu_us']:.0f}, I/O thread "
                  f"{f['io_cpu_us']:.0f})")
            print("      x the floors (p50; engine CPU): " + ", ".join(
                f"{n} {f['x_floor'][n]:.2f}x; {f['cpu_x_floor'][n]:.2f}x" for n in floors))
        print("tp=1 floors: " + ", ".join(f"{n} p50 {fl['p50_us']:.0f} µs, engine CPU {fl['engine_cpu_us']:.0f} µs"
                                          for n, fl in floors.items()))
        print(f"wrong blocks {fig['wrong_blocks']}")
    return 1 if fig["wrong_blocks"] else 0


if __name__ == "__main__":
    sys.exit(main())
