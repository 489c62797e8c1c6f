"""The Paddle worker: Paddle CPU tensors are zero-copy views of the sim device's shared memory."""
import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from conftest import deployment, small_spec  # noqa: E402


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "block_wise_fp8"])
def test_paddle_worker_round_trip(dtype):
    rng = np.random.default_rng(9)
    spec = small_spec(cache_dtype=dtype)
    with deployment(spec, tp=2, framework="paddle") as (backend, workers):
        want_dtype = {"bfloat16": paddle.bfloat16, "float16": paddle.float16, "block_wise_fp8": paddle.uint8}[dtype]
        for w in workers:
            assert all(isinstance(t, paddle.Tensor) for t in w.key_caches + w.value_caches)
            assert w.key_caches[0].dtype == want_dtype
            assert list(w.key_caches[0].shape) == [24, 2, 4, 8]
            if dtype == "block_wise_fp8":
                assert w.key_cache_scales[0].dtype == paddle.float32
            for t in w.key_caches + w.value_caches + w.key_cache_scales + w.value_cache_scales:
                # write through Paddle, so the test proves the tensors share the swapped memory
                bits = rng.integers(1, 255, t.shape, dtype=np.uint8) if t.dtype == paddle.uint8 else \
                    rng.standard_normal(t.shape).astype(np.float32)
                t.copy_(paddle.to_tensor(bits).astype(t.dtype), False)
        before = [[t.numpy().copy() for t in w.key_caches + w.value_caches] for w in workers]
        backend.swap_out([3, 7, 11], [0, 5, 2]).result(timeout=20)
        for w in workers:
            for t in w.key_caches + w.value_caches:
                t.copy_(paddle.zeros(t.shape, dtype=t.dtype), False)
        backend.swap_in([20, 1, 9], [0, 5, 2]).result(timeout=20)
        for w, old in zip(workers, before):
            for t, was in zip(w.key_caches + w.value_caches, old):
                now = t.numpy()
                assert np.array_equal(now[[20, 1, 9]].view(np.uint8), was[[3, 7, 11]].view(np.uint8))
                assert not now[0].any()
