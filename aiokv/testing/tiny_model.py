"""Small, seeded random-weight checkpoints for tests, examples and benchmarks (no download): a Llama,
a DeepSeek-V2-style model with multi-head latent attention (MLA), a sliding-window Llama; a Qwen3-Next
with linear attention is in :mod:`aiokv.testing.tiny_qwen3_next`.

vLLM's ``load_format="dummy"`` fills every weight with tiny uniform values, so logits are flat and outputs
do not depend on the KV cache. These weights (normal, scaled by ``1/sqrt(fan_in)``, embeddings of std 1,
a sharper ``lm_head``) make greedy outputs depend on the context, so a wrong KV block changes them, and
they are bit-identical for equal arguments in every process.
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["write_tiny_deepseek_mla", "write_tiny_llama", "write_tiny_sliding_llama", "write_word_tokenizer"]

LM_HEAD_GAIN = 4.0  # a sharper output layer: clear greedy winners that still depend on the context


def _linear(rng: np.random.Generator, out_features: int, in_features: int, gain: float = 1.0) -> np.ndarray:
    scale = gain / np.sqrt(in_features)
    return (rng.standard_normal((out_features, in_features), dtype=np.float32) * scale).astype(np.float32)


Linear = Callable[..., np.ndarray]  # (out_features, in_features[, gain]) -> seeded weights


def _decoder(
    *,
    architecture: str,
    model_type: str,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    intermediate_size: int,
    vocab_size: int,
    rms_norm_eps: float,
    seed: int,
    attention: Callable[[Linear], dict[str, np.ndarray]],
    **config_extra: Any,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The config and weights both models share: embeddings, per layer ``attention``'s weights (named
    under ``self_attn.``) then a SiLU-gated MLP and RMS norms, the final norm and ``lm_head``. The draw
    order is fixed, so equal arguments give equal bytes."""
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": 32768,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        **config_extra,
    }
    rng = np.random.default_rng(seed)
    linear = functools.partial(_linear, rng)
    weights: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((vocab_size, hidden_size), dtype=np.float32)
    }
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        for name, weight in attention(linear).items():
            weights[prefix + "self_attn." + name] = weight
        weights[prefix + "mlp.gate_proj.weight"] = linear(intermediate_size, hidden_size)
        weights[prefix + "mlp.up_proj.weight"] = linear(intermediate_size, hidden_size)
        weights[prefix + "mlp.down_proj.weight"] = linear(hidden_size, intermediate_size)
        weights[prefix + "input_layernorm.weight"] = np.ones(hidden_size, dtype=np.float32)
        weights[prefix + "post_attention_layernorm.weight"] = np.ones(hidden_size, dtype=np.float32)
    weights["model.norm.weight"] = np.ones(hidden_size, dtype=np.float32)
    weights["lm_head.weight"] = linear(vocab_size, hidden_size, LM_HEAD_GAIN)
    return config, weights


def write_tiny_llama(
    path: str | pathlib.Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 512,
    vocab_size: int = 1024,
    seed: int = 0,
) -> pathlib.Path:
    """Write ``config.json`` and ``model.safetensors`` (bfloat16) of a random Llama into ``path``.

    Load it with ``LLM(model=str(path), load_format="safetensors", skip_tokenizer_init=True)``. Returns
    the directory. Needs ``torch`` and ``safetensors`` (both come with vLLM).
    """
    _check_sizes(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
    )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")

    def attention(linear: Linear) -> dict[str, np.ndarray]:
        return {
            "q_proj.weight": linear(num_heads * head_dim, hidden_size),
            "k_proj.weight": linear(num_kv_heads * head_dim, hidden_size),
            "v_proj.weight": linear(num_kv_heads * head_dim, hidden_size),
            "o_proj.weight": linear(hidden_size, num_heads * head_dim),
        }

    return _save(
        path,
        *_decoder(
            architecture="LlamaForCausalLM",
            model_type="llama",
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_heads=num_heads,
            intermediate_size=intermediate_size,
            vocab_size=vocab_size,
            rms_norm_eps=1e-5,
            seed=seed,
            attention=attention,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
        ),
    )


def write_word_tokenizer(path: str | pathlib.Path, vocab_size: int = 1024) -> pathlib.Path:
    """Write a word-level tokenizer into the model folder ``path``: token id ``i`` is the word ``t{i}``,
    words split on whitespace (``tokenizer.json``, and a ``tokenizer_config.json`` naming
    ``PreTrainedTokenizerFast``).

    vLLM's OpenAI server needs a tokenizer in the model folder even when prompts arrive as token ids;
    this one maps every id of the tiny models to a word and back. Needs ``tokenizers`` (comes with vLLM).
    Returns the directory.
    """
    _check_sizes(vocab_size=vocab_size)
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = pathlib.Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "t0",
        "bos_token": "t1",
        "eos_token": "t2",
        "model_max_length": 1 << 20,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _save(path: str | pathlib.Path, config: dict[str, Any], weights: dict[str, np.ndarray]) -> pathlib.Path:
    """Write ``config.json`` and the weights as bfloat16 ``model.safetensors`` into ``path``."""
    import torch
    from safetensors.torch import save_file

    directory = pathlib.Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {name: torch.from_numpy(w).to(torch.bfloat16).contiguous() for name, w in weights.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


# vLLM's CPU MLA kernels (AMX and reference) are built for DeepSeek's latent size only:
# kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token and layer.
MLA_KV_LORA_RANK = 512
MLA_ROPE_HEAD_DIM = 64


def write_tiny_deepseek_mla(
    path: str | pathlib.Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 256,
    num_heads: int = 4,
    nope_head_dim: int = 32,
    v_head_dim: int = 32,
    intermediate_size: int = 512,
    vocab_size: int = 1024,
    seed: int = 0,
) -> pathlib.Path:
    """Write a random DeepSeek-V2-style checkpoint with MLA into ``path``, as :func:`write_tiny_llama`.

    Dense MLP in every layer (``first_k_dense_replace = num_layers``: no experts), no query
    compression (``q_lora_rank`` None); the KV latent is DeepSeek's 512 + 64 (what vLLM's CPU MLA kernels
    support), the other sizes are tiny. Load it as the Llama (``load_format="safetensors"``)."""
    _check_sizes(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        nope_head_dim=nope_head_dim,
        v_head_dim=v_head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
    )
    rank, rope = MLA_KV_LORA_RANK, MLA_ROPE_HEAD_DIM

    def attention(linear: Linear) -> dict[str, np.ndarray]:
        return {
            "q_proj.weight": linear(num_heads * (nope_head_dim + rope), hidden_size),
            "kv_a_proj_with_mqa.weight": linear(rank + rope, hidden_size),
            "kv_a_layernorm.weight": np.ones(rank, dtype=np.float32),
            "kv_b_proj.weight": linear(num_heads * (nope_head_dim + v_head_dim), rank),
            "o_proj.weight": linear(hidden_size, num_heads * v_head_dim),
        }

    return _save(
        path,
        *_decoder(
            architecture="DeepseekV2ForCausalLM",
            model_type="deepseek_v2",
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_heads=num_heads,
            intermediate_size=intermediate_size,
            vocab_size=vocab_size,
            rms_norm_eps=1e-6,
            seed=seed,
            attention=attention,
            num_key_value_heads=num_heads,
            kv_lora_rank=rank,
            q_lora_rank=None,
            qk_nope_head_dim=nope_head_dim,
            qk_rope_head_dim=rope,
            v_head_dim=v_head_dim,
            first_k_dense_replace=num_layers,
            # Required by the config class; unused, as no layer has experts.
            n_routed_experts=1,
            n_shared_experts=1,
            num_experts_per_tok=1,
            moe_intermediate_size=intermediate_size,
            moe_layer_freq=1,
            attention_bias=False,
        ),
    )


def write_tiny_sliding_llama(
    path: str | pathlib.Path,
    *,
    sliding_window: int = 256,
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention"),
    seed: int = 0,
    **llama: int,
) -> pathlib.Path:
    """A random Llama whose layers are sliding-window or full attention, as ``layer_types`` says
    (``"sliding_attention"`` / ``"full_attention"``, one per layer; Mistral- and Gemma-style hybrids).

    The weights are :func:`write_tiny_llama`'s for the same arguments; only the config differs, so
    vLLM's hybrid allocator gives each kind of layer its own KV-cache group."""
    kinds = {"sliding_attention", "full_attention"}
    if not layer_types or set(layer_types) - kinds:
        raise ValueError(f"layer_types must be a non-empty sequence of {sorted(kinds)}, got {layer_types!r}")
    _check_sizes(sliding_window=sliding_window)
    directory = write_tiny_llama(path, num_layers=len(layer_types), seed=seed, **llama)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.update(layer_types=list(layer_types), sliding_window=sliding_window)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory
