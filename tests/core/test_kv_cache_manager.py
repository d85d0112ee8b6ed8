"""Unit tests of the KV cache manager (kestrel.core.kv_cache_manager): no model needed."""

from __future__ import annotations

import pytest

from kestrel.core.kv_cache_manager import KVCacheManager
from kestrel.core.request import Request
from kestrel.sampling_params import SamplingParams

BS = 16


def make_request(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, list(tokens), SamplingParams(**params), eos_token_id=None)


def prefill(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit a request the way the scheduler does (prefix lookup, allocate, advance) and return
    its block ids; asserts that the allocation succeeded."""
    hits, num_hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - num_hit, hits)
    assert new is not None
    kv.record_prefix_lookup(req.num_tokens, num_hit)
    req.num_computed_tokens = req.num_tokens
    kv.check_invariants()
    return kv.get_block_ids(req.request_id)[0]


def decode_step(kv: KVCacheManager, req: Request, token: int = 7):
    """Sample one token, then allocate room to compute it."""
    req.append_output_token_ids([token])
    new = kv.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    kv.check_invariants()
    return new


@pytest.mark.parametrize("n,blocks", [(1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3), (100, 7)])
def test_prompt_needs_ceil_blocks(n, blocks):
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("r", range(1000, 1000 + n))
    new = kv.allocate_slots(req, n)
    assert new is not None and len(new[0]) == blocks
    assert len(kv.get_block_ids("r")[0]) == blocks
    assert 0 not in kv.get_block_ids("r")[0]
    assert kv.pool.num_free_blocks == 9 - blocks
    kv.check_invariants()


def test_allocation_fails_without_changing_anything():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    a = make_request("a", range(40))  # 3 blocks
    prefill(kv, a)
    free_before = list(kv.pool.free_queue)
    b = make_request("b", range(100, 140))  # needs 3, only 1 free
    assert kv.allocate_slots(b, 40) is None
    assert kv.pool.num_free_blocks == 1
    assert list(kv.pool.free_queue) == free_before
    assert "b" not in kv.req_to_blocks
    assert kv.get_block_ids("b")[0] == []
    kv.check_invariants()
    # Exactly enough still works.
    c = make_request("c", range(200, 216))
    assert len(kv.allocate_slots(c, 16)[0]) == 1
    assert kv.pool.num_free_blocks == 0
    kv.check_invariants()


def test_failed_growth_keeps_existing_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=4)  # 2 usable blocks of 4
    a = make_request("a", [1, 2, 3, 4])
    b = make_request("b", [5, 6, 7, 8])
    prefill(kv, a)
    prefill(kv, b)
    a.append_output_token_ids([9])
    assert kv.allocate_slots(a, 1) is None
    assert kv.get_block_ids("a")[0] == [1]
    kv.check_invariants()


def test_chunked_prefill_allocation_grows_per_chunk():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("r", range(50))  # 4 blocks in all
    assert len(kv.allocate_slots(req, 20)[0]) == 2
    req.num_computed_tokens = 20
    assert len(kv.allocate_slots(req, 12)[0]) == 0  # 32 tokens: still 2 blocks
    req.num_computed_tokens = 32
    assert len(kv.allocate_slots(req, 18)[0]) == 2
    req.num_computed_tokens = 50
    assert len(kv.get_block_ids("r")[0]) == 4
    kv.check_invariants()


def test_decode_allocates_only_at_block_boundary():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("r", [1, 2, 3, 4, 5, 6])  # 2 blocks, 6 tokens
    assert len(prefill(kv, req)) == 2
    grew_at = []
    for _ in range(10):
        new = decode_step(kv, req)
        assert new is not None
        if new[0]:
            assert len(new[0]) == 1
            grew_at.append(req.num_tokens)
    # Tokens 9 and 13 start new blocks (block size 4); nothing else allocates.
    assert grew_at == [9, 13]
    assert len(kv.get_block_ids("r")[0]) == 4 == -(-req.num_tokens // 4)


def test_prefix_hit_two_full_blocks():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(1, 41))  # 40 tokens: 2 full blocks + 8
    a = make_request("a", prompt)
    a_blocks = prefill(kv, a)
    b = make_request("b", prompt[:32] + [999] * 5)
    (hits,), num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32
    assert [h.block_id for h in hits] == a_blocks[:2]
    b_blocks = prefill(kv, b)
    assert b_blocks[:2] == a_blocks[:2]
    assert b_blocks[2] not in a_blocks
    assert [kv.pool.blocks[i].ref_cnt for i in a_blocks[:2]] == [2, 2]
    assert kv.take_prefix_cache_stats() == (40 + 37, 32)
    assert kv.take_prefix_cache_stats() == (0, 0)  # taking resets


def test_prompt_exactly_two_blocks_hits_only_one():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(1, 33))  # exactly 32
    prefill(kv, make_request("a", prompt))
    b = make_request("b", prompt)
    (hits,), num_hit = kv.get_computed_blocks(b)
    assert len(hits) == 1 and num_hit == 16  # the last token must be recomputed
    # 33 tokens with the same 32-token prefix: both blocks hit.
    c = make_request("c", prompt + [5])
    assert kv.get_computed_blocks(c)[1] == 32


def test_different_first_block_means_no_hit_for_later_blocks():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(1, 41))
    prefill(kv, make_request("a", prompt))
    # Same second block, different first: chained hashes differ, no hits at all.
    b = make_request("b", [0] * 16 + prompt[16:])
    assert kv.get_computed_blocks(b) == ([[]], 0)
    # Same first block only: one hit.
    c = make_request("c", prompt[:16] + [0] * 24)
    assert kv.get_computed_blocks(c)[1] == 16


def test_prompt_logprobs_disable_prefix_hits():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(1, 41))
    prefill(kv, make_request("a", prompt))
    b = make_request("b", prompt, prompt_logprobs=1)
    assert kv.get_computed_blocks(b) == ([[]], 0)


def test_hits_survive_free_until_evicted():
    kv = KVCacheManager(num_blocks=7, block_size=BS)  # 6 usable
    prompt = list(range(1, 41))  # 3 blocks
    a = make_request("a", prompt)
    a_blocks = prefill(kv, a)
    kv.free(a)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == 6
    # Freed but cached: still hits.
    b = make_request("b", prompt)
    (hits,), num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32 and [h.block_id for h in hits] == a_blocks[:2]
    b_blocks = prefill(kv, b)  # revives the 2 hits, takes 1 fresh block
    assert b_blocks[:2] == a_blocks[:2]
    assert kv.pool.num_free_blocks == 3
    kv.free(b)
    kv.check_invariants()

    # Queue now: 2 never-used blocks, a's partial third block, then b's blocks tail first.
    # Other content takes the uncached blocks first: the cached prefix survives.
    x = make_request("x", range(500, 500 + 16 * 4))
    prefill(kv, x)
    assert kv.get_computed_blocks(make_request("p", prompt))[1] == 32
    # The next eviction takes the prefix's later block: the first block outlives it.
    y = make_request("y", range(900, 916))
    prefill(kv, y)
    assert kv.get_computed_blocks(make_request("q", prompt))[1] == 16
    assert kv.get_block_ids("y")[0] == [a_blocks[1]]  # reused, now holding y's content
    z = make_request("z", range(1900, 1916))
    prefill(kv, z)
    assert kv.get_computed_blocks(make_request("s", prompt)) == ([[]], 0)
    assert kv.pool.num_free_blocks == 0
    kv.check_invariants()


def test_eviction_order_is_lru_by_request_and_tail_first():
    kv = KVCacheManager(num_blocks=9, block_size=4)  # 8 usable blocks of 4
    p1 = list(range(1, 14))    # 3 full blocks + 1
    p2 = list(range(101, 114))
    r1 = make_request("r1", p1)
    r2 = make_request("r2", p2)
    prefill(kv, r1)
    prefill(kv, r2)
    kv.free(r1)  # r1's blocks join the queue first (older)
    kv.free(r2)
    # One new 4-block request evicts r1's blocks only, and r1's last blocks go first.
    z = make_request("z", range(1000, 1016))
    prefill(kv, z)
    assert kv.get_computed_blocks(make_request("a", p2))[1] == 12  # r2 untouched
    assert kv.get_computed_blocks(make_request("b", p1))[1] == 0
    kv.free(z)
    # z's blocks were freed last, so they sit behind r2's and must not be taken first.
    w = make_request("w", range(2000, 2008))  # 2 blocks
    prefill(kv, w)
    # Queue before w: [r2 x4 (tail-first), z x4]; w takes r2's 4th (partial) and 3rd blocks.
    assert kv.get_computed_blocks(make_request("c", p2))[1] == 8
    kv.check_invariants()


def test_caching_disabled_gives_no_hits():
    kv = KVCacheManager(num_blocks=20, block_size=BS, enable_caching=False)
    prompt = list(range(1, 41))
    prefill(kv, make_request("a", prompt))
    b = make_request("b", prompt)
    assert kv.get_computed_blocks(b) == ([[]], 0)
    prefill(kv, b)
    assert kv.pool.cached_blocks == {}
    assert kv.take_prefix_cache_stats() == (0, 0)
    kv.check_invariants()


def test_free_everything_returns_all_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    shared = list(range(1, 9))
    reqs = [make_request(f"r{i}", shared + [100 + i] * (i + 1)) for i in range(4)]
    for r in reqs:
        prefill(kv, r)
        for _ in range(3):
            assert decode_step(kv, r) is not None
    assert kv.pool.blocks[kv.get_block_ids("r0")[0][0]].ref_cnt == 4  # shared prefix block
    for r in reqs:
        kv.free(r)
        kv.check_invariants()
    assert kv.pool.num_free_blocks == 16 - 1
    assert kv.usage == 0.0
    assert not kv.req_to_blocks
    assert kv.num_cached_blocks == {}
    kv.free(reqs[0])  # freeing twice is harmless
    kv.check_invariants()
    assert kv.reset_prefix_cache() is True
    assert kv.pool.cached_blocks == {}


def test_check_invariants_catches_leaked_reference():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(10))
    prefill(kv, a)
    kv.req_to_blocks.pop("a")  # a request ends without its blocks being freed
    with pytest.raises(AssertionError):
        kv.check_invariants()


def test_revived_hits_count_against_free_blocks():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    prompt = list(range(1, 41))
    a = make_request("a", prompt)
    a_blocks = prefill(kv, a)
    kv.free(a)  # queue: [4, 3(partial), 2, 1] with 1, 2 cached
    c = make_request("c", range(300, 332))
    prefill(kv, c)  # takes the 2 uncached blocks
    assert kv.pool.num_free_blocks == 2
    # 52 tokens: 2 hits (both sitting in the free queue) + 2 new blocks. Taking the hits leaves
    # no free block, so this must fail cleanly rather than take the hits and then run short.
    b = make_request("b", prompt[:32] + list(range(600, 620)))
    (hits,), num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32 and all(h.ref_cnt == 0 for h in hits)
    assert kv.allocate_slots(b, b.num_tokens - num_hit, [hits]) is None
    assert all(h.ref_cnt == 0 for h in hits)
    assert kv.pool.num_free_blocks == 2
    assert kv.get_block_ids("b")[0] == []
    kv.check_invariants()
    # Once c gives its blocks back, b fits (the hits were not evicted by c's release).
    kv.free(c)
    new = kv.allocate_slots(b, b.num_tokens - num_hit, [hits])
    assert new is not None and len(new[0]) == 2
    assert kv.get_block_ids("b")[0][:2] == a_blocks[:2]
    assert kv.pool.num_free_blocks == 0
    kv.check_invariants()


# ---- sliding-window groups (Gemma's local layers, Mistral) ------------------------------------


def test_a_sliding_group_holds_its_window_and_a_full_group_everything():
    """A long request: the full group holds a block per 4 tokens; the window-8 group, after each step,
    only the blocks that the next token's window or the step's chunk touch."""
    kv = KVCacheManager(num_blocks=200, block_size=4, windows=(None, 8))
    req = make_request("r", range(100, 200))
    while req.num_computed_tokens < req.num_tokens:   # prefill in chunks of 16
        chunk = min(16, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, chunk) is not None
        req.num_computed_tokens += chunk
        kv.check_invariants()
        full, sliding = kv.get_block_ids("r")
        assert 0 not in full and len(full) == -(-req.num_computed_tokens // 4)
        assert len([b for b in sliding if b]) <= -(-(8 + 16) // 4) + 1
    for _ in range(40):
        decode_step(kv, req)
        full, sliding = kv.get_block_ids("r")
        held = [i for i, b in enumerate(sliding) if b]
        # the blocks of positions num_computed - 8 .. num_computed (the next token's window and itself)
        assert held == list(range((req.num_computed_tokens - 8) // 4, len(sliding)))
        assert len(full) == len(sliding) == -(-req.num_computed_tokens // 4)
    assert kv.pool.num_free_blocks == 199 - len(full) - len(held)
    kv.free(req)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == 199


def test_a_prefix_hit_takes_the_full_groups_blocks_and_the_window_of_the_sliding_ones():
    kv = KVCacheManager(num_blocks=100, block_size=4, windows=(None, 8))
    prompt = list(range(1, 41))                        # 10 full blocks
    a = make_request("a", prompt)
    a_full, a_sliding = [list(ids) for ids in (prefill(kv, a), kv.get_block_ids("a")[1])]
    decode_step(kv, a)                                 # a lets go of its sliding blocks 0 .. 7
    assert kv.get_block_ids("a")[1][:8] == [0] * 8
    b = make_request("b", prompt + [7, 7, 7, 7, 7])
    (full_hits, sliding_hits), num_hit = kv.get_computed_blocks(b)
    assert num_hit == 40 and [h.block_id for h in full_hits] == a_full
    # a token at position 40 sees 33 .. 40: blocks 8 and 9, a's (never freed); before them the null block
    assert [h.block_id for h in sliding_hits] == [0] * 8 + a_sliding[8:10]
    assert kv.allocate_slots(b, b.num_tokens - num_hit, [full_hits, sliding_hits]) is not None
    kv.check_invariants()
    assert kv.get_block_ids("b")[1][:10] == [0] * 8 + a_sliding[8:10]


def test_a_prefix_hit_stops_where_a_sliding_groups_window_was_evicted():
    """The hit is the longest prefix whose last window every sliding group still has cached: blocks a
    window let go of stay cached until the pool reuses them."""
    kv = KVCacheManager(num_blocks=30, block_size=4, windows=(None, 8))
    prompt = list(range(1, 41))
    a = make_request("a", prompt)
    prefill(kv, a)
    a_sliding = kv.get_block_ids("a")[1]
    decode_step(kv, a)
    kv.free(a)                                         # every block free, all still cached
    b = make_request("b", prompt + [7])
    assert kv.get_computed_blocks(b)[1] == 40
    kv.pool._evict_from_cache(kv.pool.blocks[a_sliding[9]])   # as if the pool had reused it
    (full_hits, sliding_hits), num_hit = kv.get_computed_blocks(b)
    # position 40's window needs sliding blocks 8 and 9; position 36's, blocks 7 and 8 (7 let go of, cached)
    assert num_hit == 36 and len(full_hits) == 9
    assert [h.block_id for h in sliding_hits] == [0] * 7 + a_sliding[7:9]
    assert kv.allocate_slots(b, b.num_tokens - num_hit, [full_hits, sliding_hits]) is not None
    kv.check_invariants()
