"""The pool of KV-cache blocks: reference counts, the LRU free queue and the prefix-cache index.

Invariants (checked by `check_invariants`):
- block 0 is the null block: never handed out, never freed, never cached;
- a block is in the free queue iff its ref_cnt is 0;
- a block with a hash is in the hash index (free-but-cached blocks stay hashed until reused);
- every block other than the null block is either free or referenced.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

NULL_BLOCK_ID = 0
BlockHash = bytes


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: bytes = b"") -> BlockHash:
    """Chained hash of one full block: equal hashes mean equal token prefixes (sha256, so a
    collision cannot hand one request another's KV)."""
    h = hashlib.sha256()
    h.update(parent_hash or b"\0" * 32)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_keys)
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # permanently held, so it can never enter the free queue
        # Free blocks in eviction order: the head is taken first. OrderedDict gives O(1) removal of
        # a cached block from the middle when a prefix hit revives it.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    # ---- queries -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (free-but-cached blocks count as free)."""
        usable = self.num_blocks - 1
        return (usable - self.num_free_blocks) / usable

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash) if self.enable_caching else None

    # ---- allocation --------------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with only {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict_from_cache(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving blocks that were free-but-cached."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block. Pass a request's blocks tail first: blocks that
        reach zero join the queue's tail in that order, so a prefix's later blocks (shared by fewer
        requests) are evicted before its earlier ones."""
        for block in blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        # If another block already holds this content, keep the older one as the index entry.
        if block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def _evict_from_cache(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no request holds a block. With no content
        left to keep, the free queue goes back to block-id order, as at start: the blocks handed
        out next are the ones used first (on CPU the pool's pages are mapped and zeroed as they are
        first written, so a queue left in LRU order would hand out never-touched memory, page fault
        after page fault, until the whole pool had been used once), in runs of consecutive ids."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks[1:]:
            self._evict_from_cache(block)
        self.free_queue = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        return True

    # ---- checks ------------------------------------------------------------------------------

    def check_invariants(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError if the pool is inconsistent. `expected_refs` (block id → number of
        requests holding it) lets the caller check that no block is referenced by a finished
        request."""
        assert self.null_block.ref_cnt == 1 and NULL_BLOCK_ID not in self.free_queue
        assert self.null_block.block_hash is None
        for block in self.blocks[1:]:
            in_queue = block.block_id in self.free_queue
            assert block.ref_cnt >= 0, block
            assert in_queue == (block.ref_cnt == 0), block
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) is block, block
            if expected_refs is not None:
                assert block.ref_cnt == expected_refs.get(block.block_id, 0), (
                    f"{block} has {block.ref_cnt} references, requests hold {expected_refs.get(block.block_id, 0)}")
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, block
        free = self.num_free_blocks
        used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        assert free + used == self.num_blocks - 1, (free, used, self.num_blocks)
