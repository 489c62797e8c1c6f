"""What a deployment leaves in /dev/shm when its owner is killed, removed without anyone running cleanup.

A killed process cannot unlink its segments, and some supervisors kill a whole tree at once: vLLM's server
SIGKILLs every descendant of its engine at stop, fastcache's transfer managers included. So the owner
starts a reaper, a small process outside its tree (it forks once more and its parent exits, so a
tree-kill walking child links does not reach it, and it has a session of its own). It holds the read end
of a pipe the owner writes: each line is a deployment suffix to look after, the closing line means the
owner cleaned up itself. It also watches the owner itself (a pidfd, by pid and start): a child the owner
forked (a multiprocessing worker, a Pool) keeps the pipe's write end open after the owner died, so end of
file alone may never come. It then waits a bounded time for the
deployment's other creators (transfer managers, workers) to exit and removes what the dead ones left,
with the cleanup tool's own rule (`remove_dead`: nothing of a live process is touched). After a normal
close there is nothing left to remove, and it exits at once.
"""
from __future__ import annotations

import os
import select
import subprocess
import sys

# The child forks first thing, before importing fastcache, so that the owner waits only for a bare
# interpreter to start and the reaper is out of the owner's tree at once.
BOOTSTRAP = ("import os\n"
             "if os.fork():\n"
             "    os._exit(0)\n"
             "from fastcache.ipc.reaper import main\n"
             "main()\n")
CREATORS_GRACE = 60.0       # seconds the reaper waits for a deployment's other processes to exit
CLOSED = b"."               # the owner's last line when it closes (never a suffix)
POLL_OWNER_S = 1.0          # where there is no pidfd: how often the reaper checks that the owner lives


class Reaper:
    """The owner's side: start it, name the suffixes to look after, close it when they are cleaned up."""

    def __init__(self):
        from .shm import OWN_START
        read_end, self._write_end = os.pipe()       # the write end is not inherited by exec'd children
        try:
            starter = subprocess.Popen([sys.executable, "-c", BOOTSTRAP, str(os.getpid()), repr(OWN_START.wall),
                                        repr(OWN_START.ticks)],
                                       stdin=read_end, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)
        starter.wait()          # it exits as soon as it has forked the reaper

    def watch(self, suffix: str):
        """Also remove what this suffix's dead processes left once the owner is gone."""
        if self._write_end is None:
            raise RuntimeError("the reaper is closed")
        os.write(self._write_end, suffix.encode() + b"\n")

    def close(self):
        """The owner cleaned up itself: the reaper checks once and exits."""
        if self._write_end is not None:
            os.write(self._write_end, CLOSED + b"\n")
            os.close(self._write_end)
            self._write_end = None


def main():
    from .shm import Started
    ticks = None if sys.argv[3] == "None" else float(sys.argv[3])
    lines = read_until_owner_gone(int(sys.argv[1]), Started(float(sys.argv[2]), ticks))
    reap([line.decode() for line in lines if line and line != CLOSED], owner_died=CLOSED not in lines)


def read_until_owner_gone(pid: int, start, fd: int = 0) -> list[bytes]:
    """The lines the owner wrote on fd, once it wrote the closing line, closed the pipe, or exited."""
    from .shm import creator_alive

    owner = _pidfd(pid, start)
    os.set_blocking(fd, False)
    lines, pending, gone = [], b"", False
    try:
        while CLOSED not in lines and not gone:
            watched = [fd] if owner is None else [fd, owner]
            ready = select.select(watched, [], [], POLL_OWNER_S if owner is None else None)[0]
            gone = owner in ready if owner is not None else not creator_alive(pid, start)
            while True:         # what is in the pipe now (all of it, once the owner is gone)
                try:
                    chunk = os.read(fd, 4096)
                except BlockingIOError:
                    break
                if not chunk:
                    gone = True         # end of file: the owner and every child of its closed the pipe
                    break
                *complete, pending = (pending + chunk).split(b"\n")
                lines += complete
    finally:
        if owner is not None:
            os.close(owner)
    return lines


def _pidfd(pid: int, start):
    """A descriptor that turns readable when the owner exits, or None (no pidfd here: the reaper polls)."""
    from .shm import creator_alive
    try:
        owner = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None         # no pidfd, or the owner is gone already (then the poll sees it at once)
    if not creator_alive(pid, start):       # the pid is another process's by now: the owner is gone
        os.close(owner)
        return None
    return owner


def reap(suffixes, owner_died: bool, grace: float = CREATORS_GRACE):
    """Remove what the dead processes of these deployments left; if the owner died, after waiting up to
    `grace` seconds for their live creators to exit (they watch the owner and exit on their own)."""
    import psutil

    from .leftovers import live_creators, remove_dead

    for suffix in dict.fromkeys(suffixes):
        if owner_died:
            psutil.wait_procs(_processes(live_creators(suffix)), timeout=grace)
        remove_dead(suffix=suffix)


def _processes(creators):
    import psutil

    from .shm import creator_alive
    procs = []
    for pid, start in creators:
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        if creator_alive(pid, start):       # not a reused pid
            procs.append(proc)
    return procs
