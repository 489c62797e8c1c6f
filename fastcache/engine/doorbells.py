"""The completion rings' doorbells (docs/design.md §4): one eventfd per rank, which every process of that rank
inherits at spawn and rings after each record it writes in its completion ring.

The doorbells are in an epoll set of their own, itself in the engine's I/O thread's epoll: the I/O thread
sleeps on all of them there. A thread waiting for a handle (result()) takes that set out of the I/O thread's
for its wait (epoll lets it do so without waking the I/O thread; one call, however many ranks) and sleeps on one
doorbell at a time:
the one of the rank it expects to report last, so that a task whose ranks report apart still wakes it once; a
rank that reports meanwhile wakes nobody, and its record is read with the last one. Whatever else completes the
handle (a failure over the reply socket, a rank lost, close) rings the waiter's own eventfd. Every sleep is
bounded, so a doorbell another process took costs that bound at most.
"""
from __future__ import annotations

import os
import select
import threading

BELL_WAIT_MS = 100      # the longest a waiter sleeps on a doorbell: a lost doorbell costs it this at most


def _eventfd() -> int:
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


def clear(fd: int):
    try:
        os.eventfd_read(fd)
    except BlockingIOError:     # another thread, woken by the same ring, read it first
        pass


class Doorbells:
    """The doorbells of the ranks, in an epoll set registered in `epoll` (the I/O thread's) unless a waiter holds
    them."""

    def __init__(self, epoll):
        self._epoll = epoll
        self._set = select.epoll()              # every doorbell
        self._epoll.register(self._set.fileno(), select.EPOLLIN)
        self._fds: dict[int, int] = {}          # rank -> its doorbell
        self._lock = threading.Lock()           # the doorbells and their set's place in the I/O thread's epoll
        self.owner = threading.Lock()           # held by that waiter for its whole wait
        self._owner_thread = None
        self._waiter_bell = _eventfd()          # rung for the waiter when another thread completes its handle
        self._sleeps: dict[int, select.poll] = {}   # rank -> a poll over its doorbell and the waiter's
        self._any = select.poll()               # every doorbell, and the waiter's
        self._any.register(self._waiter_bell, select.POLLIN)
        self.last_rank = None                   # the rank whose report completed the last handle a waiter read

    def of(self, rank: int) -> int:
        """Rank's doorbell, made on first use and kept for the rank's later processes."""
        with self._lock:
            fd = self._fds.get(rank)
            if fd is None:
                fd = self._fds[rank] = _eventfd()
                self._set.register(fd, select.EPOLLIN)
                sleep = self._sleeps[rank] = select.poll()
                sleep.register(fd, select.POLLIN)
                sleep.register(self._waiter_bell, select.POLLIN)
                self._any.register(fd, select.POLLIN)
            return fd

    def fileno(self) -> int:
        """The set's descriptor, which the I/O thread's epoll reports when a doorbell rang."""
        return self._set.fileno()

    def clear_rung(self):
        """The I/O thread's: clear the doorbells that rang (it reads the rings next)."""
        for fd, _ in self._set.poll(0):
            clear(fd)

    # -- a waiter's turn (under owner) ---------------------------------------------------------------
    def take(self):
        """Out of the I/O thread's epoll, for this thread's wait."""
        with self._lock:
            self._epoll.unregister(self._set.fileno())
        self._owner_thread = threading.get_ident()

    def sleep(self, pending, ms: int):
        """Sleep up to ms on the doorbell of one of the ranks still pending: the one that reported last the last
        time, if pending (ranks tend to keep their order), else the lowest. Then clear every doorbell that rang
        (the caller reads the rings next): one that rings after this is for a record written after it, which
        give_back then reads; the others' records are read now, so give_back has nothing to read."""
        rank = self.last_rank if self.last_rank in pending else min(pending, default=None)
        sleep = self._sleeps.get(rank)
        rang = (sleep or self._any).poll(ms)
        if rang and len(self._fds) > 1:     # other ranks' doorbells too (one rank: what the poll saw is all)
            rang = self._any.poll(0)
        for fd, _ in rang:
            clear(fd)

    def give_back(self, read):
        """The doorbells back to the I/O thread: what rang meanwhile is cleared and its records read here (read()),
        so the I/O thread is not woken for them; what rings from now on wakes it."""
        self._owner_thread = None
        rang = self._any.poll(0)
        for fd, _ in rang:
            clear(fd)
        if rang:
            read()          # a record whose ring was just cleared is read now, not at the I/O thread's bound
        with self._lock:
            self._epoll.register(self._set.fileno(), select.EPOLLIN)

    def wake_waiter(self):
        """A handle the waiter waits for was completed by another thread."""
        if threading.get_ident() != self._owner_thread:
            os.eventfd_write(self._waiter_bell, 1)

    @property
    def waiter_thread(self):
        """The thread id of the waiter holding the doorbells, None when the I/O thread has them."""
        return self._owner_thread

    def close(self):
        """Once the I/O thread has stopped and no waiter holds them."""
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds + [self._waiter_bell]:
            os.close(fd)
        self._set.close()
