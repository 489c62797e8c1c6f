"""What the copy engines make of a swap's many runs, without any kernel (cuda, cuda-python only).

    python benchmarks/dma_probe.py [--blocks 256] [--tensors 64] [--row-kib 8 32 128]

For each row size: the ceiling (one bulk copy of the swap's bytes), then the same bytes as
- `runs`: one run per block (a block of every tensor, contiguous on both sides, as staging leaves it) at
  random CPU blocks, in one cudaMemcpyBatchAsync on one stream, then split over two streams;
- `2d`: straight from evenly spaced tensors (one allocation, tensor t at t * tensor_bytes), one
  cudaMemcpy2DAsync per block (a row of each tensor, pitch tensor_bytes on the device, row_bytes in the
  block-major tier), on one stream, then split over two.
GB/s as the median of 5 runs and its share of the ceiling, each way. Bytes are not checked: a probe of rates.
"""
import argparse
import statistics
import time

import numpy as np
from cuda.bindings import runtime

from fastcache.ops.cuda_copiers import batch_attributes
from fastcache.ops.cuda_kernels import DeviceBuffer, HostBuffer, create_stream, cuda_check, set_device

RUNS = 5
D2H, H2D = runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost, runtime.cudaMemcpyKind.cudaMemcpyHostToDevice


def timed(submit, streams, nbytes) -> float:
    rates = []
    for _ in range(RUNS + 1):
        began = time.perf_counter()
        submit()
        for s in streams:
            cuda_check(runtime.cudaStreamSynchronize(s), "cudaStreamSynchronize")
        rates.append(nbytes / (time.perf_counter() - began) / 1e9)
    return statistics.median(rates[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--row-kib", type=int, nargs="+", default=[8, 32, 128])
    args = p.parse_args()
    set_device(0)
    attrs = batch_attributes(required=True)
    streams = [create_stream(), create_stream()]
    rng = np.random.default_rng(0)
    for kib in args.row_kib:
        row = kib << 10
        block = row * args.tensors
        nbytes = block * args.blocks
        gpu_blocks, cpu_blocks = 2 * args.blocks, 2 * args.blocks
        device = DeviceBuffer(args.tensors * gpu_blocks * row)         # tensor t: rows at t * gpu_blocks * row
        host = HostBuffer(cpu_blocks * block)
        try:
            gpu_ids = rng.permutation(gpu_blocks)[:args.blocks].tolist()
            cpu_ids = rng.permutation(cpu_blocks)[:args.blocks].tolist()
            tensor_bytes = gpu_blocks * row
            print(f"rows {kib} KiB x {args.tensors} tensors, {args.blocks} blocks: {nbytes / 2**20:.0f} MiB a swap")
            for label, to_host in (("D2H", True), ("H2D", False)):
                kind = D2H if to_host else H2D

                def bulk():
                    src, dst = (device.ptr, host.ptr) if to_host else (host.ptr, device.ptr)
                    cuda_check(runtime.cudaMemcpyAsync(dst, src, nbytes, kind, streams[0]), "cudaMemcpyAsync")

                def runs(split):
                    # staging holds block k at k * block; the tier's block c at c * block
                    dev = [device.ptr + k * block for k in range(args.blocks)]
                    cpu = [host.ptr + c * block for c in cpu_ids]
                    dst, src = (cpu, dev) if to_host else (dev, cpu)
                    step = -(-args.blocks // split)
                    for n, lo in enumerate(range(0, args.blocks, step)):
                        hi = min(lo + step, args.blocks)
                        cuda_check(runtime.cudaMemcpyBatchAsync(dst[lo:hi], src[lo:hi], [block] * (hi - lo), hi - lo,
                                                                [attrs], [0], 1, streams[n]), "cudaMemcpyBatchAsync")

                def two_d(split):
                    for k, (g, c) in enumerate(zip(gpu_ids, cpu_ids)):
                        dev, cpu, stream = device.ptr + g * row, host.ptr + c * block, streams[k * split // args.blocks]
                        if to_host:
                            args2d = (cpu, row, dev, tensor_bytes)
                        else:
                            args2d = (dev, tensor_bytes, cpu, row)
                        cuda_check(runtime.cudaMemcpy2DAsync(*args2d, row, args.tensors, kind, stream),
                                   "cudaMemcpy2DAsync")
                ceiling = timed(bulk, streams[:1], nbytes)
                figures = [("runs, 1 stream", timed(lambda: runs(1), streams, nbytes)),
                           ("runs, 2 streams", timed(lambda: runs(2), streams, nbytes)),
                           ("2d, 1 stream", timed(lambda: two_d(1), streams, nbytes)),
                           ("2d, 2 streams", timed(lambda: two_d(2), streams, nbytes))]
                print(f"  {label}: ceiling {ceiling:5.1f} GB/s; " +
                      "; ".join(f"{name} {rate:5.1f} ({rate / ceiling:.0%})" for name, rate in figures), flush=True)
        finally:
            device.close()
            host.close()


if __name__ == "__main__":
    main()
