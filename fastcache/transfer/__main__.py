"""python -m fastcache.transfer: run one cache transfer manager (normally spawned by SwapBackend).

Argument names follow FastDeploy's cache_transfer_manager where they mean the same.
"""
import argparse
import logging
import signal
import sys

from ..config import CacheSpec, Settings
from ..ipc.queue import read_token
from ..store import parse_store_url
from ..weight_spec import WeightSpec
from .manager import TransferManager


def parse_shape(text):
    try:
        shape = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if len(shape) != 4:
        raise argparse.ArgumentTypeError("expected num_blocks,num_kv_heads,block_size,head_dim")
    return shape


def build_parser():
    p = argparse.ArgumentParser(prog="python -m fastcache.transfer", description=__doc__)
    p.add_argument("--rank", type=int, required=True, help="tensor-parallel rank served")
    p.add_argument("--mp_num", type=int, required=True, help="tensor-parallel size")
    p.add_argument("--device_id", type=int, default=0)
    p.add_argument("--ipc_suffix", required=True, help="the deployment's suffix (SwapBackend.suffix)")
    p.add_argument("--socket_dir", required=True, help="the deployment's task-queue directory")
    p.add_argument("--incarnation", type=int, default=0,
                   help="which process of this rank it is (0 first, one more per restart): names its task endpoint")
    p.add_argument("--engine_pid", type=int, required=True, help="exit when this process is gone")
    p.add_argument("--doorbell_fd", type=int, default=None,
                   help="the engine's eventfd (inherited), rung after each report in the completion ring")
    p.add_argument("--task_doorbell_fd", type=int, default=None,
                   help="this process's task-ring doorbell (an inherited eventfd): without it, every task comes "
                        "over the task pipe")
    p.add_argument("--device", default="sim", choices=("sim", "cuda", "auto"))
    p.add_argument("--spec", help="CacheSpec as JSON (instead of the FastDeploy-style geometry below)")
    p.add_argument("--num_layers", type=int)
    p.add_argument("--num_cpu_blocks", type=int)
    p.add_argument("--cache_dtype", default="bfloat16")
    p.add_argument("--key_cache_shape", type=parse_shape, help="num_blocks,num_kv_heads,block_size,head_dim")
    p.add_argument("--value_cache_shape", type=parse_shape, help="same as the key's, or omit for K-only")
    p.add_argument("--num_extra_layers", type=int, default=0)
    p.add_argument("--num_extra_layer_gpu_blocks", type=int, default=None)
    p.add_argument("--store", default=None, help="L3 store URL: mooncake://HOST:PORT or file:///DIR")
    p.add_argument("--weights", default=None, help="the weight group's WeightSpec as JSON (placed; docs/design.md §11)")
    return p


def spec_from_args(args) -> CacheSpec:
    if args.spec:
        return CacheSpec.from_json(args.spec)
    if args.num_layers is None or args.num_cpu_blocks is None or args.key_cache_shape is None:
        raise ValueError("give --spec, or --num_layers, --num_cpu_blocks and --key_cache_shape")
    blocks, heads, block_size, head_dim = args.key_cache_shape
    if args.value_cache_shape not in (None, args.key_cache_shape):
        raise ValueError("--value_cache_shape must equal --key_cache_shape")
    return CacheSpec(num_layers=args.num_layers, num_gpu_blocks=blocks, num_cpu_blocks=args.num_cpu_blocks,
                     block_size=block_size, num_kv_heads=heads, head_dim=head_dim, cache_dtype=args.cache_dtype,
                     has_value=args.value_cache_shape is not None, num_extra_layers=args.num_extra_layers,
                     num_extra_gpu_blocks=args.num_extra_layer_gpu_blocks)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [transfer rank{args.rank}] %(levelname)s %(message)s")
    try:
        spec = spec_from_args(args)
        settings = Settings.from_env()
        if args.store:
            parse_store_url(args.store)
        weights = WeightSpec.from_json(args.weights) if args.weights else None
        token = read_token(sys.stdin.buffer)
    except ValueError as exc:
        print(f"fastcache.transfer: {exc}", file=sys.stderr)
        return 2
    manager = TransferManager(spec, args.rank, args.mp_num, args.ipc_suffix, args.socket_dir, args.incarnation,
                              args.engine_pid, device=args.device, device_id=args.device_id, settings=settings, store=args.store,
                              token=token, weights=weights, doorbell=args.doorbell_fd,
                              task_doorbell=args.task_doorbell_fd)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return manager.run()
    finally:
        manager.close()


if __name__ == "__main__":
    sys.exit(main())
