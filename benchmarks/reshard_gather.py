"""The reshard's head-slice copies on one GPU: the gather path against the 2-D copies and one D2D memcpy.

    python benchmarks/reshard_gather.py [--slice-bytes 1024 4096] [--slices 2] [--rows 131072] [--live 0.5]
                                        [--chunk-rows 65536] [--repeat 3] [--device 0] [--json PATH]

For each slice size (fastcache.ops.cuda_reshard.gather_rate): `rows` live rows, at random among rows/live,
each of `slices` head slices, gathered slice by slice (a plan Copy per slice and chunk of chunk-rows rows)
into consecutive rows of a second buffer on the same GPU. Rates are GB/s of the gathered bytes:
- gather: new copies each time, so every run table is built and uploaded (as in a reshard), wall time;
- gather warm: the same copies again, the tables kept (launches only);
- 2d: one cudaMemcpy2DAsync per run of consecutive rows (FASTCACHE_RESHARD_COPY=2d);
each against one cudaMemcpyAsync device to device of the same bytes (the ratio; the reshard's goal is 0.8).
The gathered bytes are checked against NumPy; the exit status is 1 if they differ. JSON goes to --json, or
to $OUT/reshard_gather.json where OUT is set.
"""
import argparse
import json
import os
import sys

from fastcache.ops.cuda_reshard import gather_rate


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slice-bytes", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--slices", type=int, default=2, help="head slices a source row holds (copies a chunk)")
    p.add_argument("--rows", type=int, default=131072, help="live rows gathered")
    p.add_argument("--live", type=float, default=0.5, help="share of the source's rows that are live")
    p.add_argument("--chunk-rows", type=int, default=65536, help="rows a chunk gathers (staging / row)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results, ok = [], True
    for size in args.slice_bytes:
        r = gather_rate(size, args.slices, args.rows, args.live, args.chunk_rows, args.device, args.repeat)
        results.append(r)
        ok &= r["bit_for_bit"]
        print(f"{size}-byte slices, {r['bytes'] / 2**20:.0f} MiB: gather {r['gather_gbps']:.1f} GB/s "
              f"({r['gather_ratio']:.3f} of D2D {r['d2d_gbps']:.1f} GB/s), warm {r['gather_warm_gbps']:.1f} GB/s "
              f"({r['gather_warm_ratio']:.3f}), 2d {r['2d_gbps']:.1f} GB/s ({r['2d_ratio']:.3f}); "
              f"gather/2d {r['gather_gbps'] / r['2d_gbps']:.1f}x; bytes {'ok' if r['bit_for_bit'] else 'DIFFER'}",
              flush=True)
    path = args.json or (os.path.join(os.environ["OUT"], "reshard_gather.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
