"""The least a prefix-cache index can do per store on this machine, vectorised, against TieredCache's own store.

A throwaway design, not fastcache's: one dict from hash to slot, NumPy arrays for each slot's hash, state,
pins and last touch, and a ring of touches that eviction scans in one vectorised pass (lazy deletion: a
touch that is not a slot's last one is skipped). A store of new hashes into a full index finds the new ones,
evicts as many least recently used slots, and inserts. No validation, no handle, no lock, no L3.

Three calls are timed in turn: this floor, TieredCache.store over a stub backend whose swaps cost nothing
(the cache's own work), and the Reference of tier_bench (an OrderedDict churn, no fastcache code). Each call
is timed two ways: right after an untimed call of its own (its code and data warm), and right after a real
sim swap of a tp=2 deployment completes (the state a store meets in an engine). What the floor saves against
the cache right after a swap bounds what any index written in Python could save there.

    python benchmarks/index_floor.py [--blocks 64] [--samples 300]
"""
import argparse
import statistics
import sys
import time
from collections import deque
from itertools import count, filterfalse, islice

import numpy as np

from tier_bench import Reference, StubBackend, close, deployment
from fastcache import CacheSpec, TieredCache

READY = 1


class FloorIndex:
    def __init__(self, capacity, touches):
        self.slot_of = {}
        self.free = list(range(capacity))
        self.hash_of = np.zeros(capacity, np.uint64)
        self.state = np.zeros(capacity, np.int8)
        self.pins = np.zeros(capacity, np.int32)
        self.last = np.full(capacity, -1, np.int64)     # the ring position of each slot's last touch
        self.ring = np.zeros(touches, np.int64)         # slots in the order they were touched
        self.head = self.tail = 0

    def store(self, hashes):
        new = list(filterfalse(self.slot_of.__contains__, hashes))
        n = len(new)
        if len(self.free) >= n:
            slots = np.array(self.free[len(self.free) - n:])
            del self.free[len(self.free) - n:]
        else:
            window = np.arange(self.head, self.head + 2 * n)   # enough here: no touch goes stale, nothing is pinned
            ring = self.ring[window]
            usable = (self.last[ring] == window) & (self.state[ring] == READY) & (self.pins[ring] == 0)
            picked = np.flatnonzero(usable)[:n]
            slots = ring[picked]
            self.head += int(picked[-1]) + 1
            deque(map(self.slot_of.__delitem__, self.hash_of[slots].tolist()), maxlen=0)
        self.hash_of[slots] = new
        self.state[slots] = READY
        self.slot_of.update(zip(new, slots.tolist()))
        touched = slots[::-1]                                    # the first hash ends most recent
        self.ring[self.tail:self.tail + n] = touched
        self.last[touched] = np.arange(self.tail, self.tail + n)
        self.tail += n


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    size = args.blocks
    warmup = 8
    floor = FloorIndex(4 * size, touches=(warmup + 3 * args.samples) * size)
    stub = StubBackend(size)
    cache = TieredCache(stub, "index-floor")                     # 4 * size blocks: full after 4 stores
    gpu = list(range(size))
    calls = {"floor index": floor.store, "TieredCache.store": lambda p: cache.store(p, gpu),
             "reference": lambda p, churn=Reference(size): churn()}       # it makes its own keys
    streams = {name: count((k + 1) << 40) for k, name in enumerate(calls)}   # each call's hashes are new to it
    for name, call in calls.items():
        for _ in range(warmup):
            call(list(islice(streams[name], size)))
    spec = CacheSpec(num_layers=8, num_gpu_blocks=512, num_cpu_blocks=512, block_size=16, num_kv_heads=4,
                     head_dim=64)                                # tier_bench's geometry
    backend, workers = deployment(spec, 2)
    try:
        raw = backend.allocate_cpu_blocks(size)
        times = {(name, way): [] for name in calls for way in ("after its own call", "after a swap")}
        for _ in range(args.samples):
            for name, call in calls.items():
                for way in ("after its own call", "after a swap"):
                    prompt = list(islice(streams[name], size))
                    if way == "after a swap":
                        backend.swap_out(gpu, raw).result(30)
                    else:
                        call(list(islice(streams[name], size)))     # the call's own code and data just ran
                    t0 = time.perf_counter()
                    call(prompt)
                    times[name, way].append(time.perf_counter() - t0)
        backend.free_cpu_blocks(raw)
    finally:
        close(backend, workers)
    stored = (warmup + 3 * args.samples) * size           # by the floor: its last 4 * size hashes must be held
    if set(floor.slot_of) != set(range((1 << 40) + stored - 4 * size, (1 << 40) + stored)):
        raise SystemExit("the floor index did not keep the most recent hashes: its figures mean nothing")
    print(f"{size} new hashes into a full index of {4 * size}, medians of {args.samples}:")
    for name in calls:
        print(f"  {name:18} " + ", ".join(f"{statistics.median(times[name, way]) * 1e6:6.1f} us {way}"
                                         for way in ("after its own call", "after a swap")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
