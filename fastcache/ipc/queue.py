"""The task queue's sockets: pyzmq over ipc:// in a private (0700) directory.

Tasks and phase commands go out on one PUSH socket per rank, bound by the engine and written by the
submitting thread itself (no hand-off to another thread on the hot path); a PUSH->PULL pipe with one
peer is reliable and ordered, and with no peer connected a non-blocking send fails instead of
dropping. Each transfer-manager process gets a PUSH socket and endpoint of its own (its incarnation):
zmq tears the pipe to a dead peer down asynchronously, so a socket kept across a restart would keep
handing tasks to the dead process for as long as zmq's I/O thread is late. Replies come back on one
ROUTER, read by the engine's I/O thread; each transfer manager's DEALER carries its rank and pid as
identity and registers before the first task.

Every message is authenticated (docs/design.md §12): frame 0 is a keyed BLAKE2b MAC of the others under
the deployment's token, which the engine hands each transfer manager on its stdin and never sends; a
message from any other process of the same user is dropped. Engine-to-rank messages carry a sequence
number (frame 1), so a transfer manager sees when another process has taken messages off its pipe.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import struct
import tempfile

import zmq

from .naming import PREFIX
from .shm import OWN_START

OWNER_FILE = "owner.json"
TOKEN_BYTES = 16
MAC_BYTES = 16
SEQ = struct.Struct("<Q")
TO_RANK, TO_ENGINE = b"fastcache>rank", b"fastcache>engine"     # MAC personalisation: one per direction


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def read_token(stream) -> bytes:
    """The deployment token from the first line of `stream` (hex), as the engine writes it."""
    try:
        token = bytes.fromhex(stream.readline().decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        token = b""
    if len(token) != TOKEN_BYTES:
        raise ValueError("no deployment token on stdin (the engine that spawns a transfer manager writes one)")
    return token


def mac(token: bytes, direction: bytes, frames) -> bytes:
    digest = hashlib.blake2b(key=token, digest_size=MAC_BYTES, person=direction)
    for frame in frames:
        view = memoryview(frame)
        digest.update(SEQ.pack(view.nbytes))        # frame boundaries are part of what is signed
        digest.update(view)
    return digest.digest()


def signed(token: bytes, direction: bytes, frames: list) -> list:
    return [mac(token, direction, frames)] + frames


def verified(token: bytes, direction: bytes, frames: list):
    """The frames after the MAC, or None if the MAC is missing or wrong."""
    if len(frames) < 2 or len(frames[0]) != MAC_BYTES:
        return None
    return frames[1:] if hmac.compare_digest(frames[0], mac(token, direction, frames[1:])) else None


def make_socket_dir(suffix: str) -> str:
    """A 0700 directory for the deployment's sockets, recording its creator for clean-up."""
    path = tempfile.mkdtemp(prefix=f"{PREFIX}.{suffix}.")
    os.chmod(path, 0o700)
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        json.dump({"pid": os.getpid(), "start": OWN_START.wall, "start_ticks": OWN_START.ticks, "suffix": suffix},
                  f)
    return path


def remove_socket_dir(path: str):
    shutil.rmtree(path, ignore_errors=True)


def task_endpoint(socket_dir: str, rank: int, incarnation: int) -> str:
    return f"ipc://{os.path.join(socket_dir, f'tasks{rank}.{incarnation}')}"


def reply_endpoint(socket_dir: str) -> str:
    return f"ipc://{os.path.join(socket_dir, 'replies')}"


def rank_identity(rank: int, pid: int | None = None) -> bytes:
    return b"rank%d.%d" % (rank, os.getpid() if pid is None else pid)


def identity_rank(identity: bytes):
    """(rank, pid) of a transfer manager's identity, or None."""
    m = re.fullmatch(rb"rank([0-9]{1,9})\.([0-9]{1,10})", identity)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _configure(sock):
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)      # never drop or block on a burst of tasks
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 28)   # an oversized frame is refused by zmq itself


def bind_tasks(context: zmq.Context, socket_dir: str, rank: int, incarnation: int):
    """The task PUSH socket for one incarnation of rank's transfer manager."""
    push = context.socket(zmq.PUSH)
    _configure(push)
    push.bind(task_endpoint(socket_dir, rank, incarnation))
    return push


def bind_replies(context: zmq.Context, socket_dir: str):
    """The engine's reply ROUTER."""
    router = context.socket(zmq.ROUTER)
    _configure(router)
    router.bind(reply_endpoint(socket_dir))
    return router


def connect_client(context: zmq.Context, socket_dir: str, rank: int, incarnation: int):
    """(task PULL, reply DEALER) of rank's transfer manager."""
    pull = context.socket(zmq.PULL)
    _configure(pull)
    pull.connect(task_endpoint(socket_dir, rank, incarnation))
    dealer = context.socket(zmq.DEALER)
    _configure(dealer)
    dealer.setsockopt(zmq.IDENTITY, rank_identity(rank))
    dealer.connect(reply_endpoint(socket_dir))
    return pull, dealer
