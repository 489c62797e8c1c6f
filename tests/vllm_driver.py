"""Runs vLLM's real engine (CPU build, a tiny dummy-weight Llama) with and without fastcache and prints what
tests/test_vllm.py checks, as one JSON line. A separate process per run: vLLM spawns its own processes and
wants the `__main__` guard.

    python tests/vllm_driver.py rounds --cpu-mib 256 [--fastcache] [--kill-after 1] [--store URL] ...
"""
import argparse
import json
import os
import random
import sys
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")       # vLLM's block hashes: equal across engines (L3 sharing)

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
          "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
          "rope_theta": 10000.0}
SHARES = (128, 256, 384, 512)          # shared prefix lengths: 1-4 of vLLM's 128-token CPU blocks


def prompts(bases: int, tails: int, seed: int = 0):
    """bases x len(SHARES) x tails prompts: a base's first SHARES[i] tokens, then a tail of its own."""
    r = random.Random(seed)
    base = [[r.randrange(3, 1000) for _ in range(max(SHARES))] for _ in range(bases)]
    out = []
    for t in range(tails):
        for b in range(bases):
            for share in SHARES:
                out.append(base[b][:share] + [r.randrange(3, 1000) for _ in range(40 + t)])
    return out


class WeightsExtension:
    """Mixed into vLLM's workers (worker_extension_cls), called by name through collective_rpc (no function
    crosses vLLM's wire)."""

    def set_weights(self, seed: int):
        """Random weights large enough that the output depends on every token of the context (vLLM's dummy
        weights, all within 1e-3, would not): a weight update as a trainer would send it."""
        import torch
        model = self.model_runner.get_model()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.08)
        return True


def transfer_managers():
    import psutil
    return [p for p in psutil.Process().children(recursive=True)
            if "fastcache.transfer" in " ".join(p.cmdline())]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fastcache", action="store_true")
    ap.add_argument("--cpu-bytes", type=int, default=256 << 20)
    ap.add_argument("--store")
    ap.add_argument("--namespace")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config, JSON")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bases", type=int, default=4)
    ap.add_argument("--tails", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--update-seed", type=int, help="new weights after round 1 (and reset_connector)")
    ap.add_argument("--kill-after", type=int, help="kill the transfer managers after this round")
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()

    here = os.path.dirname(os.path.abspath(__file__))      # vLLM's workers import WeightsExtension from here
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    if args.tp > 1:     # vllm-cpu binds each rank's threads; on one NUMA node it must be told where
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(r % (os.cpu_count() or 1)) for r in range(args.tp)))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model_dir = tempfile.mkdtemp(prefix="fastcache-llama-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    kv = None
    if args.fastcache:
        extra = {"spec_name": "FastcacheOffloadingSpec", "spec_module_path": "fastcache.integrations.vllm",
                 "cpu_bytes_to_use": args.cpu_bytes, **json.loads(args.extra)}
        if args.store:
            extra["store"] = args.store
        if args.namespace:
            extra["namespace"] = args.namespace
        kv = KVTransferConfig(kv_connector="FastcacheConnector", kv_connector_module_path="fastcache.integrations.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    report = {"rounds": [], "cached": [], "external_hits": [], "load_bytes": [], "killed": [],
              "transfer_managers": 0}
    try:
        llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, seed=0,
                  dtype="float32", kv_transfer_config=kv, disable_log_stats=False, tensor_parallel_size=args.tp,
                  worker_extension_cls="vllm_driver.WeightsExtension")
    except Exception as exc:
        report["start_error"] = f"{type(exc).__name__}: {exc}"
        print("REPORT " + json.dumps(report), flush=True)
        return
    llm.collective_rpc("set_weights", args=(args.seed,))
    params = SamplingParams(temperature=0, max_tokens=16, detokenize=False)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(args.bases, args.tails)]
    for rnd in range(args.rounds):
        outs = llm.generate(batch, params, use_tqdm=False)
        report["rounds"].append([list(o.outputs[0].token_ids) for o in outs])
        report["cached"].append(sum(o.num_cached_tokens or 0 for o in outs))
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        report["external_hits"].append(metrics.get("vllm:external_prefix_cache_hits"))
        report["load_bytes"].append(metrics.get("vllm:kv_offload_load_bytes"))
        if args.update_seed is not None and rnd == 0:
            llm.collective_rpc("set_weights", args=(args.update_seed,))
            llm.reset_prefix_cache(reset_connector=True)
        else:
            llm.reset_prefix_cache()           # round two's hits can only come from fastcache
        if args.kill_after is not None and rnd + 1 == args.kill_after:
            for proc in transfer_managers():
                proc.kill()
                report["killed"].append(proc.pid)
    report["transfer_managers"] = len(transfer_managers())
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.exit(main())
