"""A beating thread: writes time.time() into a heartbeat slot every interval and runs a liveness check.

It runs beside the main work so that a process blocked in a phase barrier still counts as alive, while
a stopped (SIGSTOP) or dead process goes silent.
"""
from __future__ import annotations

import os
import threading
import time

import psutil


class Heartbeat(threading.Thread):
    def __init__(self, slots, index: int, interval: float, check=None):
        super().__init__(name="fastcache-heartbeat", daemon=True)
        self._slots, self._index, self._interval, self._check = slots, index, interval, check
        self._stop_event = threading.Event()

    def run(self):
        while True:
            self._slots[self._index] = time.time()
            if self._check is not None:
                self._check()
            if self._stop_event.wait(self._interval):
                return

    def stop(self):
        self._stop_event.set()
        if self.is_alive():
            self.join()


def process_alive(pid: int) -> bool:
    if pid == os.getppid():         # a parent is alive while it has us: an exited one hands its children on at once
        return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
