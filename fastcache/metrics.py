"""Counters of the swap backend and the tiered cache, and their Prometheus export (docs/design.md §8).

The counters are plain integers under a lock, updated where the work happens (a task's completion,
a cache call). prometheus-client is imported only by `serve`, which reads the counters at scrape time:
the engine's hot paths never touch a Prometheus object, and a deployment that never asks for metrics
never imports it.

    server = fastcache.metrics.serve(9400, backend=backend, caches=[cache])   # http://127.0.0.1:9400/metrics
    ...
    server.close()
"""
from __future__ import annotations

import bisect
import collections
import threading

# Upper bounds (seconds) of the latency histograms: a one-block task takes ~0.5 ms on sim, a bulk one
# tens of ms, a GPU swap of a few GiB about a second.
LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
                   500e-3, 1.0, 2.5, 5.0, 10.0)
DIRECTIONS = {"SWAP_TO_CPU": "to_cpu", "SWAP_TO_GPU": "to_gpu", "CPU_TO_STORE": "to_store",
              "STORE_TO_CPU": "from_store"}


class Histogram:
    """Cumulative-bucket latency histogram (Prometheus semantics); not locked: its owner locks."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)     # the last one is +Inf
        self.sum = 0.0

    def observe(self, seconds: float):
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds

    def snapshot(self) -> dict:
        cumulative, total = [], 0
        for bound, count in zip(self.buckets + (float("inf"),), self.counts):
            total += count
            cumulative.append((bound, total))
        return {"buckets": cumulative, "count": total, "sum": self.sum}


class SwapCounters:
    """What a SwapBackend has moved: tasks by direction and outcome, bytes, latency (submit -> every rank
    done). Fed by each task handle's completion callback, which only queues the handle (one append on the
    engine's I/O thread per task): the queue is counted in batches of FOLD_EVERY, and at each snapshot."""

    FOLD_EVERY = 256

    def __init__(self):
        self._lock = threading.Lock()
        self._tasks = {(d, o): 0 for d in DIRECTIONS.values() for o in ("done", "failed")}
        self._bytes = {d: 0 for d in DIRECTIONS.values()}
        self._latency = {d: Histogram() for d in DIRECTIONS.values()}
        self._queue = collections.deque()       # done handles not counted yet (appends and pops are atomic)

    def record(self, handle):
        queue = self._queue
        queue.append(handle)
        if len(queue) >= self.FOLD_EVERY:
            self._fold()

    def _fold(self):
        queue = self._queue
        with self._lock:
            while True:
                try:
                    handle = queue.popleft()
                except IndexError:
                    return
                direction = DIRECTIONS.get(handle.kind, handle.kind)
                if handle.error is not None:
                    self._tasks[direction, "failed"] += 1
                else:
                    self._tasks[direction, "done"] += 1
                    self._bytes[direction] += handle.nbytes
                    self._latency[direction].observe(handle.elapsed)

    def snapshot(self) -> dict:
        self._fold()
        with self._lock:
            return {"tasks": dict(self._tasks), "bytes": dict(self._bytes),
                    "latency": {d: h.snapshot() for d, h in self._latency.items()}}


class MetricsServer:
    """The HTTP endpoint returned by `serve`; `close()` stops it and frees the port."""

    def __init__(self, server, thread):
        self._server, self._thread = server, thread
        self.host, self.port = server.server_address[:2]
        self.url = f"http://{self.host}:{self.port}/metrics"

    def close(self):
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve(port: int, backend=None, caches=()) -> MetricsServer:
    """Export `backend.counters` and each TieredCache's stats() on http://127.0.0.1:PORT/metrics
    (port 0: any free port, see .port). Bound to the loopback interface only: the counters are for a
    local scraper or agent, not for the network. Opt-in: nothing listens unless this is called."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be an int in 0..65535, got {port!r}")
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(backend, list(caches)))
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return MetricsServer(server, thread)


class _Collector:
    """Reads the counters at scrape time and yields them as Prometheus metric families."""

    def __init__(self, backend, caches):
        self.backend, self.caches = backend, caches

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self.backend is not None:
            yield from _swap_families(self.backend.counters.snapshot())
        if not self.caches:
            return
        stats = [cache.stats() for cache in self.caches]
        labels = ["cache"]
        families = {name: CounterMetricFamily(f"fastcache_tier_{name}", help_, labels=labels)
                    for name, help_ in TIER_COUNTERS.items()}
        gauges = {name: GaugeMetricFamily(f"fastcache_tier_{name}", help_, labels=labels)
                  for name, help_ in TIER_GAUGES.items()}
        latency = _histogram_family("fastcache_tier_transfer_seconds",
                                    "store (to_cpu) and load (to_gpu) latency, submit to every rank done",
                                    ["cache", "direction"])
        for index, s in enumerate(stats):
            name = str(index)
            for key, family in families.items():
                family.add_metric([name], s[key])
            for key, family in gauges.items():
                family.add_metric([name], s[key])
            for direction, hist in (("to_cpu", s["store_latency"]), ("to_gpu", s["load_latency"])):
                _add_histogram(latency, [name, direction], hist)
        yield from families.values()
        yield from gauges.values()
        yield latency


TIER_COUNTERS = {
    "lookups": "lookup calls",
    "lookup_blocks": "hashes asked about by lookup",
    "hits": "leading hashes lookup found in the CPU tier",
    "misses": "hashes lookup did not find (after the leading hits)",
    "loads": "load calls that moved blocks",
    "loaded_blocks": "blocks loaded from the CPU tier to the GPU",
    "stored_blocks": "blocks stored from the GPU to the CPU tier",
    "store_skipped": "hashes a store skipped because the CPU tier already held them",
    "store_full": "hashes a store could not place (every CPU block in use by a transfer)",
    "evicted": "entries evicted (chosen by the cache's eviction policy)",
    "failed_loads": "loads that failed (their entries were dropped)",
    "failed_stores": "stores that failed (their entries were dropped)",
    "loaded_bytes": "bytes loaded, all ranks",
    "stored_bytes": "bytes stored, all ranks",
    # the store below the CPU tier (L3), where the backend has one
    "l3_hits": "leading hashes lookup found only in the store",
    "l3_loaded_blocks": "blocks fetched from the store by loads (then swapped in)",
    "l3_loaded_bytes": "bytes fetched from the store, all ranks",
    "l3_written_blocks": "blocks put into the store on every rank (write-back of evicted entries, or write-through)",
    "l3_written_bytes": "bytes put into the store, all ranks (puts a full store skipped not counted)",
    "l3_skipped_blocks": "blocks a full store (or a pool with no memory lent to it) did not take, on some rank",
    "l3_errors": "store failures (each sets the store aside for a while; the CPU tier keeps serving)",
}
TIER_GAUGES = {
    "entries": "hashes held and visible to lookup",
    "capacity": "CPU blocks reserved by the cache",
}


def _swap_families(snap):
    from prometheus_client.core import CounterMetricFamily

    tasks = CounterMetricFamily("fastcache_swap_tasks", "swap tasks completed, by direction and outcome",
                                labels=["direction", "outcome"])
    for (direction, outcome), n in snap["tasks"].items():
        tasks.add_metric([direction, outcome], n)
    moved = CounterMetricFamily("fastcache_swap_bytes", "bytes moved by completed swaps, all ranks",
                                labels=["direction"])
    for direction, n in snap["bytes"].items():
        moved.add_metric([direction], n)
    latency = _histogram_family("fastcache_swap_seconds", "swap latency, submit to every rank done",
                                ["direction"])
    for direction, hist in snap["latency"].items():
        _add_histogram(latency, [direction], hist)
    return [tasks, moved, latency]


def _histogram_family(name, help_, labels):
    from prometheus_client.core import HistogramMetricFamily
    return HistogramMetricFamily(name, help_, labels=labels)


def _add_histogram(family, labels, hist):
    buckets = [("+Inf" if bound == float("inf") else repr(bound), count) for bound, count in hist["buckets"]]
    family.add_metric(labels, buckets, hist["sum"])
