"""A tiny random Gemma 2 checkpoint for vLLM's engine tests of hybrid models: config.json plus model.safetensors,
read by vLLM's own loader, as tiny_llama.py writes its Llama. Sliding-window layers alternate with global ones
(five layers: sliding, global, sliding, global, sliding), so vLLM makes three KV cache groups over two shared
KV tensors: the global layers, two sliding layers, and the last sliding layer alone, whose group uses only
one of the two tensors. The window (256 tokens, two of vLLM's 128-token CPU blocks) is shorter than the
prompts (`prompts()`), so the sliding groups keep and reuse only their last blocks.
"""
from __future__ import annotations

import json
import os

import numpy as np

from . import tiny_llama

WINDOW = 256
CONFIG = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 32, "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
          "torch_dtype": "float32", "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
          "pad_token_id": 0, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 32,
          "sliding_window": WINDOW, "attn_logit_softcapping": None, "final_logit_softcapping": None,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                          "sliding_attention"],
          "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
SHARES = (256, 384, 512, 640)       # shared prefix lengths: 2-5 CPU blocks, all at least the window
BASES, TAILS = 4, 4
EMBED = 0.05         # embedding (and output head) scale: the residual stream is the layers' more than the token's
POST = 1.0           # Gemma's post-norms scale by 1 + weight: each layer's output counts double
GAIN = 1.5            # weights' scale over 1/sqrt(fan_in): sharp enough attention that every token counts


def tensors(seed: int) -> dict[str, np.ndarray]:
    """Every weight of CONFIG's Gemma 2, in Hugging Face's names, drawn from `seed` (Gemma's norms scale by
    1 + weight: zeros are the identity; the embedding is also the output head)."""
    c, rng = CONFIG, np.random.default_rng(seed)
    hidden, inter, vocab, head = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head

    def dense(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (GAIN / np.sqrt(cols))).astype(np.float32)

    zeros = np.zeros(hidden, np.float32)
    out = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32) * EMBED,
           "model.norm.weight": zeros}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        post = np.full(hidden, POST, np.float32)
        out.update({p + "input_layernorm.weight": zeros, p + "post_attention_layernorm.weight": post,
                    p + "pre_feedforward_layernorm.weight": zeros, p + "post_feedforward_layernorm.weight": post,
                    p + "self_attn.q_proj.weight": dense(q, hidden),
                    p + "self_attn.k_proj.weight": dense(kv, hidden),
                    p + "self_attn.v_proj.weight": dense(kv, hidden),
                    p + "self_attn.o_proj.weight": dense(hidden, q),
                    p + "mlp.gate_proj.weight": dense(inter, hidden),
                    p + "mlp.up_proj.weight": dense(inter, hidden),
                    p + "mlp.down_proj.weight": dense(hidden, inter)})
    return out


def write_checkpoint(path: str, seed: int) -> str:
    """Writes config.json and model.safetensors of seed's weights under `path`."""
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    save_file(tensors(seed), os.path.join(path, "model.safetensors"))
    return path


def prompts(bases: int = BASES, tails: int = TAILS, seed: int = 0):
    """tiny_llama's prompts over this model's shared prefix lengths (each at least the sliding window)."""
    return tiny_llama.prompts(bases, tails, seed, shares=SHARES)
