"""Weights as a tensor group (docs/design.md §11): resident and streamed forwards, sleep/wake, faults and
bad input, on sim with worker processes (fastcache.launch.model_worker) where a forward runs."""
from __future__ import annotations

import os
import contextlib
import signal
import time

import numpy as np
import pytest

from conftest import round_trip, small_spec
from fastcache import RefusedError, SwapBackend, TransferError
from fastcache.ipc.signal import CLEARED, NORMAL
from fastcache.launch.model import forward, layer_weights, model_input, model_spec, reference
from fastcache.launch.offload import ModelWorkers
from fastcache.weight_spec import WeightSpec
from fastcache.worker import CacheWorker

SPEC = small_spec()
LAYERS, HIDDEN, BATCH = 8, 32, 4
MODEL = model_spec(LAYERS, HIDDEN)


def expected(seed, tp, x_seed=99):
    x = model_input(x_seed, BATCH, HIDDEN)
    return [reference(seed, r, x, LAYERS, HIDDEN) for r in range(tp)]


def assert_outputs(outs, want):
    for r, ((out, _), ref) in enumerate(zip(outs, want)):
        assert out.tobytes() == ref.tobytes(), f"rank {r}: the forward's output differs from its weights'"


def weight_segments(suffix):
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(f"fastcache.{suffix}.weights_gen"))


def mapped_weights(pid):
    with open(f"/proc/{pid}/maps") as maps:
        return [line.split()[-1] for line in maps if "weights_gen" in line]


@contextlib.contextmanager
def weights_deployment(tp=1, **backend_kwargs):
    """In-process workers with their weights registered (when the deployment has weights)."""
    with SwapBackend(SPEC, tp_size=tp, device="sim", **backend_kwargs) as backend:
        workers = [CacheWorker(SPEC, rank=r, tp_size=tp, device="sim", suffix=backend.suffix).start()
                   for r in range(tp)]
        try:
            if backend.weight_layout is not None:
                for w in workers:
                    w.register_weights(backend.weight_layout)
            backend.wait_ready(timeout=30)
            yield backend, workers
        finally:
            for w in workers:
                w.close()


def loaded(worker, seed):
    """The worker's weights, every layer loaded with version `seed`."""
    for layer in range(LAYERS):
        worker.weights.load(layer, layer_weights(seed, worker.rank, layer, HIDDEN))
    return worker.weights


@pytest.fixture
def model_deployment():
    """(backend, workers) factory: SPEC with MODEL placed by the keyword arguments, one model worker process
    per rank, weight version 1 loaded."""
    stack = []

    def make(tp=2, **placement):
        backend = SwapBackend(SPEC, tp_size=tp, device="sim", weights=MODEL, **placement).start()
        stack.append(backend)
        workers = ModelWorkers(backend)
        stack.append(workers)
        backend.wait_ready(timeout=30)
        workers.load(seed=1)
        return backend, workers
    yield make
    for thing in reversed(stack):
        thing.close()


def test_outputs_are_bit_identical_resident_streamed_and_after_sleep1_wake(model_deployment):
    want = expected(seed=1, tp=2)
    backend, workers = model_deployment()
    assert not backend.weight_layout.streamed_layers
    resident = workers.forward(seed=99)
    assert_outputs(resident, want)

    backend, workers = model_deployment(offload_fraction=0.5)
    layout = backend.weight_layout
    assert (layout.resident_layers, layout.num_gpu_blocks) == (4, 6)      # 4 resident + a ring of 2 slots
    for _ in range(3):                      # the ring is refilled every forward
        streamed = workers.streamed_forward(seed=99)
        assert_outputs(streamed, want)
        for (a, _), (b, _) in zip(streamed, resident):
            assert a.tobytes() == b.tobytes()

    assert len(weight_segments(backend.suffix)) == 2
    backend.sleep(1, timeout=30)
    assert backend.status == CLEARED and backend.asleep == 1
    assert weight_segments(backend.suffix) == []            # the weights' memory is really returned
    assert [mapped_weights(pid) for pid in backend.transfer_pids] == [[], []]
    for r in range(2):                      # the CPU copy holds every resident layer's bytes
        region = backend.weight_region(r)
        for layer in range(layout.resident_layers):
            w = layer_weights(1, r, layer, HIDDEN)
            assert region[layer].tobytes() == w["w"].tobytes() + w["b"].tobytes()
    with pytest.raises(RefusedError):
        backend.stream_weights()
    with pytest.raises(TransferError, match="wake"):
        backend.restore_caches(timeout=5)
    backend.wake(timeout=30)
    assert backend.status == NORMAL and backend.asleep == 0 and len(weight_segments(backend.suffix)) == 2
    assert_outputs(workers.streamed_forward(seed=99), want)


def test_sleep2_copies_nothing_and_wake_serves_the_weights_the_caller_loads(model_deployment):
    backend, workers = model_deployment(offload_fraction=0.5)
    rng = np.random.default_rng(5)
    regions = [backend.weight_region(r) for r in range(2)]
    resident = backend.weight_layout.resident_layers
    for region in regions:                  # a copy to the CPU region would overwrite these bytes
        region[:resident] = rng.integers(1, 256, region[:resident].shape, dtype=np.uint8)
    before = [region.copy() for region in regions]
    backend.sleep(2, timeout=30)
    assert weight_segments(backend.suffix) == []
    for region, old in zip(regions, before):
        np.testing.assert_array_equal(region, old)
    with pytest.raises(TransferError, match="sleep\\(1\\) refused"):
        backend.sleep(1)
    backend.sleep(2)                        # idempotent
    backend.wake(timeout=30)
    workers.load(seed=2)                    # the trainer's new weights
    assert_outputs(workers.streamed_forward(seed=99), expected(seed=2, tp=2))


def test_sleep_and_wake_keep_swapped_out_kv_rules():
    """A sleep is a clear for the KV cache: swaps refused meanwhile, the CPU allocator reset, swaps work after."""
    rng = np.random.default_rng(6)
    with weights_deployment(tp=2, weights=MODEL) as (backend, workers):
        round_trip(backend, workers, rng)
        backend.allocate_cpu_blocks(3)
        backend.sleep(1, timeout=30)
        assert workers[0].key_caches == [] and not workers[0].weights.allocated
        with pytest.raises(RefusedError):
            backend.swap_out([1], [1])
        assert backend.allocator.num_free == SPEC.num_cpu_blocks
        backend.wake(timeout=30)
        backend.wake(timeout=30)            # idempotent
        round_trip(backend, workers, rng)


def test_a_ring_slot_is_not_refilled_while_the_forward_reads_it():
    """Each streamed layer's bytes are checked when its wait returns and again after a pause in which the
    stream runs on: a slot refilled too early, or a layer published before it is in place, shows."""
    with weights_deployment(weights=MODEL, offload_fraction=0.5) as (backend, (worker,)):
        weights = loaded(worker, seed=3)
        for _ in range(2):
            handle = backend.stream_weights()
            with weights.forward(handle.task_id, timeout=30) as f:
                for layer in range(LAYERS):
                    p = f.layer(layer)
                    want = layer_weights(3, 0, layer, HIDDEN)
                    for _ in range(2):
                        assert p["w"].tobytes() == want["w"].tobytes(), f"layer {layer}"
                        assert p["b"].tobytes() == want["b"].tobytes(), f"layer {layer}"
                        time.sleep(0.03)
            handle.result(timeout=30)
        handle = backend.stream_weights()           # the engine's side waits per layer too
        handle.wait_layer(0, timeout=30)
        with weights.forward(handle.task_id, timeout=30) as f:
            out = forward(model_input(1, BATCH, HIDDEN), f.layer, LAYERS)
        handle.result(timeout=30)
        assert out.tobytes() == reference(3, 0, model_input(1, BATCH, HIDDEN), LAYERS, HIDDEN).tobytes()


def test_a_forward_given_a_stream_on_sim_waits_on_the_host_and_reads_the_same_bytes():
    """The cuda form of the forward (a stream for its waits) runs unchanged on sim: the stream is ignored
    there, each streamed layer is waited for on the host, the output is the reference bit for bit."""
    with weights_deployment(weights=MODEL, offload_fraction=0.5) as (backend, (worker,)):
        weights = loaded(worker, seed=5)
        x = model_input(2, BATCH, HIDDEN)
        for stream in (12345, None):
            handle = backend.stream_weights()
            with weights.forward(handle.task_id, timeout=30, stream=stream) as f:
                out = forward(x.copy(), f.layer, LAYERS)
            handle.result(timeout=30)
            assert out.tobytes() == reference(5, 0, x, LAYERS, HIDDEN).tobytes(), f"stream {stream}"


def test_a_transfer_manager_killed_while_a_forward_waits_fails_the_wait_naming_it(model_deployment, monkeypatch):
    monkeypatch.setenv("FASTCACHE_TRANSFER_TIMEOUT", "2")
    monkeypatch.setenv("FASTCACHE_HEARTBEAT_INTERVAL", "0.2")
    backend, workers = model_deployment(offload_fraction=0.5)
    victim = backend.transfer_pids[1]
    os.kill(victim, signal.SIGSTOP)          # rank 1's stream cannot start: its forward waits on layer 4
    handle = backend.stream_weights()
    workers.ask([0, 1], {"op": "forward", "task_id": handle.task_id, "seed": 99, "batch": BATCH, "timeout": 60})
    assert workers.answers([0], timeout=30)[0]["ok"]        # rank 0 streams and computes
    time.sleep(0.3)
    began = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="rank 1"):       # the worker's wait raised, naming its rank
        workers.answers([1], timeout=30)
    assert time.monotonic() - began < 2 + 5
    with pytest.raises(TransferError, match="rank 1"):
        handle.result(timeout=30)
    backend.restart_rank(1)
    backend.wait_ready(timeout=30)
    assert_outputs(workers.streamed_forward(seed=99), expected(seed=1, tp=2))   # the worker was not left blocked


def test_sleep_and_wake_with_a_dead_rank_fail_naming_it_and_succeed_after_a_restart(model_deployment):
    backend, workers = model_deployment(offload_fraction=0.5)
    os.kill(backend.transfer_pids[1], signal.SIGKILL)
    with pytest.raises(TransferError, match="rank 1"):
        backend.sleep(1, timeout=10)
    assert backend.status == NORMAL and len(weight_segments(backend.suffix)) == 2     # nothing freed
    backend.restart_rank(1)
    backend.wait_ready(timeout=30)
    backend.sleep(1, timeout=30)
    os.kill(backend.transfer_pids[0], signal.SIGKILL)
    with pytest.raises(TransferError, match="rank 0"):
        backend.wake(timeout=10)
    backend.restart_rank(0)
    backend.wake(timeout=30)
    assert_outputs(workers.streamed_forward(seed=99), expected(seed=1, tp=2))
    # a sleep(2) whose clear phase meets a dead rank
    os.kill(backend.transfer_pids[0], signal.SIGKILL)
    with pytest.raises(TransferError, match="rank 0"):
        backend.sleep(2, timeout=10)
    backend.restart_rank(0)
    backend.sleep(2, timeout=30)
    backend.wake(timeout=30)
    workers.load(seed=4)
    assert_outputs(workers.streamed_forward(seed=99), expected(seed=4, tp=2))


def test_bad_placements_are_refused_before_anything_is_created():
    layer = MODEL.layer_bytes
    cases = [(dict(weight_budget=layer - 1), "below one layer"),
             (dict(weight_budget=1 << 60), "above the device"),
             (dict(weight_budget=2 * layer, ring_slots=3), "fewer than the ring's 3 slots"),
             (dict(offload_fraction=0.5, ring_slots=0), "ring needs at least one slot"),
             (dict(offload_fraction=1.5), "offload_fraction"),
             (dict(offload_fraction=0.5, weight_budget=4 * layer), "not both")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            SwapBackend(SPEC, tp_size=1, device="sim", weights=MODEL, **kwargs)
    with pytest.raises(ValueError, match="give weights=WeightSpec"):
        SwapBackend(SPEC, tp_size=1, device="sim", offload_fraction=0.5)
    with pytest.raises(ValueError, match="ring needs at least one slot"):
        WeightSpec(4, {"w": ((2,), "float32")}, ring_slots=0)
    with pytest.raises(ValueError, match="unique identifier"):
        WeightSpec(4, {"w x": ((2,), "float32")})
    with pytest.raises(ValueError, match="unknown dtype"):
        WeightSpec(4, {"w": ((2,), "int7")})
    placed = MODEL.placed(budget_bytes=5 * layer + 1)           # 5 layers: 3 resident + a ring of 2
    assert (placed.resident_layers, placed.num_gpu_blocks) == (3, 5)
    assert MODEL.placed(budget_bytes=LAYERS * layer).streamed_layers == range(LAYERS, LAYERS)



# -- tensor parallelism: a rank's slice of the model ---------------------------------------------------
SHARDED = {"qkv": ((12, 4), "float16", 0),        # column-parallel
           "o": ((4, 12), "float16", 1),          # row-parallel
           "norm": ((4,), "float32")}             # replicated


def test_a_sharded_spec_describes_the_ranks_slice():
    spec = WeightSpec(3, SHARDED, tp_size=2)
    assert spec.layer_tensors == (("qkv", (6, 4), "float16"), ("o", (4, 6), "float16"), ("norm", (4,), "float32"))
    assert spec.split_dims == (0, 1, None) and spec.tp_size == 2
    assert [t.shape for t in spec.tensors(rank=1)] == [(3, 6, 4), (3, 4, 6), (3, 4)]
    assert spec.layer_bytes == 6 * 4 * 2 + 4 * 6 * 2 + 4 * 4
    assert (spec.gpu_cache_bytes, spec.cpu_cache_bytes, spec.task_bytes([0, 2])) == \
        (3 * spec.layer_bytes, 3 * spec.layer_bytes, 2 * spec.layer_bytes)
    assert [spec.full_shape(n) for n in ("qkv", "o", "norm")] == [(12, 4), (4, 12), (4,)]
    full = {n: np.arange(np.prod(spec.full_shape(n))).reshape(spec.full_shape(n)) for n in ("qkv", "o", "norm")}
    for name, axis in (("qkv", 0), ("o", 1)):     # the ranks' slices side by side are the full tensor
        parts = [full[name][spec.rank_slice(name, r)] for r in range(2)]
        assert all(p.shape == dict((n, s) for n, s, _ in spec.layer_tensors)[name] for p in parts)
        assert np.array_equal(np.concatenate(parts, axis=axis), full[name])
    assert np.array_equal(full["norm"][spec.rank_slice("norm", 1)], full["norm"])
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\)"):
        spec.rank_slice("qkv", 2)
    with pytest.raises(ValueError, match="unknown weight names"):
        spec.full_shape("zz")
    placed = spec.placed(offload_fraction=0.5)        # placement keeps the slicing
    assert (placed.tp_size, placed.split_dims, placed.layer_tensors) == (2, spec.split_dims, spec.layer_tensors)
    assert placed.resident_layers == 1
    # no split dims at tp 1, or only replicated tensors at any tp: today's spec
    plain = WeightSpec(3, {"w": ((4, 4), "float32"), "b": ((4,), "float32")})
    assert plain == WeightSpec(3, {"w": ((4, 4), "float32", None), "b": ((4,), "float32")}, tp_size=1)
    assert plain.layer_tensors == (("w", (4, 4), "float32"), ("b", (4,), "float32"))
    assert plain.split_dims == (None, None)
    assert WeightSpec(3, {"w": ((4, 4), "float32", 1)}).layer_tensors == (("w", (4, 4), "float32"),)
    replicated = WeightSpec(3, {"w": ((4, 4), "float32")}, tp_size=4)
    assert replicated.layer_tensors == (("w", (4, 4), "float32"),) and replicated.layer_bytes == 64


def test_resharded_is_the_same_model_at_another_tp():
    spec = WeightSpec(3, SHARDED, tp_size=2)
    four = spec.resharded(4)
    assert four.tp_size == 4 and [s for _, s, _ in four.layer_tensors] == [(3, 4), (4, 3), (4,)]
    assert [four.full_shape(n) for n in ("qkv", "o", "norm")] == [spec.full_shape(n) for n in ("qkv", "o", "norm")]
    assert four.resharded(2) == spec and spec.resharded(2) == spec
    assert [s for _, s, _ in spec.resharded(1).layer_tensors] == [(12, 4), (4, 12), (4,)]
    assert spec.resharded(3).layer_tensors[0] == ("qkv", (4, 4), "float16")
    with pytest.raises(ValueError, match="weight 'qkv': dim 0 \\(12\\) does not divide over tp_size 5"):
        spec.resharded(5)
    with pytest.raises(ValueError, match="tp_size must be an int >= 1"):
        spec.resharded(0)


def test_bad_split_dims_and_tp_sizes_are_refused_naming_the_tensor():
    cases = [(dict(layer_tensors={"w": ((4, 4), "float32", 2)}), "weight 'w': split dim 2 is out of range"),
             (dict(layer_tensors={"w": ((4, 4), "float32", -1)}), "weight 'w': split dim -1 is out of range"),
             (dict(layer_tensors={"w": ((4, 4), "float32", True)}), "weight 'w': split dim True is out of range"),
             (dict(layer_tensors={"w": ((4,), "float32", "0")}), "weight 'w': split dim '0' is out of range"),
             (dict(layer_tensors={"w": ((4, 6), "float32", 1)}, tp_size=4),
              "weight 'w': dim 1 \\(6\\) does not divide"),
             (dict(layer_tensors={"w": ((4, 4), "float32")}, tp_size=0), "tp_size must be an int >= 1"),
             (dict(layer_tensors={"w": ((4, 4), "float32")}, tp_size=True), "tp_size must be an int >= 1"),
             (dict(layer_tensors={"w": ((4, 4), "float32", 0, 1)}), "weight 'w' must be given as"),
             (dict(layer_tensors=[("w", (4, 4))]), "weight 'w' must be given as")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            WeightSpec(3, **kwargs)


def test_weight_specs_round_trip_through_json_with_and_without_split_dims():
    for spec in (MODEL, MODEL.placed(offload_fraction=0.5), WeightSpec(3, SHARDED, tp_size=2),
                 WeightSpec(3, SHARDED, tp_size=4).placed(offload_fraction=0.5, ring_slots=1)):
        assert WeightSpec.from_json(spec.to_json()) == spec
    text = WeightSpec(3, SHARDED, tp_size=2).to_json()
    assert '["qkv", [12, 4], "float16", 0]' in text and '["norm", [4], "float32"]' in text   # full shapes
    old = ('{"layer_tensors": [["w", [4, 4], "float32"], ["b", [4], "float32"]], "num_layers": 3, '
           '"resident_layers": 3, "ring_slots": 2}')                  # JSON from before tp_size
    assert WeightSpec.from_json(old) == WeightSpec(3, {"w": ((4, 4), "float32"), "b": ((4,), "float32")})
    with pytest.raises(ValueError, match="a WeightSpec is a JSON object"):
        WeightSpec.from_json(old[:-1] + ', "split": 0}')
    with pytest.raises(ValueError, match="layer_tensors must be"):
        WeightSpec.from_json(old.replace('"float32"]', '"float32", 0, 1]', 1))

def test_bad_weight_requests_are_refused_before_anything_moves():
    rng = np.random.default_rng(8)
    with weights_deployment(weights=MODEL, offload_fraction=0.25) as (backend, workers):
        weights = workers[0].weights
        good = layer_weights(1, 0, 0, HIDDEN)
        weights.load(0, good)
        with pytest.raises(ValueError, match="unknown weight names \\['zz'\\]"):
            weights.load(0, {**layer_weights(2, 0, 0, HIDDEN), "zz": np.ones(3, np.float32)})
        with pytest.raises(ValueError, match="missing"):
            weights.load(0, {"w": good["w"]})
        with pytest.raises(ValueError, match="weight 'b'"):
            weights.load(0, {"w": good["w"], "b": good["b"].astype(np.float64)})
        assert weights.resident(0)["w"].tobytes() == good["w"].tobytes()      # nothing was written
        region = backend.weight_region(0).copy()
        with pytest.raises(ValueError, match="layer must be in"):
            weights.load(LAYERS, good)
        np.testing.assert_array_equal(backend.weight_region(0), region)
        with pytest.raises(ValueError, match="stream_weights"):
            weights.forward(None)
        with pytest.raises(ValueError, match="once"):
            workers[0].register_weights(backend.weight_layout)
        with pytest.raises(ValueError, match="level must be 1 or 2"):
            backend.sleep(3)
        h = backend.stream_weights()
        with pytest.raises(ValueError, match="layer must be an int"):
            h.wait_layer(LAYERS)
        with weights.forward(h.task_id, timeout=30) as f:
            forward(model_input(1, BATCH, HIDDEN), f.layer, LAYERS)
        h.result(timeout=30)
        round_trip(backend, workers, rng)
    with weights_deployment(weights=MODEL) as (backend, workers):
        with pytest.raises(ValueError, match="nothing to stream"):
            backend.stream_weights()
    with weights_deployment() as (backend, workers):
        with pytest.raises(ValueError, match="no weights"):
            backend.stream_weights()
        backend.sleep(1, timeout=30)            # without weights a sleep is a clear
        backend.wake(timeout=30)
        round_trip(backend, workers, rng)


def test_a_worker_that_never_moves_on_fails_the_stream_naming_the_rank(monkeypatch):
    """A forward that stops reading holds its ring: the stream fails after the worker timeout, the waiter
    (here, the engine's handle) wakes with the error instead of hanging, and the next stream works."""
    monkeypatch.setenv("FASTCACHE_WORKER_TIMEOUT", "1")
    monkeypatch.setenv("FASTCACHE_HEARTBEAT_INTERVAL", "0.1")
    with weights_deployment(weights=MODEL, offload_fraction=0.5) as (backend, (worker,)):
        weights = loaded(worker, seed=1)
        handle = backend.stream_weights()
        with weights.forward(handle.task_id, timeout=30) as f:
            f.layer(LAYERS // 2)            # the first streamed layer, then nothing more
            with pytest.raises(TransferError, match="rank 0.*still in use"):
                handle.wait_layer(3, timeout=30)
        handle = backend.stream_weights()
        with weights.forward(handle.task_id, timeout=30) as f:
            out = forward(model_input(1, BATCH, HIDDEN), f.layer, LAYERS)
        handle.result(timeout=30)
        assert out.tobytes() == reference(1, 0, model_input(1, BATCH, HIDDEN), LAYERS, HIDDEN).tobytes()


def test_protocol_carries_the_group_and_refuses_a_ring_elsewhere():
    from fastcache.ipc import protocol
    ids = np.array([4, 5, 4], np.int64), np.array([4, 5, 6], np.int64)
    header, got = protocol.decode(protocol.encode_task(7, protocol.SWAP_TO_GPU, *ids, True, protocol.WEIGHTS, 2))
    assert (header["group"], header["ring"]) == ("weights", 2) and got[0].tolist() == [4, 5, 4]
    for bad in (dict(group="optimizer"), dict(group="kv", ring=2)):
        frames = protocol.encode_task(7, protocol.SWAP_TO_GPU, *ids, True, **{"group": "weights", "ring": 0, **bad})
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(frames)


def test_launch_offload_weights_compares_and_times_both_forwards():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "fastcache.launch", "--device", "sim", "--offload-weights", "0.5"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "outputs bit-identical on every rank: yes" in done.stdout
    assert "resident:" in done.stdout and "streamed:" in done.stdout and "4 layers offloaded" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "fastcache.launch", "--device", "sim", "--offload-weights", "1.5"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "fraction in [0, 1]" in bad.stderr


def test_two_streams_in_flight_each_forward_reads_its_own_bytes_or_is_refused():
    """Two streams submitted before either forward: forwards in submission order read the right bytes; a
    forward over the older stream after one over the newer has begun is refused (its slots hold the newer
    stream's layers), never served wrong bytes, and the ring serves on."""
    with weights_deployment(weights=MODEL, offload_fraction=0.5) as (backend, (worker,)):
        weights = loaded(worker, seed=8)
        x = model_input(3, BATCH, HIDDEN)
        want = reference(8, 0, x, LAYERS, HIDDEN).tobytes()

        def run(handle):
            with weights.forward(handle.task_id, timeout=30) as f:
                return forward(x.copy(), f.layer, LAYERS).tobytes()
        first, second = backend.stream_weights(), backend.stream_weights()
        assert run(first) == want and run(second) == want
        first.result(timeout=30)
        second.result(timeout=30)
        first, second = backend.stream_weights(), backend.stream_weights()
        assert run(second) == want
        with pytest.raises(ValueError, match="stale"):
            run(first)
        first.result(timeout=30)
        second.result(timeout=30)
        assert run(backend.stream_weights()) == want


def test_a_streamed_layer_read_after_a_later_one_is_refused_and_the_forward_goes_on():
    """Layers 0, 5, 6 then 4: layer 4's slot may hold layer 6 by then. The read is refused with ValueError,
    and the forward goes on reading the right bytes; resident layers may be read in any order."""
    with weights_deployment(weights=MODEL, offload_fraction=0.5) as (backend, (worker,)):
        weights = loaded(worker, seed=7)

        def same(params, layer):
            w = layer_weights(7, 0, layer, HIDDEN)
            return params["w"].tobytes() == w["w"].tobytes() and params["b"].tobytes() == w["b"].tobytes()
        handle = backend.stream_weights()
        with weights.forward(handle.task_id, timeout=30) as f:
            for layer in (0, 5, 6):
                assert same(f.layer(layer), layer), f"layer {layer}"
            for earlier in (4, 5):
                with pytest.raises(ValueError, match="in order"):
                    f.layer(earlier)
            for layer in (6, 2, 7, 1):
                assert same(f.layer(layer), layer), f"layer {layer}"
        handle.result(timeout=30)
        handle = backend.stream_weights()       # the next pass reads every layer right
        with weights.forward(handle.task_id, timeout=30) as f:
            assert all(same(f.layer(layer), layer) for layer in range(LAYERS))
        handle.result(timeout=30)


def test_a_second_forward_over_a_stream_is_refused_never_served_the_ring_s_later_layers():
    """A forward over a stream that already had one (a retry after the model raised, say) would read layer l
    from slot l % k, refilled with a later layer once the first forward left: it is refused as stale, and the
    next stream serves every layer right."""
    with weights_deployment(weights=MODEL, offload_fraction=0.5) as (backend, (worker,)):
        weights = loaded(worker, seed=9)
        layout = backend.weight_layout
        assert len(layout.streamed_layers) > layout.ring_slots      # the ring is refilled within a pass
        x = model_input(4, BATCH, HIDDEN)
        want = reference(9, 0, x, LAYERS, HIDDEN).tobytes()
        handle = backend.stream_weights()
        with pytest.raises(RuntimeError, match="the model failed"):
            with weights.forward(handle.task_id, timeout=30) as f:
                f.layer(layout.resident_layers)         # the first streamed layer, then the model raises
                raise RuntimeError("the model failed")
        handle.result(timeout=30)                       # every layer streamed: the ring holds the last ones
        with pytest.raises(ValueError, match="stale"):
            with weights.forward(handle.task_id, timeout=30) as f:
                got = f.layer(layout.resident_layers)
                right = layer_weights(9, 0, layout.resident_layers, HIDDEN)
                assert got["w"].tobytes() == right["w"].tobytes(), "served another layer's bytes"
        handle = backend.stream_weights()
        with weights.forward(handle.task_id, timeout=30) as f:
            assert forward(x.copy(), f.layer, LAYERS).tobytes() == want
        handle.result(timeout=30)


def test_a_sleep_that_timed_out_waiting_for_a_task_in_flight_can_be_called_again():
    """A stream in flight whose forward has not begun holds the ring, so a sleep's drain times out: nothing was
    freed, the deployment serves on, and once the forward has read the stream the same sleep again succeeds."""
    with weights_deployment(weights=MODEL, offload_fraction=0.5) as (backend, (worker,)):
        weights = loaded(worker, seed=11)
        layout = backend.weight_layout
        assert len(layout.streamed_layers) > layout.ring_slots      # the stream waits for the forward
        handle = backend.stream_weights()
        with pytest.raises(TransferError, match="timed out"):
            backend.sleep(1, timeout=0.2)
        assert backend.asleep == 0 and len(weight_segments(backend.suffix)) == 1     # nothing freed
        x = model_input(5, BATCH, HIDDEN)
        with weights.forward(handle.task_id, timeout=30) as f:
            assert forward(x.copy(), f.layer, LAYERS).tobytes() == reference(11, 0, x, LAYERS, HIDDEN).tobytes()
        handle.result(timeout=30)
        backend.sleep(1, timeout=30)
        assert backend.status == CLEARED and backend.asleep == 1 and weight_segments(backend.suffix) == []
        backend.wake(timeout=30)
        handle = backend.stream_weights()
        with weights.forward(handle.task_id, timeout=30) as f:
            assert forward(x.copy(), f.layer, LAYERS).tobytes() == reference(11, 0, x, LAYERS, HIDDEN).tobytes()
        handle.result(timeout=30)


def test_a_forward_over_a_stream_from_before_a_sleep_is_refused_after_the_wake():
    """A ring as large as the stream: the stream lands without its forward. A sleep frees the ring and the wake
    allocates it anew, so that stream's layers are no longer in it: a forward over it is refused (never served
    the new ring's bytes as those layers), and a stream after the wake serves every layer right."""
    with weights_deployment(weights=MODEL, offload_fraction=0.5, ring_slots=4) as (backend, (worker,)):
        weights = loaded(worker, seed=12)
        layout = backend.weight_layout
        assert len(layout.streamed_layers) == layout.ring_slots
        x = model_input(6, BATCH, HIDDEN)
        want = reference(12, 0, x, LAYERS, HIDDEN).tobytes()
        before = backend.stream_weights()
        before.result(timeout=30)                   # in the ring, with no forward yet
        backend.sleep(1, timeout=30)
        backend.wake(timeout=30)
        with pytest.raises(ValueError):
            with weights.forward(before.task_id, timeout=30) as f:
                got = f.layer(layout.resident_layers)
                right = layer_weights(12, 0, layout.resident_layers, HIDDEN)
                assert got["w"].tobytes() == right["w"].tobytes(), "served the new ring's bytes as the layer"
        handle = backend.stream_weights()
        with weights.forward(handle.task_id, timeout=30) as f:
            assert forward(x.copy(), f.layer, LAYERS).tobytes() == want
        handle.result(timeout=30)
