"""python -m fastcache.tools.cleanup: remove what dead deployments left in /dev/shm and the temp dir.

Every fastcache segment records its creator's pid and start time; a segment whose creator is gone is
stale. Segments of live deployments are never touched. `--dry-run` only lists.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

from ..ipc.naming import PREFIX
from ..ipc.queue import OWNER_FILE, remove_socket_dir
from ..ipc.shm import SHM_DIR, SegmentError, creator_alive, read_creator, unlink


def find_stale(suffix: str = ""):
    """(kind, path-or-name, creator pid) of every leftover whose creator is dead (of one deployment, if
    suffix is given)."""
    stale, prefix = [], f"{PREFIX}.{suffix + '.' if suffix else ''}"
    for entry in sorted(os.listdir(SHM_DIR)):
        if not entry.startswith(prefix):
            continue
        try:
            pid, start, _suffix = read_creator(entry)
        except (OSError, SegmentError):
            continue        # vanished, unreadable or not ours: leave it
        if not creator_alive(pid, start):
            stale.append(("segment", "/" + entry, pid))
    for path in sorted(glob.glob(os.path.join(tempfile.gettempdir(), prefix + "*"))):
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = json.load(f)
            pid, start = int(owner["pid"]), float(owner["start"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not creator_alive(pid, start):
            stale.append(("socket dir", path, pid))
    return stale


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastcache.tools.cleanup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="list stale leftovers without removing them")
    args = parser.parse_args(argv)
    stale = remove_dead(args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for kind, name, pid in stale:
        print(f"{verb} {kind} {name} (creator pid {pid} is gone)")
    print(f"{len(stale)} stale item(s) {verb}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
