"""python -m fastcache.worker: a stand-alone GPU worker process holding one rank's cache.

The launcher uses it to give each rank its own process, as in a real deployment. It runs until
SIGTERM, or until its engine is gone.
"""
import argparse
import logging
import signal
import sys
import threading

from ..config import CacheSpec, Settings
from ..ipc.heartbeat import process_alive
from ..weight_spec import WeightSpec
from .cache_worker import CacheWorker


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastcache.worker", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--suffix", required=True, help="the deployment's suffix (SwapBackend.suffix)")
    p.add_argument("--spec", required=True, help="CacheSpec as JSON")
    p.add_argument("--engine-pid", type=int, required=True, help="exit when this process is gone")
    p.add_argument("--device", default="sim", choices=("sim", "cuda", "auto"))
    p.add_argument("--framework", default="numpy")
    p.add_argument("--device-id", type=int, default=None)
    p.add_argument("--weights", default=None, help="register the weight group: its WeightSpec as JSON "
                   "(SwapBackend.weight_layout, or resharding.weights for a rank a reshard adds)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [worker rank{args.rank}] %(levelname)s %(message)s")
    try:
        spec, settings = CacheSpec.from_json(args.spec), Settings.from_env()
        weights = WeightSpec.from_json(args.weights) if args.weights else None
    except ValueError as exc:
        print(f"fastcache.worker: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker = CacheWorker(spec, rank=args.rank, tp_size=args.tp, device=args.device, suffix=args.suffix,
                         framework=args.framework, device_id=args.device_id, settings=settings)
    worker.start()
    try:
        if weights is not None:
            worker.register_weights(weights)
        while not stop.wait(0.5):
            if not process_alive(args.engine_pid):
                logging.getLogger("fastcache.worker").error("rank %d: engine is gone; exiting", args.rank)
                break
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
