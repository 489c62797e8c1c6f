"""fastcache's kv_connector_extra_config checks and vLLM's keys mapped to fastcache's (no vLLM needed)."""
import numpy as np
import psutil
import pytest

from fastcache.integrations.vllm.keys import block_hashes, chunk_blocks, gpu_to_cpu_blocks, key_hash
from fastcache.integrations.vllm.options import ConfigError, VllmOptions


def test_good_config_keeps_vllm_keys():
    opts = VllmOptions.from_extra_config({"spec_name": "FastcacheOffloadingSpec", "spec_module_path": "m",
                                          "cpu_bytes_to_use": 1 << 20, "store": "file:///tmp/x",
                                          "blocks_per_chunk": 2, "namespace": "llama/step-0"})
    assert (opts.cpu_bytes_to_use, opts.store, opts.namespace) == (1 << 20, "file:///tmp/x", "llama/step-0")


@pytest.mark.parametrize("extra, key", [
    ({"cpu_bytes_to_use": 1, "cpu_byts": 1}, "cpu_byts"),
    ({}, "cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": -5}, "cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": "1G"}, "cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": psutil.virtual_memory().total + 1}, "cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": 1, "store": "redis://host:1"}, "store"),
    ({"cpu_bytes_to_use": 1, "store": "mooncake://host"}, "store"),
    ({"cpu_bytes_to_use": 1, "namespace": ""}, "namespace"),
    ({"cpu_bytes_to_use": 1, "transfer_timeout": 0}, "transfer_timeout"),
    ({"cpu_bytes_to_use": 1, "policy": "mru"},
     "'policy' must be one of \\['adaptive', 'arc', 'laps', 'lru', 'probation', 'shadow'\\].*got 'mru'"),
    ({"cpu_bytes_to_use": 1, "policy": "LRU"}, "policy"),
    ({"cpu_bytes_to_use": 1, "policy": 3}, "policy"),
])
def test_bad_config_names_the_key(extra, key):
    with pytest.raises(ConfigError, match=key):
        VllmOptions.from_extra_config(extra)


def test_the_eviction_policy_defaults_to_evictions_default_and_takes_each_name():
    from fastcache.eviction import DEFAULT_POLICY
    assert VllmOptions.from_extra_config({"cpu_bytes_to_use": 1}).policy == DEFAULT_POLICY
    assert VllmOptions.from_extra_config({"cpu_bytes_to_use": 1, "policy": None}).policy == DEFAULT_POLICY
    for name in ("lru", "arc", "probation", "adaptive", "laps", "shadow"):
        assert VllmOptions.from_extra_config({"cpu_bytes_to_use": 1, "policy": name}).policy == name


def test_key_hash_mixes_the_group():
    block = bytes(range(32))
    a, b = key_hash(block + (0).to_bytes(4, "big")), key_hash(block + (1).to_bytes(4, "big"))
    assert a != b and 0 <= a < 2**64 and 0 <= b < 2**64
    hashes = block_hashes([block + bytes(4)], 4)
    assert len(set(hashes.tolist())) == 4 and hashes[0] == a


def test_gpu_blocks_pair_with_chunk_blocks_like_vllm():
    """Group 0 starts at request block 3 with 2 blocks per chunk: its first chunk is entered half-way."""
    gpu, cpu = gpu_to_cpu_blocks([10, 11, 12, 13, 20], group_sizes=[4, 1], block_indices=[3, 0],
                                 chunks=[7, 8, 9, 5], blocks_per_chunk=2)
    assert list(gpu) == [10, 11, 12, 13, 20]
    assert list(cpu) == [15, 16, 17, 18, 10]
    assert chunk_blocks([7, 5], 2).tolist() == [14, 15, 10, 11]
    with pytest.raises(ValueError, match="chunks"):
        gpu_to_cpu_blocks([1, 2, 3], [3], [0], chunks=[1], blocks_per_chunk=2)
    assert np.array_equal(gpu_to_cpu_blocks([4], [1], [0], [6], 1)[1], [6])


def test_small_and_large_transfers_pair_blocks_alike(monkeypatch):
    """The plain-Python path for small transfers against the NumPy one, on random groups; the oracle tells a
    chunk off by one apart."""
    from fastcache.integrations.vllm import keys
    rng = np.random.default_rng(7)
    for _ in range(300):
        bpc = int(rng.integers(1, 5))
        sizes = rng.integers(0, 6, int(rng.integers(1, 4))).tolist()
        firsts = rng.integers(0, 9, len(sizes)).tolist()
        used = sum(-(-(s + f % bpc) // bpc) for s, f in zip(sizes, firsts) if s)
        gpu = rng.permutation(64)[:sum(sizes)]
        chunks = rng.permutation(100)[:used]
        small = keys.gpu_to_cpu_blocks(gpu, sizes, firsts, chunks, bpc)
        monkeypatch.setattr(keys, "SMALL", -1)
        large = keys.gpu_to_cpu_blocks(gpu, sizes, firsts, chunks, bpc)
        monkeypatch.setattr(keys, "SMALL", 64)
        assert small[0] == large[0].tolist() and small[1] == large[1].tolist()
        assert all(type(i) is int for i in small[0] + small[1]) and large[1].dtype == np.int64
        if used:
            off = chunks.copy()
            off[-1] += 1
            assert keys.gpu_to_cpu_blocks(gpu, sizes, firsts, off, bpc)[1] != large[1].tolist()


@pytest.mark.parametrize("n", [1, 2, 5])
def test_an_entry_is_stamped_only_when_every_rank_wrote_its_stamp(n):
    """The manager's fail-closed check, on the short path (one or two chunks) and the vectorised one."""
    from fastcache.config import CacheSpec
    from fastcache.integrations.vllm.link import ManagerLinks, WorkerLink
    spec = CacheSpec(num_layers=1, num_gpu_blocks=8, num_cpu_blocks=8, block_size=1, num_kv_heads=1, head_dim=16,
                     cache_dtype="uint8")
    engine = f"test-link-{n}"
    workers = [WorkerLink(engine, r, spec, 8, "ns") for r in range(2)]
    links = ManagerLinks(engine, 2, wait=1)
    try:
        chunks, stamps = list(range(1, n + 1)), [100 + c for c in range(1, n + 1)]
        assert not links.stamped(chunks, stamps).any()
        workers[0].stamp(chunks, stamps)
        assert not links.stamped(chunks, stamps).any(), "one rank's stamp is not enough"
        workers[1].stamp(chunks[1:], stamps[1:])
        workers[1].stamp(chunks[:1], [7])                    # a stale stamp on the first chunk
        assert links.stamped(chunks, stamps).tolist() == [False] + [True] * (n - 1)
        assert links.stamped(np.asarray(chunks), np.asarray(stamps, np.uint64)).dtype == bool
    finally:
        links.close()
        for w in workers:
            w.close()


def test_the_store_timeout_defaults_to_the_engines_query_bound_and_is_checked():
    from fastcache.store.remote import QUERY_TIMEOUT
    assert VllmOptions.from_extra_config({"cpu_bytes_to_use": 1}).store_timeout == QUERY_TIMEOUT
    assert VllmOptions.from_extra_config({"cpu_bytes_to_use": 1, "store_timeout": 1.5}).store_timeout == 1.5
    for bad in (0, -1, 61, True, "5"):
        with pytest.raises(ConfigError, match="'store_timeout' must be seconds"):
            VllmOptions.from_extra_config({"cpu_bytes_to_use": 1, "store_timeout": bad})
