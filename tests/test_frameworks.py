"""Framework hand-off on the sim device: torch CPU tensors are zero-copy DLPack views of the cache
(Paddle has tests/test_paddle.py). Skips where torch is not installed."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import deployment, small_spec  # noqa: E402


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "block_wise_fp8"])
def test_torch_worker_round_trip(dtype):
    rng = np.random.default_rng(12)
    spec = small_spec(cache_dtype=dtype)
    want = {"bfloat16": torch.bfloat16, "float16": torch.float16, "block_wise_fp8": torch.uint8}[dtype]
    with deployment(spec, tp=2, framework="torch") as (backend, workers):
        for w in workers:
            tensors = w.key_caches + w.value_caches
            assert all(isinstance(t, torch.Tensor) and t.dtype == want for t in tensors)
            assert tuple(w.key_caches[0].shape) == (24, 2, 4, 8)
            for t in tensors + w.key_cache_scales + w.value_cache_scales:   # written through torch
                t.view(torch.uint8).copy_(torch.from_numpy(rng.integers(1, 256, t.view(torch.uint8).shape,
                                                                        dtype=np.uint8)))
        before = [[t.clone() for t in w.key_caches + w.value_caches] for w in workers]
        backend.swap_out([3, 7], [0, 5]).result(timeout=20)
        for w in workers:
            for t in w.key_caches + w.value_caches:
                t.zero_()
        backend.swap_in([20, 1], [0, 5]).result(timeout=20)
        for w, old in zip(workers, before):
            for t, was in zip(w.key_caches + w.value_caches, old):
                assert torch.equal(t[[20, 1]].view(torch.uint8), was[[3, 7]].view(torch.uint8))
                assert not t[0].view(torch.uint8).any()
