"""RadixCache and ChunkCache unit tests (the hypothesis state machine is in
test_radix_cache_properties.py)."""

from __future__ import annotations

import pytest
import torch

from engine.kv.allocator import TokenSlotAllocator
from engine.kv.base import PrefixCache
from engine.kv.chunk_cache import ChunkCache
from engine.kv.pool import ReqToTokenPool
from engine.kv.radix_cache import RadixCache
from tests.engine.kv_requests import compute, new_req


def make(size=32, rows=4, ctx=32):
    alloc = TokenSlotAllocator(size, debug=True)
    pool = ReqToTokenPool(rows, ctx, "cpu")
    return alloc, pool, RadixCache(alloc, pool)


def put(tree, alloc, key):
    """Insert key with fresh slots, freeing duplicates like a caller must; returns the slots."""
    slots = alloc.alloc(len(key))
    n = tree.insert(key, slots)
    alloc.free(slots[:n])
    return slots


# ---- match / insert -----------------------------------------------------------------------------
def test_empty_tree_and_empty_key():
    _, _, tree = make()
    m = tree.match_prefix([1, 2])
    assert m.indices.numel() == 0 and m.last_node is tree.root
    m = tree.match_prefix([])
    assert m.indices.numel() == 0 and m.last_node is tree.root
    assert tree.insert([], torch.empty(0, dtype=torch.int64)) == 0
    assert tree.total_size() == 0
    tree.check_invariants()


def test_split_on_partial_match():
    alloc, _, tree = make()
    slots = put(tree, alloc, [1, 2, 3, 4])
    m = tree.match_prefix([1, 2, 9])
    assert m.indices.tolist() == slots[:2].tolist()
    assert m.last_node.key == [1, 2]
    assert tree.root.children[1] is m.last_node
    (child,) = m.last_node.children.values()
    assert child.key == [3, 4] and child.parent is m.last_node
    assert child.value.tolist() == slots[2:].tolist()
    assert tree.total_size() == 4
    tree.check_invariants()


def test_match_ending_at_key_end_inside_node_splits():
    alloc, _, tree = make()
    slots = put(tree, alloc, [5, 6, 7])
    m = tree.match_prefix([5, 6])
    assert m.last_node.key == [5, 6]
    assert m.indices.tolist() == slots[:2].tolist()
    full = tree.match_prefix([5, 6, 7, 8])
    assert full.indices.tolist() == slots.tolist()
    assert full.last_node.key == [7]
    tree.check_invariants()


def test_match_capped_at_prompt_minus_one():
    # the scheduler matches prompt[:-1] so the last token is always computed
    alloc, _, tree = make()
    prompt = [1, 2, 3, 4]
    put(tree, alloc, prompt)
    m = tree.match_prefix(prompt[:-1])
    assert m.indices.numel() == 3
    tree.inc_lock_ref(m.last_node)
    assert tree.protected_size() == 3 and tree.evictable_size() == 1
    assert tree.evict(10) == 1  # only the uncapped tail is evictable
    tree.dec_lock_ref(m.last_node)
    tree.check_invariants()


def test_insert_returns_duplicate_prefix_and_keeps_first_slots():
    alloc, _, tree = make(size=16)
    first = put(tree, alloc, [1, 2, 3])
    second = alloc.alloc(5)
    n = tree.insert([1, 2, 3, 4, 5], second)
    assert n == 3
    alloc.free(second[:n])
    assert tree.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == first.tolist() + second[3:].tolist()
    third = alloc.alloc(2)
    assert tree.insert([1, 2], third) == 2  # a prefix of an existing node: split, all duplicate
    alloc.free(third)
    assert tree.total_size() == 5
    assert alloc.available_size() == 11
    tree.check_invariants()


def test_insert_branches_and_length_mismatch():
    alloc, _, tree = make()
    put(tree, alloc, [1, 2, 3])
    put(tree, alloc, [1, 2, 4])
    put(tree, alloc, [2])
    assert sorted(tree.root.children) == [1, 2]
    assert sorted(tree.root.children[1].children) == [3, 4]
    with pytest.raises(ValueError):
        tree.insert([1, 2], torch.tensor([1]))
    tree.check_invariants()


def test_insert_copies_value():
    alloc, _, tree = make()
    slots = alloc.alloc(3)
    tree.insert([1, 2, 3], slots)
    expect = slots.tolist()
    slots.fill_(0)  # the caller's tensor (e.g. a req_to_token row) changes later
    assert tree.match_prefix([1, 2, 3]).indices.tolist() == expect


# ---- locks ----------------------------------------------------------------------------------------
def test_lock_covers_path_and_sizes():
    alloc, _, tree = make()
    put(tree, alloc, [1, 2, 3, 4])
    put(tree, alloc, [1, 2, 5])
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    assert tree.inc_lock_ref(node) == 4
    assert tree.protected_size() == 4 and tree.evictable_size() == 1
    assert tree.inc_lock_ref(node) == 0
    assert tree.dec_lock_ref(node) == 0
    assert tree.dec_lock_ref(node) == 4
    assert tree.protected_size() == 0 and tree.evictable_size() == 5
    with pytest.raises(RuntimeError):
        tree.dec_lock_ref(node)
    assert tree.inc_lock_ref(tree.root) == 0 and tree.dec_lock_ref(tree.root) == 0
    tree.check_invariants()


def test_split_of_locked_node_keeps_lock():
    alloc, _, tree = make()
    put(tree, alloc, [1, 2, 3])
    node = tree.match_prefix([1, 2, 3]).last_node
    tree.inc_lock_ref(node)
    upper = tree.match_prefix([1]).last_node  # splits the locked node
    assert upper.lock_ref == 1 and tree.protected_size() == 3
    tree.dec_lock_ref(node)
    assert upper.lock_ref == 0 and tree.evictable_size() == 3
    tree.check_invariants()


def test_locking_evicted_node_raises():
    alloc, _, tree = make()
    put(tree, alloc, [1, 2])
    node = tree.match_prefix([1, 2]).last_node
    tree.evict(2)
    with pytest.raises(RuntimeError, match="evicted"):
        tree.inc_lock_ref(node)


# ---- eviction -------------------------------------------------------------------------------------
def test_evict_lru_order_and_parent_follows():
    alloc, _, tree = make()
    put(tree, alloc, [1, 1, 1])  # oldest
    put(tree, alloc, [2, 2])
    put(tree, alloc, [3, 3, 3, 3])
    put(tree, alloc, [3, 3, 3, 3, 5])  # child of [3]*4; [3]*4 becomes an inner node
    tree.match_prefix([1, 1, 1])  # touch: now [2, 2] is the least recent leaf
    assert tree.evict(1) == 2
    assert 2 not in tree.root.children
    assert tree.evict(1) == 1  # leaf [5] is older than the touched [1, 1, 1]
    assert tree.evict(1) == 4  # its parent became a leaf, and is older than [1, 1, 1]
    assert list(tree.root.children) == [1]
    assert alloc.available_size() == 32 - 3
    tree.check_invariants()


def test_parent_that_becomes_leaf_competes_within_one_evict():
    alloc, _, tree = make()
    put(tree, alloc, [3, 3, 3, 3])
    put(tree, alloc, [3, 3, 3, 3, 5])
    put(tree, alloc, [1, 1, 1])  # newer than the whole [3] branch
    assert tree.evict(5) == 5  # [5], then its parent, before the newer [1, 1, 1]
    assert list(tree.root.children) == [1]


def test_inserted_leaf_is_most_recent():
    alloc, _, tree = make()
    put(tree, alloc, [1])
    put(tree, alloc, [2])
    put(tree, alloc, [1, 5])  # new leaf under an old node
    assert tree.evict(1) == 1
    assert tree.match_prefix([1, 5]).indices.numel() == 2
    assert 2 not in tree.root.children


def test_evict_stops_once_enough_and_skips_locked():
    alloc, _, tree = make()
    put(tree, alloc, [1, 2])
    put(tree, alloc, [3, 4])
    put(tree, alloc, [5, 6])
    locked = tree.match_prefix([1, 2]).last_node
    tree.inc_lock_ref(locked)
    assert tree.evict(0) == 0
    assert tree.evict(3) == 4  # whole leaves only
    assert tree.evict(100) == 0
    assert tree.match_prefix([1, 2]).indices.numel() == 2
    tree.dec_lock_ref(locked)
    assert tree.evict(100) == 2
    assert tree.total_size() == 0 and alloc.available_size() == 32
    tree.check_invariants()


def test_shared_stem_outlives_branches():
    alloc, _, tree = make()
    system = [9, 9, 9, 9]
    put(tree, alloc, system + [1])
    put(tree, alloc, system + [2])
    tree.match_prefix(system + [1])
    assert tree.evict(1) == 1  # [2]
    assert tree.evict(1) == 1  # [1]; the stem now becomes a leaf
    assert tree.match_prefix(system).indices.numel() == 4


# ---- flush / invariants ---------------------------------------------------------------------------
def test_reset_frees_everything_and_refuses_when_locked():
    alloc, _, tree = make()
    put(tree, alloc, [1, 2, 3])
    put(tree, alloc, [1, 4])
    node = tree.match_prefix([1, 4]).last_node
    tree.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="2 tokens"):
        tree.reset()
    tree.dec_lock_ref(node)
    tree.reset()
    assert tree.total_size() == 0 and alloc.available_size() == 32
    assert tree.match_prefix([1, 2, 3]).indices.numel() == 0
    with pytest.raises(RuntimeError):
        tree.inc_lock_ref(node)  # flushed nodes are gone
    tree.check_invariants()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda t: setattr(t, "_evictable", t._evictable + 1),
        lambda t: setattr(t.root.children[1], "lock_ref", -1),
        lambda t: t.root.children.__setitem__(7, t.root.children.pop(1)),
        lambda t: setattr(t.root.children[1], "parent", None),
        lambda t: t.root.children[2].value.copy_(t.root.children[1].value[:1]),
        lambda t: setattr(t.root.children[2], "key", []),
    ],
)
def test_check_invariants_catches_corruption(corrupt):
    alloc, _, tree = make()
    put(tree, alloc, [1, 2])
    put(tree, alloc, [2])
    tree.check_invariants()
    corrupt(tree)
    with pytest.raises(AssertionError):
        tree.check_invariants()


def test_chunked_prefill_then_finish_shares_with_second_request():
    alloc, pool, tree = make(size=40)
    a = new_req(tree, pool, [1, 2, 3, 4, 5, 6])
    compute(alloc, pool, a, 4)
    tree.cache_unfinished_req(a)
    assert a.fill_ids == [1, 2, 3, 4] and a.prefix_indices.numel() == 4
    assert tree.protected_size() == 4 and tree.evictable_size() == 0
    b = new_req(tree, pool, [1, 2, 3, 4, 9, 9])  # reuses a's first chunk
    assert b.prefix_indices.tolist() == a.prefix_indices.tolist()
    compute(alloc, pool, a, 2)  # finishes prefill, samples 100
    compute(alloc, pool, a, 1)  # decode 100, samples 101
    tree.cache_finished_req(a)
    assert a.req_pool_idx is None and a.last_node is None
    assert tree.total_size() == 7  # prompt + first output; 101 was never fed back
    tree.check_invariants()
    compute(alloc, pool, b, 2)
    tree.cache_finished_req(b)
    assert tree.total_size() == 9 and tree.protected_size() == 0
    assert alloc.available_size() + tree.total_size() == 40
    assert pool.available_size() == 4
    tree.check_invariants()


def test_cache_unfinished_req_frees_duplicates_and_rewrites_row():
    alloc, pool, tree = make(size=20)
    a, b = new_req(tree, pool, [1, 2, 3, 4]), new_req(tree, pool, [1, 2, 3, 4])
    compute(alloc, pool, a, 3)
    compute(alloc, pool, b, 3)  # computed the same tokens before a's chunk was cached
    tree.cache_unfinished_req(a)
    b_own = pool.req_to_token[b.req_pool_idx, :3].clone()
    tree.cache_unfinished_req(b)
    assert b.prefix_indices.tolist() == a.prefix_indices.tolist()
    assert pool.req_to_token[b.req_pool_idx, :3].tolist() == a.prefix_indices.tolist()
    assert alloc.available_size() == 20 - 3  # b's duplicates went back
    assert set(b_own.tolist()).isdisjoint(a.prefix_indices.tolist())
    tree.dec_lock_ref(a.last_node)
    tree.dec_lock_ref(b.last_node)
    tree.check_invariants()


def test_cache_finished_req_frees_kv_past_last_token():
    alloc, pool, tree = make(size=20)
    r = new_req(tree, pool, [1, 2, 3])
    compute(alloc, pool, r, 3)  # samples 100
    compute(alloc, pool, r, 1)  # samples 101
    compute(alloc, pool, r, 1)  # an extra position written (e.g. overlap): 101 fed back
    r.output_ids.pop()  # but the request stopped at 101
    tree.cache_finished_req(r)
    assert tree.total_size() == 4  # [1, 2, 3, 100]; the KV of 101 had no key
    assert alloc.available_size() == 16
    tree.check_invariants()


def test_cache_finished_req_mid_prefill_abort():
    alloc, pool, tree = make(size=20)
    r = new_req(tree, pool, [1, 2, 3, 4, 5])
    compute(alloc, pool, r, 2)
    tree.cache_finished_req(r)
    assert tree.total_size() == 2 and alloc.available_size() == 18
    assert pool.available_size() == 4 and tree.protected_size() == 0


# ---- ChunkCache -----------------------------------------------------------------------------------
def test_chunk_cache():
    alloc = TokenSlotAllocator(10, debug=True)
    pool = ReqToTokenPool(2, 16, "cpu")
    cache = ChunkCache(alloc, pool)
    assert isinstance(cache, PrefixCache)
    m = cache.match_prefix([1, 2, 3])
    assert m.indices.numel() == 0
    assert cache.insert([1], torch.tensor([1])) == 0
    assert cache.inc_lock_ref(m.last_node) == 0 and cache.dec_lock_ref(m.last_node) == 0
    assert cache.evict(5) == 0
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
    cache.reset()
    cache.check_invariants()
    r = new_req(cache, pool, [1, 2, 3, 4])
    compute(alloc, pool, r, 2)
    cache.cache_unfinished_req(r)
    assert r.prefix_indices.tolist() == pool.req_to_token[r.req_pool_idx, :2].tolist()
    compute(alloc, pool, r, 2)
    cache.cache_finished_req(r)
    assert alloc.available_size() == 10 and pool.available_size() == 2
    assert r.req_pool_idx is None
