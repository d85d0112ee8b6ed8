"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) and Qwen3, written for the paged KV cache.

Tokens arrive flattened ([num_tokens] ids and positions, no padding); projections are fused
(q|k|v in one matrix, gate|up in one) so that a layer is few large ops. Weights load from Hugging
Face state-dict names.

Under tensor and pipeline parallelism the model holds one rank's shard (kestrel/model/sharding.py),
chosen at construction from the process groups (kestrel/distributed): q|k|v and gate|up are split by
output rows (this rank's heads, KV heads and intermediate rows), o_proj and down_proj by input
columns, and their partial sums are all-reduced over the tensor-parallel group in the decoder layer
itself, so that the reduction survives --quantization replacing the projections. The embedding and the
output head are split by vocabulary rows. A pipeline stage builds only its layers; the embedding lives
on the first stage, the final norm and output head on the last.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.attention import AttentionBackend, KVCache, TorchSDPABackend
from kestrel.config import ModelConfig
from kestrel.distributed import GroupCoordinator, get_tp_group
from kestrel.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding
from kestrel.model.sharding import ModelShard, shard_of_this_rank, split_sizes
from kestrel.ops.dispatch import Ops, rms_norm_reference, select_ops

if TYPE_CHECKING:
    from kestrel.model.loader import WeightReader


@dataclass
class IntermediateTensors:
    """What a pipeline stage hands the next: the last layer's output and the residual stream before
    adding it, both [num_tokens, hidden_size] in the model's dtype."""
    hidden: torch.Tensor
    residual: torch.Tensor


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, attn: AttentionBackend, shard: ModelShard,
                 tp: GroupCoordinator, window: int | None = None) -> None:
        """`shard`: the heads and intermediate rows this rank computes; `tp`: the tensor-parallel group
        over which o_proj's and down_proj's partial sums are all-reduced; `window`: the layer's sliding
        window (ModelConfig.window_of), None for full attention."""
        super().__init__()
        dt = cfg.dtype
        self.ops, self.attn, self.tp = ops, attn, tp
        self.window = window
        self.softcap = cfg.attn_logit_softcapping
        self.tp_sharded = shard.tp_size > 1
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        self.q_size = shard.num_heads * cfg.head_dim
        self.kv_size = shard.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_multiplier or (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        # Granite scales each block's output before the residual add (None: 1)
        self.residual_multiplier = cfg.residual_multiplier if cfg.residual_multiplier != 1.0 else None
        self.eps = cfg.rms_norm_eps
        inter = shard.intermediate_size
        # The ops for this layer's shapes, chosen once (kestrel/ops/dispatch.py); the linear layers' are
        # bound to their weights once those are final (layers.bind_linear_ops_).
        rms_norm, self.add_rms_norm = ops.norm_for(cfg.hidden_size)
        self.silu_and_mul = ops.silu_and_mul_for(2 * inter)
        # The q/k norms run over strided [tokens, heads, head_dim] slices of qkv, which the norm kernel
        # does not take: always the reference (which the generic op would choose on every call).
        self.head_rms_norm = rms_norm_reference
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, rms_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, rms_norm)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias, dtype=dt,
                               linear=ops.linear)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False, dtype=dt, linear=ops.linear)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=False, dtype=dt, linear=ops.linear)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False, dtype=dt, linear=ops.linear)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt, self.head_rms_norm)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt, self.head_rms_norm)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                cache: KVCache | None, meta: object, rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before adding it); the next layer adds them
        inside its fused norm. `rows`: the only rows whose outputs are wanted (None: all). Attention
        still runs over every token, whose keys and values the cache needs; the rest of the layer only
        for `rows`, and both outputs have just those rows, in that order."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.add_rms_norm(x, residual, self.input_layernorm.weight, self.eps)
        h = self._attention(h, rope, cache, meta, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
        if self.tp_sharded:
            h = self.tp.all_reduce(h)
        if self.residual_multiplier is not None:
            h = h * self.residual_multiplier
        h, residual = self.add_rms_norm(h, residual, self.post_attention_layernorm.weight, self.eps)
        h = self._mlp(h)
        if self.tp_sharded:
            h = self.tp.all_reduce(h)
        if self.residual_multiplier is not None:
            h = h * self.residual_multiplier
        return h, residual

    def _attention(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   cache: KVCache | None, meta: object, rows: torch.Tensor | None) -> torch.Tensor:
        n, heads, kv_heads = h.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(h).view(n, heads + 2 * kv_heads, self.head_dim)
        if self.qk_norm:
            rms_norm = self.head_rms_norm
            qkv = torch.cat((rms_norm(qkv[:, :heads], self.q_norm.weight, self.eps),
                             rms_norm(qkv[:, heads:heads + kv_heads], self.k_norm.weight, self.eps),
                             qkv[:, heads + kv_heads:]), dim=1)
        # q and k heads rotated, k and v written to the cache (in one pass where a kernel can)
        self.attn.write_kv(qkv, heads, *rope, cache, meta)
        out = self.attn.forward(qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:],
                                cache, meta, self.scale, self.window, self.softcap).view(n, self.q_size)
        return self.o_proj(out if rows is None else out.index_select(0, rows))

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(h)))


@dataclass(frozen=True)
class _Placement:
    """Where one checkpoint tensor goes on this rank: `rows` rows of parameter `param` from row `row`
    (None: the whole parameter), read as the slice [start, start + size) of its dim `dim` (None: whole)."""
    param: str
    row: int = 0
    rows: int | None = None
    dim: int | None = None
    start: int = 0
    size: int | None = None


class LlamaForCausalLM(nn.Module):
    decoder_layer: type[DecoderLayer] = DecoderLayer
    # Whether the decode plan (kestrel/model/decode_plan.py), which runs the Llama layer, runs this model.
    has_llama_layers: bool = True

    def __init__(self, cfg: ModelConfig, ops: Ops | None = None, attn: AttentionBackend | None = None) -> None:
        """`ops` and `attn`: the op implementations and the attention backend the worker selected for
        the model's device; by default those for the current default device, with the PyTorch
        reference attention. The model holds this process's shard (`self.shard`) of the tensor- and
        pipeline-parallel world set up by kestrel.distributed (all of it in a world of one)."""
        super().__init__()
        if ops is None:
            ops = select_ops(torch.get_default_device(), cfg.dtype)
        if attn is None:
            attn = TorchSDPABackend(cfg.dtype, ops.rotary_for(cfg.head_dim, cfg.rotary_dim))
        self.cfg, self.ops, self.attn = cfg, ops, attn
        self.tp = get_tp_group()
        self.shard = shard = shard_of_this_rank(cfg)
        if shard.is_first_stage:
            self.embed_tokens = Embedding(shard.vocab_size, cfg.hidden_size, cfg.dtype, ops.linear_to_float)
        self.layers = nn.ModuleList(self.decoder_layer(cfg, ops, attn, shard, self.tp, cfg.window_of(i))
                                    for i in range(shard.layer_start, shard.layer_end))
        for i, layer in enumerate(self.layers):
            layer.kv_group = cfg.kv_groups.layer_groups[shard.layer_start + i]
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling, cfg.dtype)
        # The sliding-window layers' own rope (Gemma 3's local base, unscaled), where they have one.
        self.local_rotary = None if cfg.local_rope_theta is None else RotaryEmbedding(
            cfg.rotary_dim, cfg.max_model_len, cfg.local_rope_theta, None, cfg.dtype)
        if shard.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, ops.norm_for(cfg.hidden_size)[0])
            if cfg.tie_word_embeddings and shard.is_first_stage:
                self.lm_head = self.embed_tokens
            else:
                self.lm_head = Embedding(shard.vocab_size, cfg.hidden_size, cfg.dtype, ops.linear_to_float)
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache] | None,
                meta: object, intermediate: IntermediateTensors | None = None,
                output_rows: torch.Tensor | None = None,
                num_layers: int | None = None) -> torch.Tensor | IntermediateTensors:
        """Hidden states [num_tokens, hidden] (before the final norm) on the last pipeline stage, the
        stage's IntermediateTensors on the others. `meta`: the attention backend's metadata for the
        step; `kv_caches`: one per layer of this stage; `intermediate`: the previous stage's output
        (stages after the first, which take it instead of `input_ids`). `output_rows` (last stage):
        only these rows' hidden states, in that order; the last layer computes the rest of its rows
        only as far as the KV cache needs them, as llama.cpp skips the unused outputs. `num_layers`:
        run only the stage's first layers (the memory profile: see ModelRunner.profile_run)."""
        if self.shard.is_first_stage:
            x, residual = self._embed(input_ids), None
        else:
            if intermediate is None:
                raise ValueError(f"pipeline stage {self.shard.pp_rank} needs the previous stage's tensors")
            x, residual = intermediate.hidden, intermediate.residual
        rope = self.rotary.lookup(positions)
        local_rope = rope if self.local_rotary is None else self.local_rotary.lookup(positions)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        last = len(layers) - 1 if self.shard.is_last_stage else -1
        # One metadata per KV-cache group (a list, each layer taking its group's), or one for all.
        metas = meta if isinstance(meta, list) else None
        for i, layer in enumerate(layers):
            x, residual = layer(x, residual, rope if layer.window is None else local_rope,
                                kv_caches[i] if kv_caches is not None else None,
                                meta if metas is None else metas[layer.kv_group], output_rows if i == last else None)
        if not self.shard.is_last_stage:
            return IntermediateTensors(x, residual)
        return x + residual

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self._embedding_rows(input_ids)
        return x if self.cfg.embedding_multiplier == 1.0 else x * self.cfg.embedding_multiplier

    def _embedding_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.tp_size == 1:
            return self.embed_tokens.rows(input_ids)
        # Vocabulary-parallel: ids of other ranks' rows give zero rows here; the sum over ranks is the lookup.
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_size)
        x = self.embed_tokens.rows(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [rows, vocab] for the rows of `hidden` that sample, on the tensor-parallel
        group's first rank; None on the others. Collective: every tensor rank of the last stage calls it."""
        logits = self.lm_head.logits(self.norm(hidden))
        if self.cfg.logits_scaling != 1.0:
            logits = logits / self.cfg.logits_scaling
        if self.shard.tp_size == 1:
            return logits
        shard = self.shard
        padded = F.pad(logits, (0, shard.vocab_shard_rows - shard.vocab_size))
        gathered = self.tp.gather(padded, dst=0, dim=-1)
        if gathered is None:
            return None
        sizes = split_sizes(self.cfg.vocab_size, shard.tp_size)
        if all(size == shard.vocab_shard_rows for size in sizes):
            return gathered
        parts = gathered.split(shard.vocab_shard_rows, dim=-1)
        return torch.cat([part[:, :size] for part, size in zip(parts, sizes)], dim=-1)

    # ---- weights -----------------------------------------------------------------------------

    def load_weights(self, reader: WeightReader) -> None:
        """Read this rank's share of every Hugging Face-named checkpoint tensor (and no more) into the
        fused, sharded parameters; every parameter must be filled."""
        params = dict(self.named_parameters())
        rows_filled = dict.fromkeys(params, 0)
        for name in reader.names():
            for placement in self.placements(name):
                self._load_one(reader, name, placement, params, rows_filled)
        missing = sorted(n for n, p in params.items() if rows_filled[n] < p.shape[0])
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    def _load_one(self, reader: WeightReader, name: str, placement: _Placement, params: dict[str, nn.Parameter],
                  rows_filled: dict[str, int]) -> None:
        """One placement of checkpoint tensor `name`: its rows read (or its GGUF blocks) into the parameter."""
        if placement.param not in params:
            raise ValueError(f"weight {name!r} has no place in the {self.cfg.architecture} model")
        param = params[placement.param]
        dst = param.data if placement.rows is None else param.data.narrow(0, placement.row, placement.rows)
        if param.dtype == torch.uint8:
            # A GGUFLinear (kestrel/model/quantization.py) holds the file's blocks, each part's rows
            # from column 0 of a row as wide as its widest type's.
            tensor = reader.read_blocks(name, placement.dim, placement.start, placement.size)
            dst = dst[:, :tensor.shape[1]]
        else:
            tensor = reader.read(name, placement.dim, placement.start, placement.size)
        if dst.shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)} on this rank, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        rows_filled[placement.param] += dst.shape[0]

    def placements(self, name: str) -> list[_Placement]:
        """Where the parts of checkpoint tensor `name` go on this rank: one place, or three for a
        checkpoint's fused q|k|v (two for gate|up), each part's rows of this rank; none where it has no
        part here (another stage's layers, the untied copy of a tied output head)."""
        parts = name.removeprefix("model.").split(".")
        if len(parts) > 3 and parts[0] == "layers" and parts[3] in self.FUSED_IN_CHECKPOINT:
            layer = int(parts[1])
            if not self.shard.layer_start <= layer < self.shard.layer_end:
                return []
            prefix, rest = f"layers.{layer - self.shard.layer_start}", ".".join(parts[4:])
            return [self._fused_part(prefix, parts[3], part, rest) for part in self.FUSED_IN_CHECKPOINT[parts[3]]]
        placement = self.placement(name)
        return [] if placement is None else [placement]

    # A checkpoint's fused projections (Phi-3's): their parts in order, each as the unfused name.
    FUSED_IN_CHECKPOINT = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def _fused_part(self, prefix: str, fused: str, part: str, rest: str) -> _Placement:
        """Part `part` of a checkpoint's fused projection: the unfused part's placement, read from the
        part's rows of the fused tensor."""
        cfg, hd = self.cfg, self.cfg.head_dim
        offsets = {"q_proj": 0, "k_proj": cfg.num_heads * hd, "v_proj": (cfg.num_heads + cfg.num_kv_heads) * hd,
                   "gate_proj": 0, "up_proj": cfg.intermediate_size}
        unfused = self._projection_placement(prefix, part, rest)
        return dataclasses.replace(unfused, start=unfused.start + offsets[part])

    def placement(self, name: str) -> _Placement | None:
        """Where checkpoint tensor `name` (not a fused one) goes on this rank; None where it has no part
        here (another stage's layers, the untied copy of a tied output head)."""
        cfg, shard = self.cfg, self.shard
        name = name.removeprefix("model.")
        vocab_rows = dict(dim=0, start=shard.vocab_start, size=shard.vocab_size)
        if name == "embed_tokens.weight":
            if shard.is_first_stage:
                return _Placement("embed_tokens.weight", **vocab_rows)
            if cfg.tie_word_embeddings and shard.is_last_stage:
                return _Placement("lm_head.weight", **vocab_rows)
            return None
        if name.startswith("lm_head."):
            if cfg.tie_word_embeddings:
                return None
            return _Placement(name, **vocab_rows) if shard.is_last_stage else None
        if name.startswith("norm."):
            return _Placement(name) if shard.is_last_stage else None
        parts = name.split(".")
        if parts[0] != "layers":
            return _Placement(name)
        layer = int(parts[1])
        if not shard.layer_start <= layer < shard.layer_end:
            return None
        prefix = f"layers.{layer - shard.layer_start}"
        if parts[2] in ("self_attn", "mlp"):
            return self._projection_placement(prefix, parts[3], ".".join(parts[4:]))
        return _Placement(f"{prefix}.{'.'.join(parts[2:])}")

    def _projection_placement(self, prefix: str, proj: str, rest: str) -> _Placement:
        """q/k/v and gate/up: this rank's rows into the fused matrix; o/down: this rank's input columns."""
        shard, hd = self.shard, self.cfg.head_dim
        q, kv, inter = shard.num_heads * hd, shard.num_kv_heads * hd, shard.intermediate_size
        heads = dict(dim=0, start=shard.head_start * hd, size=q)
        kv_heads = dict(dim=0, start=shard.kv_head_start * hd, size=kv)
        inter_rows = dict(dim=0, start=shard.intermediate_start, size=inter)
        fused = {
            "q_proj": ("qkv_proj", 0, heads), "k_proj": ("qkv_proj", q, kv_heads),
            "v_proj": ("qkv_proj", q + kv, kv_heads),
            "gate_proj": ("gate_up_proj", 0, inter_rows), "up_proj": ("gate_up_proj", inter, inter_rows),
        }
        if proj in fused:
            target, row, read = fused[proj]
            return _Placement(f"{prefix}.{target}.{rest}", row, read["size"], **read)
        if proj == "o_proj":
            return _Placement(f"{prefix}.o_proj.{rest}", dim=1, start=shard.head_start * hd, size=q)
        if proj == "down_proj":
            return _Placement(f"{prefix}.down_proj.{rest}", dim=1, start=shard.intermediate_start, size=inter)
        return _Placement(f"{prefix}.{proj}.{rest}")   # q_norm, k_norm: replicated
