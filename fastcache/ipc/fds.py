"""File descriptors handed between processes over a Unix socket (SCM_RIGHTS): how a worker gives its transfer
manager the shareable handles of virtual-memory KV allocations (docs/design.md §2). The socket lies in the
deployment's 0700 socket directory; both ends check the peer by SO_PEERCRED (same user, and the server is
the process the manifest names). Only a JSON header travels beside the descriptors: nothing is pickled."""
from __future__ import annotations

import glob
import json
import os
import socket
import struct
import tempfile
import threading

from .naming import PREFIX

MAX_HEADER = 1 << 20            # the sizes of some 100,000 allocations (expandable segments map one per page)
SCM_MAX_FD = 253                # Linux: the most descriptors one message carries (more: EINVAL)
_CRED = struct.Struct("3i")     # struct ucred: pid, uid, gid
_LENGTH = struct.Struct("<I")   # the header's bytes, sent with the first batch of descriptors


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket."""
    pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def find_socket_dir(suffix: str) -> str:
    """The deployment's private socket directory (ipc.queue.make_socket_dir): ours, mode 0700, its owner file
    naming this suffix."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}.{suffix}.*")):
        try:
            st = os.stat(path)
            with open(os.path.join(path, "owner.json")) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            continue
        if st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700 and owner.get("suffix") == suffix:
            return path
    raise FileNotFoundError(f"no private socket directory of deployment {suffix} in {tempfile.gettempdir()}")


class FdServer:
    """Serve `fds` with `header` (a JSON object) to every same-user process that connects, on its own thread.
    The descriptors stay the caller's: it closes them after close(). On the wire: the header's length with
    the first SCM_MAX_FD descriptors, a byte with each further batch of them, then the header."""

    def __init__(self, path: str, fds: list[int], header: dict):
        self.path, self.fds = path, list(fds)
        self._header = json.dumps(header, separators=(",", ":")).encode()
        if len(self._header) > MAX_HEADER:
            raise ValueError(f"descriptor header of {len(self._header)} bytes exceeds {MAX_HEADER}")
        if os.path.exists(path):
            os.unlink(path)         # a dead worker's socket of this rank (one live worker holds a rank)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(8)
        self._thread = threading.Thread(target=self._serve, name="fastcache-fds", daemon=True)
        self._thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:         # closed
                return
            with conn:
                conn.settimeout(5.0)        # a peer that stops reading never holds the server up for long
                try:
                    _pid, uid = peer_credentials(conn)
                    if uid == os.getuid():
                        self._send(conn)
                except OSError:
                    pass            # the peer went away: nothing of ours changed

    def _send(self, conn):
        batches = [self.fds[k:k + SCM_MAX_FD] for k in range(0, len(self.fds), SCM_MAX_FD)] or [[]]
        socket.send_fds(conn, [_LENGTH.pack(len(self._header))], batches[0])
        for batch in batches[1:]:
            socket.send_fds(conn, [b"\0"], batch)
        conn.sendall(self._header)

    def close(self):
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def fetch_fds(path: str, server_pid: int, count: int, timeout: float = 10.0) -> tuple[dict, list[int]]:
    """The header and `count` descriptors served at `path` by process `server_pid`; ValueError (and every
    received descriptor closed) if the server is another process or sends another number."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        pid, uid = peer_credentials(sock)
        if pid != server_pid or uid != os.getuid():
            raise ValueError(f"descriptor socket {path} is served by pid {pid} (uid {uid}), not the exporting "
                             f"worker {server_pid}")
        fds = []
        try:
            header = json.loads(_receive(sock, path, count, fds))
            if not isinstance(header, dict) or len(fds) != count:
                raise ValueError(f"descriptor socket {path} sent {len(fds)} descriptors, expected {count}")
        except BaseException:           # a timeout between batches too: none of them may leak
            for fd in fds:
                os.close(fd)
            raise
    return header, fds


def _receive(sock, path: str, count: int, fds: list) -> bytes:
    """FdServer's header; the descriptors that came with it are appended to `fds` as they come (the caller
    closes them if this raises). Linux ends a read after a message's descriptors, so each batch comes whole."""
    batches = max(1, -(-count // SCM_MAX_FD))
    data, want = b"", None
    while want is None or len(data) < want:
        raw, got, flags, _addr = socket.recv_fds(sock, 1 << 16, SCM_MAX_FD)
        fds.extend(got)
        if flags & socket.MSG_CTRUNC or len(fds) > count or not raw:     # too many, or the end came first
            raise ValueError(f"descriptor socket {path} sent {len(fds)} descriptors, expected {count}")
        data += raw
        if want is None and len(data) >= _LENGTH.size:
            length = _LENGTH.unpack_from(data)[0]
            if length > MAX_HEADER:
                raise ValueError(f"descriptor socket {path} announced a header of {length} bytes")
            want = _LENGTH.size + batches - 1 + length
    if len(data) != want:
        raise ValueError(f"descriptor socket {path} sent {len(data) - want} bytes more than expected")
    return data[_LENGTH.size + batches - 1:]
