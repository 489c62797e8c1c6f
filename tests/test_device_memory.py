"""A reshard reports each rank's device memory as its worker sees it (docs/design.md §9): on cuda the driver's free
and total bytes (cudaMemGetInfo) and the worker framework's caching allocator (allocated, reserved, fragmented),
taken in the worker's own process at COMMIT and published in shared memory for the engine's report."""
import os
import sys
import types

import pytest

from fastcache.ipc.naming import device_memory_name
from fastcache.ipc.shm import SHM_DIR
from fastcache.ops import frameworks
from fastcache.ops.sim import SimOps

from conftest import small_spec
from test_reshard import in_process_deployment

MiB = 2**20


def fake_framework(monkeypatch, name, allocated, reserved):
    """A stand-in for torch, cupy or paddle whose allocator answers per device; records the devices asked."""
    asked = []

    def per_device(table):
        def read(device=None):
            asked.append(device)
            return table[device]
        return read

    if name == "torch":
        cuda = types.SimpleNamespace(memory_allocated=per_device(allocated), memory_reserved=per_device(reserved))
        module = types.SimpleNamespace(cuda=cuda)
    elif name == "paddle":
        cuda = types.SimpleNamespace(memory_allocated=per_device(allocated), memory_reserved=per_device(reserved))
        module = types.SimpleNamespace(device=types.SimpleNamespace(cuda=cuda))
    else:
        current = []

        class Device:
            def __init__(self, device_id):
                self.device_id = device_id

            def __enter__(self):
                current.append(self.device_id)

            def __exit__(self, *exc):
                current.pop()

        pool = types.SimpleNamespace(used_bytes=lambda: per_device(allocated)(current[-1]),
                                     total_bytes=lambda: per_device(reserved)(current[-1]))
        module = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device),
                                       get_default_memory_pool=lambda: pool)
    monkeypatch.setitem(sys.modules, name, module)
    return asked


@pytest.mark.parametrize("name", ["torch", "cupy", "paddle"])
def test_each_framework_allocator_is_read_on_the_workers_device(monkeypatch, name):
    asked = fake_framework(monkeypatch, name, allocated={0: 1, 3: 40 * MiB}, reserved={0: 2, 3: 64 * MiB})
    assert frameworks.allocator_memory(name, 3) == {"allocated_bytes": 40 * MiB, "reserved_bytes": 64 * MiB}
    assert asked == [3, 3]             # device 3's figures, never the current device's
    assert frameworks.allocator_memory("numpy", 0) == {}     # host memory: no device allocator


def test_cuda_reports_the_driver_and_the_allocator(monkeypatch):
    pytest.importorskip("cuda.bindings.runtime")
    import fastcache.ops.cuda as cuda_ops
    from fastcache.errors import TransferError
    ok = cuda_ops.runtime.cudaError_t.cudaSuccess
    devices, status = [], [ok]
    runtime = types.SimpleNamespace(cudaError_t=cuda_ops.runtime.cudaError_t,
                                    cudaMemGetInfo=lambda: (status[0], 30 * 2**30, 80 * 2**30))
    monkeypatch.setattr(cuda_ops, "runtime", runtime)
    monkeypatch.setattr(cuda_ops, "set_device", devices.append)
    fake_framework(monkeypatch, "torch", allocated={1: 40 * MiB}, reserved={1: 64 * MiB})
    report = cuda_ops.CudaOps().device_memory("torch", 1)
    assert report == {"free_bytes": 30 * 2**30, "total_bytes": 80 * 2**30, "allocated_bytes": 40 * MiB,
                      "reserved_bytes": 64 * MiB, "fragmented_bytes": 24 * MiB}
    assert devices == [1]
    status[0] = cuda_ops.runtime.cudaError_t.cudaErrorInvalidDevice
    with pytest.raises(TransferError, match="cudaMemGetInfo"):
        cuda_ops.CudaOps().device_memory("torch", 1)


def report_exists(backend, rank):
    return os.path.exists(os.path.join(SHM_DIR, device_memory_name(backend.suffix, rank).lstrip("/")))


def test_a_reshard_reports_what_each_worker_saw_at_commit(monkeypatch):
    """The sim device reports nothing of its own (negative control: no driver figures), so a SimOps that answers
    like cuda shows the worker's report reaching last_reshard, per rank, from the step's COMMIT; a worker whose
    device cannot say costs the step nothing; the reports go with their workers."""
    spec = small_spec(num_gpu_blocks=16, num_cpu_blocks=8, num_kv_heads=4)
    with in_process_deployment(spec, tp=1) as (backend, pool):
        backend.reshard(2, start_workers=pool.start, stop_workers=pool.stop, timeout=60)
        memory = backend.last_reshard["device_memory"]
        assert [m["rank"] for m in memory] == [0, 1]
        assert all("total_bytes" not in m and m["reserved_bytes"] > 0 for m in memory)   # sim's own figures
        assert not report_exists(backend, 0)

        commits = []

        def answer(self, framework, device_id):
            commits.append(framework)
            return {"free_bytes": 7 * MiB, "total_bytes": (100 + len(commits)) * MiB}
        monkeypatch.setattr(SimOps, "device_memory", answer)
        backend.reshard(4, start_workers=pool.start, stop_workers=pool.stop, timeout=60)
        memory = backend.last_reshard["device_memory"]
        assert len(commits) == 4 and [m["rank"] for m in memory] == [0, 1, 2, 3]
        assert sorted(m["total_bytes"] for m in memory) == [101 * MiB, 102 * MiB, 103 * MiB, 104 * MiB]
        assert all(m["free_bytes"] == 7 * MiB and m["gpu_blocks"] == 64 and m["reserved_bytes"] > 0 for m in memory)
        assert all(report_exists(backend, r) for r in range(4))

        def fails(self, framework, device_id):
            raise RuntimeError("no driver")
        monkeypatch.setattr(SimOps, "device_memory", fails)
        backend.reshard(2, live_blocks=range(8), start_workers=pool.start, stop_workers=pool.stop, timeout=60)
        assert all("total_bytes" not in m for m in backend.last_reshard["device_memory"])    # no stale report
        assert not any(report_exists(backend, r) for r in range(4))
    assert not os.path.exists(os.path.join(SHM_DIR, device_memory_name(backend.suffix, 0).lstrip("/")))
