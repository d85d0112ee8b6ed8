"""Turns a `SchedulerOutput` into one forward pass and sampled tokens.

The runner keeps each request's tokens and block ids between steps (the scheduler sends only what
changed) and appends the tokens it samples, so a decode step needs nothing from the engine core but
the request's id. Batch order: requests with one token this step first (decodes), then prefill
chunks; only rows that end a request's known tokens are turned into logits and sampled.

Attention: the runner describes each step's batch without reference to any backend
(`CommonAttentionMetadata`); the attention backend the worker chose turns it into its own metadata.
Decode-only steps run through the decode plan where the model and backend have one (the CPU's stand-in
for graph replay), except under --enforce-eager, where every step runs the model's forward.

Parallel ranks: every rank of the world runs every step on the same batch (built from the same
`SchedulerOutput`). A pipeline stage other than the first receives the previous stage's hidden states
and residual instead of embedding tokens, and one other than the last sends its own on; the last
stage's tensor ranks turn rows into logits together, and only its first tensor rank (the output rank)
samples and answers. The others learn the sampled tokens from the next step's `new_token_ids`.

Speculative decoding: a request with draft tokens this step (`scheduled_spec_decode_tokens`, always
after its last known token) computes its last token and the k drafts as k + 1 decode rows (each
attending to the cache up to its own position), all of them turned into logits; the rejection
sampler keeps the accepted drafts and one more token. Every rank appends the
drafts to the request's tokens while the step runs; the output rank then replaces them with what it
sampled, the others keep them until the next step's `num_computed_tokens` says how many were accepted
(the accepted ones are the drafts themselves). The proposer then drafts the next step's tokens: n-gram
lookup, or a draft model (kestrel/worker/spec_decode.py), which mirrors every forward of the target
into its own cache and keeps, for random requests, the distributions its drafts were drawn from, for
the rejection sampler of the next step.

Async scheduling needs nothing more here: steps run in the order they were scheduled, and a request
scheduled with a placeholder for the token the step before is sampling finds that token already
appended to its tokens when its step runs.

Prompt logprobs: for a request that asks (`prompt_logprobs`), the rows of its scheduled prompt
positions are turned into logits too (the row at position p scores prompt token p + 1), chunk by
chunk as the scheduler splits the prefill. Nothing extra runs when no request in the step asks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kestrel.attention import AttentionBackend, CommonAttentionMetadata, KVCache, PrefillSpan, new_kv_caches
from kestrel.config import EngineConfig
from kestrel.distributed import get_pp_group, get_tp_group
from kestrel.messages import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    StepTimings,
)
from kestrel.model import IntermediateTensors
from kestrel.model.decode_plan import DecodePlan
from kestrel.sample import Sampler, SamplerOutput, SamplingMetadata
from kestrel.sample.rejection_sampler import RejectionSampler
from kestrel.sample.sampler import gather_logprobs
from kestrel.sampling_params import SamplingParams
from kestrel.worker.batch import describe_batch
from kestrel.worker.spec_decode import DraftModelProposer, NgramProposer

# Layers the memory profile's forward runs through (ModelRunner.profile_run).
PROFILE_LAYERS = 2

# Prompt rows turned into logits at a time for prompt logprobs (bounds the [rows, vocab] tensors).
PROMPT_LOGPROBS_ROWS = 256


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]            # prompt, then every token sampled so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[list[int]]      # per KV-cache group, its block table
    num_computed_tokens: int
    # Whether this request wants prompt logprobs from the worker. A request resumed after a
    # preemption with tokens already sampled has sent all of them, so it does not.
    wants_prompt_logprobs: bool = False
    # Drafts at the end of `token_ids` that the step now running verifies (or, on a rank that does not
    # sample, that the last step verified): not known to be part of the request yet.
    num_pending_drafts: int = 0
    # A draft model's distributions for the drafts it proposed last ([k, vocab]; random requests only).
    draft_probs: torch.Tensor | None = None

    @classmethod
    def from_new(cls, new: NewRequestData) -> CachedRequestState:
        return cls(new.req_id, list(new.prompt_token_ids) + list(new.output_token_ids),
                   len(new.prompt_token_ids), new.sampling_params, new.eos_token_id,
                   [list(ids) for ids in new.block_ids], new.num_computed_tokens,
                   new.sampling_params.prompt_logprobs is not None and not new.output_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending_drafts


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: CommonAttentionMetadata    # the batch over the first KV-cache group's block tables
    group_attn: list[CommonAttentionMetadata]   # over each group's (a model of one group: [attn])
    sample_req_ids: list[str]        # requests that sample this step, in logits-row order
    sample_rows: torch.Tensor        # their last token's row in the flattened batch (with k drafts: k + 1 rows)
    sample_drafts: list[list[int]]   # per sampling request, the drafts it verifies (mostly none)
    # Requests scoring prompt tokens this step: (req_id, first row, index in the prompt of the first
    # token scored, number of tokens scored); rows are consecutive.
    prompt_logprob_spans: list[tuple[str, int, int, int]]

    @property
    def hidden_rows(self) -> torch.Tensor | None:
        """The rows the forward returns, where the step reads no others: the sampling rows, when they
        are fewer than the tokens and no prompt logprobs are scored; None: every row."""
        if self.prompt_logprob_spans or self.sample_rows.numel() == self.input_ids.numel():
            return None
        return self.sample_rows


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, attn: AttentionBackend,
                 drafter: DraftModelProposer | None = None) -> None:
        """`attn`: the attention backend the worker chose for this model (and built the model with);
        `drafter`: the draft model, for speculative method draft_model."""
        self.config = config
        self.model = model
        self.attn = attn
        self.device = config.device.device
        self.block_size = config.cache.block_size
        self.num_kv_groups = config.model.kv_groups.num_groups
        self.vocab_size = config.model.vocab_size
        self.sampler = Sampler(self.device)
        self.rejection_sampler = RejectionSampler(self.sampler.argmax_rows)
        spec = config.speculative
        self.proposer = NgramProposer(spec) if spec is not None and spec.method == "ngram" else None
        self.drafter = drafter
        self.shard = model.shard
        self.pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = self.pp.is_first_rank, self.pp.is_last_rank
        # The output rank: the last stage's first tensor rank gets the logits and samples.
        self.samples = self.is_last_stage and get_tp_group().is_first_rank
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[KVCache] = []
        # Decode-only steps run as a plan of pre-bound kernel calls where the model and backend have
        # one (bit-identical to the model's forward); never under --enforce-eager.
        # (one KV-cache group: the plan takes one block table per request)
        self.decode_plan = (None if config.enforce_eager or self.num_kv_groups > 1
                            else DecodePlan.build(model, attn))

    # ---- KV memory ---------------------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        """What this worker holds of one token's K and V: its layers, its KV heads."""
        target = self.shard.kv_bytes_per_token(self.config.model, self.config.cache.kv_cache_dtype)
        return target + (self.drafter.kv_bytes_per_token() if self.drafter is not None else 0)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One cache per block slot this rank's layers use (KVCacheGroups), each layer given its slot's:
        the layers of a slot in different groups share its memory, apart by their groups' block ids."""
        m, shard = self.config.model, self.shard
        layer_slots = m.kv_groups.layer_slots[shard.layer_start:shard.layer_end]
        slots = sorted(set(layer_slots))
        caches = new_kv_caches(len(slots), num_blocks, self.block_size, shard.num_kv_heads,
                               m.head_dim, m.dtype, self.config.cache.kv_cache_dtype == "int8", self.device)
        of_slot = dict(zip(slots, caches))
        self.kv_caches = [of_slot[slot] for slot in layer_slots]
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks)

    @torch.inference_mode()
    def profile_run(self, num_layers: int | None = PROFILE_LAYERS) -> None:
        """A forward pass at the largest batch the scheduler can send (no KV cache), then logits and
        sampling for the most sequences, so that peak activation memory can be measured.

        Through the first `num_layers` layers (None: all). A layer's activations are freed before the
        next one runs and the layers have the same shapes, so the second layer (the first with a
        residual to add) peaks as high as any later one (tests/test_memory_sizing.py), and two
        layers take 1/15 of the default model's forward: the whole of it took 4.3-6.7 s of a 2-core
        start, ~30 s for a 1B model."""
        sched = self.config.scheduler
        num_tokens = sched.max_num_batched_tokens
        spans, start = [], 0
        while start < num_tokens:
            end = min(start + sched.max_model_len, num_tokens)
            spans.append(PrefillSpan(start, end, 0, np.zeros(0, dtype=np.int64)))
            start = end
        common = self._describe(torch.zeros(num_tokens, dtype=torch.long, device=self.device), [], spans)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(s.token_end - s.token_start, device=self.device) for s in spans])
        intermediate = None if self.is_first_stage else self._empty_intermediate(num_tokens)
        hidden = self.model(ids, positions, None, self.attn.build_metadata(common), intermediate,
                            num_layers=num_layers)
        if self.drafter is not None:
            self.drafter.forward(ids, positions, common, with_cache=False)
        if not self.is_last_stage:
            return  # no collective here: each rank profiles alone
        num_rows = min(sched.max_num_seqs * (1 + self.config.num_speculative_tokens), num_tokens)
        logits = self.model.compute_logits(hidden[:num_rows])
        if logits is not None:
            params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)] * num_rows
            metadata = SamplingMetadata.build(params, [[0]] * num_rows, [[]] * num_rows, [None] * num_rows,
                                              self.vocab_size, self.device)
            self.sampler(logits, metadata)
        del hidden, logits

    # ---- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's sampled tokens on the output rank (with where the step's time went); None on the
        other ranks."""
        start = time.perf_counter()
        self._update_states(so)
        if so.is_empty:
            return EMPTY_MODEL_RUNNER_OUTPUT if self.samples else None
        batch = self._prepare_inputs(so)
        prepared = time.perf_counter()
        intermediate = None if self.is_first_stage else self._receive_intermediate(len(batch.input_ids))
        hidden = self._forward(batch, intermediate)
        if self.drafter is not None:
            self.drafter.mirror(batch.input_ids, batch.positions, batch.attn)
        if not self.is_last_stage:
            self._send_intermediate(hidden)
            return None
        forwarded = time.perf_counter()
        output = self._sample(batch, hidden, self._grammar_constraint(so, batch))
        if output is not None:
            output.timings = StepTimings(prepared - start, forwarded - prepared, time.perf_counter() - forwarded)
        return output

    def _grammar_constraint(self, so: SchedulerOutput, batch: BatchInputs
                            ) -> tuple[torch.Tensor, list[int]] | None:
        """Structured outputs: (the bitmask rows of the constrained requests, the logits rows they
        apply to), or None when no request that samples is constrained."""
        if not so.structured_output_rows:
            return None
        width = (self.vocab_size + 31) // 32
        bitmask = torch.frombuffer(bytearray(so.grammar_bitmask), dtype=torch.int32).view(-1, width)
        logits_rows: list[int] = []
        mask_rows: list[int] = []
        row = 0
        for req_id, drafts in zip(batch.sample_req_ids, batch.sample_drafts):
            num_rows = len(drafts) + 1
            first = so.structured_output_rows.get(req_id)
            if first is not None:
                logits_rows.extend(range(row, row + num_rows))
                mask_rows.extend(range(first, first + num_rows))
            row += num_rows
        return bitmask[mask_rows].to(self.device), logits_rows

    def _sample(self, batch: BatchInputs, hidden: torch.Tensor,
                constraint: tuple[torch.Tensor, list[int]] | None = None) -> ModelRunnerOutput | None:
        """Logits of the rows that sample (and of prompt-logprob rows), sampled or verified, within the
        grammars of constrained requests; the next drafts. None on a tensor rank that does not sample."""
        prompt_logprobs = (self._compute_prompt_logprobs(hidden, batch.prompt_logprob_spans)
                           if batch.prompt_logprob_spans else None)
        if not batch.sample_req_ids:
            if not self.samples:
                return None
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[],
                                     prompt_logprobs=prompt_logprobs or {})
        sampling = hidden if batch.hidden_rows is not None else hidden.index_select(0, batch.sample_rows)
        logits = self.model.compute_logits(sampling)
        if logits is None:  # another tensor rank samples
            return None
        states = [self.requests[r] for r in batch.sample_req_ids]
        if any(batch.sample_drafts):
            output = self._verify_drafts(states, logits, batch.sample_drafts, constraint)
        else:
            metadata = SamplingMetadata.build(
                [s.sampling_params for s in states], [s.prompt_token_ids for s in states],
                [s.output_token_ids for s in states], [s.eos_token_id for s in states],
                self.vocab_size, self.device)
            if constraint is not None:
                metadata.constrain(*constraint)
            output = self._make_output(states, self.sampler(logits, metadata))
        if prompt_logprobs:
            output.prompt_logprobs = prompt_logprobs
        if self._speculates():
            output.spec_token_ids = self._propose(states)
        return output

    def _propose(self, states: list[CachedRequestState]) -> list[list[int]]:
        """The next step's drafts of the requests that sampled (n-gram lookup or the draft model)."""
        if self.proposer is not None:
            return [self.proposer.propose(s.token_ids) for s in states]
        drafts, probs = self.drafter.propose([s.token_ids for s in states], [s.block_ids[0] for s in states],
                                             [s.sampling_params for s in states])
        for state, state_probs in zip(states, probs):
            state.draft_probs = state_probs
        return drafts

    def _verify_drafts(self, states: list[CachedRequestState], logits: torch.Tensor,
                       drafts: list[list[int]],
                       constraint: tuple[torch.Tensor, list[int]] | None = None) -> ModelRunnerOutput:
        """The rejection sampler over each request's 1 + k rows; the request's tokens keep what it
        accepted and sampled, instead of the drafts."""
        params, prompts, outputs, eos = [], [], [], []
        for state, request_drafts in zip(states, drafts):
            known_outputs = state.token_ids[state.num_prompt_tokens:state.num_known_tokens]
            for j in range(len(request_drafts) + 1):
                params.append(state.sampling_params)
                prompts.append(state.prompt_token_ids)
                outputs.append(known_outputs + request_drafts[:j])
                eos.append(state.eos_token_id)
        metadata = SamplingMetadata.build(params, prompts, outputs, eos, self.vocab_size, self.device)
        if constraint is not None:
            metadata.constrain(*constraint)
        verified = self.rejection_sampler(logits, metadata, drafts, self._draft_probs(states, drafts))
        logprobs: list[Logprobs | None] = [None] * len(states)
        if verified.logprobs is not None:
            ids, lps, ranks = (verified.logprob_token_ids.tolist(), verified.logprobs.tolist(),
                               verified.sampled_ranks.tolist())
        row = 0
        for i, (state, tokens) in enumerate(zip(states, verified.token_ids)):
            n = state.sampling_params.logprobs
            if n is not None:
                rows = range(row, row + len(tokens))
                logprobs[i] = Logprobs([ids[r][:n + 1] for r in rows], [lps[r][:n + 1] for r in rows],
                                       [ranks[r] for r in rows])
            del state.token_ids[state.num_known_tokens:]
            state.token_ids.extend(tokens)
            state.num_pending_drafts = 0
            row += len(drafts[i]) + 1
        return ModelRunnerOutput(req_ids=[s.req_id for s in states], sampled_token_ids=verified.token_ids,
                                 logprobs=logprobs)

    def _speculates(self) -> bool:
        """Whether to propose drafts after this step: not while the batch is as wide as
        disable_by_batch_size (the scheduler would not schedule them; the runner holds the requests the
        scheduler runs)."""
        spec = self.config.speculative
        if spec is None or (self.proposer is None and self.drafter is None):
            return False
        return spec.disable_by_batch_size is None or len(self.requests) < spec.disable_by_batch_size

    def _draft_probs(self, states: list[CachedRequestState], drafts: list[list[int]]) -> torch.Tensor | None:
        """The distributions the drafts were drawn from, a row per draft ([sum k, vocab]): the draft
        model's for random requests, one-hot for greedy ones (whose rows are verified by argmax); None
        when every draft is one-hot (n-gram drafts, or only greedy requests)."""
        if not any(s.draft_probs is not None for s, d in zip(states, drafts) if d):
            return None
        rows = []
        for state, request_drafts in zip(states, drafts):
            if not request_drafts:
                continue
            if state.draft_probs is not None:
                rows.append(state.draft_probs[:len(request_drafts)])
            else:
                one_hot = torch.zeros(len(request_drafts), self.vocab_size, device=self.device)
                rows.append(one_hot.scatter_(1, torch.tensor(request_drafts, device=self.device).unsqueeze(1), 1.0))
        return torch.cat(rows)

    def _forward(self, batch: BatchInputs,
                 intermediate: IntermediateTensors | None) -> torch.Tensor | IntermediateTensors:
        plan = self.decode_plan
        if plan is not None and plan.covers(batch.attn):
            return plan(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
        if len(batch.group_attn) == 1:
            meta = self.attn.build_metadata(batch.attn)
        else:   # one per KV-cache group: each layer takes its group's (LlamaForCausalLM.forward)
            meta = [self.attn.build_metadata(common) for common in batch.group_attn]
        return self.model(batch.input_ids, batch.positions, self.kv_caches, meta, intermediate, batch.hidden_rows)

    # ---- between pipeline stages ---------------------------------------------------------------

    def _empty_intermediate(self, num_tokens: int) -> IntermediateTensors:
        m = self.config.model
        both = torch.empty(2, num_tokens, m.hidden_size, dtype=m.dtype, device=self.device)
        return IntermediateTensors(both[0], both[1])

    def _receive_intermediate(self, num_tokens: int) -> IntermediateTensors:
        """The previous stage's hidden states and residual for this step's tokens (one message: both
        stages built the same batch, so the shape is known on both sides)."""
        m = self.config.model
        both = torch.empty(2, num_tokens, m.hidden_size, dtype=m.dtype, device=self.device)
        self.pp.recv(both, self.pp.prev_rank)
        return IntermediateTensors(both[0], both[1])

    def _send_intermediate(self, out: IntermediateTensors) -> None:
        self.pp.send(torch.stack((out.hidden, out.residual)), self.pp.next_rank)

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState.from_new(new)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed, new_tokens in zip(cached.req_ids, cached.new_block_ids,
                                                                cached.num_computed_tokens, cached.new_token_ids):
            state = self.requests[req_id]
            for table, added in zip(state.block_ids, new_blocks):
                table.extend(added)
            state.num_computed_tokens = num_computed
            if state.num_pending_drafts:  # the last step's drafts: those before num_computed were accepted
                del state.token_ids[max(num_computed, state.num_prompt_tokens):]
                state.num_pending_drafts = 0
            if new_tokens:  # a rank that did not sample them (the one that did has them already)
                first = max(num_computed, state.num_prompt_tokens)
                state.token_ids[first:first + len(new_tokens)] = new_tokens

    def _batch_order(self, so: SchedulerOutput) -> tuple[list[str], list[str]]:
        """(decodes, longest context first; prefill chunks in scheduler order). A decode is one generated
        token's row; a prompt's rows are always a prefill chunk, even a chunk of one (the last prompt token
        after a prefix-cache hit, the tail of a chunked prompt), so that a prompt row's attention runs on
        the same kernel however the prompt was split or cached (batch invariance: the decode and prefill
        kernels sum in different orders). A request verifying drafts decodes too: one row per token, each
        attending to the cache up to its own position."""
        scheduled, spec = so.num_scheduled_tokens, so.scheduled_spec_decode_tokens

        def decodes_now(req_id: str, n: int) -> bool:
            state = self.requests[req_id]
            return req_id in spec or (n == 1 and state.num_computed_tokens >= state.num_prompt_tokens)

        decodes = [r for r, n in scheduled.items() if decodes_now(r, n)]
        decodes.sort(key=lambda r: self.requests[r].num_computed_tokens, reverse=True)
        return decodes, [r for r, n in scheduled.items() if not decodes_now(r, n)]

    def _prepare_inputs(self, so: SchedulerOutput) -> BatchInputs:
        bs = self.block_size
        scheduled = so.num_scheduled_tokens
        decodes, prefills_ids = self._batch_order(so)
        num_groups = self.num_kv_groups
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[list[np.ndarray]] = [[] for _ in range(num_groups)]   # per group
        sample_req_ids: list[str] = []
        sample_rows: list[int] = []
        sample_drafts: list[list[int]] = []
        spec_tokens = so.scheduled_spec_decode_tokens
        prompt_logprob_spans: list[tuple[str, int, int, int]] = []
        prefills: list[list[PrefillSpan]] = [[] for _ in range(num_groups)]
        row = 0
        decode_rows = [(self.requests[r], scheduled[r]) for r in decodes]
        num_decode_rows = sum(n for _, n in decode_rows)
        for req_id in decodes + prefills_ids:
            state = self.requests[req_id]
            n, start = scheduled[req_id], state.num_computed_tokens
            end = start + n
            drafts = spec_tokens.get(req_id, [])
            input_ids.extend(state.token_ids[start:end - len(drafts)])
            input_ids.extend(drafts)
            pos = np.arange(start, end)
            positions.append(pos)
            for g, ids in enumerate(state.block_ids):
                table = np.asarray(ids, dtype=np.int64)
                slots[g].append(table[pos // bs] * bs + pos % bs)
                if row >= num_decode_rows:
                    prefills[g].append(PrefillSpan(row, row + n, start, table))
            if end - len(drafts) == len(state.token_ids):
                sample_req_ids.append(req_id)
                sample_rows.extend(range(row + n - 1 - len(drafts), row + n))
                sample_drafts.append(drafts)
            if drafts:
                state.token_ids.extend(drafts)
                state.num_pending_drafts = len(drafts)
            if state.wants_prompt_logprobs:
                # Positions start .. end-1 score the tokens after them, as far as the prompt goes.
                num_scored = min(end, state.num_prompt_tokens - 1) - start
                if num_scored > 0:
                    prompt_logprob_spans.append((req_id, row, start + 1, num_scored))
            row += n
        dev = self.device
        group_attn = [self._describe(torch.from_numpy(np.concatenate(slots[g])).to(dev), decode_rows, prefills[g], g)
                      for g in range(num_groups)]
        return BatchInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            attn=group_attn[0],
            group_attn=group_attn,
            sample_req_ids=sample_req_ids,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            sample_drafts=sample_drafts,
            prompt_logprob_spans=prompt_logprob_spans,
        )

    def _describe(self, slot_mapping: torch.Tensor, decode_rows: list[tuple[CachedRequestState, int]],
                  prefills: list[PrefillSpan], group: int = 0) -> CommonAttentionMetadata:
        """The step's batch for the attention backend, over KV-cache group `group`'s block tables: a
        context length and block ids per decode row (a request's n rows at consecutive positions), and
        the prefill chunks."""
        seq_lens = np.array([s.num_computed_tokens + 1 + i for s, n in decode_rows for i in range(n)], dtype=np.int64)
        block_ids = [s.block_ids[group] for s, n in decode_rows for _ in range(n)]
        return describe_batch(slot_mapping, seq_lens, block_ids, prefills, self.block_size, self.device)

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
            if logits is None:  # another tensor rank samples; this one only took part in the gather
                continue
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
