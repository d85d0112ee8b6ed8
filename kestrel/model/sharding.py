"""Which part of the model one rank holds under tensor (tp) and pipeline (pp) parallelism.

Tensor parallelism splits the attention heads, the MLP's intermediate rows and the vocabulary between
the ranks of a stage; pipeline parallelism splits the decoder layers between stages. Every split is
contiguous and as even as possible (earlier ranks get the extra).

Heads need not divide by tp, but every rank's grouped-query mapping stays uniform (local q head i uses
local KV head i // (num_heads / num_kv_heads)), so the attention backends run unchanged on a shard:
- num_kv_heads >= tp: the KV groups are split; a rank gets whole groups (each KV head with its q heads).
- num_kv_heads < tp and tp % num_kv_heads == 0: each KV head is replicated on tp / num_kv_heads ranks,
  which split its q heads.
- otherwise: the q heads are split evenly and each rank holds the KV heads its q heads use, provided
  each of those serves the same number of its q heads (e.g. 6 heads, 2 KV heads at tp 3).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kestrel.config import EngineConfig, ModelConfig
from kestrel.distributed import get_pp_group, get_tp_group


@dataclass(frozen=True)
class ModelShard:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    head_start: int            # q heads this rank computes (global index of the first)
    num_heads: int
    kv_head_start: int         # KV heads this rank holds (replicated when fewer KV heads than ranks)
    num_kv_heads: int
    intermediate_start: int
    intermediate_size: int
    vocab_start: int           # rows of the embedding / lm_head held here
    vocab_size: int
    vocab_shard_rows: int      # the padded width every rank's logits have (gather needs equal shapes)
    layer_start: int           # decoder layers of this pipeline stage: [layer_start, layer_end)
    layer_end: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_sharded(self) -> bool:
        return self.tp_size > 1 or self.pp_size > 1

    def kv_bytes_per_token(self, cfg: ModelConfig, kv_cache_dtype: str = "auto") -> int:
        """K and V of one token in this rank's KV heads, in as many layers as a block has slots for
        this rank's layers (KVCacheGroups: its layers, where the model has one group)."""
        slots = len(set(cfg.kv_groups.layer_slots[self.layer_start:self.layer_end]))
        local = dataclasses.replace(cfg, num_layers=slots, num_kv_heads=self.num_kv_heads)
        return local.kv_bytes_per_token(kv_cache_dtype)


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` split into `parts` contiguous sizes as evenly as possible, the larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` of `split_sizes(total, parts)`."""
    sizes = split_sizes(total, parts)
    return sum(sizes[:index]), sizes[index]


def shard_for(cfg: ModelConfig, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> ModelShard:
    """The part of `cfg`'s model that rank (tp_rank, pp_rank) holds; ValueError where the model cannot
    be split into tp_size x pp_size parts."""
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise ValueError(f"rank (tp {tp_rank}, pp {pp_rank}) is outside tp {tp_size} x pp {pp_size}")
    head_start, num_heads, kv_head_start, num_kv_heads = _head_split(cfg, tp_rank, tp_size)
    inter_start, inter_size = _split_or_fail("intermediate rows", cfg.intermediate_size, tp_size, tp_rank)
    vocab_start, vocab_size = _split_or_fail("vocabulary rows", cfg.vocab_size, tp_size, tp_rank)
    layer_start, num_layers = _split_or_fail("decoder layers", cfg.num_layers, pp_size, pp_rank,
                                             what_parts="pipeline stages")
    return ModelShard(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                      head_start=head_start, num_heads=num_heads,
                      kv_head_start=kv_head_start, num_kv_heads=num_kv_heads,
                      intermediate_start=inter_start, intermediate_size=inter_size,
                      vocab_start=vocab_start, vocab_size=vocab_size,
                      vocab_shard_rows=-(-cfg.vocab_size // tp_size),
                      layer_start=layer_start, layer_end=layer_start + num_layers)


def shard_of_this_rank(cfg: ModelConfig) -> ModelShard:
    """The shard of this process's place in its tensor- and pipeline-parallel groups (kestrel.distributed;
    the whole model in a world of one)."""
    tp, pp = get_tp_group(), get_pp_group()
    return shard_for(cfg, tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size)


def local_attention_config(config: EngineConfig, shard: ModelShard) -> EngineConfig:
    """`config` with the model's head counts this rank's (what its attention computes), for choosing
    the attention backend (kestrel/attention/selector.py checks the kernels' query heads per KV head)."""
    model = dataclasses.replace(config.model, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads)
    return dataclasses.replace(config, model=model)


def check_shardable(cfg: ModelConfig, tp_size: int, pp_size: int) -> None:
    """ValueError (the first rank's reason) unless every rank of tp_size x pp_size gets a valid shard."""
    for pp_rank in range(pp_size):
        for tp_rank in range(tp_size):
            shard_for(cfg, tp_rank, tp_size, pp_rank, pp_size)


def _split_or_fail(what: str, total: int, parts: int, index: int,
                   what_parts: str = "tensor-parallel ranks") -> tuple[int, int]:
    if total < parts:
        raise ValueError(f"cannot split the model's {total} {what} between {parts} {what_parts}")
    return split_range(total, parts, index)


def _head_split(cfg: ModelConfig, rank: int, tp: int) -> tuple[int, int, int, int]:
    """(head_start, num_heads, kv_head_start, num_kv_heads) of tensor rank `rank`."""
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    if heads % kv_heads:
        raise ValueError(f"the model's {heads} attention heads do not divide into {kv_heads} KV heads")
    group = heads // kv_heads
    if kv_heads >= tp:
        kv_start, kv_count = split_range(kv_heads, tp, rank)
        return kv_start * group, kv_count * group, kv_start, kv_count
    if tp % kv_heads == 0 and group >= tp // kv_heads:
        replicas = tp // kv_heads
        kv_head, part = divmod(rank, replicas)
        start, count = split_range(group, replicas, part)
        return kv_head * group + start, count, kv_head, 1
    return _even_head_split(heads, kv_heads, group, rank, tp)


def _even_head_split(heads: int, kv_heads: int, group: int, rank: int, tp: int) -> tuple[int, int, int, int]:
    """The q heads split evenly; valid where each KV head a rank uses serves equally many of its q heads."""
    why = (f"cannot split {heads} attention heads with {kv_heads} KV heads between {tp} tensor-parallel ranks "
           f"so that every rank's query heads share its KV heads evenly; choose a tensor-parallel size that "
           f"divides or is a multiple of {kv_heads}, at most {heads}")
    if heads < tp:
        raise ValueError(why)
    for r in range(tp):     # every rank must be valid, not only this one
        start, count = split_range(heads, tp, r)
        kv_start, kv_end = start // group, (start + count - 1) // group + 1
        per_kv = [min(start + count, (k + 1) * group) - max(start, k * group) for k in range(kv_start, kv_end)]
        if len(set(per_kv)) != 1:
            raise ValueError(why)
        if r == rank:
            mine = (start, count, kv_start, kv_end - kv_start)
    return mine
