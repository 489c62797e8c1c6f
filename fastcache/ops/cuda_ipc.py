"""CUDA IPC: export a device pointer as (handle of its allocation, offset), and open such handles in
another process. Caching allocators sub-allocate and a handle always opens at its allocation's base, so
every export carries the offset; CUDA lets a process open an allocation once, so openers share bases."""
from __future__ import annotations

import ctypes

from cuda.bindings import driver, runtime

from ..config import TensorInfo
from ..errors import TransferError
from .cuda_kernels import cuda_check, set_device
from .cuda_vmm import VmmExports, VmmImports, is_vmm

IPC_HANDLE_BYTES = 64


def export_pointer(ptr: int, what: str, handles: dict | None = None) -> dict:
    """IPC handle of the allocation holding ptr, ptr's offset in it, and the allocation's size. `handles`
    (allocation base -> handle) lets exports in one allocation share one handle string."""
    base, size = cuda_check(driver.cuMemGetAddressRange(driver.CUdeviceptr(ptr)), "cuMemGetAddressRange")
    base = int(base)
    handles = {} if handles is None else handles
    if base not in handles:
        try:
            handle = cuda_check(runtime.cudaIpcGetMemHandle(base), f"cudaIpcGetMemHandle({what})")
        except TransferError as exc:
            raise TransferError(f"{exc} (CUDA IPC exports cudaMalloc memory only; the KV cache's virtual-memory "
                                f"allocations are exported by file descriptor, other buffers cannot be: e.g. "
                                f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)") from None
        handles[base] = ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES).hex()
    return {"handle": handles[base], "offset": ptr - base, "alloc_bytes": int(size)}


def export_tensors(infos: list, pointers: list, device_id: int, vmm: VmmExports | None = None) -> list:
    """Manifest entries: per tensor, the IPC handle of the allocation holding it and its offset there.
    Tensors sharing an allocation share one handle string, so an attacher opens it once. Where
    cudaIpcGetMemHandle refuses a tensor and cuMemRetainAllocationHandle shows it virtual memory (cuMemCreate),
    it is exported into `vmm` as file descriptors instead, its entry naming them by index ("vmm"); without
    `vmm` the refusal stands."""
    handles, entries = {}, []
    for info, ptr in zip(infos, pointers):
        try:
            fields = export_pointer(ptr, info.name, handles)
        except TransferError:
            if vmm is None or not is_vmm(ptr):
                raise
            region = vmm.export(ptr, info.nbytes, info.name)
            fields = {"vmm": region, "offset": region["offset"],
                      "alloc_bytes": sum(vmm.sizes[i] for i in region["pieces"])}
        entries.append({"name": info.name, **fields, "nbytes": info.nbytes, "device": device_id})
    return entries


def check_region(entry: dict, nbytes: int, what: str):
    """Refuse an export whose handle is malformed or whose nbytes at offset leave its allocation."""
    handle, offset, size = entry.get("handle"), entry.get("offset"), entry.get("alloc_bytes")
    if "vmm" in entry:
        check_vmm(entry["vmm"], what)
    elif not isinstance(handle, str) or len(handle) != 2 * IPC_HANDLE_BYTES:
        raise ValueError(f"{what}: no valid IPC handle")
    if not all(isinstance(v, int) for v in (offset, size)) or offset < 0 or offset + nbytes > size:
        raise ValueError(f"{what}: {nbytes} bytes at offset {offset} lie outside its {size}-byte allocation")


def check_vmm(vmm, what: str):
    """Refuse a virtual-memory export whose fields are not what VmmExports.export writes."""
    if not isinstance(vmm, dict) or not isinstance(vmm.get("pieces"), list) or not vmm["pieces"] or \
            not all(isinstance(i, int) and i >= 0 for i in vmm["pieces"]) or \
            not isinstance(vmm.get("granularity"), int) or vmm["granularity"] < 1:
        raise ValueError(f"{what}: malformed virtual-memory export")


def check_entry(entry: dict, info: TensorInfo):
    if entry.get("name") != info.name or entry.get("nbytes") != info.nbytes:
        raise ValueError(f"manifest entry {entry.get('name')} does not match the spec's {info.name}")
    check_region(entry, info.nbytes, f"manifest entry {info.name}")


def open_handle(hex_handle: str) -> int:
    handle = runtime.cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), bytes.fromhex(hex_handle), IPC_HANDLE_BYTES)
    return int(cuda_check(runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess),
                          "cudaIpcOpenMemHandle"))


class OpenAllocations:
    """Another process's allocations opened in this one, each once, by handle string; virtual-memory ones
    through `vmm` (imported descriptors)."""

    def __init__(self, device_id: int, vmm: VmmImports | None = None):
        self.device_id, self.vmm = device_id, vmm
        self._bases = {}            # hex handle -> base address here

    def address(self, entry: dict) -> int:
        """This process's address of an export (its handle opened if it is not yet)."""
        if "vmm" in entry:
            if self.vmm is None:
                raise ValueError(f"{entry.get('name')}: a virtual-memory export without its descriptors")
            pieces = entry["vmm"]["pieces"]
            if max(pieces) >= len(self.vmm.sizes):
                raise ValueError(f"{entry.get('name')}: names a descriptor the worker did not send")
            if sum(self.vmm.sizes[i] for i in pieces) != entry["alloc_bytes"]:      # what check_region bounded
                raise ValueError(f"{entry.get('name')}: its allocations' sizes do not add up to its "
                                 f"{entry['alloc_bytes']} bytes")
            set_device(self.device_id)
            return self.vmm.address(entry["vmm"]) + entry["offset"]
        handle = entry["handle"]
        if handle not in self._bases:
            set_device(self.device_id)
            self._bases[handle] = open_handle(handle)
        return self._bases[handle] + entry["offset"]

    def close(self):
        bases, self._bases = self._bases, {}
        if bases:
            set_device(self.device_id)
        for base in bases.values():
            cuda_check(runtime.cudaIpcCloseMemHandle(base), "cudaIpcCloseMemHandle")
        vmm, self.vmm = self.vmm, None
        if vmm is not None:
            set_device(self.device_id)
            vmm.close()
