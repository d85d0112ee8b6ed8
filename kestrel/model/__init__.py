"""Models: which architectures Kestrel runs, and how a checkpoint's config becomes a `ModelConfig`."""

from __future__ import annotations

import torch
from torch import nn

from kestrel.attention import AttentionBackend
from kestrel.config import ModelConfig
from kestrel.model.gemma import GemmaForCausalLM
from kestrel.model.llama import IntermediateTensors, LlamaForCausalLM
from kestrel.model.quantization import check_quantization
from kestrel.model.sharding import (
    ModelShard,
    check_shardable,
    local_attention_config,
    shard_for,
    shard_of_this_rank,
)
from kestrel.ops.dispatch import select_ops

__all__ = ["ARCHITECTURES", "IntermediateTensors", "LlamaForCausalLM", "ModelShard", "build_model",
           "check_shardable", "local_attention_config", "model_config_from_hf", "rope_settings", "shard_for",
           "shard_of_this_rank"]

# model_type in the checkpoint's config → our module, and whether q/k are normalised per head.
ARCHITECTURES: dict[str, tuple[type[nn.Module], bool]] = {
    "llama": (LlamaForCausalLM, False),
    "mistral": (LlamaForCausalLM, False),
    "qwen2": (LlamaForCausalLM, False),
    "qwen3": (LlamaForCausalLM, True),
    "gemma2": (GemmaForCausalLM, False),
    "gemma3_text": (GemmaForCausalLM, True),
    "granite": (LlamaForCausalLM, False),
    "phi3": (LlamaForCausalLM, False),   # its fused qkv_proj and gate_up_proj: LlamaForCausalLM.placements
}
# Architectures whose q, k and v projections carry biases whatever the config says (Qwen2's have them,
# its o_proj has none: the module's attention_bias).
QKV_BIAS_ARCHITECTURES = ("qwen2",)
# The MLP gate activation each module runs, where it is not SiLU.
GATE_ACTIVATIONS = {"gemma2": "gelu_pytorch_tanh", "gemma3_text": "gelu_pytorch_tanh"}


def sliding_window_of(hf_config) -> tuple[int | None, tuple[str, ...] | None]:
    """(W, layer types) of a model whose layers, or those of type "sliding_attention", attend to the
    last W tokens only (Mistral's every layer; Qwen2's where use_sliding_window is set, per its
    layer_types; Gemma 3's local layers); (None, None) for full attention everywhere."""
    model_type = getattr(hf_config, "model_type", None)
    window = getattr(hf_config, "sliding_window", None)
    if not window or not (model_type in ("mistral", "gemma2", "gemma3_text", "phi3")
                          or (model_type == "qwen2" and getattr(hf_config, "use_sliding_window", False))):
        return None, None
    layer_types = getattr(hf_config, "layer_types", None)
    return int(window), tuple(layer_types) if layer_types else None


def rope_settings(hf_config) -> tuple[float, dict | None, float | None]:
    """(theta, scaling, the sliding layers' own theta or None) from transformers 5's `rope_parameters`
    (one dict, or one per layer type as Gemma 3's) or the older fields."""
    params = getattr(hf_config, "rope_parameters", None)
    local_theta = None
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention")
        local_theta = float(local["rope_theta"]) if local else None
        params = params["full_attention"]
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = None if params.get("rope_type", "default") == "default" else dict(params)
        return float(params["rope_theta"]), scaling, local_theta
    return float(getattr(hf_config, "rope_theta", 10000.0)), getattr(hf_config, "rope_scaling", None), local_theta


def model_config_from_hf(hf_config, *, model: str | None, dtype: torch.dtype,
                         max_model_len: int | None, eos_token_id: int | None,
                         bos_token_id: int | None, quantization: str | None = None) -> ModelConfig:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model type {model_type!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    theta, scaling, local_theta = rope_settings(hf_config)
    partial_rotary_factor = _partial_rotary_factor(hf_config)
    max_positions = int(getattr(hf_config, "max_position_embeddings", 2048))
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
        # its default attention factor comes from the ratio of the two context lengths
        original = scaling.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
        scaling = dict(scaling, rope_type="longrope", original_max_position_embeddings=int(original),
                       max_position_embeddings=max_positions)
    if max_model_len is None:
        max_model_len = max_positions
    elif max_model_len < 2:
        raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
    elif max_model_len > max_positions:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's maximum of {max_positions} positions")
    sliding_window, layer_types = sliding_window_of(hf_config)
    if layer_types is not None and len(layer_types) != hf_config.num_hidden_layers:
        raise ValueError(f"layer_types names {len(layer_types)} layers; the model has {hf_config.num_hidden_layers}")
    hidden_act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
    expected_act = GATE_ACTIVATIONS.get(model_type, "silu")
    if hidden_act != expected_act:
        raise ValueError(f"activation {hidden_act!r} is not supported for {model_type} "
                         f"(its module runs {expected_act})")
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    return ModelConfig(
        model=model,
        architecture=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        attention_bias=model_type in QKV_BIAS_ARCHITECTURES or bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=ARCHITECTURES[model_type][1],
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        dtype=dtype,
        max_model_len=max_model_len,
        quantization=check_quantization(quantization),
        sliding_window=sliding_window,
        layer_types=layer_types,
        local_rope_theta=local_theta,
        query_pre_attn_scalar=getattr(hf_config, "query_pre_attn_scalar", None),
        hidden_act=hidden_act,
        embedding_multiplier=float(getattr(hf_config, "embedding_multiplier", 1.0)),
        residual_multiplier=float(getattr(hf_config, "residual_multiplier", 1.0)),
        attention_multiplier=_float_or_none(getattr(hf_config, "attention_multiplier", None)),
        logits_scaling=float(getattr(hf_config, "logits_scaling", 1.0)),
        partial_rotary_factor=partial_rotary_factor,
        attn_logit_softcapping=_float_or_none(getattr(hf_config, "attn_logit_softcapping", None)),
        final_logit_softcapping=_float_or_none(getattr(hf_config, "final_logit_softcapping", None)),
    )


def _partial_rotary_factor(hf_config) -> float:
    """The share of each head's dimensions that rotary rotates: transformers 5 keeps it in
    rope_parameters, older configs beside it."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    return float(getattr(hf_config, "partial_rotary_factor", None) or 1.0)


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


def build_model(cfg: ModelConfig, device: torch.device, attn: AttentionBackend | None = None) -> nn.Module:
    """The model on `device`, its ops selected once for the device and dtype (kestrel/ops/dispatch.py),
    its attention on `attn` (by default the PyTorch reference)."""
    cls = ARCHITECTURES[cfg.architecture][0]
    with torch.device(device):
        return cls(cfg, select_ops(device, cfg.dtype), attn).eval()
