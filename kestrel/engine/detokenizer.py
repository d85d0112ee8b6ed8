"""Incremental detokenization and stop strings, per request, in the front end."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from kestrel.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Appends token ids and yields the text they add. Text that could still become a stop string
    is held back, so a stop string is never emitted, not even in part."""

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self._backend = getattr(tokenizer, "_tokenizer", None) or tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""            # all decoded text so far (up to and excluding a stop string)
        self._emitted = 0         # how much of `text` has been handed out
        self.stop_reason: str | None = None
        # Tokens of the last `update` that were decoded: those after the one that completed a stop
        # string are not (several arrive at once from speculative decoding).
        self.num_consumed = 0

    def update(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the newly releasable text. Sets `stop_reason` on a stop string."""
        self.num_consumed = 0
        for token_id in token_ids:
            if self.stop_reason is not None:
                break
            self.num_consumed += 1
            chunk = self._stream.step(self._backend, token_id)
            if chunk:
                self._append(chunk)
        return self._release(final=self.stop_reason is not None)

    def flush(self) -> str:
        """At the end of a request: whatever was held back."""
        return self._release(final=True)

    def _append(self, chunk: str) -> None:
        search_from = max(0, len(self.text) - self._hold)
        self.text += chunk
        found = [(idx, stop) for stop in self.stop if (idx := self.text.find(stop, search_from)) != -1]
        if found:
            idx, stop = min(found)
            self.text = self.text[:idx + len(stop) if self.include_stop else idx]
            self.stop_reason = stop

    def _release(self, final: bool) -> str:
        limit = len(self.text) if final or not self.stop else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted:limit]
        self._emitted = limit
        return out
