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

MAX_HEADER = 4096
_CRED = struct.Struct("3i")     # struct ucred: pid, uid, gid


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
    The descriptors stay the caller's: it closes them after close()."""

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
                        socket.send_fds(conn, [self._header], self.fds)
                except OSError:
                    pass            # the peer went away: nothing of ours changed

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
        raw, fds, _flags, _addr = socket.recv_fds(sock, MAX_HEADER, count + 1)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict) or len(fds) != count:
            raise ValueError(f"descriptor socket {path} sent {len(fds)} descriptors, expected {count}")
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise
    return header, fds
