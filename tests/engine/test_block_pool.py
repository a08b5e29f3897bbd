from moemesh.contracts.block_hash import HashExtra, hash_block_chain

from .factories import EXTRA, make_kv, make_request


def test_null_block_is_never_handed_out():
    kv = make_kv(num_blocks=5)
    request = make_request("a", 16)
    assert kv.allocate_slots(request, 16) is not None
    assert kv.get_block_ids("a") == [1, 2, 3, 4]
    assert kv.num_free_blocks == 0


def test_allocation_fails_without_side_effects_when_pool_is_short():
    kv = make_kv(num_blocks=4)
    assert kv.allocate_slots(make_request("a", 16), 16) is None
    assert kv.num_free_blocks == 3
    assert kv.get_block_ids("a") == []


def test_only_full_blocks_are_cached_and_hit_never_covers_last_token():
    kv = make_kv(num_blocks=10)
    a = make_request("a", 10)
    kv.allocate_slots(a, 10)
    assert len(kv.pool.cached_blocks) == 2  # tokens 0..7; the third block is partial
    kv.free(a)
    b = make_request("b", 8)  # same first 8 tokens: only the first block may hit
    blocks, num_tokens = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [1]
    assert num_tokens == 4
    c = make_request("c", 9)
    blocks, num_tokens = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in blocks] == [1, 2] and num_tokens == 8


def test_shared_prefix_block_ref_counts_and_free_order():
    kv = make_kv(num_blocks=10)
    a = make_request("a", 12)
    kv.allocate_slots(a, 12)
    assert kv.get_block_ids("a") == [1, 2, 3]
    b = make_request("b", 13)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12
    kv.allocate_slots(b, 1, hits)
    assert kv.get_block_ids("b") == [1, 2, 3, 4]
    assert [blk.ref_cnt for blk in kv.pool.blocks[1:5]] == [2, 2, 2, 1]
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.pool.blocks[1:5]] == [1, 1, 1, 1]
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9]
    kv.free(b)  # tail first, so the prefix is evicted last
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 4, 3, 2, 1]


def test_evicted_block_is_reused_only_after_refcount_drops():
    kv = make_kv(num_blocks=4)  # 3 usable blocks
    a = make_request("a", 8)
    kv.allocate_slots(a, 8)  # blocks 1, 2 cached
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [3, 2, 1]
    b = make_request("b", 8, start=100)  # different tokens: needs 2 blocks, evicts LRU first
    kv.allocate_slots(b, 8)
    assert kv.get_block_ids("b") == [3, 2]
    assert kv.num_evictions == 1  # block 2 held a key, block 3 did not
    c = make_request("c", 5)  # a's first block (id 1) is still cached
    hits, num_hit = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in hits] == [1] and num_hit == 4
    d = make_request("d", 5, start=7)  # a's second block was evicted: no hit
    assert kv.get_computed_blocks(d) == ([], 0)


def test_hit_on_a_free_cached_block_counts_against_free_capacity():
    kv = make_kv(num_blocks=4)
    a = make_request("a", 8)
    kv.allocate_slots(a, 8)
    kv.free(a)  # blocks 1, 2 free but cached; 3 free
    b = make_request("b", 9)
    hits, _ = kv.get_computed_blocks(b)  # hits 1 and 2
    assert len(hits) == 2
    assert kv.allocate_slots(b, 1 + 4, hits) is None  # needs 2 new blocks, only 1 remains
    assert kv.allocate_slots(b, 1, hits) is not None
    assert kv.get_block_ids("b") == [1, 2, 3]


def test_cache_salt_and_model_id_isolate_prefixes():
    tokens = list(range(8))
    base = hash_block_chain(tokens, 4, EXTRA)
    assert hash_block_chain(tokens, 4, HashExtra("test-model", cache_salt="tenant-1")) != base
    assert hash_block_chain(tokens, 4, HashExtra("other-model")) != base
    salted = make_kv(num_blocks=10, extra=HashExtra("test-model", cache_salt="s"))
    plain = make_kv(num_blocks=10)
    a = make_request("a", 9)
    plain.allocate_slots(a, 9)
    assert plain.pool.get_cached_block(base[0]) is not None
    salted.allocate_slots(make_request("a", 9), 9)
    assert salted.pool.get_cached_block(base[0]) is None


def test_counters_track_queries_hits_and_usage():
    kv = make_kv(num_blocks=9)
    a = make_request("a", 8)
    kv.get_computed_blocks(a)
    kv.allocate_slots(a, 8)
    b = make_request("b", 10)
    hits, _ = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 2, hits)
    assert (kv.stats.num_queries, kv.stats.num_hits) == (18, 8)
    assert kv.num_used_blocks == 3
    assert kv.usage == 3 / 8
    kv.free(a)
    kv.free(b)
    assert kv.num_used_blocks == 0


def test_prefix_caching_off_never_hits():
    kv = make_kv(num_blocks=10, caching=False)
    a = make_request("a", 8)
    kv.allocate_slots(a, 8)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", 9)) == ([], 0)
    assert kv.pool.cached_blocks == {}


def test_a_forced_prefix_reset_forgets_blocks_still_in_use_and_they_return_unkeyed():
    kv = make_kv(num_blocks=10)
    held = make_request("held", 12)  # e.g. a finished prefill whose KV waits for export
    kv.allocate_slots(held, 12)
    assert len(kv.pool.cached_blocks) == 3 and kv.num_used_blocks == 3
    assert not kv.pool.reset_prefix_cache()  # refused while in use ...
    assert kv.pool.reset_prefix_cache(even_in_use=True)  # ... unless forced (a failed round's KV)
    assert kv.pool.cached_blocks == {} and kv.drain_events().cleared
    assert kv.get_computed_blocks(make_request("again", 13)) == ([], 0)  # no prefix hit on the garbage
    kv.free(held)
    assert all(b.block_hash is None for b in kv.pool.blocks[1:4]) and kv.num_free_blocks == 9
