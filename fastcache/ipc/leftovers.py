"""Leftovers of dead deployments: segments and socket dirs whose creator process is gone.

Every fastcache segment records its creator's pid and start time, and every socket dir an owner file;
what a dead process created is stale. Segments of live deployments are never touched.
"""
from __future__ import annotations

import glob
import json
import os
import tempfile

from .naming import PREFIX
from .queue import OWNER_FILE, remove_socket_dir
from .shm import SHM_DIR, SegmentError, Started, creator_alive, read_creator, unlink


def find_stale(suffix: str = ""):
    """(kind, path-or-name, creator pid) of every leftover whose creator is dead (of one deployment, if
    suffix is given)."""
    return [(kind, name, pid) for kind, name, (pid, _start), alive in _entries(suffix) if not alive]


def live_creators(suffix: str) -> set[tuple[int, Started]]:
    """(pid, start time) of every live process that created one of a deployment's segments or socket dirs."""
    return {(pid, start) for _kind, _name, (pid, start), alive in _entries(suffix) if alive}


def _entries(suffix: str):
    """(kind, path-or-name, (creator pid, its start time), creator alive) of every entry of ours."""
    entries, prefix = [], f"{PREFIX}.{suffix + '.' if suffix else ''}"
    for entry in sorted(os.listdir(SHM_DIR)):
        if not entry.startswith(prefix):
            continue
        try:
            pid, start, _suffix = read_creator(entry)
        except (OSError, SegmentError):
            continue        # vanished, unreadable or not ours: leave it
        entries.append(("segment", "/" + entry, (pid, start), creator_alive(pid, start)))
    for path in sorted(glob.glob(os.path.join(tempfile.gettempdir(), prefix + "*"))):
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = json.load(f)
            ticks = owner.get("start_ticks")
            pid, start = int(owner["pid"]), Started(float(owner["start"]), None if ticks is None else float(ticks))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        entries.append(("socket dir", path, (pid, start), creator_alive(pid, start)))
    return entries


def remove_dead(dry_run: bool = False, suffix: str = ""):
    """Remove every stale leftover; returns what was (or, with dry_run, would be) removed."""
    stale = find_stale(suffix)
    if not dry_run:
        for kind, name, _pid in stale:
            if kind == "segment":
                unlink(name)
            else:
                remove_socket_dir(name)
    return stale
