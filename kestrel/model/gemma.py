"""Gemma 2 (model_type gemma2) and Gemma 3 (text: model_type gemma3_text, GGUF gemma3), on the Llama
module's layers.

What differs from Llama, each as Hugging Face's Gemma2ForCausalLM / Gemma3ForCausalLM computes it:
- every norm is Gemma's: normalised in float32, times (1 + w) in float32, then rounded to the model's
  dtype (`GemmaRMSNorm`, which holds 1 + w once the weights are loaded);
- four norms a layer: before and after attention, before and after the MLP, the residual stream
  added after each block's output norm;
- Gemma 3: q and k are normalised per head (Gemma's norm) before rotary;
- Gemma 2: attention scores soft-capped (cap * tanh(s / cap)) before the softmax, and the logits too;
- the MLP's gate activation is GELU (tanh approximation);
- the embedding is scaled by sqrt(hidden_size), rounded to the model's dtype;
- attention scale 1/sqrt(query_pre_attn_scalar);
- local layers attend to a sliding window (Gemma 2: every other layer; Gemma 3: five in six, with their
  own rope base): ModelConfig.layer_types, .window_of, .local_rope_theta, the Llama module's machinery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kestrel.attention import AttentionBackend, KVCache
from kestrel.config import ModelConfig
from kestrel.distributed import GroupCoordinator
from kestrel.model.llama import DecoderLayer, LlamaForCausalLM
from kestrel.model.sharding import ModelShard
from kestrel.ops.dispatch import Ops, RmsNorm, gemma_rms_norm_reference

if TYPE_CHECKING:
    from kestrel.model.loader import WeightReader


class GemmaRMSNorm(nn.Module):
    """Holds the checkpoint's w (float32) as loaded; `GemmaForCausalLM.load_weights` then adds 1.
    `norm`: the model's Gemma norm op for rows of `dim` (ops.gemma_norm_for)."""

    def __init__(self, dim: int, eps: float, norm: RmsNorm = gemma_rms_norm_reference) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=torch.float32), requires_grad=False)
        self.eps = eps
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, ops: Ops, attn: AttentionBackend, shard: ModelShard,
                 tp: GroupCoordinator, window: int | None = None) -> None:
        super().__init__(cfg, ops, attn, shard, tp, window)
        eps, norm = cfg.rms_norm_eps, ops.gemma_norm_for(cfg.hidden_size)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, norm)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, norm)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, norm)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, norm)
        # the q/k norms of DecoderLayer._attention (Gemma 3), over the strided heads of qkv
        self.head_rms_norm = ops.gemma_norm_for(cfg.head_dim)
        if cfg.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, eps, self.head_rms_norm)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, eps, self.head_rms_norm)
        self.gelu_and_mul = ops.gelu_and_mul_for(2 * shard.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                cache: KVCache | None, meta: object, rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer.forward: (the block's output, the residual stream before adding it)."""
        stream = x if residual is None else residual + x
        h = self._attention(self.input_layernorm(stream), rope, cache, meta, rows)
        if rows is not None:
            stream = stream.index_select(0, rows)
        if self.tp_sharded:
            h = self.tp.all_reduce(h)
        stream = stream + self.post_attention_layernorm(h)
        h = self._mlp(self.pre_feedforward_layernorm(stream))
        if self.tp_sharded:
            h = self.tp.all_reduce(h)
        return self.post_feedforward_layernorm(h), stream

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gelu_and_mul(self.gate_up_proj(h)))


class GemmaForCausalLM(LlamaForCausalLM):
    decoder_layer = GemmaDecoderLayer
    has_llama_layers = False

    def __init__(self, cfg: ModelConfig, ops: Ops | None = None, attn: AttentionBackend | None = None) -> None:
        super().__init__(cfg, ops, attn)
        if self.shard.is_last_stage:
            self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.ops.gemma_norm_for(cfg.hidden_size))
        # sqrt(hidden_size) in the model's dtype, as Hugging Face rounds it
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, dtype=cfg.dtype),
                             persistent=False)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super()._embed(input_ids) * self.embed_scale

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap is None or logits is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def load_weights(self, reader: WeightReader) -> None:
        super().load_weights(reader)
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.weight.data += 1.0
