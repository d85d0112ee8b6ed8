"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) and Qwen3, written for the paged KV cache.

Tokens arrive flattened ([num_tokens] ids and positions, no padding); projections are fused
(q|k|v in one matrix, gate|up in one) so that a layer is few large ops. Weights load from Hugging
Face state-dict names.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kestrel.attention import AttentionBackend, KVCache, TorchSDPABackend
from kestrel.config import ModelConfig
from kestrel.model.layers import Linear, RMSNorm, RotaryEmbedding
from kestrel.ops.dispatch import Ops, select_ops


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, attn: AttentionBackend) -> None:
        super().__init__()
        dt = cfg.dtype
        self.ops, self.attn = ops, attn
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, ops.rms_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, ops.rms_norm)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias, dtype=dt,
                               linear=ops.linear)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False, dtype=dt, linear=ops.linear)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, dtype=dt, linear=ops.linear)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dt, linear=ops.linear)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt, ops.rms_norm)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt, ops.rms_norm)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                cache: KVCache | None, meta: object) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before adding it); the next layer adds them
        inside its fused norm."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.ops.add_rms_norm(x, residual, self.input_layernorm.weight, self.eps)
        h = self._attention(h, rope, cache, meta)
        h, residual = self.ops.add_rms_norm(h, residual, self.post_attention_layernorm.weight, self.eps)
        return self._mlp(h), residual

    def _attention(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   cache: KVCache | None, meta: object) -> torch.Tensor:
        n, heads, kv_heads = h.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(h).view(n, heads + 2 * kv_heads, self.head_dim)
        if self.qk_norm:
            rms_norm = self.ops.rms_norm
            qkv = torch.cat((rms_norm(qkv[:, :heads], self.q_norm.weight, self.eps),
                             rms_norm(qkv[:, heads:heads + kv_heads], self.k_norm.weight, self.eps),
                             qkv[:, heads + kv_heads:]), dim=1)
        # q and k heads rotated, k and v written to the cache (in one pass where a kernel can)
        self.attn.write_kv(qkv, heads, *rope, cache, meta)
        out = self.attn.forward(qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:],
                                cache, meta, self.scale)
        return self.o_proj(out.view(n, self.q_size))

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(h)))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops | None = None, attn: AttentionBackend | None = None) -> None:
        """`ops` and `attn`: the op implementations and the attention backend the worker selected for
        the model's device; by default those for the current default device, with the PyTorch
        reference attention."""
        super().__init__()
        if ops is None:
            ops = select_ops(torch.get_default_device(), cfg.dtype)
        if attn is None:
            attn = TorchSDPABackend(cfg.dtype, ops.rotary)
        self.cfg, self.ops, self.attn = cfg, ops, attn
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, attn) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, ops.rms_norm)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling, cfg.dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache] | None,
                meta: object) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] (before the final norm). `meta`: the attention backend's
        metadata for the step."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, kv_caches[i] if kv_caches is not None else None, meta)
        return x + residual

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] for the rows of `hidden` that sample."""
        return self.ops.linear_to_float(self.norm(hidden), self.lm_head.weight)

    # ---- weights -----------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters; every parameter must be set."""
        cfg = self.cfg
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        shards = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv),
                  "v_proj": ("qkv_proj", q + kv, kv), "gate_proj": ("gate_up_proj", 0, inter),
                  "up_proj": ("gate_up_proj", inter, inter)}
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            target, start, size = self._target_of(name, shards)
            if target not in params:
                raise ValueError(f"weight {name!r} has no place in the {cfg.architecture} model")
            param = params[target]
            dst = param.data if size is None else param.data.narrow(0, start, size)
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(target if size is None else f"{target}[{start}]")
        expected = {n for n in params if not any(n.endswith(f"{s[0]}.weight") or n.endswith(f"{s[0]}.bias")
                                                for s in shards.values())}
        expected |= {f"{n}[{s[1]}]" for n in params for s in shards.values()
                     if n.endswith(f"{s[0]}.weight") or n.endswith(f"{s[0]}.bias")}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    @staticmethod
    def _target_of(name: str, shards: dict[str, tuple[str, int, int]]) -> tuple[str, int, int | None]:
        name = name.removeprefix("model.")
        if name.startswith("lm_head."):
            return name, 0, None
        parts = name.split(".")
        # layers.N.self_attn.q_proj.weight → layers.N.qkv_proj.weight (+ row offset)
        if parts[0] == "layers" and parts[2] in ("self_attn", "mlp"):
            proj = parts[3]
            rest = ".".join(parts[4:])
            if proj in shards:
                fused, start, size = shards[proj]
                return f"layers.{parts[1]}.{fused}.{rest}", start, size
            return f"layers.{parts[1]}.{proj}.{rest}", 0, None
        return name, 0, None
