"""file:///DIR: the L3 store as files in a local directory, for a single machine without Mooncake.

An object is one file, payload then header as in keys, at DIR/objects/<namespace>/<fingerprint>/<hh>/<hash>.r<rank>.
A put writes a temporary file in DIR/tmp (same file system) and renames it into place, so a reader sees
the whole object or none, and a writer killed half-way leaves only a temporary file, which the next store
opened on DIR removes once its writer is dead.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import stat
from urllib.parse import quote

import numpy as np
import psutil

from .base import BlockStore, StoreError
from .keys import CORRUPT, FOREIGN, HEADER_BYTES, OK, ObjectKeys


class NotRegularFile(OSError):
    """What stands where an object belongs is no regular file."""


class FileStore(BlockStore):
    def __init__(self, url: str, root: str, sealed: bool = False):
        """sealed: objects are sealed under a deployment key (key_file), so the directory need not be private."""
        self.url, self.root = url, root
        self._objects = os.path.join(root, "objects")
        self._tmp = os.path.join(root, "tmp")
        try:
            os.makedirs(self._objects, mode=0o700, exist_ok=True)
            os.makedirs(self._tmp, mode=0o700, exist_ok=True)
            if not sealed:
                self._check_private()
        except OSError as exc:
            raise StoreError(f"store {url}: cannot create {root}: {exc}") from None
        self._remove_dead_temps()

    def _check_private(self):
        """Unsealed objects are trusted once their header checks, and anyone can write a header: only this user
        may write where they live (docs/design.md §12), as for the deployment's segments."""
        for path in (self.root, self._objects, self._tmp):
            info = os.stat(path)
            if info.st_uid != os.getuid() or info.st_mode & 0o022:
                raise StoreError(f"store {self.url}: {path} is owned by uid {info.st_uid} with mode "
                                 f"{stat.S_IMODE(info.st_mode):o}: another user could plant objects in it; use a "
                                 f"directory of this user's that only it can write (chmod go-w), or seal the "
                                 f"objects (key_file=)")

    def _remove_dead_temps(self):
        for name in os.listdir(self._tmp):
            pid = name.split("-", 1)[0]
            if pid.isdigit() and not psutil.pid_exists(int(pid)):
                try:
                    os.unlink(os.path.join(self._tmp, name))
                except FileNotFoundError:
                    pass

    def _dir(self, keys: ObjectKeys) -> str:
        # readable, yet never "." or "..", never too long for one path component, and unique
        ns = quote(keys.namespace, safe="").replace(".", "%2E")[:80]
        digest = hashlib.blake2b(keys.namespace.encode(), digest_size=8).hexdigest()
        return os.path.join(self._objects, f"{ns}-{digest}", keys.fingerprint)

    def object_path(self, keys: ObjectKeys, h: int, base: str | None = None) -> str:
        """Where the object of hash h lives (for tools and tests that inspect the directory)."""
        name = f"{int(h):016x}"
        return os.path.join(base or self._dir(keys), name[:2], f"{name}.r{keys.rank}")

    def put(self, keys, hashes, cpu_ids):
        base = self._dir(keys)
        for h, c in zip(hashes.tolist(), cpu_ids.tolist()):
            payload = self.tier[c]
            final = self.object_path(keys, h, base)
            tmp = os.path.join(self._tmp, f"{os.getpid()}-{secrets.token_hex(8)}")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    if keys.sealer is None:     # the block as it is, then its header
                        _write_all(fd, memoryview(payload))
                        _write_all(fd, keys.header(h, payload))
                    else:
                        _write_all(fd, keys.object(h, payload))
                finally:
                    os.close(fd)
                os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
                try:
                    os.replace(tmp, final)      # atomic: readers see the old object or the new one
                except IsADirectoryError:       # no object: replaced, as a corrupt one is
                    self._remove_in_the_way(final)
                    os.replace(tmp, final)
            except OSError as exc:
                _unlink(tmp)
                raise StoreError(f"store {self.url}: writing {final} failed: {exc}") from None
            except StoreError:
                _unlink(tmp)
                raise
        return 0                    # a full disk is an error here: nothing evicts to make room

    def get(self, keys, hashes, cpu_ids, foreign=None):
        base = self._dir(keys)
        hits = np.zeros(len(hashes), bool)
        for i, (h, c) in enumerate(zip(hashes.tolist(), cpu_ids.tolist())):
            row = self.tier[c]
            path = self.object_path(keys, h, base)
            try:
                whole, header = self._read_object(path, row)
            except FileNotFoundError:
                continue
            except NotRegularFile:      # a directory, a FIFO, a device: no object; removed so that a put can write it
                self._remove_in_the_way(path)
                continue
            except OSError as exc:
                raise StoreError(f"store {self.url}: reading {path} failed: {exc}") from None
            verdict = keys.verdict(h, header, row) if whole else keys.wrong_size()
            hits[i] = verdict == OK
            if verdict == CORRUPT:      # removed, so that lookups stop counting it
                _unlink(path)
            elif verdict == FOREIGN and foreign is not None:
                foreign[i] = True
        return hits

    @staticmethod
    def _read_object(path, row) -> tuple[bool, bytes]:
        """Read the object at path into row: (is it exactly block and header, its header). Only a regular file
        is read, and it is opened without blocking: a FIFO or a device where an object belongs would
        otherwise hang the rank's store lane (NotRegularFile instead)."""
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotRegularFile(path)
            with open(fd, "rb", buffering=0, closefd=False) as f:
                n = _read_into(f, memoryview(row))
                header = f.read(HEADER_BYTES + 1)           # a longer file is not this object
        finally:
            os.close(fd)
        return n == len(row) and len(header) == HEADER_BYTES, header

    def _remove_in_the_way(self, path):
        """Remove what stands where an object belongs and is no regular file (a directory, a link, a FIFO)."""
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:                           # a link (to a directory or anything), a FIFO, a device
                os.unlink(path)
        except FileNotFoundError:           # another reader removed it first
            pass
        except OSError as exc:
            raise StoreError(f"store {self.url}: {path} is a directory where an object belongs, and removing "
                             f"it failed: {exc}") from None

    def exists(self, keys, hashes):
        base = self._dir(keys)
        return np.array([os.path.exists(self.object_path(keys, h, base)) for h in hashes.tolist()], bool)

    def remove(self, keys, hashes):
        base = self._dir(keys)
        for h in hashes.tolist():
            _unlink(self.object_path(keys, h, base))


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_into(f, view) -> int:
    """Fill view from f; returns the bytes read (fewer only at the end of the file)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
