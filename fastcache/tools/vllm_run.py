"""One vLLM engine over a list of prompts, timed per request: the child process of fastcache.tools.vllm_bench.

    python -m fastcache.tools.vllm_run JOB.json  ->  one line "REPORT {json}" on stdout

The job names the model ("model_dir", a checkpoint that vLLM's own loader reads), vLLM's own KV cache size in
blocks,
the prompts (token ids), the tokens to generate, the closed-loop concurrency and, for an offloading run, the
kv_connector_extra_config: fastcache's FastcacheConnector by default, vLLM's LMCacheMPConnector with
"connector": "lmcache" (its "sys_path_after" names where lmcache is installed: vLLM's connector imports it in
this process, and it is appended after this environment's own packages, so that vLLM, torch and numpy stay
this environment's). The report carries "ready_s", the engine's construction (LLM()): from then on a request
can be added; with "logprobs", each output's first-token logprob too; with "probes" (prompts), their outputs and
first-token logprobs, run one at a time after the timed requests. The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that
the scheduler's OffloadingManager can be wrapped by manager_replay.Recorder and its calls replayed against
fastcache's manager and vLLM's CPUOffloadingManager here, after the run.
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")              # vLLM's block hashes: equal across engines (L3)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def llvmlite_dunder_fix() -> None:
    """vllm-cpu 0.32 rebinds its Triton kernels by scanning every loaded module's objects, and reads
    `vars(obj)` of each that has a `__dict__`; llvmlite's `lib` (numba's, which LMCache's token hasher imports)
    answers any attribute, `__dict__` too, with a function wrapper, and the scan fails ("'_lib_fn_wrapper'
    object has no attribute 'get'"). Dunder names are made plain misses on that one class."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    lookup = ffi._lib_wrapper.__getattr__
    if getattr(lookup, "fastcache_fixed", False):
        return

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)
    __getattr__.fastcache_fixed = True
    ffi._lib_wrapper.__getattr__ = __getattr__


def engine(job: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    kv = None
    if job.get("connector") == "lmcache":
        llvmlite_dunder_fix()
        kv = KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both",
                              kv_connector_extra_config=job["extra"])
    elif job.get("extra") is not None:
        kv = KVTransferConfig(kv_connector="FastcacheConnector", kv_connector_module_path="fastcache.integrations.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config=job["extra"])
    return LLM(model=job["model_dir"], skip_tokenizer_init=True, enforce_eager=True, seed=0,
               dtype="float32", kv_transfer_config=kv, disable_log_stats=False, block_size=job["block_size"],
               num_gpu_blocks_override=job["gpu_blocks"], max_model_len=job["max_model_len"],
               max_num_seqs=max(1, job["concurrency"]))


def offloading_scheduler(llm, job: dict):
    """fastcache's connector's scheduler side in the in-process engine core, or None for another way."""
    if job.get("extra") is None or job.get("connector", "fastcache") != "fastcache":
        return None
    core = llm.llm_engine.engine_core.engine_core
    connector = getattr(core.scheduler, "connector", None)
    return getattr(connector, "connector_scheduler", None)


def replay_requests(llm, prompts, max_tokens: int, concurrency: int, logprobs: bool = False) -> dict:
    """Closed loop: `concurrency` requests in flight, the next added as one finishes. TTFT runs from a
    request's add_request to the end of the engine step that gave its first token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, logprobs=0 if logprobs else None)
    eng = llm.llm_engine
    added, first, outputs, cached, first_logprob = {}, {}, {}, {}, {}
    todo = list(enumerate(prompts))[::-1]
    began = time.perf_counter()
    while todo or eng.has_unfinished_requests():
        while todo and len(added) - len(outputs) < concurrency:
            i, tokens = todo.pop()
            added[str(i)] = time.perf_counter()
            eng.add_request(str(i), TokensPrompt(prompt_token_ids=tokens), params)
        for out in eng.step():
            now = time.perf_counter()
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                completion = out.outputs[0]
                outputs[out.request_id] = list(completion.token_ids)
                cached[out.request_id] = out.num_cached_tokens or 0
                if logprobs:        # logprobs=0: the sampled token's own
                    first_logprob[out.request_id] = completion.logprobs[0][completion.token_ids[0]].logprob
    seconds = time.perf_counter() - began
    ids = [str(i) for i in range(len(prompts))]
    report = {"seconds": seconds, "ttft": [first[r] - added[r] for r in ids], "outputs": [outputs[r] for r in ids],
              "cached_tokens": [cached[r] for r in ids]}
    if logprobs:
        report["first_logprobs"] = [first_logprob[r] for r in ids]
    return report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        job = json.load(f)
    sys.path.extend(p for p in job.get("sys_path_after", ()) if p not in sys.path)
    began = time.perf_counter()
    llm = engine(job)
    ready_s = time.perf_counter() - began
    scheduler = offloading_scheduler(llm, job) if job.get("manager_replay", True) else None
    recorder = None
    if scheduler is not None:
        from .manager_replay import Recorder
        recorder = scheduler.manager = Recorder(scheduler.manager)
    # a warm-up request outside the figures: the first forward pays one-time costs
    replay_requests(llm, [[7] * job["block_size"]], 1, 1)
    llm.reset_prefix_cache()
    if recorder is not None:
        recorder.reset()
    report = replay_requests(llm, job["prompts"], job["max_tokens"], job["concurrency"], job.get("logprobs", False))
    report["ready_s"] = ready_s
    if job.get("probes"):       # the oracle's precondition, after the figures: one prompt at a time, not timed
        probes = replay_requests(llm, job["probes"], job["max_tokens"], 1, logprobs=True)
        report["probes"] = {"outputs": probes["outputs"], "first_logprobs": probes["first_logprobs"]}
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    report["external_hit_tokens"] = metrics.get("vllm:external_prefix_cache_hits") or 0
    report["load_bytes"] = metrics.get("vllm:kv_offload_load_bytes") or 0
    if recorder is not None:
        from .manager_replay import fastcache_manager, replay, vllm_lru_manager
        steps = recorder.step_seconds
        ended = max(1, len(steps) - 1)         # the last entry collects calls after the last step's end
        report["manager_in_run"] = {"steps": ended, "mean_us": sum(steps) / ended * 1e6,
                                    "l3_fetches": recorder.l3_fetches, "num_chunks": recorder.num_chunks,
                                    "loaded_keys": recorder.loaded_keys}
        chunks = recorder.num_chunks
        report["manager_replay"] = {
            "fastcache": replay(recorder.calls, fastcache_manager(chunks, recorder.blocks_per_chunk)),
            "vllm_lru": replay(recorder.calls, vllm_lru_manager(chunks))}
    print("REPORT " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
