"""L3 stores without Mooncake: keys and headers, URLs, the local-directory store, the store tasks on the
queue, and two deployments sharing blocks through file:///DIR (docs/design.md §8)."""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import deployment, small_spec, wait_for
from fastcache import SwapBackend, TransferError
from fastcache.ipc import protocol
from fastcache.store import ObjectKeys, as_hashes, check_namespace, fingerprint, open_store, parse_store_url
from fastcache.store.keys import HEADER, HEADER_BYTES
from store_peer import block_bytes, run_peer

SPEC = small_spec(num_cpu_blocks=32)


@pytest.fixture
def blocks():
    """A CPU tier as a transfer manager hands it to its store: each block followed by its slot."""
    rng = np.random.default_rng(7)
    return rng.integers(1, 256, (SPEC.num_cpu_blocks, SPEC.cpu_block_stride), dtype=np.uint8)


@pytest.fixture
def tier(blocks):
    return blocks[:, :SPEC.cpu_block_bytes]


@pytest.fixture
def store(tmp_path, blocks):
    s = open_store(f"file://{tmp_path}/l3")
    s.attach(blocks, SPEC.cpu_block_bytes)
    yield s
    s.close()


def keys(namespace="llama/step-0", rank=0, spec=SPEC, tp=1):
    return ObjectKeys(namespace, fingerprint(spec, tp), rank)


# -- keys, headers, URLs ------------------------------------------------------------------------------
def test_hashes_accept_any_64_bit_ints_and_refuse_the_rest():
    np.testing.assert_array_equal(as_hashes([1, -1, 2**64 - 1]), np.array([1, 2**64 - 1, 2**64 - 1], np.uint64))
    np.testing.assert_array_equal(as_hashes(np.array([-2, 5], np.int64)), np.array([2**64 - 2, 5], np.uint64))
    assert as_hashes(range(3)).dtype == np.uint64
    for bad in ([1.5], [True], [2**64], [-2**63 - 1], "abc", np.zeros((2, 2), np.int64), np.array([0.5])):
        with pytest.raises(ValueError):
            as_hashes(bad)


def test_namespace_rules():
    assert check_namespace("llama-3-8b/step-0") == "llama-3-8b/step-0"
    for bad in ("", None, 5, "a\nb", "x" * 257):
        with pytest.raises(ValueError):
            check_namespace(bad)


def test_fingerprint_names_the_meaning_of_a_block_not_its_capacity():
    base = fingerprint(SPEC, 2)
    assert fingerprint(dataclasses.replace(SPEC, num_cpu_blocks=99, num_gpu_blocks=77), 2) == base
    for other in (fingerprint(SPEC, 1), fingerprint(dataclasses.replace(SPEC, head_dim=16), 2),
                  fingerprint(dataclasses.replace(SPEC, cache_dtype="float16"), 2),
                  fingerprint(dataclasses.replace(SPEC, has_value=False), 2)):
        assert other != base


def test_header_names_every_field_it_checks():
    k = keys()
    payload = np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8)
    header = np.frombuffer(k.header(42, payload), np.uint8)
    assert header.size == HEADER_BYTES and k.matches(42, header, payload)
    assert not k.matches(43, header, payload)                               # another hash
    assert not keys(rank=1).matches(42, header, payload)                    # another rank
    assert not keys(namespace="llama/step-1").matches(42, header, payload)  # another namespace
    assert not keys(tp=2).matches(42, header, payload)                      # another geometry
    assert not k.matches(42, header, payload[:-1])                          # another length
    flipped = payload.copy()
    flipped[500] ^= 1
    assert not k.matches(42, header, flipped)                               # corrupt payload
    assert not k.matches(42, header[:10], payload)                          # truncated header
    assert HEADER.unpack(header.tobytes())[3] == 42


@pytest.mark.parametrize("url", ["file:///tmp/x", "mooncake://127.0.0.1:50051", "mooncake://host:1?protocol=rdma&device=mlx5_0",
                                 "mooncake://[::1]:5?segment_mb=64&local_hostname=10.0.0.2", "mooncake://h:5?batch_mb=8",
                                 "mooncake://h:65535?segment_mb=0&batch_mb=1", "mooncake://h:1",
                                 f"mooncake://h:5?segment_mb={1 << 30}"])
def test_good_store_urls(url):
    assert parse_store_url(url).url == url


@pytest.mark.parametrize("url", ["file://relative/dir", "file:///x?y=1", "mooncake://host", "mooncake://:5",
                                 "mooncake://h:5/path", "mooncake://h:5?protocol=udp", "mooncake://h:5?bogus=1",
                                 "mooncake://h:5?segment_mb=-1", "mooncake://h:5?batch_mb=0", "redis://h:5", "", 5])
def test_bad_store_urls(url):
    with pytest.raises(ValueError):
        parse_store_url(url)


@pytest.mark.parametrize("url,named", [
    ("mooncake://h:0", "port"), ("mooncake://[::1]:0", "port"), ("mooncake://h:00", "port"),
    ("mooncake://h:65536", "port"), ("mooncake://h:-1", "port"), ("mooncake://h:fifty", "port"),
    ("mooncake://h:5?segment_mb=-1", "segment_mb"), ("mooncake://h:5?segment_mb=lots", "segment_mb"),
    ("mooncake://h:5?segment_mb=", "segment_mb"), ("mooncake://h:5?segment_mb=1.5", "segment_mb"),
    ("mooncake://h:5?segment_mb=1e3", "segment_mb"), ("mooncake://h:5?segment_mb=+64", "segment_mb"),
    ("mooncake://h:5?segment_mb=%C2%B2", "segment_mb"), ("mooncake://h:5?segment_mb=\u0665", "segment_mb"),
    (f"mooncake://h:5?segment_mb={(1 << 30) + 1}", "segment_mb"),
    pytest.param("mooncake://h:5?segment_mb=" + "9" * 5000, "segment_mb", id="segment_mb-5000-digits"),
    ("mooncake://h:5?batch_mb=0", "batch_mb"), ("mooncake://h:5?batch_mb=-8", "batch_mb"),
    ("mooncake://h:5?batch_mb=eight", "batch_mb"), ("mooncake://h:5?batch_mb=\u00b2", "batch_mb"),
    ("mooncake://h:5?batch_mb=%EF%BC%98", "batch_mb"), ("mooncake://h:5?batch_mb", "batch_mb"),
    pytest.param("mooncake://h:5?batch_mb=" + "9" * 5000, "batch_mb", id="batch_mb-5000-digits"),
    ("mooncake://h:5?batch_mb=8&batch_mb=x", "batch_mb"), ("mooncake://h:5?segment_mb=x&segment_mb=8", "segment_mb")])
def test_a_bad_store_url_is_refused_naming_what_is_wrong(url, named):
    """One ValueError when the URL is parsed (SwapBackend's construction), naming the port or the option,
    instead of an error later in the transfer managers that does not."""
    with pytest.raises(ValueError) as err:
        parse_store_url(url)
    assert f"{url!r}: {named} " in str(err.value) and len(str(err.value).splitlines()) == 1


def test_a_bad_store_url_is_refused_by_the_backend_before_anything_starts():
    with pytest.raises(ValueError, match="'mooncake://h:0': port "):
        SwapBackend(SPEC, tp_size=1, device="sim", store="mooncake://h:0")


def test_store_url_sizes_reach_the_store_in_bytes(monkeypatch):
    from fastcache.store import mooncake
    opened = []
    monkeypatch.setattr(mooncake, "MooncakeStore", lambda *args, **kwargs: opened.append(kwargs))
    rng = np.random.default_rng(37)
    for _ in range(20):
        segment, batch = int(rng.integers(0, (1 << 30) + 1)), int(rng.integers(1, (1 << 30) + 1))
        zeros = "0" * int(rng.choice([0, 1, 5000]))      # leading zeros, even more than int() takes
        open_store(f"mooncake://h:5?segment_mb={zeros}{segment}&batch_mb={zeros}{batch}")
        assert (opened[-1]["segment_bytes"], opened[-1]["batch_bytes"]) == (segment << 20, batch << 20)


# -- the store task on the wire -------------------------------------------------------------------------
def test_store_task_travels_as_raw_frames():
    hashes = np.array([2**64 - 1, 3], np.uint64)
    frames = protocol.encode_store_task(9, protocol.CPU_TO_STORE, "ns/1", hashes, np.array([4, 5]))
    assert frames[1] == hashes.astype("<u8").tobytes() and len(frames) == 3
    header, (got_hashes, cpu) = protocol.decode(frames)
    assert header["namespace"] == "ns/1" and header["kind"] == protocol.CPU_TO_STORE
    np.testing.assert_array_equal(got_hashes, hashes)
    np.testing.assert_array_equal(cpu, [4, 5])


@settings(max_examples=100, deadline=None, database=None)
@given(task_id=st.integers(0, 2**62), kind=st.sampled_from(protocol.STORE_KINDS),
       namespace=st.text(min_size=1, max_size=40).filter(str.isprintable),
       pairs=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**40)), min_size=1, max_size=200))
def test_valid_store_tasks_round_trip_exactly(task_id, kind, namespace, pairs):
    hashes, cpu = np.array([p[0] for p in pairs], np.uint64), np.array([p[1] for p in pairs], np.int64)
    header, (h, c) = protocol.decode(protocol.encode_store_task(task_id, kind, namespace, hashes, cpu))
    assert (header["task_id"], header["kind"], header["namespace"], header["count"]) == \
        (task_id, kind, namespace, len(pairs))
    np.testing.assert_array_equal(h, hashes)
    np.testing.assert_array_equal(c, cpu)


@pytest.mark.parametrize("mutate", [
    lambda f: [f[0].replace(b"CPU_TO_STORE", b"SWAP_TO_CPU")] + f[1:],       # a swap kind in a store task
    lambda f: [f[0].replace(b'"ns"', b'""')] + f[1:],                         # empty namespace
    lambda f: [f[0].replace(b'"ns"', b'"a\\nb"')] + f[1:],                    # non-printable namespace
    lambda f: f[:2],                                                          # a frame missing
    lambda f: [f[0], f[1][:-1], f[2]],                                        # short hash frame
    lambda f: [f[0].replace(b'"count":2', b'"count":0')] + f[1:],
    lambda f: [f[0].replace(b'"count":2', b'"count":2,"x":1')] + f[1:],       # unknown field
])
def test_malformed_store_tasks_are_refused(mutate):
    frames = protocol.encode_store_task(1, protocol.CPU_TO_STORE, "ns", np.array([1, 2], np.uint64), np.array([0, 1]))
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(mutate(frames))


# -- the local-directory store -------------------------------------------------------------------------
def test_file_store_round_trip_of_random_blocks(store, tier):
    k = keys()
    hashes = as_hashes(np.random.default_rng(3).integers(0, 2**63, 8))
    want = tier[:8].copy()
    store.put(k, hashes, np.arange(8))
    assert store.exists(k, hashes).all()
    tier[8:16] = 0
    assert store.get(k, hashes, np.arange(8, 16)).all()
    np.testing.assert_array_equal(tier[8:16], want)
    absent = as_hashes([12345])
    assert not store.exists(k, absent).any() and not store.get(k, absent, np.array([20])).any()
    store.remove(k, hashes[:3])
    np.testing.assert_array_equal(store.exists(k, hashes), [False] * 3 + [True] * 5)


def test_other_namespace_rank_or_geometry_misses(store):
    hashes = as_hashes([1, 2])
    store.put(keys(), hashes, np.array([0, 1]))
    for other in (keys(namespace="llama/step-1"), keys(rank=1), keys(tp=2)):
        assert not store.exists(other, hashes).any()
        assert not store.get(other, hashes, np.array([2, 3])).any()


def test_a_tier_without_room_for_the_headers_is_refused(tmp_path, tier):
    s = open_store(f"file://{tmp_path}/l3")
    for bad in (np.ascontiguousarray(tier),                                # no slots
                np.zeros((4, SPEC.cpu_block_stride), np.uint16),          # not bytes
                np.zeros((4, 2 * SPEC.cpu_block_stride), np.uint8)[:, ::2]):   # not contiguous
        with pytest.raises(ValueError, match="room for a 64-byte header"):
            s.attach(bad, SPEC.cpu_block_bytes)
        assert s.tier is None
    s.close()


def object_path(root, k, h):
    found = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f == f"{h:016x}.r{k.rank}"]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "extend", "foreign", "empty"])
def test_corrupt_or_foreign_object_is_a_miss_never_wrong_bytes(store, tier, tmp_path, damage):
    k = keys()
    store.put(k, as_hashes([5, 6]), np.array([0, 1]))
    path = object_path(tmp_path, k, 5)
    data = bytearray(open(path, "rb").read())
    if damage == "flip_payload":
        data[17] ^= 0x40
    elif damage == "flip_header":
        data[-HEADER_BYTES + 20] ^= 1              # inside the header's hash field
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "extend":
        data += b"\0"
    elif damage == "foreign":                      # hash 6's whole object, under hash 5's name
        data = bytearray(open(object_path(tmp_path, k, 6), "rb").read())
    else:
        data = bytearray()
    open(path, "wb").write(data)
    assert store.exists(k, as_hashes([5])).all()   # there is a file ...
    assert not store.get(k, as_hashes([5]), np.array([9])).any()   # ... but it is not hash 5's block
    assert not store.exists(k, as_hashes([5])).any()               # so it is removed
    assert store.get(k, as_hashes([6]), np.array([10])).all()       # its neighbour is untouched
    np.testing.assert_array_equal(tier[10], tier[1])


def _directory_in_place_of(path, rng):
    """A directory tree where an object file belongs, holding random files (nothing an object could be)."""
    os.makedirs(os.path.join(path, "sub"))
    for name in ("a", os.path.join("sub", "b")):
        with open(os.path.join(path, name), "wb") as f:
            f.write(rng.bytes(int(rng.integers(1, 4096))))


def test_a_directory_where_an_object_belongs_is_a_miss_and_is_removed(store, tier, tmp_path):
    """Not a store failure that every later fetch of the key repeats: a corrupt object, a miss that
    removes it, so that the next put of the key writes the object."""
    rng = np.random.default_rng(29)
    k = keys()
    h5 = int(rng.integers(0, 2**63))
    h6 = h5 ^ 1
    hashes = as_hashes([h5, h6])
    store.put(k, hashes, np.array([0, 1]))
    path = object_path(tmp_path, k, h5)
    os.unlink(path)
    _directory_in_place_of(path, rng)
    assert not store.get(k, as_hashes([h5]), np.array([9])).any()       # a miss, not a StoreError
    assert not os.path.lexists(path) and not store.exists(k, as_hashes([h5])).any()     # removed
    assert store.get(k, as_hashes([h6]), np.array([10])).all()          # its neighbour is untouched
    np.testing.assert_array_equal(tier[10], tier[1])
    tier[2] = rng.integers(0, 256, tier.shape[1], dtype=np.uint8)
    store.put(k, as_hashes([h5]), np.array([2]))                         # the next put writes the object
    assert os.path.isfile(path)
    assert store.get(k, as_hashes([h5]), np.array([11])).all()
    np.testing.assert_array_equal(tier[11], tier[2])


def test_a_fifo_where_an_object_belongs_is_a_prompt_miss_and_is_removed(store, tier, tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: a fetch must open regular files only, without
    blocking, or one FIFO stalls the rank's store lane for good."""
    rng = np.random.default_rng(33)
    k = keys()
    h = int(rng.integers(0, 2**63))
    store.put(k, as_hashes([h]), np.array([0]))
    path = object_path(tmp_path, k, h)
    os.unlink(path)
    os.mkfifo(path, 0o600)
    result = []
    fetch = threading.Thread(target=lambda: result.append(store.get(k, as_hashes([h]), np.array([13]))), daemon=True)
    fetch.start()
    fetch.join(5)
    if fetch.is_alive():                    # let the stuck reader go before failing: a writer ends its open()
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        fetch.join(5)
        pytest.fail("a fetch of a FIFO blocked")
    assert not result[0].any() and not os.path.lexists(path)
    tier[4] = rng.integers(0, 256, tier.shape[1], dtype=np.uint8)
    store.put(k, as_hashes([h]), np.array([4]))
    assert store.get(k, as_hashes([h]), np.array([14])).all()
    np.testing.assert_array_equal(tier[14], tier[4])


def test_a_put_replaces_a_directory_where_its_object_belongs(store, tier, tmp_path):
    """A put that comes before any fetch of the key: it writes the object, as it does over a corrupt file."""
    rng = np.random.default_rng(31)
    k = keys()
    h = int(rng.integers(0, 2**63))
    store.put(k, as_hashes([h]), np.array([0]))
    path = object_path(tmp_path, k, h)
    os.unlink(path)
    _directory_in_place_of(path, rng)
    tier[3] = rng.integers(0, 256, tier.shape[1], dtype=np.uint8)
    store.put(k, as_hashes([h]), np.array([3]))
    assert os.path.isfile(path) and os.listdir(tmp_path / "l3" / "tmp") == []
    assert store.get(k, as_hashes([h]), np.array([12])).all()
    np.testing.assert_array_equal(tier[12], tier[3])


def test_an_unsealed_directory_store_another_user_can_write_is_refused(tmp_path, blocks, tier):
    """Without a key, an object whose header checks is served, and anyone can write a header (xxh3 is no
    MAC): a directory that another user can write to (or owns) would let them plant KV bytes (docs/design.md
    §12). It is refused, naming the directory; sealed objects need no private directory."""
    from fastcache.store import StoreError, seal
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(StoreError, match=f"{root} is owned by uid {os.getuid()} with mode 777"):
        open_store(f"file://{root}")
    root.chmod(0o700)
    open_store(f"file://{root}").close()                            # this user's own: fine
    (root / "objects").chmod(0o770)
    with pytest.raises(StoreError, match="another user could plant objects"):
        open_store(f"file://{root}")
    (root / "objects").chmod(0o700)
    if os.getuid() == 0:                                           # a directory another user owns
        os.chown(root, 65534, 65534)
        with pytest.raises(StoreError, match="owned by uid 65534"):
            open_store(f"file://{root}")
        os.chown(root, 0, 0)
    root.chmod(0o777)
    key = tmp_path / "key"
    key.write_bytes(os.urandom(seal.KEY_BYTES))
    key.chmod(0o600)
    s = open_store(f"file://{root}?key_file={key}")                # sealed: a forgery fails authentication
    try:
        s.attach(blocks, SPEC.cpu_block_bytes)
        k = ObjectKeys("m", fingerprint(SPEC, 1), 0, s.sealer)
        hashes = as_hashes(np.random.default_rng(9).integers(0, 2**63, 2))
        want = tier[:2].copy()
        s.put(k, hashes, np.arange(2))
        tier[2:4] = 0
        assert s.get(k, hashes, np.arange(2, 4)).all()
        np.testing.assert_array_equal(tier[2:4], want)
    finally:
        s.close()


def test_a_writer_killed_during_a_put_leaves_no_object(tmp_path):
    """The writer dies between writing its temporary file and renaming it: nothing is visible, and the
    next store opened on the directory removes the orphaned temporary file."""
    root = tmp_path / "l3"
    script = textwrap.dedent(f"""
        import os, sys, time, numpy as np
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import small_spec
        from fastcache.store import ObjectKeys, fingerprint, open_store, as_hashes
        spec = small_spec(num_cpu_blocks=32)
        s = open_store("file://{root}")
        s.attach(np.full((32, spec.cpu_block_stride), 7, np.uint8), spec.cpu_block_bytes)
        def stall(src, dst):
            print("writing", flush=True)
            time.sleep(60)
        os.replace = stall
        s.put(ObjectKeys("ns", fingerprint(spec, 1), 0), as_hashes([77]), np.array([3]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert len(os.listdir(root / "tmp")) == 1          # the whole object, written but not published
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    s = open_store(f"file://{root}")
    assert os.listdir(root / "tmp") == []
    assert not s.exists(keys("ns"), as_hashes([77])).any()


# -- store tasks through a deployment -------------------------------------------------------------------
def test_backend_store_tasks_move_every_rank_slice(tmp_path):
    rng = np.random.default_rng(11)
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, _):
        cpu = backend.allocate_cpu_blocks(6)
        for r in range(2):
            backend.cpu_tier(r)[cpu] = rng.integers(1, 256, (6, SPEC.cpu_block_bytes), dtype=np.uint8)
        want = [backend.cpu_tier(r)[cpu].copy() for r in range(2)]
        hashes = rng.integers(0, 2**63, 6)
        handle = backend.cpu_to_store("m/0", hashes, cpu).result(timeout=30)
        assert handle.nbytes == 6 * SPEC.cpu_block_bytes * 2
        assert backend.store_contains("m/0", hashes).all() and not backend.store_contains("m/1", hashes).any()
        dst = backend.allocate_cpu_blocks(6)
        for r in range(2):
            backend.cpu_tier(r)[dst] = 0
        backend.store_to_cpu("m/0", hashes, dst).result(timeout=30)
        for r in range(2):
            np.testing.assert_array_equal(backend.cpu_tier(r)[dst], want[r])
        with pytest.raises(TransferError, match=f"store file://{tmp_path}/l3: 6 of 6 objects missing"):
            backend.store_to_cpu("m/1", hashes, dst).result(timeout=30)
        backend.store_remove("m/0", hashes[:2])
        np.testing.assert_array_equal(backend.store_contains("m/0", hashes), [False] * 2 + [True] * 4)


def test_one_rank_missing_its_object_is_a_miss(tmp_path):
    """An entry counts only when every rank's object is there."""
    with deployment(SPEC, tp=2, store=f"file://{tmp_path}/l3") as (backend, _):
        cpu = backend.allocate_cpu_blocks(2)
        backend.cpu_to_store("m", [1, 2], cpu).result(timeout=30)
        os.unlink(object_path(tmp_path, keys("m", rank=1, tp=2), 2))
        np.testing.assert_array_equal(backend.store_contains("m", [1, 2]), [True, False])
        with pytest.raises(TransferError, match="rank 1: StoreError.*1 of 2 objects"):
            backend.store_to_cpu("m", [1, 2], cpu).result(timeout=30)


def test_bad_store_requests_are_refused_before_anything_is_sent(tmp_path):
    with deployment(SPEC, tp=1, store=f"file://{tmp_path}/l3") as (backend, _):
        for call in (lambda: backend.cpu_to_store("m", [1, 2], [0]),            # lengths differ
                     lambda: backend.cpu_to_store("m", [1, 1], [0, 1]),         # duplicate hashes
                     lambda: backend.store_to_cpu("m", [1, 2], [0, 0]),         # duplicate blocks
                     lambda: backend.store_to_cpu("m", [1], [SPEC.num_cpu_blocks]),
                     lambda: backend.store_to_cpu("m", [1], [-1]),
                     lambda: backend.cpu_to_store("", [1], [0]),
                     lambda: backend.cpu_to_store("m", [1.5], [0]),
                     lambda: backend.cpu_to_store("m", [], []),
                     lambda: backend.store_contains("m", ["x"])):
            with pytest.raises(ValueError):
                call()
        assert backend._channel.pending_handles() == []
    with deployment(SPEC, tp=1) as (backend, _):
        with pytest.raises(ValueError, match="no store"):
            backend.cpu_to_store("m", [1], [0])
    with pytest.raises(ValueError, match="expected mooncake://HOST:PORT or file:///DIR"):
        deployment(SPEC, store="s3://bucket").__enter__()


def test_store_tasks_and_swaps_keep_their_order_on_shared_cpu_blocks(tmp_path):
    """A fetch into a CPU block and a swap-in from it, submitted back to back: the swap sees the fetched
    bytes (the transfer manager's scheduler orders tasks that share a CPU block)."""
    from conftest import cpu_image
    rng = np.random.default_rng(5)
    with deployment(SPEC, tp=1, store=f"file://{tmp_path}/l3") as (backend, (worker,)):
        cpu = backend.allocate_cpu_blocks(4)
        backend.cpu_tier(0)[cpu] = rng.integers(1, 256, (4, SPEC.cpu_block_bytes), dtype=np.uint8)
        want = backend.cpu_tier(0)[cpu].copy()
        backend.cpu_to_store("m", [10, 11, 12, 13], cpu).result(timeout=30)
        for _ in range(5):
            backend.cpu_tier(0)[cpu] = 0
            fetch = backend.store_to_cpu("m", [10, 11, 12, 13], cpu)
            swap = backend.swap_in([3, 4, 5, 6], cpu)
            fetch.result(timeout=30)
            swap.result(timeout=30)
            np.testing.assert_array_equal(cpu_image(worker, [3, 4, 5, 6]), want)


def test_an_unusable_store_fails_its_tasks_by_name_and_swaps_go_on(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    url = f"file://{blocker}/l3"
    with deployment(SPEC, tp=1, store=url) as (backend, workers):
        cpu = backend.allocate_cpu_blocks(1)
        with pytest.raises(TransferError, match=f"store {url}: cannot create"):
            backend.cpu_to_store("m", [1], cpu).result(timeout=30)
        from conftest import round_trip
        round_trip(backend, workers, np.random.default_rng(0))       # L2 keeps serving


# -- two deployments, one store ------------------------------------------------------------------------
def test_two_deployments_share_blocks_through_a_directory(tmp_path):
    url, spec = f"file://{tmp_path}/l3", dataclasses.asdict(SPEC)
    hashes = [int(h) for h in np.random.default_rng(2).integers(0, 2**63, 8)]
    put = run_peer(url=url, namespace="llama/0", spec=spec, tp=2, mode="put", hashes=hashes)
    assert put["present"] == [True] * 8
    got = run_peer(url=url, namespace="llama/0", spec=spec, tp=2, mode="get", hashes=hashes)
    assert got.get("error") is None and got["verified_bytes"] == 8 * 2 * SPEC.cpu_block_bytes
    other_ns = run_peer(url=url, namespace="llama/1", spec=spec, tp=2, mode="get", hashes=hashes)
    assert other_ns["present"] == [False] * 8 and "8 of 8 objects missing" in other_ns["error"]
    other_geometry = run_peer(url=url, namespace="llama/0", spec={**spec, "head_dim": 16}, tp=2, mode="get",
                              hashes=hashes)
    assert other_geometry["present"] == [False] * 8 and "missing" in other_geometry["error"]


def test_block_bytes_are_random_and_rank_specific():
    a, b = block_bytes(5, 0, 4096), block_bytes(5, 1, 4096)
    assert not np.array_equal(a, b) and a.min() >= 1 and len(np.unique(a)) > 200
    np.testing.assert_array_equal(a, block_bytes(5, 0, 4096))


# -- a transfer manager killed during a put ---------------------------------------------------------------
BIG = small_spec(num_layers=4, num_gpu_blocks=8, num_cpu_blocks=768, block_size=16, num_kv_heads=4, head_dim=64)


def kill_during_put(url):
    """Put many large blocks, SIGKILL the transfer manager once some of them are visible, and check that
    every visible object is whole and right: the one in flight is not visible. Returns (visible, total)."""
    from fastcache.store import open_store
    rng = np.random.default_rng(13)
    n = BIG.num_cpu_blocks
    hashes = rng.integers(0, 2**63, n)
    with deployment(BIG, tp=1, store=url) as (backend, _):
        tier = backend.cpu_tier(0)
        tier[...] = rng.integers(1, 256, tier.shape, dtype=np.uint8)
        want = tier.copy()
        assert not backend.store_contains("kill", hashes[:1]).any()    # the engine's client is up before the put
        handle = backend.cpu_to_store("kill", hashes, np.arange(n))
        wait_for(lambda: backend.store_contains("kill", hashes[:1]).all(), 30, "the first object")
        os.kill(backend.transfer_pids[0], signal.SIGKILL)
        with pytest.raises(TransferError, match="killed by SIGKILL"):
            handle.result(timeout=30)
        present = backend.store_contains("kill", hashes)
        assert 0 < present.sum() < n, "the put finished before the kill: make it larger"
        # every visible object is whole: fetched by a client of our own into a scratch tier, and checked
        store = open_store(url)
        try:
            scratch = np.zeros((n, BIG.cpu_block_stride), np.uint8)
            store.attach(scratch, BIG.cpu_block_bytes)
            k = ObjectKeys("kill", fingerprint(BIG, 1), 0)
            idx = np.flatnonzero(present)
            assert store.get(k, as_hashes(hashes[idx]), idx).all()
            np.testing.assert_array_equal(scratch[idx, :BIG.cpu_block_bytes], want[idx])
            missing = np.flatnonzero(~present)
            assert not store.get(k, as_hashes(hashes[missing]), missing).any()
        finally:
            store.close()
        return int(present.sum()), n


def test_transfer_manager_killed_during_a_put_leaves_no_visible_entry(tmp_path):
    kill_during_put(f"file://{tmp_path}/l3")


def test_a_store_being_opened_by_one_backend_does_not_hold_up_another(tmp_path):
    """Each backend opens its own client under its own lock: opening one can take seconds (a dead master)."""
    a = SwapBackend(SPEC, device="sim", store=f"file://{tmp_path}/a")
    b = SwapBackend(SPEC, device="sim", store=f"file://{tmp_path}/b")
    answered = threading.Event()
    with a._store_tasks._client_lock:                 # a's client is being opened
        threading.Thread(target=lambda: answered.set() if not b.store_contains("m/0", [1, 2]).any() else None,
                         daemon=True).start()
        assert answered.wait(10), "backend b waited for backend a's store"
    b._store_tasks.close()


@pytest.mark.parametrize("library, how", [("libnuma.so.1", "apt-get install libnuma1"),
                                          ("libfoo.so.7", "apt-file search libfoo.so.7")])
def test_a_mooncake_master_without_a_system_library_says_which_and_how_to_install_it(tmp_path, monkeypatch,
                                                                                      library, how):
    """The master's binary stops in the dynamic loader (the message ld.so prints, exit 127): the error names
    the library and how to install it, not only the log's last lines."""
    from fastcache.store import service
    from fastcache.store.base import StoreError
    binary = tmp_path / "mooncake_master"
    binary.write_text("#!/bin/sh\necho \"$0: error while loading shared libraries: "
                      f"{library}: cannot open shared object file: No such file or directory\" >&2\nexit 127\n")
    binary.chmod(0o700)
    monkeypatch.setattr(service, "mooncake_binary", lambda name: str(binary))
    svc = service.MooncakeService(segment_mb=0)
    with pytest.raises(StoreError, match=f"system library {re.escape(library)} is missing: .*{re.escape(how)}"):
        svc.start()         # its stop() on the way out removes the log directory
