"""Virtual-memory (cuMemCreate) allocations shared between processes (docs/design.md §2): cudaIpcGetMemHandle
refuses them, so the exporter turns each physical allocation under a tensor into a POSIX file descriptor
(cuMemRetainAllocationHandle + cuMemExportToShareableHandle) and the importer maps the descriptors, in order,
into a reservation of its own (import, reserve, map, set access). A tensor may span several allocations
(PyTorch's expandable segments map one per page run); vLLM's cumem allocator maps one per tensor."""
from __future__ import annotations

import os

from cuda.bindings import driver

from ..errors import TransferError
from .cuda_kernels import cuda_check

POSIX_FD = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def unexportable(what: str, types: int) -> TransferError:
    return TransferError(
        f"{what} lies in virtual-memory (cuMemCreate) allocations that export no POSIX file descriptor "
        f"(requested handle types {types:#x}): vLLM's sleep mode (enable_sleep_mode=True) and "
        f"enable_cumem_allocator=True allocate the KV cache this way, so fastcache cannot share it with its "
        f"transfer manager; run without sleep mode and enable_cumem_allocator, or allocate with "
        f"CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR")


def retained_handle(ptr: int):
    """The allocation handle mapped at ptr (retained: release it), or None where ptr is no VMM memory."""
    err, handle = driver.cuMemRetainAllocationHandle(driver.CUdeviceptr(ptr))
    return handle if int(err) == 0 else None


def is_vmm(ptr: int) -> bool:
    handle = retained_handle(ptr)
    if handle is None:
        return False
    cuda_check(driver.cuMemRelease(handle), "cuMemRelease")
    return True


class VmmExports:
    """One process's exported allocations: a descriptor and size per allocation, each exported once."""

    def __init__(self):
        self.fds, self.sizes = [], []
        self._index = {}        # allocation base -> its index in fds

    def export(self, ptr: int, nbytes: int, what: str) -> dict:
        """The manifest fields of the tensor at ptr: its allocations' indices (in mapping order), its offset in
        the first and the allocation granularity."""
        pieces, granularity, first, addr = [], 1, None, ptr
        while addr < ptr + nbytes:
            base, size = cuda_check(driver.cuMemGetAddressRange(driver.CUdeviceptr(addr)), "cuMemGetAddressRange")
            base, size = int(base), int(size)
            first = base if first is None else first
            granularity = max(granularity, self._export_one(base, size, what))
            pieces.append(self._index[base])
            addr = base + size
        return {"pieces": pieces, "offset": ptr - first, "granularity": granularity}

    def _export_one(self, base: int, size: int, what: str) -> int:
        handle = retained_handle(base)
        if handle is None:
            raise TransferError(f"{what}: cuMemRetainAllocationHandle refused an allocation under it")
        try:
            prop = cuda_check(driver.cuMemGetAllocationPropertiesFromHandle(handle),
                              "cuMemGetAllocationPropertiesFromHandle")
            types = int(prop.requestedHandleTypes)
            if not types & int(POSIX_FD):
                raise unexportable(what, types)
            granularity = int(cuda_check(driver.cuMemGetAllocationGranularity(
                prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                "cuMemGetAllocationGranularity"))
            if base not in self._index:
                fd = int(cuda_check(driver.cuMemExportToShareableHandle(handle, POSIX_FD, 0),
                                    f"cuMemExportToShareableHandle({what})"))
                self._index[base] = len(self.fds)
                self.fds.append(fd)
                self.sizes.append(size)
        finally:
            cuda_check(driver.cuMemRelease(handle), "cuMemRelease")
        return granularity

    def close(self):
        fds, self.fds, self.sizes, self._index = self.fds, [], [], {}
        for fd in fds:
            os.close(fd)


def unmap(va: int, sizes: list, mapped: int):
    """Unmap the first `mapped` bytes of a run of pieces, one mapping at a time (cuMemUnmap takes whole
    mappings)."""
    offset = 0
    for size in sizes:
        if offset >= mapped:
            return
        cuda_check(driver.cuMemUnmap(va + offset, size), "cuMemUnmap")
        offset += size


class VmmImports:
    """Another process's allocations imported from descriptors (each once) and mapped, per run of them, into
    a reservation of this process. close() unmaps, frees the reservations and releases every import: only
    then may the exporter's memory really go."""

    def __init__(self, fds: list[int], sizes: list[int], device_id: int):
        self.device_id, self.sizes = device_id, list(sizes)
        self._handles, self._maps = [], {}      # (pieces, granularity) -> (address, piece sizes, reserved bytes)
        try:
            for fd in fds:
                self._handles.append(cuda_check(driver.cuMemImportFromShareableHandle(fd, POSIX_FD),
                                                "cuMemImportFromShareableHandle"))
        except BaseException:
            self.close()
            raise
        finally:
            for fd in fds:      # the imported handle holds the allocation; the descriptor is no longer needed
                os.close(fd)

    def address(self, vmm: dict) -> int:
        """This process's address of the start of a run of allocations (mapped once per run)."""
        pieces, granularity = tuple(vmm["pieces"]), vmm["granularity"]
        if (pieces, granularity) not in self._maps:
            self._maps[pieces, granularity] = self._map(pieces, granularity)
        return self._maps[pieces, granularity][0]

    def _map(self, pieces, granularity):
        total = sum(self.sizes[i] for i in pieces)
        total += -total % granularity
        va = int(cuda_check(driver.cuMemAddressReserve(total, granularity, 0, 0), "cuMemAddressReserve"))
        mapped = 0
        try:
            for i in pieces:
                cuda_check(driver.cuMemMap(va + mapped, self.sizes[i], 0, self._handles[i], 0), "cuMemMap")
                mapped += self.sizes[i]
            access = driver.CUmemAccessDesc()
            access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = self.device_id
            access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            cuda_check(driver.cuMemSetAccess(va, mapped, [access], 1), "cuMemSetAccess")
        except BaseException:
            unmap(va, [self.sizes[i] for i in pieces], mapped)
            driver.cuMemAddressFree(va, total)
            raise
        return va, [self.sizes[i] for i in pieces], total

    def close(self):
        maps, self._maps = self._maps, {}
        for va, sizes, total in maps.values():
            unmap(va, sizes, sum(sizes))
            cuda_check(driver.cuMemAddressFree(va, total), "cuMemAddressFree")
        handles, self._handles = self._handles, []
        for handle in handles:
            cuda_check(driver.cuMemRelease(handle), "cuMemRelease")
