"""Stress runs of a few seconds each, every byte checked:
- engine threads over a TieredCache with a directory store below a small CPU tier, while transfer managers
  are restarted and the namespace changes; at the end every CPU block is accounted for and nothing is left
  pinned (this is the run that found the two races pinned down by tests in test_tiered_l3.py);
- engine threads doing raw swap rounds on their own blocks while transfer managers are restarted;
- engine threads storing and loading through a TieredCache and a store while the deployment reshards
  1 -> 2 -> 4 -> 2 -> 1 over and over (the run that found write-backs refused by a reshard setting the
  store aside);
- engine threads on two TieredCaches, one of which is closed and made anew every 0.3 s, beside raw
  preemption swaps: no wrong bytes, and every CPU block free at the end."""
from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pytest

from conftest import all_tensors, deployment, small_spec
from fastcache import TieredCache, TransferError
from fastcache.engine.tiered_l3 import BLOCK, PINS, READY, STATE
from test_reshard import InProcessWorkers
from test_tiered import Bytes

# A task that is never answered fails these runs (result(30) raises TimeoutError). One was, once, in CI;
# the likely cause, a task sent down the pipe of a restarted transfer manager before zmq had torn it down,
# is fixed and tested in test_faults.py::test_after_restart_rank_no_task_reaches_a_pipe_of_the_old_process.
THREADS, OWN = 6, 8         # engine threads, GPU blocks each owns
CPU_BLOCKS = 16             # a small CPU tier: loads and stores evict all the time
PROMPT = 6                  # blocks per request; chained hashes from a small space share prefixes


def random_prompt(rng):
    """Chained hashes from a small space, so that prompts share prefixes."""
    steps = [int(rng.integers(0, 12))] + [int(x) for x in rng.integers(0, 6, PROMPT - 1)]
    return [sum(steps[:i + 1]) * 1000 + i for i in range(PROMPT)]


def load_held(cache, prompt, gpu) -> int:
    """Look the prompt up and load its held blocks into gpu; how many were loaded (0: refused meanwhile)."""
    n = cache.lookup(prompt)
    if n:
        try:
            cache.load(prompt[:n], gpu[:n]).result(30)
        except (ValueError, TransferError):     # evicted since the lookup, no block, a restart
            return 0
    return n


def run_threads(engine, controller, period, seconds, stop, errors):
    """THREADS engine(t) threads, and controller(k) every `period` seconds, for `seconds`; none may hang."""
    def control():
        for k in range(1, 10**6):
            if stop.wait(period):
                return
            try:
                controller(k)
            except Exception as exc:
                errors.append(f"controller: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=engine, args=(t,)) for t in range(THREADS)] + [threading.Thread(target=control)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a thread hung"


def prefix_engine(caches, data, lock, stop, counts, errors):
    """engine(t) for run_threads: requests of random prompts to caches[t % len(caches)] (read per request:
    a controller may replace it); what the cache holds is loaded and checked (data.bad: mismatches, empty or
    per rank), the rest is written (data.write) and stored. `lock` guards the engine's own reads and writes
    of its blocks. A TransferError (a restart, a namespace change, a clear, a reshard or a close in the
    middle) is expected; anything else ends the thread as an error."""
    def engine(t):
        rng = np.random.default_rng(t)
        mine = list(range(t * OWN, t * OWN + PROMPT))
        while not stop.is_set():
            cache = caches[t % len(caches)]
            prompt = random_prompt(rng)
            try:
                n = load_held(cache, prompt, mine)
                if n:
                    with lock:
                        bad = data.bad(prompt[:n], mine[:n])
                    if any(bad):
                        errors.append(f"thread {t}: blocks {bad} of {prompt[:n]} hold wrong bytes")
                    counts["loaded"] += n
                with lock:
                    data.write(prompt[n:], mine[n:])
                cache.store(prompt, mine).result(30)
                counts["stored"] += 1
            except TransferError:
                counts["refused"] += 1
                time.sleep(0.005)
            except Exception as exc:
                errors.append(f"thread {t}: {type(exc).__name__}: {exc}")
                return
    return engine


def run(backend, workers, cache, seconds, restart_ranks, change_namespace):
    counts, errors = collections.Counter(), []
    stop = threading.Event()
    engine = prefix_engine([cache], Bytes(backend.spec, workers), threading.Lock(), stop, counts, errors)

    rng = np.random.default_rng(99)

    def chaos(k):
        if change_namespace and k % 3 == 0:
            cache.namespace = f"stress/{k}"
            counts["namespaces"] += 1
        elif restart_ranks:
            backend.restart_rank(int(rng.integers(0, backend.tp_size)))
            backend.wait_ready(timeout=30)
            counts["restarts"] += 1

    run_threads(engine, chaos, 0.8, seconds, stop, errors)
    return counts, errors


@pytest.mark.parametrize("write, restart_ranks", [("back", True), ("through", False)])
def test_engine_threads_over_a_small_cpu_tier_and_the_store_never_load_wrong_bytes(tmp_path, write, restart_ranks):
    spec = small_spec(num_gpu_blocks=THREADS * OWN, num_cpu_blocks=CPU_BLOCKS)
    with deployment(spec, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "stress/0", write=write)
        counts, errors = run(backend, workers, cache, 6.0, restart_ranks, change_namespace=True)
        assert errors == []
        stats = cache.stats()
        assert counts["loaded"] > 100 and stats["l3_loaded_blocks"] > 0 and counts["namespaces"] >= 1, (counts, stats)
        assert counts["restarts"] >= 1 or not restart_ranks
        time.sleep(0.5)             # write-backs and write-throughs still in flight finish
        blocks = [e[BLOCK] for e in cache._index.values()]
        assert sorted(blocks + cache._free) == list(range(CPU_BLOCKS))
        assert all(e[STATE] == READY and not e[PINS] for e in cache._index.values())
        cache.close()


def test_engine_threads_across_clears_restores_and_restarts_never_load_bytes_of_old_weights(tmp_path):
    """A controller clears and restores the cache around a weight update (every hash's bytes change),
    restarts a rank while the cache is cleared and another while it serves, and sets a new namespace;
    engine threads store and load through a store meanwhile. Every load that no clear overlapped is
    checked on every rank against the bytes of the current weights."""
    spec = small_spec(num_gpu_blocks=THREADS * OWN, num_cpu_blocks=CPU_BLOCKS)
    with deployment(spec, tp=2, store=f"file://{tmp_path}/l3") as (backend, workers):
        cache = TieredCache(backend, "weights/0")
        weights = {"epoch": 0, "bytes": Bytes(spec, workers, seed=0)}
        lock = threading.Lock()         # the weights' epoch and bytes
        counts, errors = collections.Counter(), []
        stop = threading.Event()

        def engine(t):
            rng = np.random.default_rng(t)
            mine = list(range(t * OWN, t * OWN + PROMPT))
            while not stop.is_set():
                prompt = random_prompt(rng)
                try:
                    with lock:
                        epoch = weights["epoch"]
                    n = load_held(cache, prompt, mine)
                    if n:
                        with lock:
                            if weights["epoch"] != epoch:   # a clear overlapped: the check proves nothing
                                continue
                            bad = weights["bytes"].bad(prompt[:n], mine[:n])
                        if any(bad):
                            errors.append(f"thread {t}: blocks {bad} of {prompt[:n]} hold wrong bytes")
                        counts["loaded"] += n
                    with lock:
                        if weights["epoch"] != epoch:
                            continue
                        weights["bytes"].write(prompt[n:], mine[n:])
                        handle = cache.store(prompt, mine)
                    handle.result(30)
                except TransferError:       # cleared, or a restart, or the namespace not yet set
                    counts["refused"] += 1
                    time.sleep(0.005)
                except Exception as exc:
                    errors.append(f"thread {t}: {type(exc).__name__}: {exc}")
                    return

        def update_weights(k):
            with lock:
                backend.clear_caches(timeout=30)
                weights["epoch"] += 1       # loads begun before the clear are not checked
                if k % 2:
                    backend.restart_rank(k % backend.tp_size)      # in CLEARED
                    counts["restarts"] += 1
                backend.restore_caches(timeout=30)
                weights["bytes"] = Bytes(spec, workers, seed=k)    # new weights, new tensors
            cache.namespace = f"weights/{k}"
            counts["clears"] += 1
            if k % 3 == 0:
                backend.restart_rank((k + 1) % backend.tp_size)    # while serving
                backend.wait_ready(timeout=30)
                counts["restarts"] += 1

        run_threads(engine, update_weights, 0.6, 6.0, stop, errors)
        assert errors == []
        assert counts["loaded"] > 100 and counts["clears"] >= 4 and counts["restarts"] >= 3, counts
        time.sleep(0.5)
        blocks = [e[BLOCK] for e in cache._index.values()]
        assert sorted(blocks + cache._free) == list(range(CPU_BLOCKS))
        cache.close()


def test_caches_closed_and_made_anew_under_traffic_never_serve_wrong_bytes_and_give_every_block_back():
    """Two TieredCaches on one backend (quotas of 12 CPU blocks) and raw preemption swaps beside them; every
    0.3 s a controller closes one cache while its stores and loads are in flight and makes a new one (a new
    quota, once the old one's blocks in flight are back). No load serves wrong bytes, no thread hangs, and
    once everything is closed every CPU block is free."""
    spec = small_spec(num_gpu_blocks=THREADS * OWN, num_cpu_blocks=40)
    with deployment(spec, tp=2) as (backend, workers):
        data, lock = Bytes(spec, workers), threading.Lock()
        caches = [TieredCache(backend, "a/0", capacity=12), TieredCache(backend, "b/0", capacity=12)]
        counts, errors = collections.Counter(), []
        stop = threading.Event()
        prefix = prefix_engine(caches, data, lock, stop, counts, errors)

        def raw_swaps(gpu):
            """Preemption: swap random bytes out and back through raw CPU blocks, checking them."""
            rng = np.random.default_rng(1)
            while not stop.is_set():
                try:
                    cpu = backend.allocate_cpu_blocks(len(gpu))
                except ValueError:          # the quotas and swaps in flight hold every block
                    time.sleep(0.002)
                    continue
                try:
                    hashes = [int(x) for x in rng.integers(1, 2**62, len(gpu))]
                    with lock:
                        data.write(hashes, gpu)
                    backend.swap_out(gpu, cpu).result(30)
                    with lock:
                        data.write([h ^ 1 for h in hashes], gpu)
                    backend.swap_in(gpu, cpu).result(30)
                    with lock:
                        bad = data.bad(hashes, gpu)
                    if any(bad):
                        errors.append(f"raw swaps: blocks {bad} came back wrong")
                    counts["raw"] += 1
                except Exception as exc:
                    errors.append(f"raw swaps: {type(exc).__name__}: {exc}")
                    return
                finally:
                    backend.free_cpu_blocks(cpu)

        def engine(t):      # thread 0 swaps raw blocks (its own GPU blocks), the others reuse prefixes
            return raw_swaps(list(range(PROMPT))) if t == 0 else prefix(t)

        def remake(k):
            caches[k % 2].close()
            for _ in range(400):
                try:
                    caches[k % 2] = TieredCache(backend, f"{'ab'[k % 2]}/{k}", capacity=12)
                    counts["remade"] += 1
                    return
                except ValueError:          # the closed cache's blocks in flight are not back yet
                    time.sleep(0.005)
            errors.append("the closed cache's blocks never came back")

        run_threads(engine, remake, 0.3, 5.0, stop, errors)
        assert errors == []
        assert counts["remade"] >= 8 and counts["loaded"] > 100 and counts["raw"] > 20, counts
        for cache in caches:
            cache.close()
        deadline = time.monotonic() + 5
        while backend.allocator.num_free < spec.num_cpu_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.allocator.num_free == spec.num_cpu_blocks


def test_engine_threads_swapping_while_ranks_restart_never_read_back_wrong_bytes():
    spec = small_spec(num_gpu_blocks=THREADS * OWN, num_cpu_blocks=THREADS * OWN)
    counts, errors = collections.Counter(), []
    with deployment(spec, tp=2) as (backend, workers):
        tensors = [all_tensors(w) for w in workers]
        cpu_blocks = backend.allocate_cpu_blocks(THREADS * OWN)
        stop = threading.Event()

        def engine(t):
            rng = np.random.default_rng(t)
            gpu, cpu = range(t * OWN, (t + 1) * OWN), cpu_blocks[t * OWN:(t + 1) * OWN]
            while not stop.is_set():
                k = int(rng.integers(1, OWN + 1))
                src, dst = (rng.permutation(gpu)[:k].tolist() for _ in range(2))
                via = rng.permutation(cpu)[:k].tolist()
                for rows in (rows for ranks in tensors for rows in ranks):
                    rows[src] = rng.integers(0, 256, rows[src].shape, dtype=np.uint8)
                want = [rows[src].copy() for ranks in tensors for rows in ranks]
                try:
                    backend.swap_out(src, via).result(30)
                    for rows in (rows for ranks in tensors for rows in ranks):
                        rows[dst] = rng.integers(0, 256, rows[dst].shape, dtype=np.uint8)
                    backend.swap_in(dst, via).result(30)
                except TransferError:       # a rank restarting: this round proves nothing
                    counts["refused"] += 1
                    time.sleep(0.005)
                    continue
                except Exception as exc:
                    errors.append(f"thread {t}: {type(exc).__name__}: {exc}")
                    return
                got = [rows[dst] for ranks in tensors for rows in ranks]
                if not all(np.array_equal(g, w) for g, w in zip(got, want)):
                    errors.append(f"thread {t}: swapped blocks came back different")
                counts["rounds"] += 1

        rng = np.random.default_rng(5)

        def restart(_):
            backend.restart_rank(int(rng.integers(0, backend.tp_size)))
            backend.wait_ready(timeout=30)
            counts["restarts"] += 1

        run_threads(engine, restart, 0.7, 5.0, stop, errors)
        assert errors == [] and counts["rounds"] > 100 and counts["restarts"] >= 2, counts


class HeadBytes:
    """Bytes of the block named by a hash, defined per layer, K/V and KV head, so that they can be written
    and checked at any tp: rank r of tp holds heads [r * H / tp, (r + 1) * H / tp)."""

    def __init__(self, spec, pool):
        self.spec, self.pool = spec, pool

    def _block(self, h):
        s = self.spec
        return np.random.default_rng(h).integers(1, 256, (s.num_layers, 2, s.num_kv_heads, s.block_size, s.head_dim),
                                                 dtype=np.uint8)

    def _slices(self, h, rank, ranks):
        """(rank's tensor of one layer and kind, the rank's slice of the block) for every layer and kind."""
        per = self.spec.num_kv_heads // len(ranks)
        block = self._block(h)
        w = ranks[rank]
        for layer in range(self.spec.num_layers):
            for kind, tensors in enumerate((w.key_caches, w.value_caches)):
                yield tensors[layer], block[layer, kind, rank * per:(rank + 1) * per]

    def write(self, hashes, gpu):
        ranks = self.pool.ranks()
        for h, b in zip(hashes, gpu):
            for r in range(len(ranks)):
                for tensor, want in self._slices(h, r, ranks):
                    tensor[b] = want

    def bad(self, hashes, gpu):
        """Per rank, the blocks that do not hold their hash's slice."""
        ranks = self.pool.ranks()
        return [[b for h, b in zip(hashes, gpu)
                 if not all(np.array_equal(t[b], want) for t, want in self._slices(h, r, ranks))]
                for r in range(len(ranks))]


def test_engine_threads_across_reshards_never_load_wrong_bytes(tmp_path):
    """tp 1 -> 2 -> 4 -> 2 -> 1 and again, while engine threads store and load through a TieredCache with a
    store below (their TieredCache calls race each step; their own tensor reads and writes, the engine's
    compute, do not). Every load is checked on every rank, and the store is never set aside."""
    spec = small_spec(num_layers=2, num_gpu_blocks=THREADS * OWN, num_cpu_blocks=CPU_BLOCKS, num_kv_heads=4,
                      block_size=2, head_dim=4, cache_dtype="uint8")
    cycle = [2, 4, 2, 1]
    with deployment(spec, tp=1, store=f"file://{tmp_path}/l3") as (backend, workers):
        pool = InProcessWorkers(backend, workers)
        try:
            data = HeadBytes(spec, pool)
            cache = TieredCache(backend, "reshard/0")
            compute = threading.Lock()      # the engine's own use of its tensors, which a reshard rewrites
            counts, errors = collections.Counter(), []
            stop = threading.Event()
            engine = prefix_engine([cache], data, compute, stop, counts, errors)

            def reshard(k):
                with compute:
                    backend.reshard(cycle[(k - 1) % 4], live_blocks=range(THREADS * OWN), start_workers=pool.start,
                                    stop_workers=pool.stop, timeout=60)
                counts["reshards"] += 1

            run_threads(engine, reshard, 0.3, 6.0, stop, errors)
            assert errors == []
            stats = cache.stats()
            assert counts["loaded"] > 100 and counts["reshards"] >= 4 and stats["l3_loaded_blocks"] > 0, (counts, stats)
            assert stats["l3_errors"] == 0, stats
            time.sleep(0.5)
            blocks = [e[BLOCK] for e in cache._index.values()] + cache._free
            assert len(set(blocks)) == len(blocks) and max(blocks) < backend.spec.num_cpu_blocks
            cache.close()
        finally:
            pool.close()
