"""The CPU tier on the cuda device: the engine's shared-memory segment registered with cudaHostRegister
(mapped, portable) in chunks on a background thread (docs/design.md §2)."""
from __future__ import annotations

import contextlib
import math
import mmap
import threading
import time

from cuda.bindings import runtime

from ..config import CacheSpec
from ..errors import TransferError
from ..ipc.shm import SharedSegment
from .base import SwapSpace
from .cuda_kernels import cuda_check, set_device

PIN_CHUNK_BYTES = 256 << 20      # cudaHostRegister granularity: ~0.1 s of pinning per chunk


class CudaSwapSpace(SwapSpace):
    """The CPU tier, registered (mapped, portable) chunk by chunk on a background thread: start-up does not
    wait for a large tier, and a swap waits only for the chunks holding its CPU blocks. The driver serialises
    cudaHostRegister with the process's other CUDA calls, so an attach pauses the pinning (paused()) rather
    than queue behind it chunk after chunk."""

    def __init__(self, segment: SharedSegment, spec: CacheSpec, device_id: int, chunk_bytes: int = PIN_CHUNK_BYTES):
        super().__init__(segment, spec)
        self.device_id = device_id
        self.stride, self.num_blocks = spec.cpu_block_stride, spec.num_cpu_blocks   # a block and its slot
        self.host_ptr = self.blocks.ctypes.data
        self.pin_seconds = None                  # wall time to pin the whole tier, once done
        # Chunks hold whole pages (two registrations never share one) and whole CPU blocks (a row never
        # straddles two); DMA runs and merged rows are split at chunk edges (dma_runs, row_copies), since
        # one cudaMemcpy must lie in one registered range to run as DMA
        page = mmap.PAGESIZE
        if self.host_ptr % page:
            raise TransferError("the CPU tier must start on a page boundary (SharedSegment payloads do)")
        unit = math.lcm(page, self.stride)
        chunk_bytes = max(1, chunk_bytes // unit) * unit
        self.chunk_blocks = chunk_bytes // self.stride
        start, end = self.host_ptr, -(-(self.host_ptr + self.blocks.nbytes) // page) * page
        self._chunks = [(addr, min(chunk_bytes, end - addr)) for addr in range(start, end, chunk_bytes)]
        self._registered = []
        self._pinned_end = start                 # every byte below this address is registered
        self._mapping_delta = set()              # device address minus host address, per chunk
        self._error = None
        self._closing = False
        self._pauses = 0                         # paused() blocks in progress
        self._waiters = 0                        # wait_pinned() calls in progress: they override a pause
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._pin, name="fastcache-pin", daemon=True)
        self._thread.start()

    def _pin(self):
        began = time.perf_counter()
        flags = runtime.cudaHostRegisterMapped | runtime.cudaHostRegisterPortable
        try:
            set_device(self.device_id)
            for k, (addr, size) in enumerate(self._chunks):
                with self._cond:
                    while self._pauses and not self._waiters and not self._closing:
                        self._cond.wait()
                    if self._closing:
                        return
                cuda_check(runtime.cudaHostRegister(addr, size, flags), f"cudaHostRegister({size} bytes)")
                self._registered.append(addr)
                mapped = int(cuda_check(runtime.cudaHostGetDevicePointer(addr, 0), "cudaHostGetDevicePointer"))
                with self._cond:
                    self._mapping_delta.add(mapped - addr)
                    self._pinned_end = addr + size
                    if k == len(self._chunks) - 1:      # set before any waiter for the whole tier wakes
                        self.pin_seconds = time.perf_counter() - began
                    self._cond.notify_all()
        except Exception as exc:        # reported to every waiter: a silent pin thread would hang swaps
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def wait_pinned(self, num_blocks: int | None = None):
        """Block until CPU blocks [0, num_blocks) (default: all) are registered."""
        end = self.host_ptr + (self.num_blocks if num_blocks is None else num_blocks) * self.stride
        if self._pinned_end >= end:          # the common case, without the lock
            return
        with self._cond:
            self._waiters += 1
            self._cond.notify_all()
            try:
                while self._pinned_end < end and self._error is None and not self._closing:
                    self._cond.wait()
            finally:
                self._waiters -= 1
            if self._error is not None:
                raise TransferError(f"pinning the swap space failed: {self._error}")
            if self._closing:
                raise TransferError("the swap space is closed")

    @contextlib.contextmanager
    def paused(self):
        """No chunk starts registering inside the block (one in progress finishes first), unless a swap
        waits for one: an attach's CUDA calls then run at once instead of after the whole tier is pinned."""
        with self._cond:
            self._pauses += 1
        try:
            yield self
        finally:
            with self._cond:
                self._pauses -= 1
                self._cond.notify_all()

    def pinned_bytes(self) -> int:
        return self._pinned_end - self.host_ptr

    def mapped_ptr(self) -> int:
        """Device address of the tier's first block (the kernel method reads and writes it directly)."""
        with self._cond:
            if len(self._mapping_delta) != 1:
                raise TransferError("copy method 'kernel' needs the CPU tier mapped at one device range "
                                    "(cudaDevAttrCanUseHostPointerForRegisteredMem); use 'staged'")
            return self.host_ptr + next(iter(self._mapping_delta))

    def close(self):
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        try:
            if self._registered:
                set_device(self.device_id)
            while self._registered:
                cuda_check(runtime.cudaHostUnregister(self._registered.pop()), "cudaHostUnregister")
        finally:
            super().close()
