"""Grants and frees KV blocks for requests, and finds their prefix-cache hits.

A request holds one block table per KV-cache group (kestrel.config.KVCacheGroups: the model's layers
grouped by attention type), all from the one pool; entry i of a group's table holds the group's K and
V of positions [i * block_size, (i + 1) * block_size). A sliding-window group lets go of the blocks
that fall wholly out of its window, keeping the null block in their entries (never read: attention
over a window starts inside it), so that a long request holds about W tokens of it; a full-attention
group keeps every block. A model of one type has one group, and everything here reduces to one table.

Prefix cache: a full block is registered per group under its chained token hash (and the group's
number), so that a hit is a run of leading positions that every full group has, whose last window's
blocks every sliding group has too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from kestrel.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from kestrel.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """A block's prefix-cache key in `group` (group 0's is the token hash itself)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 windows: Sequence[int | None] = (None,)) -> None:
        """`windows`: per KV-cache group, its sliding window (None: full attention)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = tuple(windows)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.null_block = self.pool.null_block
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}   # per request, per group
        # How many leading block positions of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Per request, per group: the leading entries already let go of (out of the window).
        self.num_released: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0  # tokens looked up since the last take_prefix_cache_stats
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table of each group (the null block 0 where a window let go)."""
        groups = self.req_to_blocks.get(request_id)
        if groups is None:
            return [[] for _ in self.windows]
        return [[b.block_id for b in blocks] for blocks in groups]

    def first_needed_block(self, num_computed: int, window: int | None) -> int:
        """The first block a group still needs once `num_computed` tokens are computed: the next token
        (at position num_computed) sees keys from num_computed - window + 1 on."""
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """The longest run of cached full blocks that prefixes the request's tokens (per group: the
        blocks, the null block before a window), and how many tokens they hold. The last token is never
        a hit: its logits are needed to sample."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [[] for _ in self.windows], 0
        self._update_block_hashes(request)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        n = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:
                k = 0
                while k < n and self.pool.get_cached_block(group_hash(hashes[k], g)) is not None:
                    k += 1
                n = k
        while n > 0 and not all(self._window_cached(hashes, n, g) for g, w in enumerate(self.windows)
                                if w is not None):
            n -= 1
        hits = []
        for g, window in enumerate(self.windows):
            first = self.first_needed_block(n * self.block_size, window)
            hits.append([self.null_block] * first
                        + [self.pool.get_cached_block(group_hash(hashes[i], g)) for i in range(first, n)])
        return hits, n * self.block_size

    def _window_cached(self, hashes: list[BlockHash], n: int, group: int) -> bool:
        """Whether sliding group `group` has cached the blocks a token at position n * block_size sees."""
        first = self.first_needed_block(n * self.block_size, self.windows[group])
        return all(self.pool.get_cached_block(group_hash(hashes[i], group)) is not None for i in range(first, n))

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once its request is admitted (a request that waits is looked up again)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[list[KVCacheBlock]] | None = None,
                       num_lookahead_tokens: int = 0) -> list[list[KVCacheBlock]] | None:
        """Give the request room for `num_new_tokens` more tokens after its computed ones (and after
        `new_computed_blocks`, its prefix-cache hits being taken now, per group), and for
        `num_lookahead_tokens` after those (a draft model's guesses, written before they are known;
        never hashed). Returns each group's new table entries (the null block for positions a window
        has passed), or None when the pool cannot supply them: then nothing changed but the blocks
        that fell out of a window, which the request never needs again."""
        rid, bs = request.request_id, self.block_size
        hits = new_computed_blocks or [[] for _ in self.windows]
        groups = self.req_to_blocks.get(rid)
        num_computed = request.num_computed_tokens + len(hits[0]) * bs
        if groups is not None:
            self._release_out_of_window(rid, groups, num_computed)
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, bs)
        shapes = []   # per group: (null entries, new blocks)
        for g, window in enumerate(self.windows):
            have = (len(groups[g]) if groups is not None else 0) + len(hits[g])
            fresh = max(0, num_required - have)
            nulls = min(fresh, max(0, self.first_needed_block(num_computed, window) - have))
            shapes.append((nulls, fresh - nulls))
        # Hits that sit in the free queue stop being free once taken.
        hit_blocks = [b for group in hits for b in group if b is not self.null_block]
        num_revived = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if sum(new for _, new in shapes) > self.pool.num_free_blocks - num_revived:
            return None
        if groups is None:
            groups = self.req_to_blocks[rid] = [[] for _ in self.windows]
            self.num_released[rid] = [0] * len(self.windows)
        self.pool.touch(hit_blocks)
        added = []
        for g, (nulls, new) in enumerate(shapes):
            entries = [self.null_block] * nulls + self.pool.get_new_blocks(new)
            groups[g].extend(hits[g])
            groups[g].extend(entries)
            added.append(entries)
            if hits[g] or nulls:   # hits and nulls before the window: already let go of
                self.num_released[rid][g] = max(self.num_released[rid][g],
                                                self.first_needed_block(num_computed, self.windows[g]))
        if self.enable_caching:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return added

    def _release_out_of_window(self, rid: str, groups: list[list[KVCacheBlock]], num_computed: int) -> None:
        """Free each sliding group's blocks that no token from `num_computed` on sees (their entries
        become the null block). They stay in the prefix cache until the pool reuses them."""
        released = self.num_released[rid]
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            blocks = groups[g]
            first = min(self.first_needed_block(num_computed, window), len(blocks))
            if first <= released[g]:
                continue
            gone = [b for b in blocks[released[g]:first] if b is not self.null_block]
            self.pool.free_blocks(reversed(gone))
            blocks[released[g]:first] = [self.null_block] * (first - released[g])
            released[g] = first

    def free(self, request: Request) -> None:
        groups = self.req_to_blocks.pop(request.request_id, None) or []
        for blocks in groups:
            self.pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_released.pop(request.request_id, None)

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        stats = (self.prefix_cache_queries, self.prefix_cache_hits)
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        refs: dict[int, int] = defaultdict(int)
        for groups in self.req_to_blocks.values():
            assert len(groups) == len(self.windows)
            assert len({len(blocks) for blocks in groups}) == 1, "the groups' tables differ in length"
            for blocks in groups:
                for block in blocks:
                    if block is not self.null_block:
                        refs[block.block_id] += 1
        self.pool.check_invariants(dict(refs))

    def _update_block_hashes(self, request: Request) -> None:
        hashes, bs = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs]))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that will be full once `num_tokens` tokens are computed, in each group
        (not the null entries a window has passed)."""
        self._update_block_hashes(request)
        groups = self.req_to_blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self.num_cached_blocks.get(request.request_id, 0)
        for g, blocks in enumerate(groups):
            for i in range(start, num_full):
                if blocks[i] is not self.null_block:
                    self.pool.cache_full_block(blocks[i], group_hash(request.block_hashes[i], g))
        self.num_cached_blocks[request.request_id] = max(start, num_full)
