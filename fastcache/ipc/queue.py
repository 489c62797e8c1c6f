"""The task queue's sockets: pyzmq over ipc:// in a private (0700) directory.

Tasks and phase commands go out on one PUSH socket per rank, bound by the engine and written by the
submitting thread itself (no hand-off to another thread on the hot path); a PUSH->PULL pipe with one
peer is reliable and ordered, and with no peer connected a non-blocking send fails instead of
dropping. Each transfer-manager process gets a PUSH socket and endpoint of its own (its incarnation):
zmq tears the pipe to a dead peer down asynchronously, so a socket kept across a restart would keep
handing tasks to the dead process for as long as zmq's I/O thread is late. Replies come back on one
ROUTER, read by the engine's I/O thread; each transfer manager's DEALER carries its rank and pid as
identity and registers before the first task.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import zmq

from .naming import PREFIX
from .shm import OWN_START

OWNER_FILE = "owner.json"


def make_socket_dir(suffix: str) -> str:
    """A 0700 directory for the deployment's sockets, recording its creator for clean-up."""
    path = tempfile.mkdtemp(prefix=f"{PREFIX}.{suffix}.")
    os.chmod(path, 0o700)
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        json.dump({"pid": os.getpid(), "start": OWN_START, "suffix": suffix}, f)
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
