"""Structured outputs in the engine core: grammars compiled with xgrammar off the step loop, a matcher
per constrained request, and each step's token bitmask for the worker to apply to the logits.

Invariants:
- A constrained request is admitted only once its grammar is compiled (`is_ready`); until then it
  keeps its place in the waiting queue and the others pass it. Compiling runs on one thread of its own,
  so a slow schema never stalls a step; compiled grammars are cached by (kind, text).
- A request's matcher has accepted exactly its output tokens, in order. Draft tokens are checked
  against it (and cut at the first it refuses) but never left in it; a preempted request keeps its
  output tokens, and so its matcher as it is.
- Bitmask layout (xgrammar's): int32 words, ceil(V / 32) per row; token t is allowed when bit t % 32 of
  word t // 32 is set. A constrained request that samples gets one row per sampled position (1 + its
  drafts), its rows consecutive; rows of a matcher that has terminated allow every token.
- Output bytes are UTF-8 that Python decodes as the grammar read them. xgrammar 0.2.9 refuses an
  overlong E0 80 but after ED accepts A0-BF (a UTF-16 surrogate, three U+FFFD once decoded, which
  broke a JSON string's maxLength). After a token that ends on a lead byte whose
  first continuation is narrower than 80-BF (E0, ED, F0, F4), a row also allows only the tokens that
  start inside that range (`Utf8Continuations`), and no row allows a token that holds an invalid
  sequence inside it (the default model's vocabulary has none).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kestrel.core.request import Request
from kestrel.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (a request repeating a schema skips compiling).
MAX_CACHED_GRAMMARS = 512


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - make install always installs it
        raise ValueError("structured outputs need xgrammar: pip install --no-deps xgrammar==0.2.9") from exc
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    if not choices:
        raise ValueError("structured_outputs.choice must list at least one string")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem if xgrammar cannot read the constraint (without the
    tokenizer: cheap enough for the front end to run before queuing the request)."""
    kind, spec = params.kind_and_spec()
    xgr = _xgrammar()
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(params.choice))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"structured_outputs.{kind} is not valid: {_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    # xgrammar prefixes its messages with a timestamp and a source location.
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.splitlines()[0] if text else type(exc).__name__


class RequestGrammar:
    """One request's constraint: its compiled grammar (a future until ready), then its matcher."""

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled
        self.matcher: Any = None

    def accept(self, token_ids: list[int]) -> None:
        for token in token_ids:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(token):
                # Only possible when the mask did not apply (a token the mask allowed always fits).
                logger.warning("structured outputs: token %d does not fit the grammar", token)
                return

    def valid_prefix(self, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar accepts; the matcher is left as it was."""
        accepted = 0
        for token in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return drafts[:accepted]


# Lead bytes whose first continuation byte is narrower than 80-BF (RFC 3629): the range it must lie in.
NARROW_LEADS = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


class Utf8Continuations:
    """For each lead byte of NARROW_LEADS, the bitmask row of the tokens that may follow a token ending
    on it (those whose bytes start inside its continuation range); each token's last byte; and, where
    the vocabulary has any, the row without the tokens that hold an invalid sequence inside them
    (`holds_invalid_utf8`), which no constrained output takes."""

    def __init__(self, token_bytes: list[bytes], bitmask_width: int) -> None:
        self.bitmask_width = bitmask_width
        first = torch.tensor([b[0] if b else -1 for b in token_bytes], dtype=torch.int32)
        self.last_byte = [b[-1] if b else -1 for b in token_bytes]
        self.allowed_after = {lead: self._row((first >= low) & (first <= high))
                              for lead, (low, high) in NARROW_LEADS.items()}
        invalid = torch.tensor([holds_invalid_utf8(b) for b in token_bytes], dtype=torch.bool)
        self.valid: torch.Tensor | None = self._row(~invalid) if bool(invalid.any()) else None

    def _row(self, allowed: torch.Tensor) -> torch.Tensor:
        """A bitmask row (int32 words) allowing the tokens where `allowed` [len(vocab)] is true."""
        bits = torch.zeros(self.bitmask_width * 32, dtype=torch.int64)
        bits[: len(allowed)] = allowed.to(torch.int64)
        words = (bits.view(self.bitmask_width, 32) << torch.arange(32)).sum(dim=1)
        return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    def restrict(self, row: torch.Tensor, previous_token: int | None) -> None:
        """Narrow `row` (one bitmask row) to what may follow `previous_token`."""
        if self.valid is not None:
            row &= self.valid
        if previous_token is None or not 0 <= previous_token < len(self.last_byte):
            return
        allowed = self.allowed_after.get(self.last_byte[previous_token])
        if allowed is not None:
            row &= allowed


def holds_invalid_utf8(token: bytes) -> bool:
    """Whether a token's bytes hold a sequence that no UTF-8 text contains (a surrogate, an overlong
    form, a stray lead byte), apart from its edges: continuation bytes at its start may end the previous
    token's character and a lead byte at its end may start the next one's."""
    start = 0
    while start < len(token) and 0x80 <= token[start] <= 0xBF:
        start += 1
    if start > 3:  # a character has at most three
        return True
    try:
        token[start:].decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.reason != "unexpected end of data"
    return False


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_id: int | None) -> None:
        self.vocab_size = vocab_size
        self.bitmask_width = (vocab_size + 31) // 32
        self._load_tokenizer = load_tokenizer
        self._eos_token_id = eos_token_id
        self._compiler: Any = None
        self._utf8: Utf8Continuations | None = None   # with the compiler
        self._executor: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()

    # ---- compiling ------------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Start compiling the request's grammar (or reuse a cached one)."""
        params = request.sampling_params.structured_outputs
        key = params.kind_and_spec()
        future = self._cache.get(key)
        if future is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kestrel-grammar")
            future = self._executor.submit(self._compile, params)
            self._cache[key] = future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        request.grammar = RequestGrammar(future)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        kind, spec = params.kind_and_spec()
        if kind == "json":
            # Without free whitespace: a small model left to choose its own can loop on newlines.
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(params.choice))
        return compiler.compile_grammar(spec)

    def _get_compiler(self) -> Any:
        """The compiler over the model's tokenizer, built on first use (on the compile thread)."""
        if self._compiler is None:
            xgr = _xgrammar()
            tokenizer = self._load_tokenizer()
            stop = sorted({t for t in (tokenizer.eos_token_id, self._eos_token_id) if t is not None})
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=stop or None)
            self._utf8 = Utf8Continuations(info.decoded_vocab, self.bitmask_width)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def is_ready(self, request: Request) -> bool:
        """Whether the request's grammar is compiled (its matcher made). Raises ValueError when it
        failed to compile."""
        grammar = request.grammar
        if grammar.matcher is not None:
            return True
        if not grammar.compiled.done():
            return False
        try:
            compiled = grammar.compiled.result()
        except Exception as exc:
            raise ValueError(f"structured outputs: the grammar did not compile: {_first_line(exc)}") from None
        grammar.matcher = _xgrammar().GrammarMatcher(compiled)
        grammar.accept(request.output_token_ids)  # resumed from a preemption, or given output ids
        return True

    # ---- each step ------------------------------------------------------------------------------

    def bitmask(self, rows: list[tuple[Request, list[int]]]) -> tuple[bytes, dict[str, int]]:
        """Rows for the constrained requests that sample this step, each with its drafts: (the bitmask
        as bytes, request id → its first row)."""
        total = sum(1 + len(drafts) for _, drafts in rows)
        bitmask = torch.full((total, self.bitmask_width), -1, dtype=torch.int32)
        first_rows: dict[str, int] = {}
        row = 0
        for request, drafts in rows:
            first_rows[request.request_id] = row
            matcher = request.grammar.matcher
            accepted = 0
            last = request.output_token_ids[-1] if request.output_token_ids else None
            previous = [last, *drafts]   # the token before each row's position
            for j in range(len(drafts) + 1):
                if not matcher.is_terminated():
                    matcher.fill_next_token_bitmask(bitmask, row + j)
                    if self._utf8 is not None:
                        self._utf8.restrict(bitmask[row + j], previous[j])
                if j < len(drafts) and matcher.accept_token(drafts[j]):
                    accepted += 1
            if accepted:
                matcher.rollback(accepted)
            row += 1 + len(drafts)
        return bitmask.numpy().tobytes(), first_rows

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
