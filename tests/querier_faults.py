"""python -m querier_faults ARGS: the store client's child (fastcache.store.querier) with one fault that
QUERIER_FAULT names, for test_store_remote.py:

- "two": answers 2 where it means 1;
- "extra": sends every answer twice (one reply too many);
- "banner": prints a line on stdout as it starts, as a chatty library might;
- "hang_open": opening the store never returns (a master that does not answer).
"""
from __future__ import annotations

import os
import sys
import threading

from fastcache.store import querier

FAULT = os.environ.get("QUERIER_FAULT", "")
_write = querier.write_message


def write_message(fd, header, payload=b"", deadline=None):
    if FAULT == "two" and payload:
        payload = bytes(2 if b else 0 for b in payload)
    _write(fd, header, payload, deadline)
    if FAULT == "extra" and "ok" in header:
        _write(fd, header, payload, deadline)


querier.write_message = write_message
if FAULT == "hang_open":
    querier.open_store = lambda url: threading.Event().wait()

if __name__ == "__main__":
    if FAULT == "banner":
        print("a library says hello on stdout", flush=True)
    sys.exit(querier.main(sys.argv[1:]))
