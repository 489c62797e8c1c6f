"""python -m fastcache.tools.bench: how fast each copy method moves KV blocks on one GPU (DESIGN §2).

For each block size, a cache of --layers layers (K and V) and --blocks random, non-contiguous block ids:
  ceiling   one bulk pinned cudaMemcpyAsync of the same bytes each way, and both ways at once
  methods   every copy method each way through CudaOps' copiers, and swap-out beside swap-in (two threads)
  gemm      a bf16 8192^3 torch.matmul loop on its own stream, alone and beside each method's round trips
  e2e       the SwapBackend round trip through a worker and a transfer manager process
Every figure is in GB/s and as a fraction of the ceiling measured in the same run. Without a usable GPU
it exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np

from ..config import CacheSpec
from ..ops import cuda_usable

GEMM_N = 8192
REPEATS = 5
WINDOW_S = 2.0           # seconds per GEMM measurement window


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m fastcache.tools.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--block-kib", type=int, nargs="+", default=[8, 32, 128], help="bytes of one tensor's block row")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=256, help="blocks per swap")
    p.add_argument("--methods", nargs="+", help="copy methods to measure (default: all)")
    p.add_argument("--device-id", type=int, default=0)
    p.add_argument("--framework", choices=("torch", "cupy"), help="allocates the cache (default: torch if present)")
    p.add_argument("--gemm", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=True)
    return p.parse_args(argv)


def bench_spec(block_kib: int, layers: int, blocks: int) -> CacheSpec:
    """bf16 K and V rows of block_kib KiB (16 tokens of 128-wide heads where it divides evenly)."""
    row = block_kib * 1024
    heads, head_dim = (row // 4096, 128) if row % 4096 == 0 else (1, row // 32)
    return CacheSpec(num_layers=layers, num_gpu_blocks=4 * blocks, num_cpu_blocks=2 * blocks, block_size=16,
                     num_kv_heads=heads, head_dim=head_dim, cache_dtype="bfloat16")


def best_seconds(fn, repeats=REPEATS) -> float:
    fn()                                   # warm-up: kernel load, first-touch of ids buffers
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best


def together_seconds(out_fn, in_fn, repeats=REPEATS) -> float:
    """Best wall time of out_fn and in_fn started together on two threads."""
    def once():
        start, errors = threading.Barrier(2), []

        def run(fn):
            start.wait()
            try:
                fn()
            except Exception as exc:
                errors.append(exc)
        thread = threading.Thread(target=run, args=(in_fn,))
        thread.start()
        run(out_fn)
        thread.join()
        if errors:
            raise errors[0]
    return best_seconds(once, repeats)


class Rig:
    """One block size's cache (framework tensors), pinned CPU tier and random task ids."""

    def __init__(self, spec: CacheSpec, device_id: int, framework: str, blocks: int, seed: int = 0):
        from ..ipc.naming import new_suffix, swap_space_name
        from ..ipc.shm import SharedSegment
        from ..ops.cuda import CudaOps

        self.spec, self.device_id = spec, device_id
        ops = CudaOps()
        self.local = ops.allocate(spec, 0, device_id, framework, "bench", 0)
        self.view = self.local.view()
        suffix = new_suffix()
        segment = SharedSegment.create(swap_space_name(suffix, 0), spec.cpu_cache_bytes, suffix)
        try:
            self.swap = ops.attach_swap_space(segment, spec, device_id=device_id)
            self.swap.wait_pinned()
        except BaseException:
            segment.close()         # unlinks it: nothing of ours stays in /dev/shm
            raise
        rng = np.random.default_rng(seed)
        gpu = rng.permutation(spec.num_gpu_blocks)
        cpu = rng.permutation(spec.num_cpu_blocks)
        self.out_ids = (gpu[:blocks], cpu[:blocks])              # swap-out: gpu -> cpu
        self.in_ids = (gpu[blocks:2 * blocks], cpu[blocks:])     # swap-in, disjoint from swap-out
        self.nbytes = blocks * spec.cpu_block_bytes

    def close(self):
        self.swap.close()            # closes the segment, which unlinks it (we created it)
        self.view.close()
        self.local.release()


class BulkCopy:
    """The ceiling: one cudaMemcpyAsync of the swap's bytes between device memory and the pinned tier,
    with a buffer and a stream per direction, as the copiers have."""

    def __init__(self, rig: Rig):
        from ..ops.cuda_kernels import DeviceBuffer, Lane, set_device

        set_device(rig.device_id)
        self.rig = rig
        self.buffers = {True: DeviceBuffer(rig.nbytes), False: DeviceBuffer(rig.nbytes)}    # keyed by "to host"
        self.lanes = {True: Lane(), False: Lane()}

    def _copy(self, to_host: bool):
        from ..ops.cuda_kernels import memcpy_async, set_device

        set_device(self.rig.device_id)
        host = self.rig.swap.host_ptr + (0 if to_host else self.rig.nbytes)
        device = self.buffers[to_host].ptr
        dst, src = (host, device) if to_host else (device, host)
        memcpy_async(dst, src, self.rig.nbytes, to_host, self.lanes[to_host].stream)
        self.lanes[to_host].sync()

    def out(self):
        self._copy(True)

    def in_(self):
        self._copy(False)

    def close(self):
        for lane in self.lanes.values():
            lane.close()
        for buf in self.buffers.values():
            buf.close()


class GemmLoop:
    """bf16 GEMMs back to back on their own torch stream and thread; rate() = TFLOP/s since start()."""

    def __init__(self, device_id: int):
        import torch

        self.torch = torch
        self.device = torch.device("cuda", device_id)
        self.a = torch.randn(GEMM_N, GEMM_N, device=self.device, dtype=torch.bfloat16)
        self.b = torch.randn(GEMM_N, GEMM_N, device=self.device, dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        self.stream = torch.cuda.Stream(self.device)

    def start(self):
        self.count, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._began = time.perf_counter()
        self._thread.start()

    def _loop(self):
        with self.torch.cuda.stream(self.stream):
            while not self._stop.is_set():
                for _ in range(4):            # a few per sync keeps the GPU fed while we wait
                    self.torch.matmul(self.a, self.b, out=self.c)
                self.stream.synchronize()
                self.count += 4

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return 2 * GEMM_N ** 3 * self.count / (time.perf_counter() - self._began) / 1e12


def beside_gemm(gemm: GemmLoop, round_trip, nbytes: int) -> tuple[float, float]:
    """(swap GB/s, GEMM TFLOP/s) with round trips (swap-out then swap-in) running beside the GEMM loop."""
    gemm.start()
    time.sleep(0.2)
    moved, began = 0, time.perf_counter()
    while time.perf_counter() - began < WINDOW_S:
        round_trip()
        moved += 2 * nbytes
    swap_rate = moved / (time.perf_counter() - began) / 1e9
    return swap_rate, gemm.stop()


def e2e_round_trip(spec: CacheSpec, device_id: int, gpu_ids, cpu_ids) -> dict:
    """Swap-out and swap-in through a SwapBackend deployment (worker in this process, framework torch),
    checking one tensor's bytes in the CPU tier."""
    import torch

    from .. import SwapBackend
    from ..worker import CacheWorker

    nbytes = len(gpu_ids) * spec.cpu_block_bytes
    with SwapBackend(spec, tp_size=1, device="cuda", device_ids=[device_id]) as backend:
        worker = CacheWorker(spec, rank=0, tp_size=1, device="cuda", suffix=backend.suffix, framework="torch",
                             device_id=device_id).start()
        try:
            backend.wait_ready(timeout=300)
            key = worker.key_caches[0].view(torch.uint8).view(spec.num_gpu_blocks, -1)
            key.random_(1, 256)
            torch.cuda.synchronize(device_id)
            out = min(backend.swap_out(gpu_ids, cpu_ids).result(timeout=120).elapsed for _ in range(REPEATS))
            row = spec.tensors()[0]
            expected = key[torch.as_tensor(gpu_ids, device=key.device)].cpu().numpy()
            if not np.array_equal(backend.cpu_tier(0)[cpu_ids, row.cpu_offset:row.cpu_offset + row.block_bytes],
                                  expected):
                raise AssertionError("the CPU tier does not hold the swapped-out bytes")
            back = min(backend.swap_in(gpu_ids, cpu_ids).result(timeout=120).elapsed for _ in range(REPEATS))
        finally:
            worker.close()
    return {"d2h": nbytes / out / 1e9, "h2d": nbytes / back / 1e9}


def bench_block_size(args, block_kib: int, framework: str) -> dict:
    spec = bench_spec(block_kib, args.layers, args.blocks)
    rig = Rig(spec, args.device_id, framework, args.blocks)
    result = {"block_kib": block_kib, "tensors": len(spec.tensors()), "swap_bytes": rig.nbytes,
              "pin_seconds": rig.swap.pin_seconds, "pinned_bytes": spec.cpu_cache_bytes, "methods": {}}
    try:
        gemm = GemmLoop(args.device_id) if args.gemm else None
        bulk = BulkCopy(rig)
        result["ceiling"] = {"d2h": rig.nbytes / best_seconds(bulk.out) / 1e9,
                             "h2d": rig.nbytes / best_seconds(bulk.in_) / 1e9,
                             "duplex": 2 * rig.nbytes / together_seconds(bulk.out, bulk.in_) / 1e9}
        if gemm:
            gemm.start()
            time.sleep(WINDOW_S)
            result["gemm_alone_tflops"] = gemm.stop()
            result["ceiling"]["beside_gemm"] = beside_gemm(gemm, lambda: (bulk.out(), bulk.in_()), rig.nbytes)
        bulk.close()
        for method in args.methods:
            result["methods"][method] = bench_method(method, rig, gemm)
    finally:
        rig.close()
    if args.e2e:        # after the rig is gone: the deployment allocates its own cache and CPU tier
        try:
            result["e2e"] = e2e_round_trip(spec, args.device_id, *rig.out_ids)
        except Exception as exc:            # the engine is optional here: report it, keep the other figures
            result["e2e"] = {"skipped": f"{type(exc).__name__}: {exc}"}
    return result


def bench_method(method: str, rig: Rig, gemm) -> dict:
    from ..ops.cuda import make_copier

    try:
        copier = make_copier(method, rig.view, rig.swap, rig.spec)
    except Exception as exc:                # e.g. cudaMemcpyBatchAsync missing on an old driver
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    out = lambda: copier.swap_out(*rig.out_ids)
    back = lambda: copier.swap_in(*rig.in_ids)
    try:
        figures = {"d2h": rig.nbytes / best_seconds(out) / 1e9, "h2d": rig.nbytes / best_seconds(back) / 1e9,
                   "duplex": 2 * rig.nbytes / together_seconds(out, back) / 1e9}
        if gemm:
            figures["beside_gemm"] = beside_gemm(gemm, lambda: (out(), back()), rig.nbytes)
        return figures
    except Exception as exc:                # one failing method must not hide the others' figures
        return {"skipped": f"failed: {type(exc).__name__}: {exc}"}
    finally:
        copier.close()


# -- report ----------------------------------------------------------------------------------------
def _cell(rate, ceiling):
    return f"{rate:6.1f} {rate / ceiling:5.0%}" if rate else "     -      "


def print_report(device: str, results: list):
    print(f"device: {device}")
    for r in results:
        ceil = r["ceiling"]
        print(f"\nblock rows {r['block_kib']} KiB x {r['tensors']} tensors: "
              f"{r['swap_bytes'] / 2**20:.0f} MiB per swap; "
              f"pinned {r['pinned_bytes'] / 2**30:.1f} GiB in {r['pin_seconds']:.2f} s")
        print(f"  {'GB/s (share of ceiling)':28s} {'D2H':>12s} {'H2D':>12s} {'duplex':>12s}")
        rows = [("ceiling: bulk memcpy", ceil)] + list(r["methods"].items())
        if "e2e" in r:
            rows.append(("e2e SwapBackend", r["e2e"]))
        for name, fig in rows:
            if "skipped" in fig:
                print(f"  {name:28s} skipped ({fig['skipped']})")
                continue
            cells = [_cell(fig.get(k), ceil[k]) for k in ("d2h", "h2d", "duplex")]
            print(f"  {name:28s} " + " ".join(cells))
        if "gemm_alone_tflops" in r:
            alone = r["gemm_alone_tflops"]
            print(f"  bf16 GEMM {GEMM_N}^3 alone: {alone:.0f} TFLOP/s; beside round trips "
                  f"(swap GB/s, share of ceiling | GEMM TFLOP/s, share of alone):")
            one_way = 2 / (1 / ceil["d2h"] + 1 / ceil["h2d"])     # a round trip runs one direction at a time
            for name, fig in rows:
                if "beside_gemm" in fig:
                    swap, tflops = fig["beside_gemm"]
                    print(f"    {name:26s} {swap:6.1f} {swap / one_way:5.0%} | {tflops:6.0f} {tflops / alone:5.0%}")


def device_name(device_id: int) -> str:
    from cuda.bindings import runtime

    err, prop = runtime.cudaGetDeviceProperties(device_id)
    if int(err) != 0:
        return f"cuda:{device_id}"
    name = prop.name
    return (name.decode(errors="replace") if isinstance(name, bytes) else str(name)).rstrip("\0")


def pick_framework(requested):
    for name in [requested] if requested else ["torch", "cupy"]:
        try:
            __import__(name)
            return name
        except ImportError:
            continue
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    if not cuda_usable():
        print("bench: no usable CUDA GPU (cuda-python missing or no device); nothing to measure", file=sys.stderr)
        return 2
    from ..ops.cuda import METHODS

    args.methods = args.methods or list(METHODS)
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        print(f"bench: unknown copy methods {sorted(unknown)}; expected some of {METHODS}", file=sys.stderr)
        return 2
    framework = pick_framework(args.framework)
    if framework is None:
        print(f"bench: needs {args.framework or 'torch or cupy'} to allocate the cache", file=sys.stderr)
        return 2
    if args.gemm and pick_framework("torch") is None:
        print("bench: the GEMM needs torch; running with --no-gemm", file=sys.stderr)
        args.gemm = False
    device = device_name(args.device_id)
    results = [bench_block_size(args, kib, framework) for kib in args.block_kib]
    print_report(device, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "framework": framework, "layers": args.layers, "blocks": args.blocks,
                       "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
