"""Virtual-memory KV tensors on a real GPU (docs/design.md §2, §6): vLLM-shaped `(num_blocks, page_bytes)` int8
tensors, one cuMemCreate allocation per layer requesting a POSIX file descriptor handle, adopted by a
CacheWorker and moved by a transfer manager in its own process, which maps them from the descriptors the
worker passes over its socket. Checked bit for bit on random bytes; a clear (the sleep order) must let the
memory really go once the owner unmaps, and a restore after the owner maps new memory at the same addresses
must move the new bytes. Memory requesting no shareable handle (vLLM's cumem allocator) is refused at start.
Marked `gpu`; skipped where no GPU is usable.
"""
from __future__ import annotations

import numpy as np
import pytest

from fastcache.config import CacheSpec
from fastcache.errors import TransferError
from fastcache.ops import cuda_usable

GPU = cuda_usable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="no usable CUDA GPU")]

LAYERS, NUM_BLOCKS, PAGE = 4, 64, 20 << 10


def check(result, what):
    err, *values = result
    assert int(err) == 0, f"{what}: {err}"
    return values[0] if len(values) == 1 else tuple(values)


class Tensor:
    """Rows of bytes at a device address, as adoption reads a framework tensor."""

    def __init__(self, ptr, rows, row_bytes):
        self.ptr, self.shape = ptr, (rows, row_bytes)

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.shape[0] * self.shape[1]

    def element_size(self):
        return 1

    def is_contiguous(self):
        return True


class VmmOwner:
    """An engine's KV cache in cumem memory, laid out as vLLM's allocator does (a reservation and one
    allocation per tensor), with the sleep (unmap, release) and wake-up (new memory, same addresses) of
    vLLM's CuMemAllocator."""

    def __init__(self, infos, handle_types, device_id=0):
        from cuda.bindings import driver, runtime
        self.driver, self.infos, self.device_id = driver, infos, device_id
        check(runtime.cudaSetDevice(device_id), "cudaSetDevice")
        check(runtime.cudaFree(0), "cudaFree(0)")       # the primary context, current on this thread
        check(driver.cuInit(0), "cuInit")
        self.prop = driver.CUmemAllocationProp()
        self.prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = device_id
        self.prop.requestedHandleTypes = handle_types
        gran = check(driver.cuMemGetAllocationGranularity(
            self.prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity")
        self.sizes = [-(-info.nbytes // gran) * gran for info in infos]
        self.addresses = [int(check(driver.cuMemAddressReserve(n, 0, 0, 0), "cuMemAddressReserve"))
                          for n in self.sizes]
        self.handles = []
        self.wake_up()

    def wake_up(self):
        d = self.driver
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device_id
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        for va, n in zip(self.addresses, self.sizes):
            handle = check(d.cuMemCreate(n, self.prop, 0), "cuMemCreate")
            check(d.cuMemMap(va, n, 0, handle, 0), "cuMemMap")
            check(d.cuMemSetAccess(va, n, [access], 1), "cuMemSetAccess")
            self.handles.append(handle)

    def sleep(self):
        for va, n in zip(self.addresses, self.sizes):
            check(self.driver.cuMemUnmap(va, n), "cuMemUnmap")
        for handle in self.handles:
            check(self.driver.cuMemRelease(handle), "cuMemRelease")
        self.handles = []

    def tensors(self):
        return {info.name: Tensor(va, info.num_blocks, info.block_bytes) for info, va in zip(self.infos,
                                                                                         self.addresses)}

    def write(self, rng):
        from cuda.bindings import runtime
        data = [rng.integers(1, 256, (info.num_blocks, info.block_bytes), dtype=np.uint8) for info in self.infos]
        for va, d in zip(self.addresses, data):
            check(runtime.cudaMemcpy(va, d.ctypes.data, d.nbytes, runtime.cudaMemcpyKind.cudaMemcpyHostToDevice),
                  "cudaMemcpy")
        check(runtime.cudaDeviceSynchronize(), "sync")
        return data

    def poison(self, blocks):
        from cuda.bindings import runtime
        for info, va in zip(self.infos, self.addresses):
            for b in blocks:
                check(runtime.cudaMemset(va + int(b) * info.block_bytes, 0x5A, info.block_bytes), "cudaMemset")
        check(runtime.cudaDeviceSynchronize(), "sync")

    def read(self):
        from cuda.bindings import runtime
        out = []
        for info, va in zip(self.infos, self.addresses):
            host = np.empty((info.num_blocks, info.block_bytes), np.uint8)
            check(runtime.cudaMemcpy(host.ctypes.data, va, host.nbytes,
                                     runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy")
            out.append(host)
        return out

    def close(self):
        if self.handles:
            self.sleep()
        for va, n in zip(self.addresses, self.sizes):
            check(self.driver.cuMemAddressFree(va, n), "cuMemAddressFree")


def vllm_spec():
    """vLLM's canonical tensors as fastcache's vLLM worker maps them (integrations/vllm/worker.py)."""
    return CacheSpec(num_layers=LAYERS, num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=NUM_BLOCKS, block_size=1,
                     num_kv_heads=1, head_dim=PAGE, cache_dtype="uint8", has_value=False)


def round_trip(backend, owner, rng):
    """Random bytes stored, their GPU blocks poisoned, loaded back: every byte of every tensor compared."""
    data = owner.write(rng)
    gpu = rng.permutation(NUM_BLOCKS)[:24]
    cpu = rng.permutation(NUM_BLOCKS)[:24]
    backend.swap_out(gpu, cpu).result(timeout=60)
    owner.poison(gpu)
    assert all(not np.array_equal(a[gpu], d[gpu]) for a, d in zip(owner.read(), data))     # the oracle can see
    backend.swap_in(gpu, cpu).result(timeout=60)
    for got, want in zip(owner.read(), data):
        assert np.array_equal(got, want)


def free_bytes():
    from cuda.bindings import runtime
    return check(runtime.cudaMemGetInfo(), "cudaMemGetInfo")[0]


def test_vmm_kv_tensors_move_bit_for_bit_and_a_clear_lets_their_memory_go_before_the_owner_sleeps():
    from cuda.bindings import driver

    from fastcache import SwapBackend
    from fastcache.worker import CacheWorker
    spec = vllm_spec()
    owner = VmmOwner(spec.tensors(0, 0),
                     driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    rng = np.random.default_rng(42)
    try:
        with SwapBackend(spec, tp_size=1, device="cuda", device_ids=[0]) as backend:
            worker = CacheWorker(spec, 0, 1, device="cuda", suffix=backend.suffix, device_id=0,
                                 tensors=owner.tensors()).start()
            try:
                backend.wait_ready(timeout=120)
                round_trip(backend, owner, rng)
                backend.clear_caches()              # the transfer manager unmaps and releases its imports
                before = free_bytes()
                owner.sleep()
                # nothing else holds the memory any more: the owner's release frees all of it
                assert free_bytes() - before >= sum(owner.sizes)
                owner.wake_up()
                backend.restore_caches()            # exported again, imported again, at the same addresses
                round_trip(backend, owner, rng)
            finally:
                worker.close()
    finally:
        owner.close()


def test_vmm_memory_without_a_shareable_handle_is_refused_at_start_naming_sleep_mode():
    from cuda.bindings import driver

    from fastcache import SwapBackend
    from fastcache.worker import CacheWorker
    spec = vllm_spec()
    owner = VmmOwner(spec.tensors(0, 0), driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE)
    try:
        with SwapBackend(spec, tp_size=1, device="cuda", device_ids=[0]) as backend:
            with pytest.raises(TransferError, match="sleep mode"):
                CacheWorker(spec, 0, 1, device="cuda", suffix=backend.suffix, device_id=0,
                            tensors=owner.tensors()).start()
    finally:
        owner.close()
