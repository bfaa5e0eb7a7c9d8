"""A small, seeded random-weight Qwen3-Next (``Qwen3NextForCausalLM``) for tests: gated delta net
(linear attention) layers beside gated full attention, as :mod:`aiokv.testing.tiny_model`'s models
(weights that make greedy outputs depend on the context, bit-identical for equal arguments)."""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import numpy as np

from .tiny_model import LM_HEAD_GAIN, _check_sizes, _linear, _save

__all__ = ["write_tiny_qwen3_next"]


def write_tiny_qwen3_next(
    path: str | pathlib.Path,
    *,
    layer_types: tuple[str, ...] = ("linear_attention", "full_attention"),
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    linear_heads: int = 2,
    linear_value_heads: int = 4,
    linear_head_dim: int = 64,
    conv_kernel: int = 4,
    num_experts: int = 2,
    expert_size: int = 128,
    vocab_size: int = 1024,
    seed: int = 0,
) -> pathlib.Path:
    """A random Qwen3-Next (``Qwen3NextForCausalLM``) into ``path``: per ``layer_types``, gated delta net
    layers (``"linear_attention"``: a recurrent state per request, vLLM's Mamba-style KV cache group)
    and gated full attention (``"full_attention"``), each followed by ``num_experts`` experts (one per
    token) and a shared expert. Load it as the Llama.

    Norm weights are Qwen3-Next's ``1 + w`` kind (zeros); the delta net's decay (``A_log``) is slow
    and differs per head, so greedy outputs depend on the state carried over long spans."""
    _check_sizes(
        num_layers=len(layer_types),
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        linear_heads=linear_heads,
        linear_value_heads=linear_value_heads,
        linear_head_dim=linear_head_dim,
        conv_kernel=conv_kernel,
        num_experts=num_experts,
        expert_size=expert_size,
        vocab_size=vocab_size,
    )
    kinds = {"linear_attention", "full_attention"}
    if not layer_types or set(layer_types) - kinds:
        raise ValueError(f"layer_types must be a non-empty sequence of {sorted(kinds)}, got {layer_types!r}")
    if linear_value_heads % linear_heads or num_heads % num_kv_heads:
        raise ValueError("value heads must be a multiple of key heads, in both kinds of layer")
    rng = np.random.default_rng(seed)
    linear = functools.partial(_linear, rng)
    key_dim, value_dim = linear_heads * linear_head_dim, linear_value_heads * linear_head_dim
    weights: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((vocab_size, hidden_size), dtype=np.float32)
    }
    for layer, kind in enumerate(layer_types):
        prefix = f"model.layers.{layer}."
        if kind == "linear_attention":
            conv = rng.standard_normal((2 * key_dim + value_dim, 1, conv_kernel), dtype=np.float32)
            weights |= {
                prefix + "linear_attn.in_proj_qkvz.weight": linear(2 * key_dim + 2 * value_dim, hidden_size),
                prefix + "linear_attn.in_proj_ba.weight": linear(2 * linear_value_heads, hidden_size),
                prefix + "linear_attn.conv1d.weight": conv / np.float32(np.sqrt(conv_kernel)),
                # Slow decays (per token exp(-A * softplus(...)), A in [0.001, 0.1]): a state keeps
                # tens to thousands of tokens, so a wrong state changes the outputs.
                prefix + "linear_attn.A_log": np.log(rng.uniform(1e-3, 0.1, linear_value_heads)).astype(
                    np.float32
                ),
                prefix + "linear_attn.dt_bias": np.ones(linear_value_heads, dtype=np.float32),
                prefix + "linear_attn.norm.weight": np.ones(linear_head_dim, dtype=np.float32),
                prefix + "linear_attn.out_proj.weight": linear(hidden_size, value_dim),
            }
        else:
            weights |= {  # the query projection carries the output gate too
                prefix + "self_attn.q_proj.weight": linear(2 * num_heads * head_dim, hidden_size),
                prefix + "self_attn.k_proj.weight": linear(num_kv_heads * head_dim, hidden_size),
                prefix + "self_attn.v_proj.weight": linear(num_kv_heads * head_dim, hidden_size),
                prefix + "self_attn.o_proj.weight": linear(hidden_size, num_heads * head_dim),
                prefix + "self_attn.q_norm.weight": np.zeros(head_dim, dtype=np.float32),
                prefix + "self_attn.k_norm.weight": np.zeros(head_dim, dtype=np.float32),
            }
        weights[prefix + "mlp.gate.weight"] = linear(num_experts, hidden_size)
        weights[prefix + "mlp.shared_expert_gate.weight"] = linear(1, hidden_size)
        for expert in [*(f"experts.{e}" for e in range(num_experts)), "shared_expert"]:
            weights |= {
                f"{prefix}mlp.{expert}.gate_proj.weight": linear(expert_size, hidden_size),
                f"{prefix}mlp.{expert}.up_proj.weight": linear(expert_size, hidden_size),
                f"{prefix}mlp.{expert}.down_proj.weight": linear(hidden_size, expert_size),
            }
        weights |= {
            prefix + "input_layernorm.weight": np.zeros(hidden_size, dtype=np.float32),
            prefix + "post_attention_layernorm.weight": np.zeros(hidden_size, dtype=np.float32),
        }
    weights["model.norm.weight"] = np.zeros(hidden_size, dtype=np.float32)
    weights["lm_head.weight"] = linear(vocab_size, hidden_size, LM_HEAD_GAIN)
    config: dict[str, Any] = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": expert_size,
        "num_hidden_layers": len(layer_types),
        "layer_types": list(layer_types),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "linear_conv_kernel_dim": conv_kernel,
        "linear_key_head_dim": linear_head_dim,
        "linear_value_head_dim": linear_head_dim,
        "linear_num_key_heads": linear_heads,
        "linear_num_value_heads": linear_value_heads,
        # vLLM's Qwen3-Next needs a mixture of experts: the smallest, in every layer.
        "num_experts": num_experts,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": expert_size,
        "shared_expert_intermediate_size": expert_size,
        "decoder_sparse_step": 1,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return _save(path, config, weights)
