"""The engine's store client in a child process, so that a hung store costs only a bounded wait.

The engine asks the store only what exists (and removes objects). Mooncake's client holds the GIL while
`setup` waits for a master that does not answer (30 s, the whole RPC timeout, measured against a stopped
master), which would stall every thread of the engine process: the in-process workers' heartbeats
included. Its other calls release the GIL, but still wait out Mooncake's timeouts. So the engine's client
lives in `python -m fastcache.store.querier`, and every call waits for its answer at most `timeout`
seconds (QUERY_TIMEOUT by default, the process's start included); a child that does not answer in time is
killed and the call raises StoreError naming the store. The next call starts a fresh child.

Questions go on the child's stdin, answers come back on a pipe of their own (the child's stdout and
stderr are the engine's stderr, so whatever a library prints never reaches the answers). A message is a
length-prefixed JSON header, then a length-prefixed raw frame (hashes as uint64, answers as one byte per
hash, 0 or 1). Every question carries a number its answer repeats (the ready message is number 0): an
answer to another question, or an answer byte other than 0 or 1, fails the call and stops the child. No
pickle.
"""
from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy as np

from .base import StoreError
from .keys import ObjectKeys

QUERY_TIMEOUT = 5.0         # seconds an engine's store call waits for its answer, at most
QUERIER = "fastcache.store.querier"     # the child's module: python -m QUERIER URL ANSWER_FD
LENGTH = struct.Struct("<I")
MAX_FRAME = 1 << 28


def write_message(fd: int, header: dict, payload: bytes = b"", deadline: float | None = None):
    """One message to fd; with a deadline fd must be non-blocking, and TimeoutError comes past it."""
    head = json.dumps(header).encode()
    view = memoryview(LENGTH.pack(len(head)) + head + LENGTH.pack(len(payload)) + payload)
    while view:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise TimeoutError
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue


def read_message(fd: int, deadline: float | None = None) -> tuple[dict, bytes]:
    """One message from fd; EOFError at its end, TimeoutError past the deadline (monotonic seconds)."""
    head = _read_exactly(fd, LENGTH.unpack(_read_exactly(fd, LENGTH.size, deadline))[0], deadline)
    payload = _read_exactly(fd, LENGTH.unpack(_read_exactly(fd, LENGTH.size, deadline))[0], deadline)
    header = json.loads(head)
    if not isinstance(header, dict):
        raise ValueError("a message header must be a JSON object")
    return header, payload


def _read_exactly(fd, n, deadline) -> bytes:
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes is too long")
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


class RemoteStore:
    """exists_every_rank and remove of a store, answered by a child process within `timeout` seconds."""

    def __init__(self, url: str, timeout: float = QUERY_TIMEOUT):
        self.url, self.timeout = url, timeout
        self._proc = None
        self._replies = None                # the read end of the child's answers
        self._asked = 0                     # the number of the last question
        self._lock = threading.Lock()       # one question at a time on the pipe

    def exists_every_rank(self, keys: list[ObjectKeys], hashes: np.ndarray) -> np.ndarray:
        return np.frombuffer(self._ask("exists", keys, hashes), np.uint8).astype(bool)

    def remove(self, keys: ObjectKeys, hashes: np.ndarray):
        self._ask("remove", [keys], hashes)

    def _ask(self, op, keys, hashes) -> bytes:
        deadline = time.monotonic() + self.timeout
        if not self._lock.acquire(timeout=self.timeout):
            raise self._no_answer("another call is still waiting for the store")
        try:
            proc = self._started(deadline)
            self._asked += 1
            header = {"op": op, "seq": self._asked,
                      "keys": [[k.namespace, k.fingerprint, k.rank] for k in keys]}    # each rank's own
            try:
                write_message(proc.stdin.fileno(), header, np.ascontiguousarray(hashes, np.uint64).tobytes(), deadline)
                reply, payload = self._reply(self._asked, deadline)
            except TimeoutError:            # first: it is an OSError too
                self._stop()
                raise self._no_answer("a hung master or memory server?") from None
            except (OSError, EOFError, ValueError) as exc:
                self._stop()
                why = str(exc) or type(exc).__name__
                raise StoreError(f"store {self.url}: the store client process failed ({why}); the next call starts "
                                 f"a new one") from None
            if "error" in reply:
                raise StoreError(str(reply["error"]))
            answer = np.frombuffer(payload, np.uint8)
            if op == "exists" and (len(answer) != len(hashes) or (answer > 1).any()):
                self._stop()
                raise StoreError(f"store {self.url}: the store client's answer is not one 0 or 1 per hash "
                                 f"({len(answer)} bytes for {len(hashes)} hashes); the next call starts a new one")
            return payload
        finally:
            self._lock.release()

    def _reply(self, seq, deadline) -> tuple[dict, bytes]:
        """The answer to question `seq`; ValueError if the child answers another one (a stray reply would
        shift every later answer)."""
        reply, payload = read_message(self._replies, deadline)
        if reply.get("seq") != seq:
            raise ValueError(f"it answered question {reply.get('seq')!r} when asked question {seq}")
        return reply, payload

    def _started(self, deadline):
        """The child, started (and its store opened) if need be, within the deadline."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()
        replies, answer_fd = os.pipe()
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", QUERIER, self.url, str(answer_fd)],
                                          stdin=subprocess.PIPE, stdout=2, close_fds=True, pass_fds=(answer_fd,))
        except BaseException:
            os.close(replies)
            raise
        finally:
            os.close(answer_fd)
        self._replies, self._asked = replies, 0
        os.set_blocking(self._proc.stdin.fileno(), False)     # a long question to a stuck child keeps the bound
        try:
            reply, _ = self._reply(0, deadline)
        except TimeoutError:
            self._stop()
            raise self._no_answer("opening it; a hung master?") from None
        except EOFError:
            self._stop()
            raise StoreError(f"store {self.url}: the store client process exited while opening the store") from None
        except (OSError, ValueError) as exc:
            self._stop()
            raise StoreError(f"store {self.url}: the store client process failed while opening the store "
                             f"({exc or type(exc).__name__})") from None
        if "error" in reply:
            self._stop()
            raise StoreError(str(reply["error"]))
        return self._proc

    def _no_answer(self, why) -> StoreError:
        return StoreError(f"store {self.url}: no answer within {self.timeout:g} s ({why})")

    def _stop(self, grace: float = 0.0):
        proc, self._proc = self._proc, None
        replies, self._replies = self._replies, None
        if replies is not None:
            os.close(replies)
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(grace)            # stdin closed: a child that is not stuck exits at once
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def close(self):
        with self._lock:
            self._stop(grace=2.0)

    def __repr__(self):
        return f"RemoteStore({self.url!r})"
