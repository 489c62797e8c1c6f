"""Virtual-memory (cuMemCreate) KV caches shared by file descriptor (docs/design.md §2), without a GPU.

A fake driver plays the VMM calls on host memory: a physical allocation is a memfd, a mapping is that memfd
mmap'ed MAP_SHARED|MAP_FIXED into a reserved address range, an exported shareable handle is a real duplicate
of the memfd, an import holds its own. So the descriptors really travel over the worker's Unix socket
(SCM_RIGHTS), an importer's bytes are the exporter's only through the descriptor it received, and memory
lives exactly as long as a handle or a mapping holds it (as in CUDA, where an import keeps memory alive).
"""
import contextlib
import ctypes
import hashlib
import mmap
import multiprocessing
import os

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.driver")

import fastcache.ops.cuda as cuda_ops  # noqa: E402
import fastcache.ops.cuda_ipc as cuda_ipc  # noqa: E402
import fastcache.ops.cuda_vmm as cuda_vmm  # noqa: E402
from cuda.bindings import driver  # noqa: E402
from fastcache import TransferError  # noqa: E402
from fastcache.ipc.barrier import phase_barrier  # noqa: E402
from fastcache.ipc.fds import find_socket_dir  # noqa: E402
from fastcache.ipc.manifest import read_manifest  # noqa: E402
from fastcache.ipc.naming import new_suffix  # noqa: E402
from fastcache.ipc.queue import make_socket_dir, remove_socket_dir  # noqa: E402
from fastcache.ipc.signal import DeploymentSignals  # noqa: E402
from fastcache.worker.cache_worker import CacheWorker, serve_descriptors  # noqa: E402

from conftest import small_spec  # noqa: E402
from test_cuda_logic import FakeRuntime, install_runtime  # noqa: E402

OK = driver.CUresult.CUDA_SUCCESS
OK_RT = FakeRuntime.cudaError_t.cudaSuccess
INVALID = driver.CUresult.CUDA_ERROR_INVALID_VALUE
NONE = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
POSIX_FD = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
GRANULARITY = 64 * 1024

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value
PROT_NONE, MAP_FIXED = 0, 0x10       # Linux values (the mmap module lacks them)


def _mmap(addr, size, prot, flags, fd):
    got = libc.mmap(addr, size, prot, flags, fd, 0)
    if got == MAP_FAILED:
        raise OSError(ctypes.get_errno(), "mmap")
    return got


class FakeDriver:
    """cuMem* on memfds. Handles are ints naming a descriptor this fake holds; `log` records the calls that
    let memory go, in order, with the physical allocation (the memfd's inode) they concern."""
    CUdeviceptr = staticmethod(lambda p: int(p))
    CUmemAllocationHandleType = driver.CUmemAllocationHandleType
    CUmemAllocationGranularity_flags = driver.CUmemAllocationGranularity_flags
    CUmemAccessDesc, CUmemLocationType = driver.CUmemAccessDesc, driver.CUmemLocationType
    CUmemAccess_flags, CUresult = driver.CUmemAccess_flags, driver.CUresult

    def __init__(self):
        self.handles = {}       # handle -> (fd, size, requested types)
        self.maps = {}          # mapped address -> (size, handle's inode, types)
        self.reserved = {}      # reservation address -> size
        self.access = {}        # mapped address -> device id it is readable and writable from
        self.log = []
        self._next = 1

    def inode(self, fd):
        return os.fstat(fd).st_ino

    def _handle(self, fd, size, types):
        handle, self._next = self._next, self._next + 1
        self.handles[handle] = (fd, size, types)
        return handle

    def cuMemCreate(self, size, prop, flags):
        assert size % GRANULARITY == 0
        fd = os.memfd_create("fake-vmm")
        os.ftruncate(fd, size)
        return OK, self._handle(fd, size, int(prop.requestedHandleTypes))

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        assert size % GRANULARITY == 0
        va = _mmap(None, size, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
        self.reserved[va] = size
        return OK, va

    def cuMemMap(self, ptr, size, offset, handle, flags):
        fd, hsize, types = self.handles[handle]
        assert offset == 0 and size == hsize and any(a <= ptr and ptr + size <= a + n for a, n in self.reserved.items())
        _mmap(ptr, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED, fd)
        self.maps[ptr] = (size, self.inode(fd), types)
        return (OK,)

    def cuMemSetAccess(self, ptr, size, descs, count):
        covered = [a for a, (n, _, _) in self.maps.items() if ptr <= a < ptr + size]
        assert covered and sum(self.maps[a][0] for a in covered) == size
        for a in covered:
            self.access[a] = descs[0].location.id
        return (OK,)

    def cuMemUnmap(self, ptr, size):
        msize, inode, _ = self.maps.pop(ptr)
        assert msize == size, "cuMemUnmap of part of a mapping"
        self.access.pop(ptr, None)
        _mmap(ptr, size, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED, -1)
        self.log.append(("unmap", ptr, inode))
        return (OK,)

    def cuMemAddressFree(self, ptr, size):
        assert self.reserved.pop(ptr) == size
        assert not any(ptr <= a < ptr + size for a in self.maps), "freeing a reservation that is still mapped"
        libc.munmap(ptr, size)
        return (OK,)

    def cuMemRelease(self, handle):
        fd, _, _ = self.handles.pop(handle)
        self.log.append(("release", handle, self.inode(fd)))
        os.close(fd)
        return (OK,)

    def _mapping_at(self, ptr):
        return next(((a, n, i, t) for a, (n, i, t) in self.maps.items() if a <= ptr < a + n), None)

    def cuMemGetAddressRange(self, ptr):
        found = self._mapping_at(int(ptr))
        return (OK, found[0], found[1]) if found else (INVALID, 0, 0)

    def cuMemRetainAllocationHandle(self, ptr):
        found = self._mapping_at(int(ptr))
        if found is None:
            return INVALID, None
        base, size, inode, types = found
        fd = os.open(f"/proc/self/map_files/{base:x}-{base + size:x}", os.O_RDWR)
        assert self.inode(fd) == inode
        return OK, self._handle(fd, size, types)

    def cuMemGetAllocationPropertiesFromHandle(self, handle):
        prop = driver.CUmemAllocationProp()
        prop.requestedHandleTypes = self.handles[handle][2]
        return OK, prop

    def cuMemGetAllocationGranularity(self, prop, option):
        return OK, GRANULARITY

    def cuMemExportToShareableHandle(self, handle, handle_type, flags):
        fd, _, types = self.handles[handle]
        if handle_type != POSIX_FD or not types & int(POSIX_FD):
            return INVALID, None
        return OK, os.dup(fd)

    def cuMemImportFromShareableHandle(self, fd, handle_type):
        assert handle_type == POSIX_FD
        size = os.fstat(fd).st_size
        handle = self._handle(os.dup(fd), size, int(POSIX_FD))
        self.log.append(("import", handle, self.inode(fd)))
        return OK, handle

    def live(self, inode) -> list:
        """What still holds physical allocation `inode` in this process: every open descriptor of it (handles,
        exported or received descriptors) and every mapping."""
        fds = []
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/self/fd/{name}").st_ino == inode:
                    fds.append(int(name))
        return fds + [a for a, (_, i, _) in self.maps.items() if i == inode]


class Tensor:
    """A framework tensor as adoption sees it: rows of bytes at a device address."""

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


class Owner:
    """The engine side: its KV tensors in VMM memory as vLLM's cumem allocator lays them out (one reservation
    and one allocation per tensor; `pieces` > 1 splits a tensor over several allocations mapped back to back,
    as PyTorch's expandable segments do). sleep() unmaps and releases, wake_up() maps new memory at the
    same addresses, as CuMemAllocator does."""

    def __init__(self, fake, infos, types=POSIX_FD, pieces=1):
        self.fake, self.infos, self.types, self.pieces = fake, infos, types, pieces
        self.spans = []         # per tensor: (reservation, reserved bytes, [(address, size)])
        self.handles = []
        for info in infos:
            total = -(-info.nbytes // (GRANULARITY * pieces)) * GRANULARITY * pieces
            _, va = fake.cuMemAddressReserve(total, GRANULARITY, 0, 0)
            step = total // pieces
            self.spans.append((va, total, [(va + i * step, step) for i in range(pieces)]))
        self.wake_up()

    def wake_up(self):
        prop = driver.CUmemAllocationProp()
        prop.requestedHandleTypes = self.types
        for _, _, parts in self.spans:
            for addr, size in parts:
                _, handle = self.fake.cuMemCreate(size, prop, 0)
                self.fake.cuMemMap(addr, size, 0, handle, 0)
                self.handles.append(handle)

    def sleep(self):
        """Unmap and release every allocation; returns the inodes that went, for the caller to check."""
        inodes = [self.fake.maps[addr][1] for _, _, parts in self.spans for addr, _ in parts]
        for _, _, parts in self.spans:
            for addr, size in parts:
                self.fake.cuMemUnmap(addr, size)
        for handle in self.handles:
            self.fake.cuMemRelease(handle)
        self.handles = []
        return inodes

    def tensors(self):
        return {info.name: Tensor(va, info.num_blocks, info.block_bytes)
                for info, (va, _, _) in zip(self.infos, self.spans)}

    def write(self, rng):
        """Random bytes in every tensor (never zeros); returns them."""
        data = [rng.integers(0, 256, info.nbytes, dtype=np.uint8) for info in self.infos]
        for (va, _, _), d in zip(self.spans, data):
            ctypes.memmove(va, d.ctypes.data, d.nbytes)
        return data

    def read(self):
        return [np.ctypeslib.as_array((ctypes.c_uint8 * info.nbytes).from_address(va)).copy()
                for info, (va, _, _) in zip(self.infos, self.spans)]

    def close(self):
        if self.handles:
            self.sleep()
        for va, total, _ in self.spans:
            self.fake.cuMemAddressFree(va, total)


@pytest.fixture
def fake_vmm(monkeypatch):
    fake = FakeDriver()
    runtime = FakeRuntime()
    # as CUDA does: IPC handles refuse memory that cuMemCreate made
    runtime.cudaIpcGetMemHandle = lambda ptr: (FakeRuntime.cudaError_t.cudaErrorInvalidValue, None)
    runtime.cudaGetErrorName = lambda err: (OK_RT, err.name.encode())
    runtime.cudaGetErrorString = lambda err: (OK_RT, b"")
    install_runtime(monkeypatch, runtime)
    for module in (cuda_vmm, cuda_ipc):
        monkeypatch.setattr(module, "driver", fake)
    monkeypatch.setattr(cuda_ipc, "runtime", runtime)
    monkeypatch.setattr(cuda_ipc, "set_device", lambda device_id: None)
    suffix = new_suffix()
    socket_dir = make_socket_dir(suffix)
    yield fake, suffix
    remove_socket_dir(socket_dir)


def spec_of(num_layers=3):
    # rows of 3000 bytes: a tensor neither starts nor ends on a granularity boundary
    return small_spec(num_layers=num_layers, num_gpu_blocks=40, cache_dtype="uint8", block_size=1,
                      num_kv_heads=1, head_dim=3000, has_value=False)


@contextlib.contextmanager
def exported(owner, suffix, spec):
    """The worker side: adopt the owner's tensors and serve their descriptors, as CacheWorker does."""
    cache = cuda_ops.CudaOps().adopt(spec, 0, 0, owner.tensors())
    manifest, server = serve_descriptors(suffix, 0, cache)
    try:
        yield manifest
    finally:
        if server is not None:
            server.close()
        cache.release()


@pytest.mark.parametrize("pieces", [1, 3])
def test_a_vmm_kv_cache_moves_bit_for_bit_through_descriptors_passed_over_the_socket(fake_vmm, pieces):
    fake, suffix = fake_vmm
    spec = spec_of()
    infos = spec.tensors()
    rng = np.random.default_rng(pieces)
    owner = Owner(fake, infos, pieces=pieces)
    try:
        data = owner.write(rng)
        with exported(owner, suffix, spec) as manifest:
            # every allocation a tensor touches, in order, once (a tensor of 3000-byte rows over 64 KiB pieces
            # touches two of its three)
            touched = [[a for a, n in parts if a < va + info.nbytes] for info, (va, _, parts) in
                       zip(infos, owner.spans)]
            assert [len(e["vmm"]["pieces"]) for e in manifest] == [len(t) for t in touched] == [min(pieces, 2)] * 3
            assert all("handle" not in e and e["vmm"]["count"] == sum(map(len, touched)) for e in manifest)
            logged = len(fake.log)
            attached = cuda_ops.CudaOps().attach(manifest, infos, suffix)
            try:
                imports = [i for what, _, i in fake.log[logged:] if what == "import"]
                assert imports == [fake.maps[a][1] for t in touched for a in t]
                # the transfer manager's addresses are its own mappings, readable from its device
                assert not set(attached.pointers) & {va for va, _, _ in owner.spans}
                assert all(fake.access.get(p - e["offset"]) == 0 for p, e in zip(attached.pointers, manifest))
                for index, d in enumerate(data):
                    assert np.array_equal(attached.read(index).reshape(-1), d)
                # and the other way: rows written through the import land in the owner's memory
                blocks = rng.choice(infos[0].num_blocks, 7, replace=False)
                rows = rng.integers(0, 256, (7, infos[0].block_bytes), dtype=np.uint8)
                attached.write(1, rows, blocks)
                assert np.array_equal(owner.read()[1].reshape(-1, infos[1].block_bytes)[blocks], rows)
            finally:
                attached.close()
    finally:
        owner.close()
    assert not fake.handles and not fake.maps and not fake.reserved


def test_a_vmm_cache_over_more_allocations_than_one_message_carries_attaches_bit_for_bit(fake_vmm):
    """PyTorch's expandable segments map a page (2 or 20 MiB) per allocation, so a KV cache of some GiB lies in
    thousands of them. One SCM_RIGHTS message carries at most 253 descriptors (Linux's SCM_MAX_FD) and their
    sizes outgrow a 4 KiB header: here 3 tensors over 705 allocations, every byte compared through them."""
    fake, suffix = fake_vmm
    spec = small_spec(num_layers=3, num_gpu_blocks=40, cache_dtype="uint8", block_size=1, num_kv_heads=1,
                      head_dim=384_000, has_value=False)
    infos = spec.tensors()
    pieces = -(-infos[0].nbytes // GRANULARITY)          # one allocation per granule, as expandable segments do
    rng = np.random.default_rng(705)
    owner = Owner(fake, infos, pieces=pieces)
    try:
        data = owner.write(rng)
        with exported(owner, suffix, spec) as manifest:
            assert manifest[0]["vmm"]["count"] == len(infos) * pieces > 253
            attached = cuda_ops.CudaOps().attach(manifest, infos, suffix)
            try:
                for index, d in enumerate(data):
                    assert np.array_equal(attached.read(index).reshape(-1), d)
            finally:
                attached.close()
    finally:
        owner.close()
    assert not fake.handles and not fake.maps and not fake.reserved


def test_descriptors_served_in_another_order_are_caught_by_the_comparison(fake_vmm, monkeypatch):
    """Negative control: the bytes compared above come through the descriptors, so a server that swaps two
    of them makes the same comparison fail."""
    fake, suffix = fake_vmm
    spec = spec_of()
    infos = spec.tensors()
    owner = Owner(fake, infos)
    real_init = cuda_ops.VmmImports.__init__

    def swapped(self, fds, sizes, device_id):
        real_init(self, [fds[1], fds[0], *fds[2:]], sizes, device_id)

    monkeypatch.setattr(cuda_ops.VmmImports, "__init__", swapped)
    try:
        data = owner.write(np.random.default_rng(7))
        with exported(owner, suffix, spec) as manifest:
            attached = cuda_ops.CudaOps().attach(manifest, infos, suffix)
            try:
                assert not np.array_equal(attached.read(0).reshape(-1), data[0])
                assert np.array_equal(attached.read(0).reshape(-1), data[1])
            finally:
                attached.close()
    finally:
        owner.close()


def test_sleep_releases_the_import_before_the_owner_unmaps_and_wake_imports_the_new_memory(fake_vmm):
    """The order of a sleep (docs/design.md §6, §10): the transfer manager unmaps and releases its import
    (detach), the worker lets go of its exports, and only then does the owner unmap; after wake-up the
    worker exports again and the transfer manager maps the new memory, whose bytes it then reads."""
    fake, suffix = fake_vmm
    spec = spec_of()
    infos = spec.tensors()
    rng = np.random.default_rng(3)
    owner = Owner(fake, infos)
    try:
        owner.write(rng)
        with exported(owner, suffix, spec) as manifest:
            attached = cuda_ops.CudaOps().attach(manifest, infos, suffix)
            attached.close()                    # the transfer manager's detach on CLEARING
        before_sleep = len(fake.log)
        inodes = owner.sleep()
        for inode in inodes:                    # nothing but the owner held the memory: it is gone
            assert not fake.live(inode)
        first_owner_unmap = next(i for i, (what, _, _) in enumerate(fake.log) if what == "unmap" and
                                 i >= before_sleep)
        imports = {h for what, h, _ in fake.log if what == "import"}
        released = [i for i, (what, h, _) in enumerate(fake.log) if what == "release" and h in imports]
        assert len(released) == len(imports) == len(infos) and max(released) < first_owner_unmap

        owner.wake_up()
        data = owner.write(rng)
        with exported(owner, suffix, spec) as manifest:
            attached = cuda_ops.CudaOps().attach(manifest, infos, suffix)
            try:
                for index, d in enumerate(data):
                    assert np.array_equal(attached.read(index).reshape(-1), d)
            finally:
                attached.close()
    finally:
        owner.close()
    assert not fake.handles and not fake.maps and not fake.reserved


def test_an_import_kept_across_the_owners_sleep_keeps_the_memory_alive(fake_vmm):
    """Negative control of the order above: had the transfer manager kept its import, the owner's sleep would
    free nothing (and after wake-up it would read the old memory, not the owner's)."""
    fake, suffix = fake_vmm
    spec = spec_of(num_layers=1)
    infos = spec.tensors()
    owner = Owner(fake, infos)
    try:
        old = owner.write(np.random.default_rng(5))
        with exported(owner, suffix, spec) as manifest:
            attached = cuda_ops.CudaOps().attach(manifest, infos, suffix)
        try:
            inodes = owner.sleep()
            assert all(fake.live(inode) for inode in inodes)
            owner.wake_up()
            new = owner.write(np.random.default_rng(6))
            assert np.array_equal(attached.read(0).reshape(-1), old[0])
            assert not np.array_equal(attached.read(0).reshape(-1), new[0])
        finally:
            attached.close()
    finally:
        owner.close()


def test_start_on_vmm_memory_without_an_exportable_handle_fails_naming_sleep_mode(fake_vmm):
    """vLLM's cumem allocator (sleep mode, enable_cumem_allocator) requests no shareable handle type: the
    adoption at start refuses it with an error that says so, and leaves nothing exported."""
    fake, suffix = fake_vmm
    spec = spec_of()
    owner = Owner(fake, spec.tensors(), types=NONE)
    try:
        handles = set(fake.handles)
        with pytest.raises(TransferError, match=r"sleep mode \(enable_sleep_mode=True\) and "
                                                r"enable_cumem_allocator=True") as raised:
            cuda_ops.CudaOps().adopt(spec, 0, 0, owner.tensors())
        assert "requested handle types 0x0" in str(raised.value)
        assert set(fake.handles) == handles     # every handle it retained to look was released
    finally:
        owner.close()


def test_the_transfer_manager_refuses_descriptors_from_a_process_that_is_not_the_worker(fake_vmm):
    fake, suffix = fake_vmm
    spec = spec_of()
    infos = spec.tensors()
    owner = Owner(fake, infos)
    try:
        with exported(owner, suffix, spec) as manifest:
            forged = [{**e, "vmm": {**e["vmm"], "pid": os.getpid() + 1}} for e in manifest]
            with pytest.raises(ValueError, match="not the exporting worker"):
                cuda_ops.CudaOps().attach(forged, infos, suffix)
            fewer = [{**e, "vmm": {**e["vmm"], "count": len(infos) - 1}} for e in manifest]
            with pytest.raises(ValueError, match="descriptors, expected"):
                cuda_ops.CudaOps().attach(fewer, infos, suffix)
            outside = [{**e, "offset": e["alloc_bytes"]} for e in manifest]
            with pytest.raises(ValueError, match="lie outside"):
                cuda_ops.CudaOps().attach(outside, infos, suffix)
            larger = [{**e, "alloc_bytes": e["alloc_bytes"] + GRANULARITY} for e in manifest]
            with pytest.raises(ValueError, match="do not add up"):
                cuda_ops.CudaOps().attach(larger, infos, suffix)
        assert not [h for h in fake.handles if h not in owner.handles]      # no import left behind
    finally:
        owner.close()


def attach_and_digest(manifest, infos, suffix, conn):
    """The transfer manager's side in its own process: attach (descriptors over the socket), then send back a
    digest of every tensor's bytes as its mappings show them."""
    try:
        attached = cuda_ops.CudaOps().attach(manifest, infos, suffix)
        try:
            conn.send([hashlib.sha256(attached.read(i).tobytes()).hexdigest() for i in range(len(infos))])
        finally:
            attached.close()
    except BaseException as exc:
        conn.send(repr(exc))
    finally:
        conn.close()


def test_another_process_maps_the_cache_from_the_descriptors_it_received(fake_vmm):
    """Across processes: the worker's server checks nothing but the uid, the transfer manager checks the
    server is the pid the manifest names, and the child's bytes come from descriptors that crossed the socket."""
    fake, suffix = fake_vmm
    spec = spec_of()
    infos = spec.tensors()
    owner = Owner(fake, infos)
    try:
        data = owner.write(np.random.default_rng(11))
        with exported(owner, suffix, spec) as manifest:
            ctx = multiprocessing.get_context("fork")
            ours, theirs = ctx.Pipe()
            child = ctx.Process(target=attach_and_digest, args=(manifest, infos, suffix, theirs))
            child.start()
            theirs.close()
            got = ours.recv()
            child.join()
        assert got == [hashlib.sha256(d.tobytes()).hexdigest() for d in data], got
    finally:
        owner.close()


@contextlib.contextmanager
def deployment_signals(suffix):
    """What the engine creates before a worker starts: the signals and the phase barrier."""
    signals = DeploymentSignals(suffix, 1, create=True)
    barrier = phase_barrier(suffix, 1, create=True)
    try:
        yield signals
    finally:
        barrier.close()
        signals.close()


def test_a_cache_worker_publishes_vmm_exports_by_socket_and_lets_go_of_them_on_close(fake_vmm):
    fake, suffix = fake_vmm
    spec = spec_of()
    infos = spec.tensors()
    owner = Owner(fake, infos)
    try:
        data = owner.write(np.random.default_rng(13))
        with deployment_signals(suffix) as signals:
            worker = CacheWorker(spec, 0, 1, device="cuda", suffix=suffix, device_id=0,
                                 tensors=owner.tensors()).start()
            try:
                assert signals.cache_ready[0] == 1
                manifest = read_manifest(suffix, 0)         # as the transfer manager reads it
                path = manifest[0]["vmm"]["socket"]
                assert os.path.dirname(path) == find_socket_dir(suffix) and manifest[0]["vmm"]["pid"] == os.getpid()
                attached = cuda_ops.CudaOps().attach(manifest, infos, suffix)
                try:
                    for index, d in enumerate(data):
                        assert np.array_equal(attached.read(index).reshape(-1), d)
                finally:
                    attached.close()
            finally:
                worker.close()
            assert not os.path.exists(path)
        # the worker closed its exported descriptors: only the owner's handle and mapping hold each allocation
        for _, _, parts in owner.spans:
            assert len(fake.live(fake.maps[parts[0][0]][1])) == 2
    finally:
        owner.close()


def test_a_cache_worker_on_unexportable_vmm_memory_fails_at_start_naming_sleep_mode(fake_vmm):
    fake, suffix = fake_vmm
    spec = spec_of()
    owner = Owner(fake, spec.tensors(), types=NONE)
    try:
        with deployment_signals(suffix) as signals:
            with pytest.raises(TransferError, match="sleep mode"):
                CacheWorker(spec, 0, 1, device="cuda", suffix=suffix, device_id=0, tensors=owner.tensors()).start()
            assert signals.cache_ready[0] == 0
            assert not os.path.exists(os.path.join(find_socket_dir(suffix), "fds_rank0"))
    finally:
        owner.close()
