"""The engine's periodic stats line in the log, as vLLM's `LoggingStatLogger` prints it:

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s, Running: 12 reqs,
    Waiting: 3 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 37.5%

The front ends (`LLMEngine`, `AsyncLLM`) hand it every `SchedulerStats` the engine core reports, one
per step; at most once per interval (10 s), while there is work, it logs a line. Throughputs are the
tokens computed since the previous line over the time since it (or since work resumed after a
pause); running, waiting and KV-cache usage
are the latest step's; the prefix-cache hit rate is over every lookup since start. Off with
`--disable-log-stats` (and by default for the offline `LLM`, as in vLLM).

With several data-parallel engine cores the server logs one line per core, labelled as vLLM labels
them ("Engine 1: Avg prompt throughput: ..."); the offline `LLMEngine` logs one line for them all
(throughputs and requests summed, KV-cache usage averaged).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kestrel.config import EngineConfig
from kestrel.messages import SchedulerStats, SpecDecodingStats

logger = logging.getLogger(__name__)

LOG_STATS_INTERVAL_S = 10.0


class LoggingStatLogger:
    def __init__(self, enabled: bool = True, interval_s: float = LOG_STATS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, label: str | None = None) -> None:
        self.enabled = enabled
        self.label = label  # e.g. "Engine 1": the line starts "Engine 1: "; None: no prefix
        self.interval_s = interval_s
        self.clock = clock
        self.last_log_time = clock()
        self.prompt_tokens = 0       # since the last line
        self.generation_tokens = 0   # since the last line
        self.prefix_cache_queries = 0  # since start
        self.prefix_cache_hits = 0
        self.latest: SchedulerStats | None = None
        self.spec_decoding = SpecDecodingStats()  # since the last line

    @classmethod
    def from_config(cls, config: EngineConfig, label: str | None = None) -> LoggingStatLogger:
        return cls(enabled=not config.disable_log_stats, label=label)

    def record(self, stats: SchedulerStats) -> None:
        """Count one step's stats, and log a line if the interval has passed."""
        if not self.enabled:
            return
        if self._idle():
            # Work begins after a pause: the interval starts now, so that the pause does not dilute
            # the next line's throughputs.
            self.last_log_time = self.clock()
        self.prompt_tokens += stats.num_prompt_tokens
        self.generation_tokens += stats.num_generation_tokens
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        if stats.spec_decoding is not None:
            self.spec_decoding.add(stats.spec_decoding)
        self.latest = stats
        if self.clock() - self.last_log_time >= self.interval_s:
            self.log()

    def _idle(self) -> bool:
        """Nothing counted since the last line, and nothing running or waiting at the latest step."""
        return not (self.prompt_tokens or self.generation_tokens or (
            self.latest is not None and (self.latest.num_running_reqs or self.latest.num_waiting_reqs)))

    def log(self) -> str | None:
        """Log the line for the interval that ends now (skipped while idle) and start the next one;
        returns the line, or None when nothing was logged."""
        if not self.enabled:
            return None
        now = self.clock()
        line = self.format_line(now - self.last_log_time)
        busy = not self._idle()
        self.prompt_tokens = self.generation_tokens = 0
        self.spec_decoding = SpecDecodingStats()
        self.last_log_time = now
        if not busy:
            return None
        logger.info(line)
        return line

    def format_line(self, elapsed_s: float) -> str:
        latest = self.latest or SchedulerStats()
        elapsed_s = max(elapsed_s, 1e-9)
        hit_rate = self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        prefix = f"{self.label}: " if self.label else ""
        return (f"{prefix}Avg prompt throughput: {self.prompt_tokens / elapsed_s:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation_tokens / elapsed_s:.1f} tokens/s, "
                f"Running: {latest.num_running_reqs} reqs, Waiting: {latest.num_waiting_reqs} reqs, "
                f"KV cache usage: {100 * latest.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * hit_rate:.1f}%"
                + self.format_spec_decoding())

    def format_spec_decoding(self) -> str:
        """vLLM's figures: mean acceptance length (tokens per draft step, the sampled one included),
        accepted of drafted tokens, and the acceptance rate at each draft position."""
        s = self.spec_decoding
        if not s.num_drafts:
            return ""
        per_pos = ", ".join(f"{n / s.num_drafts:.3f}" for n in s.num_accepted_tokens_per_pos)
        return (f", Spec decode: mean acceptance length {1 + s.num_accepted_tokens / s.num_drafts:.2f}, "
                f"accepted {s.num_accepted_tokens}/{s.num_draft_tokens} draft tokens "
                f"({100 * s.num_accepted_tokens / max(s.num_draft_tokens, 1):.1f}%), per position: {per_pos}")


# vLLM's buckets of `iteration_tokens_total`: the tokens of one engine step.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class IterationTokens:
    """The histogram of tokens per engine step (prompt tokens computed plus tokens sampled), as
    vLLM's `iteration_tokens_total`, over every engine core: cumulative bucket counts, sum, count."""

    def __init__(self, buckets: tuple[int, ...] = ITERATION_TOKEN_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # per bucket (not cumulative), +Inf last
        self.sum = 0
        self.count = 0

    def record(self, stats: SchedulerStats) -> None:
        tokens = stats.num_prompt_tokens + stats.num_generation_tokens
        if stats.step is None or tokens <= 0:
            return
        self.sum += tokens
        self.count += 1
        self.counts[next((i for i, b in enumerate(self.buckets) if tokens <= b), len(self.buckets))] += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, cumulative count) per bucket, "+Inf" last, as Prometheus exposes them."""
        out, total = [], 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += n
            out.append((bound, total))
        return out
