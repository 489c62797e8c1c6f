"""SwapBackend.reshard moves the weights with the KV in one step (docs/design.md §9, "Weights in the plan"), on
the sim device with worker processes: every weight byte of every rank equals its slice of the full random
tensors after every step, every live KV block holds its bytes, refusals come before anything moves, a failed
step rolls back with the weights intact, and a corrupted byte is caught."""
import contextlib
import os

import numpy as np
import pytest

from fastcache import SwapBackend, TransferError
from fastcache.ipc.naming import PREFIX
from fastcache.ipc.shm import SHM_DIR
from fastcache.launch.harness import WorkerProcesses
from fastcache.launch.liquid import BlockModel, WeightModel
from fastcache.weight_spec import WeightSpec

from fastcache.worker import CacheWorker

from conftest import small_spec

# column-split (dim 0), row-split (dim 1) and replicated tensors; every split dim divides over 4 ranks
MODEL = WeightSpec(3, {"qkv": ((8, 6), "float16", 0), "o": ((6, 8), "float16", 1), "norm": ((6,), "float32")})
SPEC = small_spec(num_layers=2, num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=4, block_size=2, head_dim=4)


@contextlib.contextmanager
def in_process(**placement):
    """One in-process worker with its weights registered."""
    with SwapBackend(SPEC, tp_size=1, device="sim", weights=MODEL, **placement) as backend:
        worker = CacheWorker(SPEC, rank=0, tp_size=1, device="sim", suffix=backend.suffix).start()
        try:
            worker.register_weights(backend.weight_layout)
            backend.wait_ready(timeout=30)
            yield backend
        finally:
            worker.close()


def leftovers(suffix):
    return [e for e in os.listdir(SHM_DIR) if e.startswith(f"{PREFIX}.{suffix}.")]


@pytest.mark.parametrize("path", [[1, 2, 4, 2, 1], [1, 4, 2, 1]])
def test_weights_and_kv_move_in_one_step_and_every_byte_lands(path):
    rng = np.random.default_rng(sum(path))
    with SwapBackend(SPEC, tp_size=1, device="sim", weights=MODEL) as backend:
        suffix = backend.suffix
        workers = WorkerProcesses(backend)
        try:
            workers.start([0])
            backend.wait_ready(timeout=60)
            kv, weights = BlockModel(backend, rng), WeightModel(backend, rng)
            kv.attach()
            kv.fill(range(SPEC.num_gpu_blocks // 2))
            weights.load()
            assert not weights.check() and not kv.check()
            allocations = []
            for tp in path[1:]:
                kv.detach()
                new, block_map = backend.reshard(tp, live_blocks=sorted(kv.gpu), start_workers=workers.start,
                                                 stop_workers=workers.stop, timeout=120)
                r = backend.last_reshard
                kv.remap(block_map, r["cpu_block_map"])
                kv.attach()
                assert backend.tp_size == tp and backend.weight_layout == MODEL.resharded(tp)
                assert not weights.check(), (r["from_tp"], tp)
                assert not kv.check(), (r["from_tp"], tp)
                assert r["weights_bytes"] > 0 and r["kv_bytes"] > 0
                # timed apart: both parts took time, and together no longer than the copies did
                assert r["kv_seconds"] > 0 and r["weights_seconds"] > 0 and r["kv_gbps"] > 0 and r["weights_gbps"] > 0
                assert r["kv_seconds"] + r["weights_seconds"] <= 2 * r["copy_seconds"] + 1e-6
                assert r["weights_bytes"] == sum(m["bytes"] for m in r["weight_moves"])
                assert {m["tensor"] for m in r["weight_moves"]} == {"qkv", "o", "norm"} if tp > r["from_tp"] \
                    else {m["tensor"] for m in r["weight_moves"]} == {"qkv", "o"}     # replicated rows stay
                allocations += r["weight_allocations"]
                memory = r["device_memory"]
                assert [m["rank"] for m in memory] == list(range(tp))
                for m in memory:
                    assert m["gpu_blocks"] == new.num_gpu_blocks
                    assert m["in_use_bytes"] == new.gpu_cache_bytes + backend.weight_layout.gpu_cache_bytes
                    assert m["reserved_bytes"] >= m["in_use_bytes"] and m["free_bytes"] >= 0
                    assert m["allocated_bytes"] >= m["reserved_bytes"] and m["fragmented_bytes"] >= 0
                kv.fill(rng.choice(new.num_gpu_blocks, 4, replace=False))     # the deployment serves on
                assert not kv.check()
            # 1-4-2: rank 1 was born with a quarter and needs half: a new allocation, which then serves it
            assert bool(allocations) == (path == [1, 4, 2, 1])
            kv.detach()
        finally:
            workers.close()
    assert not leftovers(suffix)


def test_a_corrupted_weight_byte_is_caught():
    rng = np.random.default_rng(7)
    with SwapBackend(SPEC, tp_size=1, device="sim", weights=MODEL) as backend:
        workers = WorkerProcesses(backend)
        try:
            workers.start([0])
            backend.wait_ready(timeout=60)
            weights = WeightModel(backend, rng)
            weights.load()
            backend.reshard(2, start_workers=workers.start, stop_workers=workers.stop, timeout=120)
            assert not weights.check()
            weights.corrupt(1, 1, 5)
            assert weights.check() == [(1, "o")]
        finally:
            workers.close()


def test_a_failed_start_rolls_back_with_the_weights_intact():
    rng = np.random.default_rng(8)
    with SwapBackend(SPEC, tp_size=2, device="sim", weights=MODEL.resharded(2)) as backend:
        workers = WorkerProcesses(backend)
        try:
            workers.start([0, 1])
            backend.wait_ready(timeout=60)
            kv, weights = BlockModel(backend, rng), WeightModel(backend, rng)
            kv.attach()
            kv.fill(range(SPEC.num_gpu_blocks))
            weights.load()
            kv.detach()

            def refuse(ranks, spec):
                raise RuntimeError("no GPUs today")
            with pytest.raises(TransferError, match="no GPUs today"):
                backend.reshard(4, start_workers=refuse, stop_workers=workers.stop, timeout=60)
            backend.wait_ready(timeout=60)
            assert backend.tp_size == 2 and backend.weight_layout == MODEL.resharded(2)
            kv.attach()
            assert not weights.check() and not kv.check()
            kv.detach()
            backend.reshard(4, start_workers=workers.start, stop_workers=workers.stop, timeout=120)  # then it works
            assert not weights.check()
        finally:
            workers.close()


def test_offloaded_layers_and_sleep_are_refused_before_anything_moves():
    with in_process(offload_fraction=0.5) as backend:
        with pytest.raises(ValueError, match="offloaded"):
            backend.reshard(2, start_workers=lambda *a: None, stop_workers=lambda *a: None)
        assert backend.tp_size == 1 and backend.resharding is None
    with in_process() as backend:
        backend.sleep(2, timeout=30)
        with pytest.raises(ValueError, match="sleeps"):
            backend.reshard(2, start_workers=lambda *a: None, stop_workers=lambda *a: None)
        assert backend.tp_size == 1 and backend.weight_layout == MODEL.placed()
        backend.wake(timeout=30)
        backend.wait_ready(timeout=30)
