"""The vectorized sampler: logits [B, V] of one step → one token per row, plus logprobs if asked.

Order, as in vLLM V1: raw logprobs → the grammar's bitmask (structured outputs) → allowed_token_ids
mask → bad words mask → logit bias → min_tokens mask → penalties → greedy argmax, or for random rows
temperature → min_p → top_k → top_p → sample by the exponential race.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.ops.dispatch import Argmax, argmax_reference, select_argmax
from kestrel.sample.metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor          # [B] int64
    # [B, N+1]: column 0 the sampled token, then the top-N tokens, N = max logprobs of any row.
    logprob_token_ids: torch.Tensor | None   # int64
    logprobs: torch.Tensor | None            # float32, raw log_softmax of the model's logits
    sampled_ranks: torch.Tensor | None       # [B] int64, 1 = most likely


class Sampler(torch.nn.Module):
    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.argmax_rows = select_argmax(torch.device(device))   # the kernel on CPU where it builds

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        assert logits.shape[-1] == metadata.vocab_size, (logits.shape, metadata.vocab_size)
        # The steps below that change the logits do it in place, on a float32 copy when they change
        # anything, so that the caller's tensor stays as it was.
        logits, raw_logprobs = prepare_logits(logits, metadata)
        sampled = sample(logits, metadata, self.argmax_rows)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        token_ids, logprobs, ranks = gather_logprobs(raw_logprobs, sampled,
                                                     metadata.max_num_logprobs)
        return SamplerOutput(sampled, token_ids, logprobs, ranks)


def prepare_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(float32 logits with grammars' bitmasks, allowed_token_ids, bad words, logit bias, min_tokens and
    penalties applied, raw logprobs if any row asks). The caller's tensor is never changed."""
    # A batch that only takes the argmax (all greedy, nothing that changes the logits) skips the
    # copy ([B, V] floats, ~10 MB at 52 rows of a 49k vocabulary, a fresh allocation each step).
    if metadata.changes_logits:
        logits = logits.to(torch.float32, copy=True)
    else:
        logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1) if metadata.max_num_logprobs is not None else None
    apply_token_bitmask(logits, metadata)
    apply_allowed_token_ids(logits, metadata)
    apply_bad_words(logits, metadata)
    apply_logit_bias(logits, metadata)
    apply_min_tokens(logits, metadata)
    apply_penalties(logits, metadata)
    return logits, raw_logprobs


# Byte value → the additive mask of its 8 tokens: 0.0 where the bit is set (allowed), -inf where not.
_BYTE_MASKS = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def token_bitmask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float32, 0 on allowed tokens and -inf on the others, from an [R, ceil(V / 32)] int32
    bitmask (token t allowed when bit t % 32 of word t // 32 is set). Read a byte at a time through a
    256-row table: as an embedding lookup this is several times faster than shifting every bit out,
    or than a boolean masked_fill, at a batch's [64, 49152]."""
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # little-endian: byte k of a word = bits 8k..8k+7
    masks = torch.nn.functional.embedding(as_bytes, _BYTE_MASKS.to(bitmask.device))
    return masks.view(bitmask.shape[0], -1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """-inf on the tokens a constrained row's grammar does not allow next (structured outputs)."""
    if metadata.token_bitmask is None:
        return logits
    bias = token_bitmask_bias(metadata.token_bitmask, logits.shape[-1])
    rows = metadata.token_bitmask_rows
    # The rows are distinct and ascending (the model runner's order): as many as the batch means all.
    if rows.shape[0] == logits.shape[0]:
        return logits.add_(bias)
    return logits.index_add_(0, rows, bias)


def apply_allowed_token_ids(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """-inf outside allowed_token_ids, on the rows that have them."""
    if metadata.allowed_rows is not None:
        rows = metadata.allowed_rows
        logits[rows] = logits[rows].masked_fill_(metadata.disallowed_mask, float("-inf"))
    return logits


def apply_bad_words(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """-inf on the token that would complete a bad word."""
    if metadata.bad_words_rows is not None:
        logits[metadata.bad_words_rows, metadata.bad_words_token_ids] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """logit_bias added to its tokens' logits."""
    if metadata.logit_bias_rows is not None:
        logits.index_put_((metadata.logit_bias_rows, metadata.logit_bias_token_ids), metadata.logit_bias_values,
                          accumulate=True)
    return logits


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """-inf on EOS and stop ids of rows that have not yet generated min_tokens tokens."""
    if metadata.min_tokens_rows is not None:
        logits[metadata.min_tokens_rows, metadata.min_tokens_token_ids] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt or output tokens), then frequency and presence (output tokens), in place."""
    if metadata.no_penalties:
        return logits
    output_counts = count_token_ids(metadata.output_token_ids, metadata.vocab_size)
    output_seen = output_counts > 0
    if metadata.repetition_penalties is not None:
        prompt_seen = count_token_ids(metadata.prompt_token_ids, metadata.vocab_size) > 0
        apply_repetition_penalty(logits, prompt_seen | output_seen, metadata.repetition_penalties)
    if metadata.frequency_penalties is not None:
        logits -= metadata.frequency_penalties.unsqueeze(1) * output_counts
    if metadata.presence_penalties is not None:
        logits -= metadata.presence_penalties.unsqueeze(1) * output_seen
    return logits


def count_token_ids(padded_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] int64 occurrence counts of each token in each row of a [B, L] tensor padded with
    vocab_size (counted in an extra bin that is then dropped)."""
    num_rows = padded_token_ids.shape[0]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int64,
                         device=padded_token_ids.device)
    counts.scatter_add_(1, padded_token_ids, torch.ones_like(padded_token_ids))
    return counts[:, :vocab_size]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor,
                             penalties: torch.Tensor) -> torch.Tensor:
    """On seen tokens: positive logits divided by the penalty, others multiplied (CTRL / vLLM)."""
    penalties = penalties.unsqueeze(1).expand_as(logits)
    penalized = torch.where(logits > 0, logits / penalties, logits * penalties)
    return logits.copy_(torch.where(seen, penalized, logits))


def sample(logits: torch.Tensor, metadata: SamplingMetadata,
           argmax_rows: Argmax = argmax_reference) -> torch.Tensor:
    """[B] int64: argmax on greedy rows, a random draw on the others."""
    greedy = None if metadata.all_random else argmax_rows(logits)
    if metadata.all_greedy:
        return greedy
    random = sample_random(logits, metadata, argmax_rows)
    if metadata.all_random:
        return random
    return torch.where(metadata.greedy_mask, greedy, random)


# Random rows are drawn this many at a time: the filters' intermediates (a sort's values and indices,
# the softmax, the cumulative mass, the masks: ~28 bytes a logit) then stay ~45 MB at a 49k
# vocabulary, where 256 rows at once (the profile forward's batch, which sizes the KV cache) took
# 350 MB more than the step's peak without them.
RANDOM_ROWS_AT_A_TIME = 32


def sample_random(logits: torch.Tensor, metadata: SamplingMetadata,
                  argmax_rows: Argmax = argmax_reference) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p, then a draw from the softmax. Modifies `logits`."""
    drawn = []
    for start in range(0, logits.shape[0], RANDOM_ROWS_AT_A_TIME):
        rows = slice(start, start + RANDOM_ROWS_AT_A_TIME)
        seeds = {row - start: seed for row, seed in metadata.row_seeds.items()
                 if start <= row < start + RANDOM_ROWS_AT_A_TIME}
        drawn.append(sample_by_exponential_race(random_probs(logits[rows], metadata, rows), seeds, argmax_rows))
    return drawn[0] if len(drawn) == 1 else torch.cat(drawn)


def random_probs(logits: torch.Tensor, metadata: SamplingMetadata, rows: slice = slice(None)) -> torch.Tensor:
    """The distribution random rows draw from: temperature, min_p, top_k, top_p, softmax, for the
    batch's rows `rows` (which `logits` holds). Modifies `logits`; greedy rows (temperature 1, no
    filters) come out as the plain softmax."""
    logits.div_(metadata.temperature[rows].unsqueeze(1))
    if metadata.min_p is not None:
        apply_min_p(logits, metadata.min_p[rows])
    if metadata.top_k is not None or metadata.top_p is not None:
        apply_top_k_top_p(logits, None if metadata.top_k is None else metadata.top_k[rows],
                          None if metadata.top_p is None else metadata.top_p[rows])
    return logits.softmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """-inf on tokens whose probability is below min_p × the row's highest probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, float("-inf"))


# A row's top_k / top_p set is looked for among its most likely tokens before the whole vocabulary is
# sorted: torch's topk of 1024 of a 49k vocabulary takes ~0.23 ms a row where the sort took 1.8 (2 Zen 4
# cores), which made top_p sampling cost more than a batch-1 decode step of the default model.
TOP_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """-inf outside each row's top_k, then outside the smallest most-likely set holding top_p of the
    remaining mass, in place. Rows whose set lies among their TOP_CANDIDATES most likely tokens are
    filtered there; the others (top_k above it, or a flat distribution) by sorting the vocabulary."""
    if logits.shape[-1] <= TOP_CANDIDATES:
        return top_k_top_p_by_sort(logits, top_k, top_p)
    rest = (~top_k_top_p_among_candidates(logits, top_k, top_p)).nonzero().squeeze(1)
    if rest.numel() > 0:
        logits[rest] = top_k_top_p_by_sort(logits[rest], None if top_k is None else top_k[rest],
                                           None if top_p is None else top_p[rest])
    return logits


def top_k_top_p_among_candidates(logits: torch.Tensor, top_k: torch.Tensor | None,
                                 top_p: torch.Tensor | None) -> torch.Tensor:
    """The filters of apply_top_k_top_p on the rows whose kept tokens are all among their
    TOP_CANDIDATES most likely, in place (-inf below the row's smallest kept logit: ties with it
    stay); [B] bool, which rows those were. Rows without a filter count as done."""
    rows, vocab = logits.shape
    done = torch.ones(rows, dtype=torch.bool, device=logits.device)
    floor = torch.full((rows, 1), float("-inf"), dtype=logits.dtype, device=logits.device)
    filtered = None if top_p is None else top_p < 1   # the rows top_p filters
    filtering_p = filtered is not None and bool(filtered.any())
    if top_k is None and not filtering_p:
        return done   # a slice of the batch whose rows have no filter: no topk to pay for
    wanted = TOP_CANDIDATES
    if top_k is not None and not filtering_p:
        wanted = int(torch.where(top_k < vocab, top_k, 1).max().clamp(max=TOP_CANDIDATES))
    candidates = logits.topk(wanted, dim=-1).values   # descending
    if top_k is not None:
        k_within = top_k <= wanted
        done &= k_within | (top_k >= vocab)            # top_k = V: no top-k on that row
        kth = candidates.gather(1, (top_k.clamp(max=wanted) - 1).unsqueeze(1))
        floor = torch.where(k_within.unsqueeze(1), kth, floor)
    if filtering_p:
        # Each candidate's probability after top-k, and the mass of the more likely ones before it:
        # a candidate stays while that mass is below top_p (the most likely always stays).
        normalizer = logits.masked_fill(logits < floor, float("-inf")).logsumexp(dim=-1, keepdim=True)
        probs = (candidates.masked_fill(candidates < floor, float("-inf")) - normalizer).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(min=1)
        cutoff = candidates.gather(1, kept - 1)
        floor = torch.where(filtered.unsqueeze(1), torch.maximum(floor, cutoff), floor)
        # Past the candidates the mass before is at least theirs: they are all dropped once it reaches top_p.
        done &= ~filtered | (probs.sum(dim=-1) >= top_p)
    logits.masked_fill_(done.unsqueeze(1) & (logits < floor), float("-inf"))
    return done


def top_k_top_p_by_sort(logits: torch.Tensor, top_k: torch.Tensor | None,
                        top_p: torch.Tensor | None) -> torch.Tensor:
    """-inf outside each row's top_k, then outside the smallest most-likely set holding top_p of
    the remaining mass. One ascending sort serves both filters; the most likely token is last."""
    sorted_logits, sorted_ids = logits.sort(dim=-1)
    vocab_size = logits.shape[-1]
    if top_k is not None:
        # Keeps every token tied with the k-th largest logit, as vLLM does.
        kth_largest = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Mass of this token and all less likely ones; the token is dropped when the more likely
        # tokens alone already hold top_p. Written this way, top_p = 1 drops nothing with mass.
        mass_up_to_here = sorted_probs.cumsum(dim=-1)
        drop = mass_up_to_here <= 1 - top_p.unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, sorted_ids, sorted_logits)


def exponential_draws_(q: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`q` filled with Exp(1) draws, -log(1 - u) for u ~ U[0, 1): on a CPU 3.7x faster than torch's
    `exponential_` (38 -> 10.4 ms for 32 rows of a 49k vocabulary on 2 Zen 3 cores)."""
    return torch.log1p(q.uniform_(generator=generator).neg_(), out=q).neg_()


def sample_by_exponential_race(probs: torch.Tensor, row_seeds: dict[int, int],
                               argmax_rows: Argmax = argmax_reference) -> torch.Tensor:
    """argmax(probs / q) with q ~ Exp(1) draws a token with probability probs (Gumbel-max in
    disguise). Seeded rows draw q from their own generator, so their token depends only on their
    seed, output position and logits; the other rows share one batched draw. Modifies `probs`."""
    q = torch.empty_like(probs)
    if len(row_seeds) < probs.shape[0]:
        exponential_draws_(q)
    for row, seed in row_seeds.items():
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(seed)
        exponential_draws_(q[row], generator)
    # A zero draw would turn a zero probability into 0/0 = NaN, which argmax would pick.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return argmax_rows(probs.div_(q))


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor,
                    num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids [B, N+1], logprobs [B, N+1] (sampled token first, then the top N, descending)
    and the sampled token's rank [B] (1 + number of strictly more likely tokens)."""
    num_top = min(num_top, raw_logprobs.shape[-1])
    sampled = sampled.unsqueeze(1)
    sampled_logprobs = raw_logprobs.gather(1, sampled)
    top_logprobs, top_ids = raw_logprobs.topk(num_top, dim=-1)
    ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1
    return (torch.cat([sampled, top_ids], dim=1),
            torch.cat([sampled_logprobs, top_logprobs], dim=1),
            ranks)
