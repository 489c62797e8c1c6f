"""python -m fastcache.tools.cleanup: remove what dead deployments left in /dev/shm and the temp dir.

Every fastcache segment records its creator's pid and start time; a segment whose creator is gone is
stale. Segments of live deployments are never touched. `--dry-run` only lists.
"""
from __future__ import annotations

import argparse
import sys

from ..ipc.leftovers import remove_dead


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
