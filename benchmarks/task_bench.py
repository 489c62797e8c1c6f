"""One-block tasks through SwapBackend (the sim device, or cuda with torch) at tp=1, 2 and 4, against the floors of
benchmarks/queue_floor.py measured in the same run:

  - round trip (submit -> every rank done) p50/p99, alone and as a multiple of each floor;
  - engine CPU per task: the CPU time of the submitting thread and of the engine's I/O thread (which reads the
    replies and completes the handles), each read from its thread's own CPU clock, and of the whole engine
    process (its in-process workers' heartbeat threads included);
  - pipelined one-block tasks per second, WINDOW tasks in flight;
  - the same round trip and engine CPU with a 256-byte block (SMALL_BLOCK: one layer, one token, one head): the
    control plane with next to no copy, where the default block's 128 KiB copy (16 rows the cache has not
    touched lately) is part of the one-block figure and none of the floors';
  - the floors' own engine CPU per round trip (the submitting process's, all threads), and the task's as a
    multiple of each: what the bare wake-ups cost the engine in Python, with no record, MAC or handle.

Every swapped block is checked bit for bit against the random bytes it came from.

    python benchmarks/task_bench.py [--tp 1 2 4] [--tasks 2000] [--json]
    python benchmarks/task_bench.py --device cuda --tp 1        # on a GPU machine (every rank on GPU 0)
"""
import argparse
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fastcache import CacheSpec, SwapBackend  # noqa: E402
from fastcache.worker import CacheWorker  # noqa: E402
import queue_floor  # noqa: E402

WINDOW = 64         # pipelined tasks in flight
SPEC = dict(num_layers=8, num_gpu_blocks=512, num_cpu_blocks=256, block_size=16, num_kv_heads=4, head_dim=64,
            cache_dtype="bfloat16")     # python -m fastcache.launch's default geometry: 128 KiB per block per rank
SMALL_BLOCK = dict(SPEC, num_layers=1, block_size=1, num_kv_heads=1)     # 256 bytes per block per rank: K and V


def thread_clock(name: str):
    """The CPU clock of the engine's thread called `name`."""
    for thread in threading.enumerate():
        if thread.name == name:
            return time.pthread_getcpuclockid(thread.ident)
    raise RuntimeError(f"no thread {name!r} in this process")


def tensors(worker):
    """(TensorInfo, tensor) of every tensor of a worker, in CacheSpec.tensors() order."""
    return [(info, getattr(worker, info.kind)[info.layer])
            for info in worker.spec.tensors(worker.rank, worker.device_id)]


def snapshot(worker, device):
    """A copy of every tensor of a worker as uint8 rows [blocks, block bytes], in CacheSpec.tensors() order."""
    out = []
    for info, t in tensors(worker):
        if device == "cuda":
            import torch
            t = t.view(torch.uint8).cpu().numpy()
        out.append(np.array(np.asarray(t).view(np.uint8).reshape(info.num_blocks, info.block_bytes)))
    return out


def randomize(worker, device, rng):
    if device == "cuda":
        import torch
        for _, t in tensors(worker):
            t.view(torch.uint8).random_(0, 256)
        torch.cuda.synchronize()
        return
    for info, t in tensors(worker):
        rows = np.asarray(t).view(np.uint8).reshape(info.num_blocks, info.block_bytes)
        rows[...] = rng.integers(0, 256, rows.shape, dtype=np.uint8)


def measure(tp: int, tasks: int, device: str = "sim", geometry: dict = SPEC) -> dict:
    spec = CacheSpec(**geometry)
    rng = np.random.default_rng(tp)
    framework = "torch" if device == "cuda" else "numpy"
    device_ids = [0] * tp if device == "cuda" else list(range(tp))     # cuda: every rank on GPU 0
    with SwapBackend(spec, tp_size=tp, device=device, device_ids=device_ids) as backend:
        workers = [CacheWorker(spec, rank=r, tp_size=tp, device=device, suffix=backend.suffix, framework=framework,
                               device_id=device_ids[r]).start() for r in range(tp)]
        try:
            backend.wait_ready(timeout=120)
            for w in workers:
                randomize(w, device, rng)
            want = [snapshot(w, device) for w in workers]
            io_clock = thread_clock("fastcache-engine-io")
            for i in range(50):             # warm
                backend.swap_out([i], [i]).result(timeout=30)
            latencies = []
            cpu0, io0, proc0 = time.thread_time(), time.clock_gettime(io_clock), time.process_time()
            for i in range(tasks):
                began = time.perf_counter()
                backend.swap_out([i % spec.num_gpu_blocks], [i % spec.num_cpu_blocks]).result(timeout=30)
                latencies.append(time.perf_counter() - began)
            submit_cpu = time.thread_time() - cpu0
            io_cpu = time.clock_gettime(io_clock) - io0
            proc_cpu = time.process_time() - proc0
            began, handles = time.perf_counter(), []
            for i in range(tasks):
                handles.append(backend.swap_out([i % spec.num_gpu_blocks], [i % spec.num_cpu_blocks]))
                if len(handles) >= WINDOW:
                    handles.pop(0).result(timeout=30)
            for h in handles:
                h.result(timeout=30)
            rate = tasks / (time.perf_counter() - began)
            wrong = 0                       # CPU block b holds the GPU block of the last task that wrote it
            for r in range(tp):
                tier = backend.cpu_tier(r)
                for b in range(min(tasks, spec.num_cpu_blocks)):
                    last = b + spec.num_cpu_blocks * ((tasks - 1 - b) // spec.num_cpu_blocks)
                    g = last % spec.num_gpu_blocks
                    wrong += any(not np.array_equal(tier[b, info.cpu_offset:info.cpu_offset + info.block_bytes], t[g])
                                 for info, t in zip(spec.tensors(r, device_ids[r]), want[r]))
        finally:
            for w in workers:
                w.close()
    steady = np.array(latencies[len(latencies) // 10:]) * 1e6
    return {"p50_us": float(np.percentile(steady, 50)), "p99_us": float(np.percentile(steady, 99)),
            "submit_cpu_us": submit_cpu / tasks * 1e6, "io_cpu_us": io_cpu / tasks * 1e6,
            "engine_cpu_us": (submit_cpu + io_cpu) / tasks * 1e6, "process_cpu_us": proc_cpu / tasks * 1e6,
            "pipelined_per_s": rate, "wrong_blocks": wrong}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--device", choices=("sim", "cuda"), default="sim")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    for tp in args.tp:
        floors = queue_floor.measure(tp, args.tasks)
        fig = measure(tp, args.tasks, args.device)
        fig["floors"] = floors
        fig["x_floor"] = {name: fig["p50_us"] / f["p50_us"] for name, f in floors.items()}
        fig["cpu_x_floor"] = {name: fig["engine_cpu_us"] / f["engine_cpu_us"] for name, f in floors.items()}
        small = fig["small_block"] = measure(tp, args.tasks, args.device, SMALL_BLOCK)
        small["x_floor"] = {name: small["p50_us"] / f["p50_us"] for name, f in floors.items()}
        results[tp] = fig
        if not args.json:
            print(f"tp={tp}: one-block p50 {fig['p50_us']:.0f} µs, p99 {fig['p99_us']:.0f} µs; "
                  + ", ".join(f"{n} floor {f['p50_us']:.0f} µs (x{fig['x_floor'][n]:.2f})" for n, f in floors.items()))
            print(f"      engine CPU per task {fig['engine_cpu_us']:.0f} µs (submitting thread {fig['submit_cpu_us']:.0f}, "
                  f"I/O thread {fig['io_cpu_us']:.0f}; whole process {fig['process_cpu_us']:.0f}); "
                  f"pipelined {fig['pipelined_per_s']:.0f} tasks/s; wrong blocks {fig['wrong_blocks']}")
            print("      the floors' engine CPU per round trip: " + ", ".join(
                f"{n} {f['engine_cpu_us']:.0f} µs (x{fig['cpu_x_floor'][n]:.2f})" for n, f in floors.items()))
            print(f"      a 256-byte block (next to no copy): p50 {small['p50_us']:.0f} µs ("
                  + ", ".join(f"x{small['x_floor'][n]:.2f} {n}" for n in floors)
                  + f"), engine CPU per task {small['engine_cpu_us']:.0f} µs; wrong blocks {small['wrong_blocks']}")
    if args.json:
        print(json.dumps(results))
    return 1 if any(f["wrong_blocks"] or f["small_block"]["wrong_blocks"] for f in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
