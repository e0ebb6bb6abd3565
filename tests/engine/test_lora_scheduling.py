"""LoRA in the scheduler, without a model. The radix cache's namespaces (a LoRA adapter's id; None
for the base model): a prefix is never shared across them, eviction and flush cover them all, and
dropping one (an unloaded adapter) frees exactly its tokens, refused while a request locks it.
Admission under --max-loras-per-batch: FCFS, no starvation."""

from __future__ import annotations

import pytest

from engine.kv.allocator import TokenSlotAllocator
from engine.kv.pool import ReqToTokenPool
from engine.kv.radix_cache import RadixCache


def _tree():
    alloc = TokenSlotAllocator(64, debug=True)
    return alloc, RadixCache(alloc, ReqToTokenPool(4, 32, "cpu"))


def _put(tree, alloc, key, namespace):
    slots = alloc.alloc(len(key))
    alloc.free(slots[:tree.insert(key, slots, namespace)])
    return slots


def test_namespaces_never_share_a_prefix():
    alloc, tree = _tree()
    base = _put(tree, alloc, [1, 2, 3, 4], None)
    a = _put(tree, alloc, [1, 2, 3, 4], 7)
    assert tree.match_prefix([1, 2, 3, 4], 7).indices.tolist() == a.tolist()
    assert tree.match_prefix([1, 2, 3, 4]).indices.tolist() == base.tolist()
    assert tree.match_prefix([1, 2, 3], 8).indices.numel() == 0
    assert tree.total_size() == 8
    tree.check_invariants()


def test_drop_namespace_frees_its_tokens_only_and_not_while_locked():
    alloc, tree = _tree()
    _put(tree, alloc, [1, 2, 3, 4], None)
    _put(tree, alloc, [1, 2, 3, 4, 5], 7)
    _put(tree, alloc, [1, 2, 9], 7)  # splits the adapter's tree: two nodes under a stem
    free_before = alloc.available_size()
    node = tree.match_prefix([1, 2, 9], 7).last_node
    tree.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="running requests lock it"):
        tree.drop_namespace(7)
    tree.dec_lock_ref(node)
    assert tree.drop_namespace(7) == 6
    assert alloc.available_size() == free_before + 6
    assert tree.match_prefix([1, 2, 3, 4], 7).indices.numel() == 0
    assert tree.match_prefix([1, 2, 3, 4]).indices.numel() == 4 and tree.total_size() == 4
    assert tree.drop_namespace(99) == 0
    tree.check_invariants()


def test_evict_and_reset_cover_every_namespace():
    alloc, tree = _tree()
    for namespace in (None, 1, 2):
        _put(tree, alloc, [5, 6, 7], namespace)
    assert tree.evictable_size() == 9
    assert tree.evict(4) >= 4 and tree.total_size() <= 5
    tree.check_invariants()
    tree.reset()
    assert tree.total_size() == 0 and alloc.available_size() == alloc.size
    tree.check_invariants()


def test_max_loras_per_batch_admission_never_starves_the_head():
    """--max-loras-per-batch 1: a waiting request of another adapter stops admission (FCFS), so the
    base requests queued behind it cannot overtake it forever; it runs once the running ones end."""
    from engine.scheduler.request import Req
    from engine.sampling_params import SamplingParams
    from engine.scheduler.scheduler import Scheduler, SchedulerConfig

    alloc = TokenSlotAllocator(1000)
    rows = ReqToTokenPool(9, 64, "cpu")
    sched = Scheduler(SchedulerConfig(8, None, 16384, max_loras_per_batch=1), RadixCache(alloc, rows), alloc, rows)

    def req(rid, lora_id):
        r = Req(rid=rid, origin_input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=2), seed=0)
        r.lora_id = lora_id
        return r

    for r in (req("base0", None), req("a", 1), req("base1", None)):
        sched.add_request(r)
    first = sched.schedule()
    assert [r.rid for r in first.reqs] == ["base0"]  # "a" needs a second slot, "base1" waits behind it
    sched.commit(first, [7])
    decode = sched.schedule()
    assert decode.forward_mode.is_decode and [r.rid for r in decode.reqs] == ["base0"]  # the others still wait
    sched.commit(decode, [7])
    base0 = sched.running[0]
    base0.finished_reason = {"type": "length"}
    sched.release(base0)
    assert [r.rid for r in sched.schedule().reqs] == ["a"]
    assert [r.rid for r in sched.waiting] == ["base1"]


def test_pinned_adapters_keep_their_pool_slots_out_of_the_batch_limit():
    """3 slots, adapter 9 pinned (resident while loaded): a batch may hold 2 unpinned adapters with
    it, or 2 without it, not 3 (that would need a 4th slot); the base takes no slot."""
    from engine.sampling_params import SamplingParams
    from engine.scheduler.request import Req
    from engine.scheduler.scheduler import Scheduler, SchedulerConfig

    alloc = TokenSlotAllocator(1000)
    rows = ReqToTokenPool(9, 64, "cpu")
    sched = Scheduler(SchedulerConfig(8, None, 16384, max_loras_per_batch=3), RadixCache(alloc, rows), alloc, rows)
    sched.admission.pinned_loras = frozenset({9})
    for rid, lora_id in (("a", 1), ("b", 2), ("c", 3), ("base", None)):
        r = Req(rid=rid, origin_input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=2), seed=0)
        r.lora_id = lora_id
        sched.add_request(r)
    assert [r.rid for r in sched.schedule().reqs] == ["a", "b"]  # c would be a 3rd unpinned beside 9's slot
    assert [r.rid for r in sched.waiting] == ["c", "base"]
