"""fastcache.metrics: the backend's and the tiered cache's counters, scraped over HTTP as Prometheus does."""
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastcache import TieredCache, TransferError, metrics
from fastcache.launch.verify import HashBytes

from conftest import deployment, small_spec


def scrape(server) -> dict:
    """{(sample name, sorted labels): value} of one scrape over HTTP."""
    with urllib.request.urlopen(server.url, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_counters_move_and_a_scrape_over_http_sees_them(monkeypatch):
    monkeypatch.setenv("FASTCACHE_FAIL_EVERY", "0:3")       # rank 0 fails its 3rd task
    spec = small_spec()
    with deployment(spec, tp=2) as (backend, workers):
        cache = TieredCache(backend, "ns", capacity=4)
        with metrics.serve(0, backend=backend, caches=[cache]) as server:
            assert server.host == "127.0.0.1" and server.port > 0
            before = scrape(server)
            assert before[("fastcache_swap_tasks_total", (("direction", "to_cpu"), ("outcome", "done")))] == 0
            assert before[("fastcache_tier_capacity", (("cache", "0"),))] == 4
            cpu = backend.allocate_cpu_blocks(2)
            backend.swap_out([0, 1], cpu).result(10)
            cache.store([1, 2, 3], [0, 1, 2]).result(10)
            with pytest.raises(TransferError):
                cache.load([1], [5]).result(10)               # rank 0's third task
            assert cache.lookup([2, 3, 9]) == 2
            after = scrape(server)
            direction = lambda d, o: ("fastcache_swap_tasks_total", (("direction", d), ("outcome", o)))
            assert after[direction("to_cpu", "done")] == 2 and after[direction("to_gpu", "failed")] == 1
            assert after[("fastcache_swap_bytes_total", (("direction", "to_cpu"),))] == \
                2 * (spec.task_bytes([0, 1]) + spec.task_bytes([0, 1, 2]))
            assert after[("fastcache_swap_seconds_count", (("direction", "to_cpu"),))] == 2
            assert after[("fastcache_swap_seconds_sum", (("direction", "to_cpu"),))] > 0
            assert after[("fastcache_swap_seconds_bucket", (("direction", "to_cpu"), ("le", "+Inf")))] == 2
            tier = lambda name: after[(f"fastcache_tier_{name}", (("cache", "0"),))]
            assert tier("stored_blocks_total") == 3 and tier("failed_loads_total") == 1
            assert tier("hits_total") == 2 and tier("misses_total") == 1 and tier("lookups_total") == 1
            assert tier("entries") == 2                        # the failed load dropped hash 1
            assert tier("stored_bytes_total") == 2 * spec.task_bytes([0, 1, 2])
            assert after[("fastcache_tier_transfer_seconds_count", (("cache", "0"), ("direction", "to_cpu")))] == 1
            backend.free_cpu_blocks(cpu)
        cache.close()
        # closed: nothing listens on the port any more
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", server.port))


def test_the_endpoint_listens_on_loopback_only():
    with metrics.serve(0) as server:
        addresses = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
        others = addresses - {"127.0.0.1", "127.0.1.1"}
        for address in others:       # the machine's own address must not answer
            with socket.socket() as s, pytest.raises(OSError):
                s.settimeout(2)
                s.connect((address, server.port))
        assert server.url.startswith("http://127.0.0.1:")
        assert scrape(server) == {}                           # nothing registered: an empty page


@pytest.mark.parametrize("port", [-1, 65536, "9400", 1.5, True])
def test_bad_port_is_a_value_error(port):
    with pytest.raises(ValueError, match="metrics port"):
        metrics.serve(port)


def test_histogram_buckets_are_cumulative():
    h = metrics.Histogram((1.0, 2.0))
    for seconds in (0.5, 1.0, 1.5, 3.0):
        h.observe(seconds)
    snap = h.snapshot()
    assert snap["buckets"] == [(1.0, 2), (2.0, 3), (float("inf"), 4)] and snap["count"] == 4
    assert snap["sum"] == pytest.approx(6.0)


def test_hash_bytes_differ_by_hash_and_rank_and_are_never_blank():
    data = HashBytes(small_spec())
    a, b = data.images([1, 2, 2**64 - 1], 0), data.images([1], 1)
    assert a.shape == (3, small_spec().cpu_block_bytes) and a.any(axis=1).all()
    assert (a[0] != a[1]).mean() > 0.9 and (a[0] != b[0]).mean() > 0.9 and (a[2] != a[0]).mean() > 0.9
    assert (data.images([1, 2], 0) == a[:2]).all()          # the same hash: the same bytes
