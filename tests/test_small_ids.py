"""The small-swap path of SwapBackend (engine/ids.py small_swap_ids, ipc/protocol.py encode_small_task): it
accepts exactly the requests the generic checks accept and sends the same bytes; anything else goes the generic
way, which names what is wrong. No processes."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from fastcache.engine.ids import SMALL_IDS, as_ids, small_swap_ids
from fastcache.ipc import protocol

GPU, CPU = 24, 16


def generic(kind, gpu, cpu):
    """SwapBackend._validate's checks: the ids as int64 lists, or the ValueError's text."""
    try:
        g, c = as_ids(gpu, "gpu_block_ids"), as_ids(cpu, "cpu_block_ids")
        if len(g) != len(c):
            raise ValueError("lengths differ")
        if not 0 < len(g) <= protocol.MAX_IDS:
            raise ValueError("empty")
        protocol.check_ids(g, c, kind, GPU, CPU)
    except ValueError as exc:
        return str(exc)
    return g.tolist(), c.tolist()


def requests():
    """Good and bad requests in every shape the small path looks at, and some it leaves alone."""
    rng = np.random.default_rng(11)
    ids = [[0], [23], [24], [-1], [3, 3], [1, 2], [5, 6, 7], [15], [16], list(range(SMALL_IDS)),
           list(range(SMALL_IDS + 1)), [], [True], [1.0], [None], [np.int64(3)], [2**40], [-2**70]]
    ids += [rng.integers(-2, 26, rng.integers(1, 8)).tolist() for _ in range(60)]
    for g, c in itertools.product(ids, repeat=2):
        yield g, c
        yield tuple(g), c
        for dtype in (np.int32, np.int64, np.uint16):
            info = np.iinfo(dtype)
            if all(type(v) is int and info.min <= v <= info.max for v in g + c):
                yield np.array(g, dtype), np.array(c, dtype)
    yield np.array([[1]]), np.array([[2]])
    yield np.array([True]), np.array([1])
    yield np.array([1.0]), np.array([1])
    yield "1", [1]
    yield {1}, {2}
    yield range(3), range(3)


def disagreements(check):
    """Requests where check(kind, gpu, cpu) accepts what the generic checks refuse, or gives other ids."""
    wrong = []
    for kind in protocol.TASK_KINDS:
        for gpu, cpu in requests():
            small = check(gpu, cpu, kind == protocol.SWAP_TO_CPU, GPU, CPU)
            if small is None:
                continue
            want = generic(kind, gpu, cpu)
            if isinstance(want, str) or list(small) != list(want) or \
                    not all(type(v) is int for v in small[0] + small[1]):
                wrong.append((kind, gpu, cpu, small, want))
    return wrong


def test_the_small_path_accepts_only_what_the_generic_checks_accept_with_the_same_ids():
    assert disagreements(small_swap_ids) == []
    # and it takes every valid request of its shapes: lists and tuples of ints, 1-D integer arrays, that short
    missed, taken = [], 0
    for kind in protocol.TASK_KINDS:
        for gpu, cpu in requests():
            if not all(eligible(x) for x in (gpu, cpu)) or isinstance(generic(kind, gpu, cpu), str):
                continue
            taken += 1
            if small_swap_ids(gpu, cpu, kind == protocol.SWAP_TO_CPU, GPU, CPU) is None:
                missed.append((kind, gpu, cpu))
    assert missed == [] and taken > 500


def eligible(ids) -> bool:
    if isinstance(ids, np.ndarray):
        return ids.ndim == 1 and ids.dtype.kind in "iu" and ids.size <= SMALL_IDS
    return isinstance(ids, (list, tuple)) and len(ids) <= SMALL_IDS and all(type(v) is int for v in ids)


def test_the_oracle_sees_a_small_path_that_skips_a_check():
    """The negative control: small paths that let a duplicate destination or an id out of range through."""
    def no_duplicate_check(gpu, cpu, dest_is_cpu, num_gpu, num_cpu):
        ok = small_swap_ids(gpu, cpu, dest_is_cpu, num_gpu, num_cpu)
        if ok is None and isinstance(gpu, list) and isinstance(cpu, list) and len(gpu) == len(cpu) == 2 and \
                all(type(v) is int and 0 <= v < 16 for v in gpu + cpu):
            return gpu, cpu
        return ok

    def off_by_one(gpu, cpu, dest_is_cpu, num_gpu, num_cpu):
        return small_swap_ids(gpu, cpu, dest_is_cpu, num_gpu + 1, num_cpu)
    assert any("duplicate" in w[4] for w in disagreements(no_duplicate_check))
    assert any("out of range" in w[4] for w in disagreements(off_by_one))


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("layerwise", [False, True])
def test_a_small_task_is_sent_as_the_same_bytes_as_the_generic_encoder_makes(wide, layerwise):
    rng = np.random.default_rng(int(wide) * 2 + int(layerwise))
    wire = np.int64 if wide else np.int32
    for n in (1, 2, 7, SMALL_IDS):
        gpu, cpu = rng.integers(0, 2**31 - 1, n).tolist(), rng.integers(0, 2**31 - 1, n).tolist()
        for kind, fence in itertools.product(protocol.TASK_KINDS, ([], [protocol.Fence(1, 3, 63)],
                                                                   [protocol.Fence(0, 1, 2), protocol.Fence(3, 9, 0)])):
            task_id = int(rng.integers(1, 2**40))
            small = protocol.encode_small_task(task_id, kind, gpu, cpu, wide, layerwise, fence)
            lazy = protocol.SmallTask(task_id, kind, gpu, cpu, wide, layerwise, fence)
            assert list(lazy) == list(lazy) == small and lazy.task == small.task    # what a pipe sends, each time
            assert small == protocol.encode_task(task_id, kind, np.array(gpu, wire), np.array(cpu, wire), layerwise,
                                                 fence=fence)
            header, (g, c) = protocol.decode(small)
            assert (header["task_id"], header["kind"], header["layerwise"], header["fence"], g.tolist(),
                    c.tolist()) == (task_id, kind, layerwise, fence, gpu, cpu)
    # the oracle sees one id changed
    assert protocol.encode_small_task(1, protocol.SWAP_TO_CPU, [1], [2], wide) != \
        protocol.encode_task(1, protocol.SWAP_TO_CPU, np.array([1], wire), np.array([3], wire))
