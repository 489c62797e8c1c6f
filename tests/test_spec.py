import numpy as np
import pytest

from fastcache import CacheSpec
from fastcache.engine import CpuBlockAllocator

from conftest import small_spec


def test_tensor_names_and_layout_follow_fastdeploy():
    spec = small_spec(cache_dtype="block_wise_fp8", num_extra_layers=1, num_extra_gpu_blocks=10)
    infos = spec.tensors(rank=1, device_id=1)
    names = [i.name for i in infos]
    assert names[:4] == ["key_caches_0_rank1.device1", "value_caches_0_rank1.device1",
                         "key_cache_scales_0_rank1.device1", "value_cache_scales_0_rank1.device1"]
    assert len(infos) == 4 * 4
    assert infos[0].shape == (24, 2, 4, 8) and infos[0].dtype == "uint8" and infos[0].block_bytes == 64
    assert infos[2].shape == (24, 2, 4) and infos[2].block_bytes == 2 * 4 * 4
    assert infos[-1].num_blocks == 10                       # draft layer
    offsets = [i.cpu_offset for i in infos]
    assert offsets == sorted(offsets) and spec.cpu_block_bytes == sum(i.block_bytes for i in infos)


def test_k_only_and_json_round_trip():
    spec = small_spec(has_value=False)
    assert [i.kind for i in spec.tensors()] == ["key_caches"] * 3
    assert CacheSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("bad", [dict(num_layers=0), dict(num_gpu_blocks=-1), dict(block_size=1.5),
                                 dict(cache_dtype="int4"), dict(scale_dtype="int8"),
                                 dict(num_extra_gpu_blocks=99), dict(has_value="yes"), dict(head_dim=True)])
def test_bad_spec_is_refused(bad):
    with pytest.raises(ValueError):
        small_spec(**bad)


def test_task_bytes_counts_draft_layers_only_for_their_blocks():
    spec = small_spec(num_extra_layers=1, num_extra_gpu_blocks=10)
    main = sum(i.block_bytes for i in spec.tensors() if i.layer < 3)
    extra = spec.cpu_block_bytes - main
    assert spec.task_bytes(np.array([1, 2, 15])) == 3 * main + 2 * extra


def test_cpu_allocator():
    alloc = CpuBlockAllocator(8)
    assert alloc.allocate(3) == [0, 1, 2]
    alloc.free([1])
    assert alloc.allocate(2) == [1, 3]
    with pytest.raises(ValueError):
        alloc.allocate(6)
    with pytest.raises(ValueError):
        alloc.free([7])                 # never allocated
    with pytest.raises(ValueError):
        alloc.free([0, 0])
    alloc.reset()
    assert alloc.num_free == 8
