"""New weights at the same path, one shared cache: what each way serves afterwards, on vLLM's real engine.

    python -m fastcache.tools.vllm_lineage [--ways vllm,fastcache,fastcache+l3,fastcache+l3/fixed,lmcache]
        [--lmcache-python /path/to/lmcache-venv/bin/python] [--json OUT]

A trainer writes new weights over the checkpoint an engine serves (same directory, same model name, the
files' old modification times kept, as `cp -p` or `rsync -a` leave them). Per way, one cache service runs
for the whole scenario (a Mooncake Store, LMCache's server) and three engines run in turn, each in its own
process (fastcache.tools.vllm_run) over the prompts of fastcache.tools.tiny_llama (a small random Llama
whose outputs depend on the whole prefix, read by vLLM's own loader):

- A: the old weights. Its outputs must equal vLLM alone on the old weights.
- A again: a restarted engine, the same weights: what a cache shared across engines can serve (hits > 0
  for a shared store or server: the scenario can see sharing).
- B: the new weights, written in place; the same command. Its outputs must equal vLLM alone on the new
  weights. Hits here are KV computed with the old weights unless they are a prefix's tail recomputed.

Ways: `vllm` (its own prefix cache only; its A and B are the references), `fastcache` (the CPU tier, one per
engine), `fastcache+l3` (a Mooncake Store below the tier, the default namespace: the weights' digest),
`fastcache+l3/fixed` (the same with `namespace` set by the user and kept across the change: the promise the
README asks of an explicit namespace broken on purpose; the check's negative control) and `lmcache`
(LMCache's multiprocess server, with --lmcache-python).

Before judging, the oracle is shown to see the property: the references give pairwise different outputs for
prompts that differ only in their prefix, and the old and new weights differ on every prompt. An output
equals another when its greedy tokens do and its first token's logprob is within 1e-3.
Exit status: 0 when the preconditions hold and fastcache's ways (not the negative control) serve outputs equal
to vLLM alone at every step; 1 otherwise. What LMCache serves is reported, not judged.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile

from ..store.service import store_for_run
from .lmcache_server import lmcache_import_dir, lmcache_server
from .tiny_llama import BASES, CONFIG, SHARES, prompts, write_checkpoint
from .vllm_bench import blind_pairs, mismatches, run_way

WAYS = ("vllm", "fastcache", "fastcache+l3", "fastcache+l3/fixed", "lmcache")
NEGATIVE_CONTROL = "fastcache+l3/fixed"
STEPS = ("A", "A again", "B")
OLD, NEW = 1, 2                     # the seeds of the old and the new weights
BLOCK_TOKENS = 128                  # vLLM's block; one fastcache chunk, one LMCache chunk
MAX_TOKENS = 8


def kv_block_bytes() -> int:
    c = CONFIG
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * BLOCK_TOKENS * 4


def prefix_blind_probes(run: dict) -> list[tuple[int, int]]:
    """Pairs of probes (one tail after different prefixes of one length) with equal outputs: where the oracle
    could not tell one prefix's KV from another's. Empty when the precondition holds."""
    first = len(run["outputs"]) - len(SHARES) * BASES
    return [pair for s in range(len(SHARES))
            for pair in blind_pairs(run, range(first + s * BASES, first + (s + 1) * BASES))]


@contextlib.contextmanager
def way_service(way: str, args):
    """What the way adds to an engine's job (its connector's config), around the service it runs for the
    whole scenario."""
    cpu_bytes = args.cpu_blocks * kv_block_bytes()
    if way == "vllm":
        yield {}
    elif way == "fastcache":
        yield {"extra": fastcache_extra(cpu_bytes)}
    elif way.startswith("fastcache+l3"):
        with store_for_run("mooncake", max(64, 4 * cpu_bytes >> 20)) as url:
            extra = {**fastcache_extra(cpu_bytes), "store": url}
            if way == NEGATIVE_CONTROL:
                extra["namespace"] = "tiny-llama/fixed"
            yield {"extra": extra}
    elif way == "lmcache":
        with lmcache_import_dir(args.lmcache_python) as site, \
                lmcache_server(args.lmcache_python, l1_bytes=cpu_bytes, chunk_tokens=BLOCK_TOKENS) as server:
            yield {"connector": "lmcache", "extra": server.connector_config(), "sys_path_after": [site]}
    else:
        raise ValueError(way)


def fastcache_extra(cpu_bytes: int) -> dict:
    return {"spec_name": "FastcacheOffloadingSpec", "spec_module_path": "fastcache.integrations.vllm",
            "cpu_bytes_to_use": cpu_bytes}


def run_scenario(way: str, args, checkpoint: str, timeout: float) -> dict:
    """A, A again and B for one way, around one cache service; per step the engine's report."""
    job = {"model_dir": checkpoint, "block_size": BLOCK_TOKENS, "gpu_blocks": args.gpu_blocks,
           "prompts": prompts(), "max_model_len": 1024, "concurrency": 1, "max_tokens": MAX_TOKENS,
           "logprobs": True, "manager_replay": False, "extra": None, "way": way}
    steps = {}
    write_checkpoint(checkpoint, OLD)
    with way_service(way, args) as connector:
        job.update(connector)
        for step in STEPS:
            if step == "B":
                write_checkpoint(checkpoint, NEW, keep_mtime=True)
            steps[step] = run_way(job, timeout)
    return steps


def judge(runs: dict) -> dict:
    """Per way and step: external hit tokens, outputs equal to vLLM alone on the weights served, mismatches."""
    ref = {"A": runs["vllm"]["A"], "A again": runs["vllm"]["A"], "B": runs["vllm"]["B"]}
    table = {}
    for way, steps in runs.items():
        table[way] = {}
        for step, run in steps.items():
            wrong = mismatches(run, ref[step])
            table[way][step] = {"external_tokens": int(run["external_hit_tokens"]), "mismatches": len(wrong),
                                "outputs_equal": not wrong}
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastcache.tools.vllm_lineage", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ways", default=None, help=f"comma-separated, of {', '.join(WAYS)} (default: all, lmcache "
                   "only with --lmcache-python); vllm always runs: it is the reference")
    p.add_argument("--lmcache-python", metavar="PATH", help="a Python with lmcache 0.5.6 (its own environment)")
    p.add_argument("--gpu-blocks", type=int, default=64, help="vLLM's own KV cache, blocks (default 64)")
    p.add_argument("--cpu-blocks", type=int, default=64, help="fastcache's CPU tier and LMCache's L1 pool, "
                   "blocks of vLLM's page (default 64)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per engine")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    args = p.parse_args(argv)
    ways = ([w for w in args.ways.split(",") if w] if args.ways is not None else
            [w for w in WAYS if w != "lmcache" or args.lmcache_python])
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        p.error(f"--ways: unknown {unknown}; choose from {list(WAYS)}")
    if "lmcache" in ways and not args.lmcache_python:
        p.error("--ways lmcache needs --lmcache-python (a Python with lmcache installed)")
    ways = ["vllm"] + [w for w in ways if w != "vllm"]
    print(f"vllm_lineage: {len(prompts())} prompts, tiny Llama (fastcache.tools.tiny_llama) seed {OLD} then seed "
          f"{NEW} written in place; ways {', '.join(ways)}", flush=True)

    runs = {}
    with tempfile.TemporaryDirectory(prefix="fastcache-lineage-") as scratch:
        for way in ways:
            runs[way] = run_scenario(way, args, f"{scratch}/{way.replace('/', '-')}", args.timeout)
            print(f"  {way}: done", flush=True)
    result = report(runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["preconditions_hold"] and result["safe"] else 1


def report(runs: dict) -> dict:
    ref_old, ref_new = runs["vllm"]["A"], runs["vllm"]["B"]
    blind = prefix_blind_probes(ref_old) + prefix_blind_probes(ref_new)
    same = len(ref_old["outputs"]) - len(mismatches(ref_new, ref_old))
    preconditions = not blind and same == 0
    print(f"\noracle: probes that differ only in their prefix give different outputs "
          f"({'yes' if not blind else f'NO, {len(blind)} equal pairs'}); old and new weights agree on {same} of "
          f"{len(ref_old['outputs'])} prompts (must be 0)")
    table = judge(runs)
    n = len(ref_old["outputs"])
    print(f"\n{'way':<20}" + "".join(f"{step + ': hits, equal':>26}" for step in STEPS))
    for way, steps in table.items():
        cells = [f"{s['external_tokens']:>8} tok, " + ("yes" if s["outputs_equal"] else f"NO ({s['mismatches']}/{n})")
                 for s in steps.values()]
        print(f"{way:<20}" + "".join(f"{c:>26}" for c in cells))
    print("(hits: tokens vLLM took from the way's connector; equal: to vLLM alone on the weights that engine "
          "serves; A again and B restart the engine, the cache service stays)")
    safe = all(s["outputs_equal"] for way, steps in table.items() if way.startswith("fastcache")
               and way != NEGATIVE_CONTROL for s in steps.values())
    return {"ways": table, "preconditions_hold": preconditions, "prefix_blind_pairs": blind,
            "old_new_equal_prompts": same, "safe": safe}


if __name__ == "__main__":
    sys.exit(main())
