"""mooncake://HOST:PORT: the L3 store in Mooncake Store, whose master listens on HOST:PORT.

The rank's CPU tier is registered with Mooncake once. An object is one buffer of the tier: a CPU block and
the header in the slot after it (`batch_put_from`, `batch_get_into`), so the block's bytes move between
the store and the CPU tier in place, and header and payload appear, vanish and are evicted together; a
separate header object could outlive or miss its payload, and a second buffer per object costs Mooncake's
TCP transport a slice per object (about 15% of a 512 KiB get on loopback).
A fetch writes the payload into its CPU block before the header is checked, so the caller must treat
that block as garbage on a miss (TieredCache loads L3 hits only into blocks nobody else can see yet).
Mooncake keeps an existing object on a second put of its key: keys are content addresses, so the
object is the same (a corrupt one is removed when a fetch finds it; one this engine cannot authenticate,
another key's, is left alone).
"""
from __future__ import annotations

import concurrent.futures
import os
import socket

import numpy as np

from .base import BlockStore, StoreError
from .keys import CORRUPT, FOREIGN, HEADER_BYTES, OK

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that we name or treat specially
CODES = {-10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND", -103: "CLIENT_NOT_FOUND",
         -200: "NO_AVAILABLE_HANDLE (store full)", -600: "INVALID_PARAMS", -703: "REPLICA_IS_NOT_READY",
         -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE",
         -707: "LEASE_EXPIRED", -710: "REPLICA_NOT_FOUND", -712: "REPLICA_IS_GONE", -800: "TRANSFER_FAIL",
         -900: "RPC_FAIL (master unreachable?)"}
# a fetch that finds no whole object of ours: absent, still being written (or abandoned by a killed
# writer), or gone
MISS_CODES = {-703, -704, -710, -712}
# what a fetch of an object longer (INVALID_PARAMS: buffers too small) or shorter (TRANSFER_FAIL) than
# header + block returns; the object's size then tells a foreign object from a failed transfer
SIZE_CODES = {-600, -800}
# a put that finds no room (the store evicts in the background): the object is skipped, as a full cache does
FULL_CODES = {-200}
# objects per Mooncake call (the bytes per call are the URL's batch_mb). A task of up to 256 MiB is one call:
# splitting it to overlap checksums with the transfer cost more than it gained, 5-10% of a 64 MiB put or
# get on loopback. Larger tasks go in parts whose checksums overlap the next part's transfer.
BATCH_OBJECTS = 1024
SEAL_BYTES = 16 << 20        # a sealed put's part: ciphertexts staged in one of two registered buffers
# Mooncake's timeout of a call to the master (its default is 30 s). `setup` holds the GIL while it waits for
# a master that does not answer: this bounds that stall of a transfer manager well below its heartbeat timeout
RPC_TIMEOUT_MS = 3000
# Mooncake's TCP transport waits this long (its default 30 s) for a status frame, and for any progress of a
# payload, before it fails a transfer: a get or put on a hung memory server costs the rank's store lane 5 s
STALL_TIMEOUT_S = 5


def set_environment(protocol: str, local_hostname: str):
    """Mooncake reads these at setup; a user's own settings win."""
    if protocol == "tcp":
        os.environ.setdefault("MC_FORCE_TCP", "true")          # no RDMA device discovery for TCP
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        # parallel connections per peer: +40-70% put/get on loopback here, for fastcache and raw clients alike
        os.environ.setdefault("MC_TCP_LANES_PER_PEER", "4")
        os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", str(STALL_TIMEOUT_S))     # a frame, not a payload
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(STALL_TIMEOUT_S))   # sliding: no byte moved
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")   # a dead master fails setup in ~4 s, not 90
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(RPC_TIMEOUT_MS))   # a hung master fails a call in 3 s, not 30
    os.environ.setdefault("GLOG_minloglevel", "1")             # Mooncake's INFO lines drown our logs


class MooncakeStore(BlockStore):
    def __init__(self, url: str, master: str, protocol: str = "tcp", devices: str = "",
                 local_hostname: str = "127.0.0.1", segment_bytes: int = 0, batch_bytes: int = 256 << 20):
        self.url, self.master, self.batch_bytes = url, master, batch_bytes
        self._registered = None         # address of the registered CPU tier
        self._seal_rows = None          # registered staging of sealed objects: two halves, one per part in flight
        set_environment(protocol, local_hostname)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise StoreError(f"store {url}: Mooncake is not installed ({exc}); "
                             f"pip install 'fastcache[mooncake]'") from None
        # setup holds the GIL while it fails to reach a master (about 4.4 s against a closed port, its retry
        # included), stalling every swap of this process; a connect that is refused costs nothing and no GIL
        why = _unreachable(master, RPC_TIMEOUT_MS / 1000)
        if why:
            raise StoreError(f"store {url}: cannot connect to the Mooncake master at {master} ({why}); "
                             f"is mooncake_master running there?")
        self._client = MooncakeDistributedStore()
        self._io = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="mooncake-io")  # one per direction
        # P2PHANDSHAKE: transfer endpoints meet peer to peer, so the master is the only service needed.
        # segment_bytes > 0 lends this process's memory to the pool (objects then die with the process).
        rc = self._client.setup(local_hostname, "P2PHANDSHAKE", segment_bytes, 0, protocol, devices, master)
        if rc != 0:
            raise StoreError(f"store {url}: cannot connect to the Mooncake master at {master} "
                             f"(setup returned {rc}); is mooncake_master running there?")

    # -- the CPU tier ----------------------------------------------------------------------------
    def attach(self, blocks, block_bytes):
        self.detach()
        super().attach(blocks, block_bytes)
        rc = self._client.register_buffer(blocks.ctypes.data, blocks.nbytes)
        if rc != 0:
            self.detach()
            raise StoreError(f"store {self.url}: registering {blocks.nbytes} bytes failed ({_name(rc)})")
        self._registered = blocks.ctypes.data

    def detach(self):
        if self._registered is not None:
            self._client.unregister_buffer(self._registered)
        self._registered = None
        if self._seal_rows is not None:
            self._client.unregister_buffer(self._seal_rows.ctypes.data)
            self._seal_rows = None
        super().detach()

    def _seal_staging(self):
        """[2, part, stride] registered rows that sealed objects are put from (the CPU tier keeps plaintext)."""
        if self._seal_rows is None:
            stride = self.blocks.shape[1]
            rows = np.empty((2, max(1, SEAL_BYTES // stride), stride), np.uint8)
            rc = self._client.register_buffer(rows.ctypes.data, rows.nbytes)
            if rc != 0:
                raise StoreError(f"store {self.url}: registering {rows.nbytes} bytes of seal staging failed "
                                 f"({_name(rc)})")
            self._seal_rows = rows
        return self._seal_rows

    def _buffers(self, cpu_ids):
        """Per object, the one buffer it is put from or fetched into: its CPU block and the slot after it."""
        base, stride, size = self.blocks.ctypes.data, self.blocks.shape[1], self.tier.shape[1] + HEADER_BYTES
        return [base + c * stride for c in cpu_ids], [size] * len(cpu_ids)

    def _chunks(self, n, most: int | None = None):
        """The parts of a task, one Mooncake call each (of at most `most` objects)."""
        step = max(1, min(most or BATCH_OBJECTS, self.batch_bytes // (self.tier.shape[1] + HEADER_BYTES)))
        return [slice(i, min(i + step, n)) for i in range(0, n, step)]

    # -- operations ------------------------------------------------------------------------------
    def put(self, keys, hashes, cpu_ids):
        hashes, cpu_ids = hashes.tolist(), cpu_ids.tolist()

        staging = self._seal_staging() if keys.sealer is not None else None
        parts = self._chunks(len(hashes), staging.shape[1] if staging is not None else None)
        # consecutive parts alternate halves, whatever their size (batch_mb may cut them below a half): the
        # part staged next must never be written into the rows of the part in flight
        half = {part.start: i % 2 for i, part in enumerate(parts)}

        def prepare(part):          # headers and checksums of the next part, while the previous one moves
            names = [keys.name(h) for h in hashes[part]]
            if staging is None:     # the object is the CPU block and its slot: put in place
                for h, c in zip(hashes[part], cpu_ids[part]):
                    keys.write_header(self.headers[c], h, self.tier[c])
                return (names, *self._buffers(cpu_ids[part]))
            rows = staging[half[part.start]]
            size = self.tier.shape[1] + HEADER_BYTES
            for row, h, c in zip(rows, hashes[part], cpu_ids[part]):
                keys.write_object(row[:size], h, self.tier[c])
            return names, [row.ctypes.data for row in rows[:len(names)]], [size] * len(names)

        full = 0

        def finish(part, job, codes):
            nonlocal full
            for name, code in zip(job[0], codes):
                if code in FULL_CODES:
                    full += 1
                elif code < 0:
                    raise StoreError(f"store {self.url}: put of {name} failed: {_name(code)}")

        self._pipelined(parts, prepare, self._client.batch_put_from, finish)
        return full

    def get(self, keys, hashes, cpu_ids, foreign=None):
        hashes, cpu_ids = hashes.tolist(), cpu_ids.tolist()
        whole = HEADER_BYTES + self.tier.shape[1]
        hits, bad = np.zeros(len(hashes), bool), []

        def prepare(part):
            return ([keys.name(h) for h in hashes[part]], *self._buffers(cpu_ids[part]))

        def finish(part, job, codes):       # checksums of this part, while the next one moves
            for i, (name, h, c, code) in enumerate(zip(job[0], hashes[part], cpu_ids[part], codes)):
                if code == whole:
                    verdict = keys.verdict(h, self.headers[c], self.tier[c])
                elif code >= 0 or (code in SIZE_CODES and self._other_size(name, whole)):
                    verdict = keys.wrong_size()     # an object of another size: not ours
                elif code in MISS_CODES:
                    continue
                else:
                    raise StoreError(f"store {self.url}: get of {name} failed: {_name(code)}")
                hits[part.start + i] = verdict == OK
                if verdict == CORRUPT:
                    bad.append(name)
                elif verdict == FOREIGN and foreign is not None:
                    foreign[part.start + i] = True

        self._pipelined(self._chunks(len(hashes)), prepare, self._client.batch_get_into, finish)
        if bad:     # corrupt objects under our keys: removed, so that a put can replace them
            self._client.batch_remove(bad, True)
        return hits

    def _pipelined(self, parts, prepare, transfer, finish):
        """transfer(*prepare(part)) for each part in turn on an I/O thread (Mooncake releases the GIL),
        while this thread prepares the next part and finishes the previous one. Returns or raises only
        once nothing is in flight: a fetch still writing into CPU blocks after its task has failed would
        corrupt blocks that the engine hands out again."""
        job = prepare(parts[0])
        future = self._io.submit(transfer, *job)
        try:
            for i, part in enumerate(parts):
                following = prepare(parts[i + 1]) if i + 1 < len(parts) else None
                codes, future = future.result(), None
                if following is not None:
                    future = self._io.submit(transfer, *following)
                finish(part, job, codes)
                job = following
        finally:
            if future is not None:
                concurrent.futures.wait([future])

    def _other_size(self, name, whole) -> bool:
        size = self._client.get_size(name)
        return size >= 0 and size != whole

    def exists(self, keys, hashes):
        return self.exists_every_rank([keys], hashes)

    def exists_every_rank(self, keys, hashes):
        """One round trip to the master for every rank's objects (a lookup waits for it)."""
        values = hashes.tolist()
        names = [k.name(h) for k in keys for h in values]
        codes = self._client.batch_is_exist(names) if names else []
        for name, code in zip(names, codes):
            if code < 0:
                raise StoreError(f"store {self.url}: exists of {name} failed: {_name(code)}")
        return (np.array(codes, np.int64).reshape(len(keys), len(values)) == 1).all(axis=0)

    def remove(self, keys, hashes):
        names = [keys.name(h) for h in hashes.tolist()]
        for name, code in zip(names, self._client.batch_remove(names, True) if names else []):
            if code not in (0, -704):
                raise StoreError(f"store {self.url}: remove of {name} failed: {_name(code)}")

    def close(self):
        if self._client is not None:
            self._io.shutdown()
            self.detach()
            self._client.close()
            self._client = None


def _unreachable(master: str, timeout: float) -> str | None:
    """Why nothing answers a TCP connect to the master's HOST:PORT, or None if something accepts it (a hung
    master does: its kernel completes the handshake)."""
    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout).close()
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    return None


def _name(code: int) -> str:
    return f"code {code} {CODES.get(code, '')}".rstrip()
