"""python -m fastcache.tools.bench: how fast each copy method moves KV blocks on one GPU (docs/design.md §2).

For each block size, a cache of --layers layers (K and V) filled with random bytes, and --blocks random,
non-contiguous block ids:
  ceiling   one bulk cudaMemcpyAsync of the same bytes between device memory and a cudaHostAlloc buffer,
            each way and both ways at once
  methods   every copy method each way through CudaOps' copiers, and swap-out beside swap-in (two threads);
            the destination rows are poisoned first and every byte is checked after the timed runs
  gemm      a bf16 8192^3 matrix-product loop in ANOTHER process (python -m fastcache.tools.gemm_load),
            as the model runs beside a transfer manager: its TFLOP/s and the swap's GB/s are both measured
            only over windows in which both run, for the ceiling and for every method
  e2e       a real SwapBackend deployment (worker here, transfer manager in its own process): bulk swaps
            each way, bytes verified, and the one-block all-layer task round trip, p50 and p99
Every figure is the median of several runs with its spread (min-max), in GB/s and as a share of the
ceiling's median measured in the same run. Exit status: 0, 1 if any byte check failed, 2 without a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np

from ..config import CacheSpec, Settings
from ..ops import cuda_usable

GEMM_N = 8192
RUNS = 5                 # timed runs behind each figure
WINDOWS = 3              # beside-GEMM measurement windows
WINDOW_S = 1.0           # seconds per window
LATENCY_TASKS = 300      # one-block round trips through the deployment
POISON = 0xA5            # destination rows before a method runs: a row it skipped keeps this byte


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


def summary(samples) -> dict:
    """Median and spread of one figure's runs."""
    values = sorted(float(v) for v in samples)
    return {"median": float(np.median(values)), "min": values[0], "max": values[-1], "runs": len(values)}


def rates(fn, nbytes: int, runs: int = RUNS) -> dict:
    """GB/s of fn() moving nbytes, over `runs` timed calls after one warm-up (kernel load, first touch)."""
    fn()
    samples = []
    for _ in range(runs):
        began = time.perf_counter()
        fn()
        samples.append(nbytes / (time.perf_counter() - began) / 1e9)
    return summary(samples)


def duplex_rates(out_fn, in_fn, nbytes: int, runs: int = RUNS) -> dict:
    """GB/s of both directions together: out_fn and in_fn started at once on two threads."""
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
    return rates(once, 2 * nbytes, runs)


def beside_gemm(gemm, round_trip, nbytes: int) -> dict:
    """Swap GB/s and GEMM TFLOP/s over windows in which round trips (out, then in) and the GEMM process
    both run; the GEMM is paused outside them, so it disturbs no other figure."""
    swap, flops = [], []
    gemm.run()
    try:
        for _ in range(WINDOWS):
            start, moved, began = gemm.mark(), 0, time.perf_counter()
            while time.perf_counter() - began < WINDOW_S:
                round_trip()
                moved += 2 * nbytes
            swap.append(moved / (time.perf_counter() - began) / 1e9)
            flops.append(gemm.tflops(start, gemm.mark()))
    finally:
        gemm.pause()
    return {"swap": summary(swap), "gemm": summary(flops)}


def gemm_alone(gemm) -> dict:
    gemm.run()
    try:
        samples = []
        for _ in range(WINDOWS):
            start = gemm.mark()
            time.sleep(WINDOW_S)
            samples.append(gemm.tflops(start, gemm.mark()))
    finally:
        gemm.pause()
    return summary(samples)


def fill_random(tensors: dict, framework: str, seed: int):
    """Random bytes in every tensor, generated on the device (gigabytes: NumPy would take minutes)."""
    if framework == "torch":
        import torch

        generator = torch.Generator(device=next(iter(tensors.values())).device).manual_seed(seed)
        for t in tensors.values():
            t.view(torch.uint8).random_(0, 256, generator=generator)
        torch.cuda.synchronize()
    else:
        import cupy

        cupy.random.seed(seed)
        for t in tensors.values():
            rows = t.view(cupy.uint8)
            rows[...] = cupy.random.randint(0, 256, rows.shape, dtype=cupy.uint8)
        cupy.cuda.runtime.deviceSynchronize()


class Verifier:
    """Byte checks of swaps between a rank's tensors (DeviceTensors) and its CPU tier rows: poison the
    destination rows, let the method run, then compare every (tensor, block) row with its source."""

    def __init__(self, view, tier_rows: np.ndarray):
        self.view, self.tier = view, tier_rows

    def poison_tier(self, cpu_ids):
        self.tier[cpu_ids] = POISON

    def poison_device(self, gpu_ids):
        from ..ops import cuda_kernels as ck

        ck.set_device(self.view.device_id)
        for info, ptr in zip(self.view.infos, self.view.pointers):
            for g in np.asarray(gpu_ids).tolist():
                if g < info.num_blocks:
                    ck.cuda_check(ck.runtime.cudaMemset(ptr + g * info.block_bytes, POISON, info.block_bytes),
                                  "cudaMemset")
        ck.cuda_check(ck.runtime.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def mismatches(self, gpu_ids, cpu_ids) -> list[str]:
        """Tensors whose rows at gpu_ids differ from the tier's rows at cpu_ids (empty: every byte agrees)."""
        gpu_ids, cpu_ids = np.asarray(gpu_ids), np.asarray(cpu_ids)
        bad = []
        for index, info in enumerate(self.view.infos):
            keep = gpu_ids < info.num_blocks
            device = self.view.read(index, gpu_ids[keep])
            host = self.tier[cpu_ids[keep], info.cpu_offset:info.cpu_offset + info.block_bytes]
            if not np.array_equal(device, host):
                bad.append(info.name)
        return bad


class Rig:
    """One block size's cache (framework tensors, random), pinned CPU tier (random) and task ids."""

    def __init__(self, spec: CacheSpec, device_id: int, framework: str, blocks: int, seed: int = 0):
        from ..ipc.naming import new_suffix, swap_space_name
        from ..ipc.shm import SharedSegment
        from ..ops.cuda import CudaOps

        self.spec, self.device_id = spec, device_id
        ops = CudaOps()
        self.local = ops.allocate(spec, 0, device_id, framework, "bench", 0)
        fill_random(self.local.tensors, framework, seed)
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
        self.swap.rows[...] = np.frombuffer(rng.bytes(self.swap.rows.nbytes), np.uint8).reshape(self.swap.rows.shape)
        gpu = rng.permutation(spec.num_gpu_blocks)
        cpu = rng.permutation(spec.num_cpu_blocks)
        self.out_ids = (gpu[:blocks], cpu[:blocks])              # swap-out: gpu -> cpu
        self.in_ids = (gpu[blocks:2 * blocks], cpu[blocks:])     # swap-in, disjoint from swap-out
        self.nbytes = blocks * spec.cpu_block_bytes
        self.verifier = Verifier(self.view, self.swap.rows)

    def poison(self):
        self.verifier.poison_tier(self.out_ids[1])
        self.verifier.poison_device(self.in_ids[0])

    def check(self) -> dict:
        """Tensors with a wrong byte, per direction, after the swaps since poison()."""
        return {"out": self.verifier.mismatches(*self.out_ids), "in": self.verifier.mismatches(*self.in_ids)}

    def close(self):
        self.swap.close()            # closes the segment, which unlinks it (we created it)
        self.view.close()
        self.local.release()


class BulkCopy:
    """The ceiling: one cudaMemcpyAsync of the swap's bytes between device memory and a cudaHostAlloc
    buffer (as swapbench.cu measures it), with a buffer and a stream per direction, as the copiers have."""

    def __init__(self, rig: Rig):
        from ..ops.cuda_kernels import DeviceBuffer, HostBuffer, Lane, set_device

        set_device(rig.device_id)
        self.rig = rig
        self.device = {True: DeviceBuffer(rig.nbytes), False: DeviceBuffer(rig.nbytes)}    # keyed by "to host"
        self.host = {True: HostBuffer(rig.nbytes), False: HostBuffer(rig.nbytes)}
        self.lanes = {True: Lane(), False: Lane()}

    def _copy(self, to_host: bool):
        from ..ops.cuda_kernels import memcpy_async, set_device

        set_device(self.rig.device_id)
        host, device = self.host[to_host].ptr, self.device[to_host].ptr
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
        for buf in [*self.device.values(), *self.host.values()]:
            buf.close()


def bench_block_size(args, block_kib: int, framework: str, gemm) -> dict:
    spec = bench_spec(block_kib, args.layers, args.blocks)
    rig = Rig(spec, args.device_id, framework, args.blocks)
    result = {"block_kib": block_kib, "tensors": len(spec.tensors()), "swap_bytes": rig.nbytes,
              "pin_seconds": rig.swap.pin_seconds, "pinned_bytes": spec.cpu_cache_bytes, "methods": {}}
    try:
        bulk = BulkCopy(rig)
        try:
            result["ceiling"] = {"d2h": rates(bulk.out, rig.nbytes), "h2d": rates(bulk.in_, rig.nbytes),
                                 "duplex": duplex_rates(bulk.out, bulk.in_, rig.nbytes)}
            if gemm:
                result["gemm_alone_tflops"] = gemm_alone(gemm)
                result["ceiling"]["beside_gemm"] = beside_gemm(gemm, lambda: (bulk.out(), bulk.in_()), rig.nbytes)
        finally:
            bulk.close()
        for method in args.methods:
            result["methods"][method] = bench_method(method, rig, gemm)
    finally:
        rig.close()
    if args.e2e:        # after the rig is gone: the deployment allocates its own cache and CPU tier
        try:
            result["e2e"] = e2e(spec, args.device_id, framework, rig.out_ids, rig.in_ids)
        except Exception as exc:            # report it, keep the other figures
            result["e2e"] = {"skipped": f"failed: {type(exc).__name__}: {exc}"}
    return result


def bench_method(method: str, rig: Rig, gemm) -> dict:
    from ..ops.cuda_copiers import make_copier

    try:
        copier = make_copier(method, rig.view, rig.swap, rig.spec)
    except Exception as exc:                # e.g. cudaMemcpyBatchAsync missing on an old driver
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    out = lambda: copier.swap_out(*rig.out_ids)
    back = lambda: copier.swap_in(*rig.in_ids)
    try:
        rig.poison()
        figures = {"d2h": rates(out, rig.nbytes), "h2d": rates(back, rig.nbytes),
                   "duplex": duplex_rates(out, back, rig.nbytes)}
        if gemm:
            figures["beside_gemm"] = beside_gemm(gemm, lambda: (out(), back()), rig.nbytes)
        figures["wrong_tensors"] = rig.check()
        return figures
    except Exception as exc:                # one failing method must not hide the others' figures
        return {"skipped": f"failed: {type(exc).__name__}: {exc}"}
    finally:
        copier.close()


def e2e(spec: CacheSpec, device_id: int, framework: str, out_ids, in_ids) -> dict:
    """A SwapBackend deployment (worker in this process, transfer manager in its own): bulk swaps each way
    with every byte checked, then the one-block all-layer task round trip."""
    from .. import SwapBackend
    from ..worker import CacheWorker

    nbytes = len(out_ids[0]) * spec.cpu_block_bytes
    began = time.perf_counter()
    with SwapBackend(spec, tp_size=1, device="cuda", device_ids=[device_id]) as backend:
        worker = CacheWorker(spec, rank=0, tp_size=1, device="cuda", suffix=backend.suffix, framework=framework,
                             device_id=device_id).start()
        try:
            backend.wait_ready(timeout=300)
            ready_s = time.perf_counter() - began     # transfer manager spawned, cache attached, CPU tier pinned
            fill_random(worker._cache.tensors, framework, seed=1)   # finished: the writer's step is done
            check = Verifier(worker._cache.view(), backend.cpu_tier(0))
            check.poison_tier(out_ids[1])
            check.poison_device(in_ids[0])

            def timed(swap, ids):
                return rates(lambda: swap(*ids).result(timeout=120), nbytes)
            figures = {"ready_s": ready_s, "d2h": timed(backend.swap_out, out_ids), "h2d": timed(backend.swap_in, in_ids)}
            figures["wrong_tensors"] = {"out": check.mismatches(*out_ids), "in": check.mismatches(*in_ids)}
            figures["one_block_us"] = one_block_latency(backend, check, spec)
        finally:
            worker.close()
    return figures


def one_block_latency(backend, check: Verifier, spec: CacheSpec) -> dict:
    """p50/p99 in µs of a one-block task over every layer, each direction, submission to result."""
    rng = np.random.default_rng(2)
    times, runs = {"out": [], "in": []}, {"out": [], "in": []}
    for _ in range(LATENCY_TASKS):
        gpu, cpu = int(rng.integers(spec.num_gpu_blocks)), int(rng.integers(spec.num_cpu_blocks))
        for kind, swap in (("out", backend.swap_out), ("in", backend.swap_in)):
            began = time.perf_counter()
            handle = swap([gpu], [cpu]).result(timeout=30)
            times[kind].append((time.perf_counter() - began) * 1e6)
            runs[kind].append(handle.run_seconds * 1e6)
    wrong = check.mismatches([gpu], [cpu])
    return {kind: {"p50": float(np.percentile(t, 50)), "p99": float(np.percentile(t, 99)), "tasks": len(t),
                   "run_p50": float(np.percentile(runs[kind], 50))}
            for kind, t in times.items()} | {"wrong_tensors": wrong}


# -- report ----------------------------------------------------------------------------------------
def _cell(fig, ceiling) -> str:
    """'median share (min-max)' of a GB/s figure against the ceiling's median."""
    if not fig:
        return f"{'-':>22s}"
    return f"{fig['median']:6.1f} {fig['median'] / ceiling['median']:4.0%} ({fig['min']:.1f}-{fig['max']:.1f})"


def failures(results: list) -> list[str]:
    """Every byte check that failed, as 'block size / method / direction: tensors'."""
    bad = []
    for r in results:
        places = [(name, fig) for name, fig in r["methods"].items()] + [("e2e", r.get("e2e", {})),
                                                                         ("e2e one block", r.get("e2e", {}).get("one_block_us", {}))]
        for name, fig in places:
            wrong = fig.get("wrong_tensors", {})
            for direction, tensors in (wrong.items() if isinstance(wrong, dict) else [("both", wrong)]):
                if tensors:
                    bad.append(f"{r['block_kib']} KiB / {name} / {direction}: {', '.join(tensors[:4])}")
    return bad


def print_report(device: str, results: list):
    print(f"device: {device}; every figure: median, share of the ceiling's median, (min-max) over {RUNS} runs")
    for r in results:
        ceil = r["ceiling"]
        print(f"\nblock rows {r['block_kib']} KiB x {r['tensors']} tensors: "
              f"{r['swap_bytes'] / 2**20:.0f} MiB per swap; "
              f"pinned {r['pinned_bytes'] / 2**30:.1f} GiB in {r['pin_seconds']:.2f} s")
        print(f"  {'GB/s':24s} {'D2H':>22s} {'H2D':>22s} {'duplex':>22s}  bytes")
        rows = [("ceiling: bulk memcpy", ceil)] + list(r["methods"].items())
        if "e2e" in r:
            rows.append(("e2e SwapBackend", r["e2e"]))
        for name, fig in rows:
            if "skipped" in fig:
                print(f"  {name:24s} skipped ({fig['skipped']})")
                continue
            wrong = fig.get("wrong_tensors")
            verdict = "" if wrong is None else ("verified" if not any(wrong.values()) else "WRONG")
            cells = [_cell(fig.get(k), ceil[k]) for k in ("d2h", "h2d", "duplex")]
            print(f"  {name:24s} " + " ".join(cells) + f"  {verdict}")
        if "gemm_alone_tflops" in r:
            alone = r["gemm_alone_tflops"]
            print(f"  bf16 GEMM {GEMM_N}^3 in another process: alone {alone['median']:.0f} TFLOP/s "
                  f"({alone['min']:.0f}-{alone['max']:.0f}); beside round trips (medians):")
            one_way = ceil["beside_gemm"]["swap"] if "beside_gemm" in ceil else None
            for name, fig in rows:
                if "beside_gemm" in fig:
                    swap, flops = fig["beside_gemm"]["swap"], fig["beside_gemm"]["gemm"]
                    share = f" {swap['median'] / one_way['median']:4.0%} of bulk" if one_way else ""
                    print(f"    {name:22s} swap {swap['median']:6.1f} GB/s ({swap['min']:.1f}-{swap['max']:.1f}){share}"
                          f" | GEMM {flops['median']:4.0f} TFLOP/s {flops['median'] / alone['median']:4.0%}")
        if "ready_s" in r.get("e2e", {}):
            print(f"  deployment ready (transfer manager spawned, cache attached, tier pinned) in {r['e2e']['ready_s']:.2f} s")
        one = r.get("e2e", {}).get("one_block_us")
        if one:
            print(f"  one-block all-layer task through SwapBackend ({one['out']['tasks']} each way): "
                  f"out p50 {one['out']['p50']:.0f} us p99 {one['out']['p99']:.0f} us, "
                  f"in p50 {one['in']['p50']:.0f} us p99 {one['in']['p99']:.0f} us; of which the transfer manager's "
                  f"own run p50 {one['out']['run_p50']:.0f} / {one['in']['run_p50']:.0f} us")
    bad = failures(results)
    print("\nbyte checks: " + ("every swap verified" if not bad else "FAILED: " + "; ".join(bad)))


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
    try:
        Settings.from_env()         # a bad FASTCACHE_* value: one line, not a traceback from a copier
    except ValueError as exc:
        print(f"fastcache.tools.bench: {exc}", file=sys.stderr)
        return 2
    if not cuda_usable():
        print("bench: no usable CUDA GPU (cuda-python missing or no device); nothing to measure", file=sys.stderr)
        return 2
    from ..config import COPY_METHODS as METHODS

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
    gemm = None
    if args.gemm:
        from .gemm_load import GemmLoad
        gemm = GemmLoad("torch", GEMM_N, args.device_id)
    try:
        results = [bench_block_size(args, kib, framework, gemm) for kib in args.block_kib]
    finally:
        if gemm is not None:
            gemm.close()
    print_report(device, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "framework": framework, "layers": args.layers, "blocks": args.blocks,
                       "runs": RUNS, "results": results}, f, indent=2)
    return 1 if failures(results) else 0


if __name__ == "__main__":
    sys.exit(main())
