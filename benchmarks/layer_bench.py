"""How early a layer-by-layer swap-in lets a forward start: submit to layer 0 in place, against submit to
the whole task done, for the same swap-in (a real deployment; sim by default, --device cuda on a GPU with
torch workers).

    python benchmarks/layer_bench.py [--layers 32] [--blocks 256] [--runs 7] [--tp 1] [--device sim|cuda]

Prints the medians, their ratio, and a plain swap_in of the same blocks for what publishing per layer
costs. On cuda it also times a worker's stream wait for layer 0 (`wait_layer(..., stream=s)`): the host
returns once the transfer manager recorded the layer's event, and the stream waits on the device. Each run's destination blocks are written once untimed first (a shared-memory page written for the
first time costs a page fault, which would be charged to whichever copy came first). Bytes are checked once per run: every layer equals what was swapped out.
"""
import argparse
import statistics
import time

import numpy as np

from fastcache import CacheSpec, SwapBackend
from fastcache.worker import CacheWorker


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=256, help="blocks per swap-in")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", default="sim", choices=("sim", "cuda"))
    args = p.parse_args()
    framework = "torch" if args.device == "cuda" else "numpy"
    spec = CacheSpec(num_layers=args.layers, num_gpu_blocks=2 * args.blocks, num_cpu_blocks=args.blocks,
                     block_size=16, num_kv_heads=4, head_dim=128, cache_dtype="bfloat16")
    rng = np.random.default_rng(0)
    with SwapBackend(spec, tp_size=args.tp, device=args.device) as backend:
        workers = [CacheWorker(spec, rank=r, tp_size=args.tp, device=args.device, suffix=backend.suffix,
                               framework=framework).start() for r in range(args.tp)]
        try:
            backend.wait_ready(timeout=60)
            for r in range(args.tp):
                tier = backend.cpu_tier(r)
                tier[...] = rng.integers(1, 256, tier.shape, dtype=np.uint8)
            cpu = np.arange(args.blocks)
            first, whole, plain, on_stream = [], [], [], []
            for _ in range(args.runs):
                gpu = rng.permutation(spec.num_gpu_blocks)[:args.blocks]
                backend.swap_in(gpu, cpu).result(timeout=120)     # untimed: the destination pages exist
                began = time.perf_counter()
                handle = backend.swap_in(gpu, cpu, layerwise=True)
                handle.wait_layer(0, timeout=120)
                first.append(time.perf_counter() - began)
                handle.result(timeout=120)
                whole.append(time.perf_counter() - began)
                if args.device == "cuda":
                    on_stream.append(stream_wait_seconds(backend, workers[0], gpu, cpu))
                began = time.perf_counter()
                backend.swap_in(gpu, cpu).result(timeout=120)
                plain.append(time.perf_counter() - began)
                check(workers, backend, gpu, cpu)
        finally:
            for w in workers:
                w.close()
    nbytes = spec.task_bytes(np.arange(args.blocks)) * args.tp
    f, w, p_ = (statistics.median(x) * 1e3 for x in (first, whole, plain))
    print(f"layer-by-layer swap-in of {nbytes / 2**20:.0f} MiB ({args.layers} layers, {args.blocks} blocks, "
          f"tp={args.tp}), medians of {args.runs}: layer 0 in place after {f:.2f} ms, the whole task after "
          f"{w:.2f} ms ({f / w:.2f} of it); a plain swap_in {p_:.2f} ms ({w / p_:.2f}x for layer by layer)")
    if on_stream:
        print(f"  a worker's stream wait for layer 0 returned to its host after {statistics.median(on_stream) * 1e3:.2f} ms "
              f"(the event recorded; the stream waits on the device)")


def stream_wait_seconds(backend, worker, gpu, cpu) -> float:
    """Submit to the return of rank 0's wait for layer 0 on its current stream, then the task finished."""
    import torch
    stream = torch.cuda.current_stream()
    began = time.perf_counter()
    handle = backend.swap_in(gpu, cpu, layerwise=True)
    worker.wait_layer(handle.task_id, 0, timeout=120, stream=stream)
    seconds = time.perf_counter() - began
    handle.result(timeout=120)
    stream.synchronize()
    return seconds


def check(workers, backend, gpu, cpu):
    for r, w in enumerate(workers):
        tier = backend.cpu_tier(r)
        tensors = [t for pair in zip(w.key_caches, w.value_caches) for t in pair]     # CacheSpec.tensors order
        for info, tensor in zip(w.spec.tensors(r), tensors):
            host = tensor.cpu().view(torch_uint8()).numpy() if hasattr(tensor, "cpu") else np.asarray(tensor)
            rows = host.view(np.uint8).reshape(info.num_blocks, info.block_bytes)
            want = tier[cpu, info.cpu_offset:info.cpu_offset + info.block_bytes]
            if not np.array_equal(rows[gpu], want):
                raise SystemExit(f"wrong bytes in {info.name}")


def torch_uint8():
    import torch
    return torch.uint8


if __name__ == "__main__":
    main()
