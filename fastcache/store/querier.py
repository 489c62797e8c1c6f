"""python -m fastcache.store.querier URL ANSWER_FD: the engine's store client, in a process of its own
(remote.py).

Opens the store, says so (or why not) on ANSWER_FD, then answers one question at a time from stdin until
stdin ends, each answer numbered as its question. What the process prints goes to stdout, never among
the answers. It exits when its parent process does (a thread watches; PR_SET_PDEATHSIG would fire when the
engine thread that started it ends), so an engine that is killed leaves no querier behind.
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np

from .base import StoreError
from .keys import ObjectKeys
from .remote import read_message, write_message
from .url import open_store

ORPHAN_CHECK = 0.5          # seconds between checks that the parent is still there


def main(argv) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m fastcache.store.querier STORE_URL ANSWER_FD", file=sys.stderr)
        return 2
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    inp, out = sys.stdin.fileno(), int(argv[1])
    try:
        store = open_store(argv[0])
    except (StoreError, ValueError) as exc:
        write_message(out, {"seq": 0, "error": str(exc)})
        return 1
    write_message(out, {"seq": 0, "ready": True})
    try:
        while True:
            try:
                header, payload = read_message(inp)
            except EOFError:
                return 0
            seq = header.get("seq")
            try:
                keys = [ObjectKeys(str(namespace), str(fp), int(rank)) for namespace, fp, rank in header["keys"]]
                hashes = np.frombuffer(payload, np.uint64)
                if header["op"] == "exists":
                    answer = store.exists_every_rank(keys, hashes).astype(np.uint8).tobytes()
                elif header["op"] == "remove":
                    for rank_keys in keys:
                        store.remove(rank_keys, hashes)
                    answer = b""
                else:
                    raise ValueError(f"unknown question {header['op']!r}")
            except (StoreError, ValueError, KeyError, TypeError) as exc:
                write_message(out, {"seq": seq, "error": str(exc)})
                continue
            write_message(out, {"seq": seq, "ok": True}, answer)
    finally:
        store.close()


def _exit_with_parent(parent: int):
    while os.getppid() == parent:
        threading.Event().wait(ORPHAN_CHECK)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
