"""Turns a `SchedulerOutput` into one forward pass and sampled tokens.

The runner keeps each request's tokens and block ids between steps (the scheduler sends only what
changed) and appends the tokens it samples, so a decode step needs nothing from the engine core but
the request's id. Batch order: requests with one token this step first (decodes), then prefill
chunks; only rows that end a request's known tokens are turned into logits and sampled.

Prompt logprobs: for a request that asks (`prompt_logprobs`), the rows of its scheduled prompt
positions are turned into logits too (the row at position p scores prompt token p + 1), chunk by
chunk as the scheduler splits the prefill. Nothing extra runs when no request in the step asks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kestrel.config import EngineConfig
from kestrel.messages import EMPTY_MODEL_RUNNER_OUTPUT, Logprobs, ModelRunnerOutput, NewRequestData, SchedulerOutput
from kestrel.model.attention import AttentionMetadata, DecodeGroup, KVCache, PrefillChunk
from kestrel.model.decode_plan import DecodePlan
from kestrel.ops import amx_disabled, cpu_kernels, cpu_prefill
from kestrel.sample import Sampler, SamplerOutput, SamplingMetadata
from kestrel.sample.sampler import gather_logprobs
from kestrel.sampling_params import SamplingParams

# Padded context slots per decode attention call (see kestrel/model/attention.py).
DECODE_GROUP_SLOTS = 2048
# Prompt rows turned into logits at a time for prompt logprobs (bounds the [rows, vocab] tensors).
PROMPT_LOGPROBS_ROWS = 256


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On CPU its pages are mapped lazily (calloc via numpy), so a large KV pool
    costs RAM only as it fills. Zeros matter: masked padding slots must not hold NaN."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)) * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]            # prompt, then every token sampled so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    # Whether this request wants prompt logprobs from the worker. A request resumed after a
    # preemption with tokens already sampled has sent all of them, so it does not.
    wants_prompt_logprobs: bool = False

    @classmethod
    def from_new(cls, new: NewRequestData) -> CachedRequestState:
        return cls(new.req_id, list(new.prompt_token_ids) + list(new.output_token_ids),
                   len(new.prompt_token_ids), new.sampling_params, new.eos_token_id,
                   list(new.block_ids), new.num_computed_tokens,
                   new.sampling_params.prompt_logprobs is not None and not new.output_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_req_ids: list[str]        # requests that sample this step, in logits-row order
    sample_rows: torch.Tensor        # their last token's row in the flattened batch
    # Requests scoring prompt tokens this step: (req_id, first row, index in the prompt of the first
    # token scored, number of tokens scored); rows are consecutive.
    prompt_logprob_spans: list[tuple[str, int, int, int]]


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module) -> None:
        self.config = config
        self.model = model
        self.device = config.device.device
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.vocab_size
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[KVCache] = []
        self.kv_int8 = config.cache.kv_cache_dtype == "int8"
        self.decode_kernel = self._find_decode_kernel()
        self.prefill_kernel = self._find_prefill_kernel()
        # Decode-only steps run as a plan of pre-bound kernel calls where the model has one (the
        # CPU's stand-in for graph replay; bit-identical to the model's forward).
        self.decode_plan = DecodePlan.build(model)

    def _find_decode_kernel(self):
        """The compiled decode attention for this model and cache, called as
        kernel(q, *cache, block_table, seq_lens, block_size, scale[, in_q_dtype]); None: PyTorch."""
        m = self.config.model
        if self.device.type != "cpu" or m.dtype not in (torch.float32, torch.bfloat16):
            return None
        kernels = cpu_kernels()
        if kernels is None or not kernels.supports(m.head_dim, m.num_heads // m.num_kv_heads):
            return None
        if self.kv_int8:
            return kernels.paged_decode_attention_int8
        return kernels.paged_decode_attention

    def _find_prefill_kernel(self):
        m = self.config.model
        if (self.device.type != "cpu" or m.dtype != torch.bfloat16 or m.head_dim % 32 != 0 or m.head_dim > 256
                or amx_disabled()):
            return None
        kernels = cpu_prefill()
        if kernels is None or not kernels.usable():
            return None
        return kernels.prefill_attention

    # ---- KV memory ---------------------------------------------------------------------------

    def initialize_kv_cache(self, num_blocks: int) -> None:
        m = self.config.model
        slots, heads, dim, dev = num_blocks * self.block_size, m.num_kv_heads, m.head_dim, self.device
        if self.kv_int8:  # the layout of kestrel/model/attention.py: K transposed within each block
            self.kv_caches = [(zeroed((num_blocks, heads, dim, self.block_size), torch.int8, dev),
                               zeroed((num_blocks, heads, self.block_size), torch.float32, dev),
                               zeroed((slots, heads, dim), torch.int8, dev),
                               zeroed((slots, heads), torch.float32, dev))
                              for _ in range(m.num_layers)]
            return
        shape = (slots, heads, dim)
        self.kv_caches = [(zeroed(shape, m.dtype, dev), zeroed(shape, m.dtype, dev)) for _ in range(m.num_layers)]

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward pass at the largest batch the scheduler can send (no KV cache), then logits and
        sampling for the most sequences, so that peak activation memory can be measured."""
        sched = self.config.scheduler
        num_tokens = sched.max_num_batched_tokens
        chunks, start = [], 0
        while start < num_tokens:
            end = min(start + sched.max_model_len, num_tokens)
            chunks.append(PrefillChunk(start, end, None, None, end - start))
            start = end
        meta = AttentionMetadata(slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=self.device),
                                 block_size=self.block_size, decodes=[], prefills=chunks,
                                 prefill_kernel=self.prefill_kernel)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(c.token_end - c.token_start, device=self.device) for c in chunks])
        hidden = self.model(ids, positions, None, meta)
        num_rows = min(sched.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:num_rows])
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)] * num_rows
        metadata = SamplingMetadata.build(params, [[0]] * num_rows, [[]] * num_rows, [None] * num_rows,
                                          self.vocab_size, self.device)
        self.sampler(logits, metadata)
        del hidden, logits

    # ---- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.is_empty:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self._prepare_inputs(so)
        hidden = self._forward(batch)
        prompt_logprobs = (self._compute_prompt_logprobs(hidden, batch.prompt_logprob_spans)
                           if batch.prompt_logprob_spans else None)
        if not batch.sample_req_ids:
            if prompt_logprobs:
                return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[],
                                         prompt_logprobs=prompt_logprobs)
            return EMPTY_MODEL_RUNNER_OUTPUT
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))
        states = [self.requests[r] for r in batch.sample_req_ids]
        metadata = SamplingMetadata.build(
            [s.sampling_params for s in states], [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states], [s.eos_token_id for s in states],
            self.vocab_size, self.device)
        sampled = self.sampler(logits, metadata)
        output = self._make_output(states, sampled)
        if prompt_logprobs:
            output.prompt_logprobs = prompt_logprobs
        return output

    def _forward(self, batch: BatchInputs) -> torch.Tensor:
        plan = self.decode_plan
        if plan is not None and plan.covers(batch.input_ids.shape[0], batch.meta):
            return plan(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState.from_new(new)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            state = self.requests[req_id]
            state.block_ids.extend(new_blocks)
            state.num_computed_tokens = num_computed

    def _batch_order(self, so: SchedulerOutput) -> tuple[list[str], list[str]]:
        """(decodes, longest context first; prefill chunks in scheduler order)."""
        scheduled = so.num_scheduled_tokens
        decodes = [r for r, n in scheduled.items() if n == 1]
        decodes.sort(key=lambda r: self.requests[r].num_computed_tokens, reverse=True)
        return decodes, [r for r, n in scheduled.items() if n > 1]

    def _prepare_inputs(self, so: SchedulerOutput) -> BatchInputs:
        bs = self.block_size
        scheduled = so.num_scheduled_tokens
        decodes, prefills_ids = self._batch_order(so)
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        sample_req_ids: list[str] = []
        sample_rows: list[int] = []
        prompt_logprob_spans: list[tuple[str, int, int, int]] = []
        prefills: list[PrefillChunk] = []
        row = 0
        for req_id in decodes + prefills_ids:
            state = self.requests[req_id]
            n, start = scheduled[req_id], state.num_computed_tokens
            end = start + n
            input_ids.extend(state.token_ids[start:end])
            pos = np.arange(start, end)
            positions.append(pos)
            table = np.asarray(state.block_ids, dtype=np.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
            if n > 1:
                prefills.append(self._prefill_chunk(row, start, end, table))
            if end == len(state.token_ids):
                sample_req_ids.append(req_id)
                sample_rows.append(row + n - 1)
            if state.wants_prompt_logprobs:
                # Positions start .. end-1 score the tokens after them, as far as the prompt goes.
                num_scored = min(end, state.num_prompt_tokens - 1) - start
                if num_scored > 0:
                    prompt_logprob_spans.append((req_id, row, start + 1, num_scored))
            row += n
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
                                 block_size=bs, decodes=self._decode_groups(decodes), prefills=prefills,
                                 decode_kernel=self.decode_kernel, prefill_kernel=self.prefill_kernel)
        return BatchInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            meta=meta,
            sample_req_ids=sample_req_ids,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            prompt_logprob_spans=prompt_logprob_spans,
        )

    def _decode_groups(self, decodes: list[str]) -> list[DecodeGroup]:
        """One group for the kernel; for the PyTorch path, the (longest-first) decodes cut into groups
        of at most DECODE_GROUP_SLOTS padded slots."""
        if self.decode_kernel is not None and decodes:
            return [self._decode_group(decodes, 0, len(decodes))]
        groups: list[DecodeGroup] = []
        start = 0
        while start < len(decodes):
            max_len = self.requests[decodes[start]].num_computed_tokens + 1
            size = max(1, min(len(decodes) - start, DECODE_GROUP_SLOTS // max_len))
            groups.append(self._decode_group(decodes, start, start + size))
            start += size
        return groups

    def _decode_group(self, decodes: list[str], start: int, end: int) -> DecodeGroup:
        bs, dev = self.block_size, self.device
        states = [self.requests[r] for r in decodes[start:end]]
        seq_lens = [s.num_computed_tokens + 1 for s in states]
        max_blocks = -(-seq_lens[0] // bs)
        table = np.zeros((len(states), max_blocks), dtype=np.int64)  # block 0: the null block
        for i, (state, seq_len) in enumerate(zip(states, seq_lens)):
            n = -(-seq_len // bs)
            table[i, :n] = state.block_ids[:n]
        lens = torch.tensor(seq_lens, device=dev)
        mask = None
        if self.decode_kernel is None:
            span = max_blocks * bs
            visible = torch.arange(span, device=dev)[None, :] < lens[:, None]
            # An additive mask in the model's dtype: SDPA would convert a boolean one in every layer.
            mask = torch.zeros(visible.shape, dtype=self.config.model.dtype, device=dev)
            mask.masked_fill_(~visible, float("-inf")).unsqueeze_(1).unsqueeze_(1)
        return DecodeGroup(start, end, torch.from_numpy(table).to(dev), lens, mask)

    def _prefill_chunk(self, row: int, start: int, end: int, table: np.ndarray) -> PrefillChunk:
        n = end - start
        if start == 0:
            return PrefillChunk(row, row + n, None, None, end)
        bs, dev = self.block_size, self.device
        num_blocks = -(-end // bs)
        blocks = torch.from_numpy(table[:num_blocks]).to(dev)
        if self.prefill_kernel is not None:  # it takes the first `end` keys, causal from the bottom right
            return PrefillChunk(row, row + n, blocks, None, end)
        # Query i sits at position start + i and sees keys 0 .. start + i (the padding after `end`
        # is never visible).
        mask = (torch.arange(num_blocks * bs, device=dev)[None, :]
                <= torch.arange(start, end, device=dev)[:, None])
        return PrefillChunk(row, row + n, blocks, mask, end)

    def _compute_prompt_logprobs(self, hidden: torch.Tensor, spans: list[tuple[str, int, int, int]]
                                 ) -> dict[str, tuple[int, Logprobs]]:
        """Raw float32 log-softmax over the rows of `spans`, as `Logprobs` rows: the actual prompt
        token first, then the request's top-N, with the actual token's rank."""
        dev = self.device
        rows = np.concatenate([np.arange(r, r + k) for _, r, _, k in spans])
        targets: list[int] = []
        for req_id, _, first, k in spans:
            targets.extend(self.requests[req_id].token_ids[first:first + k])
        num_top = max(self.requests[r].sampling_params.prompt_logprobs for r, *_ in spans)
        rows_t = torch.from_numpy(rows).to(dev)
        targets_t = torch.tensor(targets, dtype=torch.long, device=dev)
        ids: list[list[int]] = []
        lps: list[list[float]] = []
        ranks: list[int] = []
        for i in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            logits = self.model.compute_logits(hidden.index_select(0, rows_t[i:i + PROMPT_LOGPROBS_ROWS]))
            t_ids, t_lps, t_ranks = gather_logprobs(logits.log_softmax(dim=-1),
                                                    targets_t[i:i + PROMPT_LOGPROBS_ROWS], num_top)
            ids.extend(t_ids.tolist())
            lps.extend(t_lps.tolist())
            ranks.extend(t_ranks.tolist())
            del logits
        out: dict[str, tuple[int, Logprobs]] = {}
        at = 0
        for req_id, _, first, k in spans:
            m = self.requests[req_id].sampling_params.prompt_logprobs + 1
            out[req_id] = (first, Logprobs([r[:m] for r in ids[at:at + k]], [r[:m] for r in lps[at:at + k]],
                                           ranks[at:at + k]))
            at += k
        return out

    def _make_output(self, states: list[CachedRequestState], sampled: SamplerOutput) -> ModelRunnerOutput:
        token_ids = sampled.sampled_token_ids.tolist()
        logprobs: list[Logprobs | None] = [None] * len(states)
        if sampled.logprobs is not None:
            ids, lps, ranks = (sampled.logprob_token_ids.tolist(), sampled.logprobs.tolist(),
                               sampled.sampled_ranks.tolist())
            for i, state in enumerate(states):
                n = state.sampling_params.logprobs
                if n is not None:
                    logprobs[i] = Logprobs([ids[i][:n + 1]], [lps[i][:n + 1]], [ranks[i]])
        for state, token_id in zip(states, token_ids):
            state.token_ids.append(token_id)
        return ModelRunnerOutput(req_ids=[s.req_id for s in states],
                                 sampled_token_ids=[[t] for t in token_ids], logprobs=logprobs)
