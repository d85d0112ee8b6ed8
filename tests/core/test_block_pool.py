"""Unit tests of the KV block pool (kestrel.core.block_pool): no model needed."""

from __future__ import annotations

import pytest

from kestrel.core.block_pool import NULL_BLOCK_ID, BlockPool, hash_block_tokens


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.free_queue.keys())


def test_rejects_pool_without_room_for_null_block():
    with pytest.raises(ValueError):
        BlockPool(1)
    BlockPool(2).check_invariants()


def test_fresh_pool_state():
    pool = BlockPool(8)
    pool.check_invariants({})
    assert pool.num_free_blocks == 7
    assert pool.usage == 0.0
    assert NULL_BLOCK_ID not in pool.free_queue
    assert pool.null_block.ref_cnt == 1
    assert free_order(pool) == list(range(1, 8))


def test_allocate_and_free_ref_counts():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    assert ids(a) == [1, 2]
    assert all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 3
    assert pool.usage == pytest.approx(2 / 5)
    pool.check_invariants({1: 1, 2: 1})

    # A second holder (a prefix hit) takes another reference.
    pool.touch(a)
    assert [b.ref_cnt for b in a] == [2, 2]
    assert pool.num_free_blocks == 3
    pool.check_invariants({1: 2, 2: 2})

    pool.free_blocks(reversed(a))
    assert [b.ref_cnt for b in a] == [1, 1]
    assert pool.num_free_blocks == 3  # still held once: not free
    pool.check_invariants({1: 1, 2: 1})

    pool.free_blocks(reversed(a))
    assert [b.ref_cnt for b in a] == [0, 0]
    assert pool.num_free_blocks == 5
    assert pool.usage == 0.0
    pool.check_invariants({})


def test_asking_for_too_many_blocks_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(2)
    before = free_order(pool)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    assert free_order(pool) == before
    pool.check_invariants({1: 1, 2: 1})


def test_null_block_never_handed_out_and_never_freed():
    pool = BlockPool(5)
    for _ in range(3):
        blocks = pool.get_new_blocks(4)
        assert NULL_BLOCK_ID not in ids(blocks)
        assert pool.num_free_blocks == 0
        with pytest.raises(RuntimeError):
            pool.get_new_blocks(1)
        # Freeing the null block (e.g. a padded block table) is a no-op.
        pool.free_blocks([pool.null_block, *reversed(blocks), pool.null_block])
        assert pool.null_block.ref_cnt == 1
        assert NULL_BLOCK_ID not in pool.free_queue
        pool.check_invariants({})
    assert pool.null_block.block_hash is None


def test_freed_blocks_join_tail_and_request_blocks_are_evicted_tail_first():
    pool = BlockPool(8)
    req_a = pool.get_new_blocks(3)   # 1, 2, 3
    req_b = pool.get_new_blocks(2)   # 4, 5
    assert ids(req_a) == [1, 2, 3] and ids(req_b) == [4, 5]
    assert free_order(pool) == [6, 7]

    # Free a request's blocks the way the KV manager does: tail first.
    pool.free_blocks(reversed(req_b))
    assert free_order(pool) == [6, 7, 5, 4]
    pool.free_blocks(reversed(req_a))
    assert free_order(pool) == [6, 7, 5, 4, 3, 2, 1]
    pool.check_invariants({})

    # LRU: never-used blocks first, then b's later block before its earlier one, then a's.
    assert ids(pool.get_new_blocks(1)) == [6]
    assert ids(pool.get_new_blocks(3)) == [7, 5, 4]
    assert ids(pool.get_new_blocks(3)) == [3, 2, 1]
    pool.check_invariants({b: 1 for b in range(1, 8)})


def test_chained_hash():
    toks = [1, 2, 3, 4]
    h_root = hash_block_tokens(None, toks)
    assert h_root == hash_block_tokens(None, list(toks))  # deterministic
    assert len(h_root) == 32
    parent_a = hash_block_tokens(None, [9, 9, 9, 9])
    parent_b = hash_block_tokens(None, [8, 8, 8, 8])
    ha = hash_block_tokens(parent_a, toks)
    hb = hash_block_tokens(parent_b, toks)
    assert ha != hb, "same tokens under different parents must hash differently"
    assert ha != h_root
    assert hash_block_tokens(parent_a, [1, 2, 3, 5]) != ha
    assert hash_block_tokens(parent_a, toks, b"lora-1") != ha
    assert hash_block_tokens(parent_a, toks, b"lora-1") != hash_block_tokens(parent_a, toks, b"lora-2")
    # Token ids are encoded at full width: large ids must not collide with small ones.
    assert hash_block_tokens(None, [256, 0]) != hash_block_tokens(None, [0, 1])
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])


def test_cache_full_block_and_lookup():
    pool = BlockPool(6)
    h1 = hash_block_tokens(None, [1, 2])
    h2 = hash_block_tokens(h1, [3, 4])
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_block(b1, h1)
    pool.cache_full_block(b2, h2)
    assert pool.get_cached_block(h1) is b1
    assert pool.get_cached_block(h2) is b2
    assert pool.get_cached_block(hash_block_tokens(None, [3, 4])) is None
    pool.check_invariants({1: 1, 2: 1})

    # Caching an already-hashed block again is a no-op.
    pool.cache_full_block(b1, h2)
    assert b1.block_hash == h1 and pool.get_cached_block(h2) is b2

    # A second block with the same content does not replace the index entry.
    (b3,) = pool.get_new_blocks(1)
    pool.cache_full_block(b3, h1)
    assert pool.get_cached_block(h1) is b1
    assert b3.block_hash is None
    pool.check_invariants({1: 1, 2: 1, 3: 1})


def test_freed_cached_blocks_stay_hashed_and_touch_revives_them():
    pool = BlockPool(6)
    h1 = hash_block_tokens(None, [1, 2])
    h2 = hash_block_tokens(h1, [3, 4])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_block(blocks[0], h1)
    pool.cache_full_block(blocks[1], h2)
    pool.free_blocks(reversed(blocks))
    pool.check_invariants({})
    assert pool.num_free_blocks == 5
    # Free but still cached.
    assert pool.get_cached_block(h1) is blocks[0]
    assert pool.get_cached_block(h2) is blocks[1]
    assert free_order(pool) == [3, 4, 5, 2, 1]

    # A prefix hit revives both: they leave the free queue.
    hits = [pool.get_cached_block(h1), pool.get_cached_block(h2)]
    pool.touch(hits)
    assert [b.ref_cnt for b in hits] == [1, 1]
    assert 1 not in pool.free_queue and 2 not in pool.free_queue
    assert pool.num_free_blocks == 3
    assert free_order(pool) == [3, 4, 5]
    pool.check_invariants({1: 1, 2: 1})
    # New allocations cannot take the revived blocks.
    assert ids(pool.get_new_blocks(3)) == [3, 4, 5]
    pool.check_invariants({b: 1 for b in range(1, 6)})


def test_evicting_a_cached_block_removes_its_hash():
    pool = BlockPool(4)
    h1 = hash_block_tokens(None, [1, 2])
    h2 = hash_block_tokens(h1, [3, 4])
    a = pool.get_new_blocks(2)  # blocks 1, 2
    pool.cache_full_block(a[0], h1)
    pool.cache_full_block(a[1], h2)
    pool.free_blocks(reversed(a))
    assert free_order(pool) == [3, 2, 1]

    # Block 3 (never used) goes first and evicts nothing.
    pool.get_new_blocks(1)
    assert pool.get_cached_block(h1) is a[0] and pool.get_cached_block(h2) is a[1]
    # Next is block 2, the later block of the prefix: its hash goes, the earlier one stays.
    (b,) = pool.get_new_blocks(1)
    assert b is a[1]
    assert b.block_hash is None
    assert pool.get_cached_block(h2) is None
    assert pool.get_cached_block(h1) is a[0]
    assert h2 not in pool.cached_blocks
    pool.check_invariants({2: 1, 3: 1})


def test_caching_disabled_never_hashes_or_hits():
    pool = BlockPool(4, enable_caching=False)
    h = hash_block_tokens(None, [1])
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, h)
    assert b.block_hash is None
    assert pool.get_cached_block(h) is None
    assert pool.cached_blocks == {}
    pool.check_invariants({1: 1})


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4)
    h = hash_block_tokens(None, [1])
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, h)
    assert pool.reset_prefix_cache() is False  # a block is in use
    assert pool.get_cached_block(h) is b
    pool.free_blocks([b])
    assert pool.get_cached_block(h) is b
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h) is None and b.block_hash is None
    assert pool.cached_blocks == {}
    pool.check_invariants({})


def test_reset_prefix_cache_hands_out_blocks_in_id_order_again():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)   # 1, 2, 3
    b = pool.get_new_blocks(2)   # 4, 5
    pool.cache_full_block(a[0], hash_block_tokens(None, [1]))
    pool.free_blocks(reversed(b))
    pool.free_blocks(reversed(a))
    assert free_order(pool) == [6, 7, 5, 4, 3, 2, 1]
    assert pool.reset_prefix_cache() is True
    assert free_order(pool) == [1, 2, 3, 4, 5, 6, 7]
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    pool.check_invariants({1: 1, 2: 1, 3: 1})


def test_invariants_hold_through_a_random_sequence():
    import random

    rng = random.Random(0)
    pool = BlockPool(17)
    held: dict[int, list] = {}  # owner -> blocks
    parent = None
    for step in range(400):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            n = rng.randint(1, min(3, pool.num_free_blocks))
            blocks = pool.get_new_blocks(n)
            for blk in blocks:
                if rng.random() < 0.5:
                    parent = hash_block_tokens(parent, [step, blk.block_id])
                    pool.cache_full_block(blk, parent)
            held[step] = blocks
        elif op < 0.6 and pool.cached_blocks:
            blk = rng.choice(list(pool.cached_blocks.values()))
            pool.touch([blk])
            held[step] = [blk]
        elif held:
            owner = rng.choice(list(held))
            pool.free_blocks(reversed(held.pop(owner)))
        refs: dict[int, int] = {}
        for blocks in held.values():
            for blk in blocks:
                refs[blk.block_id] = refs.get(blk.block_id, 0) + 1
        pool.check_invariants(refs)
    for owner in list(held):
        pool.free_blocks(reversed(held.pop(owner)))
    pool.check_invariants({})
    assert pool.num_free_blocks == 16


# ---- check_invariants must catch corruption ----------------------------------------------------


def _pool_with_state():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_block(blocks[0], h)
    pool.free_blocks([blocks[2]])
    pool.check_invariants({1: 1, 2: 1})
    return pool, blocks, h


def test_invariants_catch_wrong_expected_refs():
    pool, blocks, _ = _pool_with_state()
    with pytest.raises(AssertionError):
        pool.check_invariants({1: 1})  # block 2 held but no request claims it (a leak)
    with pytest.raises(AssertionError):
        pool.check_invariants({1: 2, 2: 1})
    with pytest.raises(AssertionError):
        pool.check_invariants({1: 1, 2: 1, 3: 1})  # block 3 is free


@pytest.mark.parametrize("corruption", [
    "ref_without_dequeue", "free_without_enqueue", "null_in_queue", "null_freed",
    "hash_not_indexed", "index_points_elsewhere", "negative_ref", "null_hashed",
])
def test_invariants_catch_corruption(corruption):
    pool, blocks, h = _pool_with_state()
    b_used, b_free = blocks[1], blocks[2]
    if corruption == "ref_without_dequeue":
        b_free.ref_cnt = 1
    elif corruption == "free_without_enqueue":
        b_used.ref_cnt = 0
    elif corruption == "null_in_queue":
        pool.free_queue[NULL_BLOCK_ID] = pool.null_block
    elif corruption == "null_freed":
        pool.null_block.ref_cnt = 0
    elif corruption == "hash_not_indexed":
        b_used.block_hash = hash_block_tokens(None, [7])
    elif corruption == "index_points_elsewhere":
        pool.cached_blocks[h] = b_used
    elif corruption == "negative_ref":
        del pool.free_queue[b_free.block_id]
        b_free.ref_cnt = -1
    elif corruption == "null_hashed":
        pool.null_block.block_hash = h
    with pytest.raises(AssertionError):
        pool.check_invariants()
