"""Named POSIX shared-memory segments with a small header naming their creator.

The header lets `fastcache.tools.cleanup` tell a live deployment's segment from a dead one's, and lets an
attacher refuse a segment that another deployment (or another user) put under the expected name.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import struct
import typing

import numpy as np
import posix_ipc
import psutil

MAGIC = b"FCSEG001"
HEADER = struct.Struct("<8sqdq32s")     # magic, creator pid, creator start (wall clock), payload bytes, suffix
TICKS = struct.Struct("<8sd")           # right after it: TICKS_MAGIC, the creator's start in ticks since boot
TICKS_MAGIC = b"FCTICKS1"               # (older segments lack it; older readers do not look at it)
HEADER_BYTES = mmap.PAGESIZE              # the payload starts on a page: the CUDA tier pins it by whole pages
SHM_DIR = "/dev/shm"
SHM_HEADROOM = 0.9     # never plan to use more than this share of free RAM / /dev/shm


class SegmentError(RuntimeError):
    """A segment is missing, foreign, or not one of ours."""


def check_shm_room(need: int, what: str):
    """Refuse (ValueError) to plan `need` more bytes of shared memory than RAM and /dev/shm have free."""
    import shutil
    have = min(psutil.virtual_memory().available, shutil.disk_usage(SHM_DIR).free) * SHM_HEADROOM
    if need > have:
        raise ValueError(f"{what} needs {need / 2**30:.2f} GiB of shared memory, but only {have / 2**30:.2f} GiB "
                         f"can be had")


PROC_DIR = "/proc"


def _proc_stat(pid: int):
    """(state, start in clock ticks since boot) from /proc/PID/stat, None if the process is gone."""
    try:
        with open(f"{PROC_DIR}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()      # after the command name, which may hold spaces
    return fields[0], float(fields[19])                # fields 3 (state) and 22 (starttime) of proc(5)


class Started(typing.NamedTuple):
    """When a process started: wall-clock seconds (psutil) and, where /proc is, clock ticks since boot."""
    wall: float
    ticks: float | None = None


def process_start(pid: int) -> Started:
    """What tells a process from a later one with its pid. Its start in clock ticks since boot is what
    counts where there is /proc: no wall-clock step (NTP, a VM's migration) changes it. The wall-clock start
    stays beside it, for segments and readers that know only that. Started(0.0) if the process is gone."""
    try:
        wall = psutil.Process(pid).create_time()
    except psutil.Error:
        return Started(0.0)
    stat = _proc_stat(pid)
    return Started(wall, None if stat is None else stat[1])


OWN_START = process_start(os.getpid())


def creator_alive(pid: int, start) -> bool:
    """True if the process that created a segment still runs (a reused pid does not count, a zombie neither).
    start: a Started, or wall-clock seconds alone (what an older segment recorded)."""
    wall, ticks = (start, None) if isinstance(start, (int, float)) else start
    if pid <= 0:
        return False
    if ticks is not None and os.path.isdir(PROC_DIR):
        stat = _proc_stat(pid)
        return stat is not None and stat[1] == ticks and stat[0] != b"Z"
    try:       # wall-clock seconds: a step of the clock between the two reads makes a live creator look dead
        proc = psutil.Process(pid)
        return abs(proc.create_time() - wall) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def pack_header(size: int, suffix: str) -> bytes:
    """This process's header for a segment of `size` payload bytes."""
    ticks = TICKS.pack(TICKS_MAGIC, OWN_START.ticks) if OWN_START.ticks is not None else b""
    return HEADER.pack(MAGIC, os.getpid(), OWN_START.wall, size, suffix.encode()[:32]) + ticks


class SharedSegment:
    """A named segment: `create` (mode 0600, exclusive) or `attach`; `close` unlinks if we created it."""

    def __init__(self, name: str, shm: posix_ipc.SharedMemory, owner: bool):
        self.name = name
        self.owner = owner
        self._map = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        self.size = len(self._map) - HEADER_BYTES
        self.creator_pid, self.creator_start, self.suffix = read_header(self._map, name)
        self.closed = False

    @classmethod
    def create(cls, name: str, size: int, suffix: str) -> "SharedSegment":
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=HEADER_BYTES + size)
        except posix_ipc.ExistentialError:
            raise SegmentError(f"shared-memory segment {name} already exists (a stale deployment? "
                               f"run python -m fastcache.tools.cleanup)") from None
        buf = mmap.mmap(shm.fd, HEADER_BYTES)
        header = pack_header(size, suffix)
        buf[:len(header)] = header
        buf.close()
        return cls(name, shm, owner=True)

    @classmethod
    def attach(cls, name: str, suffix: str | None = None) -> "SharedSegment":
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise SegmentError(f"shared-memory segment {name} does not exist") from None
        st = os.fstat(shm.fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            shm.close_fd()
            raise SegmentError(f"refusing {name}: owned by uid {st.st_uid} with mode {oct(st.st_mode & 0o777)}")
        seg = cls(name, shm, owner=False)
        if suffix is not None and seg.suffix != suffix[:32]:
            seg.close()
            raise SegmentError(f"refusing {name}: it belongs to deployment {seg.suffix!r}, not {suffix!r}")
        return seg

    def array(self, dtype, shape, offset: int = 0) -> np.ndarray:
        """A NumPy view of the payload (offset in payload bytes)."""
        return np.ndarray(shape, dtype=dtype, buffer=self._map, offset=HEADER_BYTES + offset)

    def close(self):
        """Unmap (views must be dropped first, else the mapping lives on until they are) and unlink if owner."""
        if self.closed:
            return
        self.closed = True
        try:
            self._map.close()
        except BufferError:
            pass    # a caller still holds a view; the mapping goes with it, the name goes now
        if self.owner:
            unlink(self.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class HeldSegment:
    """A segment only one live process holds: an exclusive flock on it, which the kernel drops when its holder
    exits or dies. Taking it is one atomic step (the lock), so of two processes taking over a dead holder's
    segment at once exactly one gets it; the header then names the new holder, for the clean-up tool."""

    def __init__(self, name: str, fd: int):
        self.name, self._fd = name, fd

    @classmethod
    def take(cls, name: str, suffix: str) -> "HeldSegment":
        """SegmentHeld (naming the holder's pid) if a live process holds it."""
        path = os.path.join(SHM_DIR, name.lstrip("/"))
        while True:
            fd = _create_or_open(name, path)
            if fd is None:
                continue            # its holder let go between our two tries: create it
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = HEADER.unpack_from(os.pread(fd, HEADER.size, 0).ljust(HEADER.size, b"\0"))[1]
                os.close(fd)
                raise SegmentHeld(name, pid) from None
            os.pwrite(fd, pack_header(0, suffix), 0)
            if _same_file(path, fd):
                return cls(name, fd)
            os.close(fd)            # its holder unlinked it before letting go: take the name anew

    def close(self):
        """Unlink (if the name is still this segment) and let go."""
        if self._fd is None:
            return
        try:
            if _same_file(os.path.join(SHM_DIR, self.name.lstrip("/")), self._fd):
                unlink(self.name)
        finally:
            os.close(self._fd)
            self._fd = None


class SegmentHeld(SegmentError):
    def __init__(self, name: str, pid: int):
        super().__init__(f"{name} is held by live process {pid}")
        self.pid = pid


def _create_or_open(name: str, path: str):
    """A descriptor of the segment, made now (mode 0600) or there already; None if it vanished meanwhile."""
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=HEADER_BYTES)
    except posix_ipc.ExistentialError:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SegmentError(f"cannot open {name}: {exc}") from None
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            os.close(fd)
            raise SegmentError(f"refusing {name}: owned by uid {st.st_uid} with mode {oct(st.st_mode & 0o777)}")
        return fd
    fd = os.dup(shm.fd)
    shm.close_fd()
    return fd


def _same_file(path: str, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


class ProcessMemory:
    """Shared memory another process of this user holds open by descriptor (an adopted tensor's storage),
    mapped through /proc/PID/fd: it has no name, so nothing can be left behind."""

    def __init__(self, pid: int, fd: int, size: int):
        self.name = f"pid{pid}.fd{fd}"
        try:
            handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        except OSError as exc:
            raise SegmentError(f"cannot open descriptor {fd} of process {pid}: {exc}") from None
        try:
            st = os.fstat(handle)
            if st.st_uid != os.getuid() or st.st_size < size:
                raise SegmentError(f"refusing descriptor {fd} of process {pid}: owner uid {st.st_uid}, "
                                   f"{st.st_size} bytes, {size} expected")
            self._map = mmap.mmap(handle, size)
        finally:
            os.close(handle)
        self.size = size

    def array(self, dtype, shape, offset: int = 0) -> np.ndarray:
        return np.ndarray(shape, dtype=dtype, buffer=self._map, offset=offset)

    def close(self):
        try:
            self._map.close()
        except BufferError:
            pass    # a view still holds the mapping; it goes with the view


def read_header(buf, name: str):
    if len(buf) < HEADER.size:
        raise SegmentError(f"{name} is too small to be a fastcache segment")
    magic, pid, wall, _size, suffix = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise SegmentError(f"{name} is not a fastcache segment")
    ticks = None
    if len(buf) >= HEADER.size + TICKS.size:
        tag, value = TICKS.unpack_from(buf, HEADER.size)
        ticks = value if tag == TICKS_MAGIC else None
    return pid, Started(wall, ticks), suffix.rstrip(b"\0").decode(errors="replace")


def read_creator(name: str):
    """(pid, start time, suffix) of a segment's creator, read without mapping it writable."""
    with open(os.path.join(SHM_DIR, name.lstrip("/")), "rb") as f:
        return read_header(f.read(HEADER_BYTES), name)


def unlink(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False
