"""Sealed L3 objects under a deployment key (docs/design.md §12): what a hostile writer of the store can
and cannot do. Anyone who reaches a Mooncake master can write any key and read any object; with a key the
store sees no plaintext, and a forged, replayed or foreign object is a miss, never bytes; it stays in the
store (another key's object is no proof of corruption), counted apart."""
from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import small_spec
from fastcache.store import ObjectKeys, as_hashes, fingerprint, open_store, parse_store_url
from fastcache.store.keys import HEADER_BYTES
from fastcache.store.seal import KEY_BYTES, Sealer

SPEC = small_spec(num_cpu_blocks=16)
FP = fingerprint(SPEC, 1)


def key_file(path, key: bytes | None = None, mode=0o600, hex_form=False):
    key = os.urandom(KEY_BYTES) if key is None else key
    with open(path, "wb") as f:
        f.write(key.hex().encode() + b"\n" if hex_form else key)
    os.chmod(path, mode)
    return str(path)


def random_tier(seed):
    return np.random.default_rng(seed).integers(1, 256, (SPEC.num_cpu_blocks, SPEC.cpu_block_stride), np.uint8)


class Rank:
    """One rank's side of a store URL: its CPU tier attached, keys of one namespace."""

    def __init__(self, url, seed, namespace="llama/step-0", rank=0):
        self.store = open_store(url)
        self.blocks = random_tier(seed)
        self.tier = self.blocks[:, :SPEC.cpu_block_bytes]
        self.store.attach(self.blocks, SPEC.cpu_block_bytes)
        self.keys = ObjectKeys(namespace, FP, rank, self.store.sealer)

    def put(self, hashes, cpu):
        return self.store.put(self.keys, as_hashes(hashes), np.array(cpu))

    def get(self, hashes, cpu, foreign=None):
        return self.store.get(self.keys, as_hashes(hashes), np.array(cpu), foreign)

    def close(self):
        self.store.close()


def object_file(rank: Rank, h: int) -> str:
    return rank.store.object_path(rank.keys, h)


def sealed_url(tmp_path, name="k"):
    return f"file://{tmp_path}/l3?key_file={key_file(tmp_path / name)}"


def test_a_sealed_round_trip_returns_every_byte_and_the_store_holds_no_plaintext(tmp_path):
    url = sealed_url(tmp_path)
    writer, reader = Rank(url, 1), Rank(url, 2)
    try:
        assert writer.put([10, 11, 12], [0, 5, 9]) == 0
        for h, c in ((10, 0), (11, 5), (12, 9)):
            stored = open(object_file(writer, h), "rb").read()
            assert len(stored) == SPEC.cpu_block_bytes + HEADER_BYTES
            payload = writer.tier[c].tobytes()
            assert stored[:SPEC.cpu_block_bytes] != payload
            assert payload[:64] not in stored and payload[-64:] not in stored     # no run of the plaintext
        assert reader.get([10, 11, 12], [3, 4, 7]).all()
        for c_w, c_r in ((0, 3), (5, 4), (9, 7)):
            np.testing.assert_array_equal(reader.tier[c_r], writer.tier[c_w])
        np.testing.assert_array_equal(writer.tier, random_tier(1)[:, :SPEC.cpu_block_bytes])   # put changed nothing
    finally:
        writer.close()
        reader.close()


def test_a_forged_object_built_from_public_facts_is_a_miss_left_in_place_and_an_honest_put_replaces_it(tmp_path):
    """The attacker knows namespace, fingerprint, hash and rank (they are in the key) and builds an object
    with a valid plain header and checksum, as today's unsealed format accepts."""
    sealed = Rank(sealed_url(tmp_path), 3)
    attacker = Rank(f"file://{tmp_path}/l3", 4)           # no key: plain objects
    try:
        assert attacker.put([20], [1]) == 0
        path = object_file(sealed, 20)
        assert os.path.exists(path)
        foreign = np.zeros(1, bool)
        assert not sealed.get([20], [6], foreign).any()   # block 6 is undefined now, as after any miss
        assert foreign.all() and os.path.exists(path)     # it cannot be authenticated: not ours to delete
        honest = sealed.tier[7].copy()
        assert sealed.put([20], [7]) == 0 and sealed.get([20], [2]).all()
        np.testing.assert_array_equal(sealed.tier[2], honest)
    finally:
        sealed.close()
        attacker.close()


def test_replayed_objects_under_other_hashes_ranks_or_namespaces_are_misses(tmp_path):
    url = sealed_url(tmp_path)
    a = Rank(url, 5)
    b = Rank(url, 6, rank=1)
    other_ns = Rank(url, 7, namespace="llama/step-1")
    try:
        a.put([30, 31], [0, 1])
        b.put([30], [0])
        other_ns.put([32], [0])
        replays = [(object_file(a, 30), object_file(a, 33)),              # under another hash
                   (object_file(b, 30), object_file(a, 34)),              # another rank's object
                   (object_file(other_ns, 32), object_file(a, 35))]       # another namespace's
        for src, dst in replays:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(src, "rb") as f, open(dst, "wb") as g:
                g.write(f.read())
        foreign = np.zeros(3, bool)
        assert not a.get([33, 34, 35], [8, 9, 10], foreign).any()
        assert foreign.all()
        for _, dst in replays:
            assert os.path.exists(dst)                    # a miss, left in the store
        assert a.get([30, 31], [11, 12]).all()            # the honest objects still serve
    finally:
        for r in (a, b, other_ns):
            r.close()


def test_a_sealed_object_is_bound_to_its_namespace_alone(tmp_path):
    """Another namespace's object of the same hash, rank and geometry, copied under this namespace's key:
    only the namespace tells them apart, and the tag covers it."""
    url = sealed_url(tmp_path)
    mine, other = Rank(url, 12), Rank(url, 13, namespace="llama/step-1")
    try:
        other.put([36], [4])
        dst = object_file(mine, 36)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(object_file(other, 36), "rb") as f, open(dst, "wb") as g:
            g.write(f.read())
        assert not mine.get([36], [5]).any()
        assert other.get([36], [6]).all()                 # the original still serves its own namespace
        np.testing.assert_array_equal(other.tier[6], other.tier[4])
    finally:
        mine.close()
        other.close()


def test_a_flipped_bit_anywhere_in_a_sealed_object_is_a_miss(tmp_path):
    rank = Rank(sealed_url(tmp_path), 8)
    try:
        rank.put([40], [0])
        path = object_file(rank, 40)
        good = open(path, "rb").read()
        rng = np.random.default_rng(8)
        for where in [0, SPEC.cpu_block_bytes - 1, *rng.integers(0, len(good), 6).tolist()]:
            bad = bytearray(good)
            bad[where] ^= 1 << int(rng.integers(8))
            with open(path, "wb") as f:
                f.write(bad)
            assert not rank.get([40], [3]).any(), f"bit flipped at byte {where} was served"
        with open(path, "wb") as f:
            f.write(good)
        assert rank.get([40], [3]).all()
    finally:
        rank.close()


def test_another_key_cannot_open_a_deployments_objects_and_no_key_serves_none(tmp_path):
    root = f"{tmp_path}/l3"
    mine = Rank(f"file://{root}?key_file={key_file(tmp_path / 'k1')}", 9)
    theirs = Rank(f"file://{root}?key_file={key_file(tmp_path / 'k2')}", 10)
    plain = Rank(f"file://{root}", 11)
    try:
        mine.put([50], [0])
        foreign = np.zeros(1, bool)
        assert not theirs.get([50], [1], foreign).any() and foreign.all()
        mine.put([51], [1])
        foreign[:] = False
        assert not plain.get([51], [2], foreign).any() and foreign.all()     # a sealed object is no plain one
        assert mine.get([50, 51], [3, 4]).all()        # neither was deleted: the right key still reads both
        np.testing.assert_array_equal(mine.tier[3:5], mine.tier[0:2])
    finally:
        for r in (mine, theirs, plain):
            r.close()


def test_the_key_is_read_from_a_private_file_and_never_shown(tmp_path):
    key = os.urandom(KEY_BYTES)
    ok_hex = key_file(tmp_path / "hex", key, hex_form=True)
    assert repr(Sealer.from_file(ok_hex)) == "Sealer(<key>)"
    assert parse_store_url(f"file:///tmp/x?key_file={ok_hex}").options == {"key_file": ok_hex}
    bad = {"missing": str(tmp_path / "nope"),
           "short": key_file(tmp_path / "short", key[:16]),
           "not hex": key_file(tmp_path / "nothex", b"z" * 64),
           "readable by others": key_file(tmp_path / "open", key, mode=0o644),
           "a directory": str(tmp_path)}
    for what, path in bad.items():
        for url in (f"file:///tmp/x?key_file={path}", f"mooncake://h:5?key_file={path}"):
            with pytest.raises(ValueError, match="key_file") as err:
                parse_store_url(url)
            assert key.hex() not in str(err.value) and repr(key) not in str(err.value), what
    with pytest.raises(ValueError, match="unknown options"):
        parse_store_url("file:///tmp/x?segment_mb=1")


def test_an_engine_with_the_wrong_key_deletes_none_of_the_right_keys_objects_and_says_why(tmp_path, capfd):
    """Two deployments share a store; the second names another key. Its loads miss, saying "wrong key or
    foreign object" (logged once), and every object stays: the first deployment still loads each byte."""
    from conftest import deployment
    from fastcache import TransferError
    root = tmp_path / "l3"
    right = f"file://{root}?key_file={key_file(tmp_path / 'right')}"
    wrong = f"file://{root}?key_file={key_file(tmp_path / 'wrong')}"
    rng = np.random.default_rng(60)
    hashes = [int(h) for h in rng.integers(0, 2**63, 3)]
    with deployment(SPEC, tp=1, store=right) as (a, _):
        tier = a.cpu_tier(0)
        tier[:3] = rng.integers(0, 256, (3, SPEC.cpu_block_bytes), dtype=np.uint8)
        want = tier[:3].copy()
        a.cpu_to_store("shared", hashes, [0, 1, 2]).result(timeout=30)
        with deployment(SPEC, tp=1, store=wrong) as (b, _):
            assert b.store_contains("shared", hashes).all()
            for _ in range(2):
                with pytest.raises(TransferError,
                                   match="3 of them failed authentication \\(wrong key or foreign object"):
                    b.store_to_cpu("shared", hashes, [5, 6, 7]).result(timeout=30)
            assert b.store_contains("shared", hashes).all()         # nothing deleted
        tier[3:6] = rng.integers(0, 256, (3, SPEC.cpu_block_bytes), dtype=np.uint8)
        a.store_to_cpu("shared", hashes, [3, 4, 5]).result(timeout=30)
        np.testing.assert_array_equal(tier[3:6], want)
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "WARNING" in line and "wrong key or foreign object" in line]
    assert len(warnings) == 1, err[-3000:]          # said once


def test_a_key_that_is_plainly_not_random_is_refused(tmp_path):
    """32 zero bytes, 32 characters of text, a short repeated pattern: each would seal every object under a
    key anyone can guess. Raw or hex, they are refused naming key_file; random keys in both forms load."""
    rng = np.random.default_rng(61)
    weak = {"zeros": bytes(KEY_BYTES), "text": b"correct horse battery staple 123",
            "hex digits of 16 bytes": os.urandom(16).hex().encode(), "pattern": bytes(range(8)) * 4,
            "few values": bytes(rng.integers(0, 8, KEY_BYTES, dtype=np.uint8))}
    for what, key in weak.items():
        assert len(key) == KEY_BYTES, what
        for hex_form in (False, True):
            path = key_file(tmp_path / f"{what}-{hex_form}", key, hex_form=hex_form)
            with pytest.raises(ValueError, match="key_file") as err:
                parse_store_url(f"file:///tmp/x?key_file={path}")
            assert key.hex() not in str(err.value), what
    for i in range(20):
        key = os.urandom(KEY_BYTES)
        for hex_form in (False, True):
            Sealer.from_file(key_file(tmp_path / f"good{i}-{hex_form}", key, hex_form=hex_form))
