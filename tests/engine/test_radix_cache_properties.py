"""RadixCache property tests: a hypothesis state machine drives the tree through inserts, matches,
request lifecycles (chunked prefill, decode, finish, abort), eviction and flushes, checking it
against a dict model after every step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.allocator import TokenSlotAllocator
from engine.kv.pool import ReqToTokenPool
from engine.kv.radix_cache import RadixCache
from tests.engine.kv_requests import compute, new_req

# ---- property-based -------------------------------------------------------------------------------
tokens = st.lists(st.integers(0, 2), min_size=0, max_size=7)
# a few shared heads with short tails, so concurrent requests compute the same tokens
prompts = st.builds(
    lambda head, tail: head + tail,
    st.sampled_from([[0], [0, 1, 2], [0, 1, 2, 2, 1], [1, 1]]),
    st.lists(st.integers(0, 2), max_size=3),
)


def tree_map(tree) -> dict[tuple, int]:
    """Every prefix in the tree -> the slot of its last token."""
    out, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for child in node.children.values():
            p = path
            for tok, slot in zip(child.key, child.value.tolist()):
                p = p + (tok,)
                out[p] = slot
            stack.append((p, child))
    return out


class RadixMachine(RuleBasedStateMachine):
    SIZE, ROWS, CTX = 24, 3, 16

    def __init__(self):
        super().__init__()
        self.alloc = TokenSlotAllocator(self.SIZE, debug=True)
        self.pool = ReqToTokenPool(self.ROWS, self.CTX, "cpu")
        self.tree = RadixCache(self.alloc, self.pool)
        self.model: dict[tuple, int] = {}  # what the tree must hold
        self.reqs: list[SimpleNamespace] = []
        self.pins: list[tuple[tuple, object]] = []  # bare locks: (key, node)

    # -- helpers
    def expect_match(self, key) -> list[int]:
        out = []
        for j in range(1, len(key) + 1):
            if tuple(key[:j]) not in self.model:
                break
            out.append(self.model[tuple(key[:j])])
        return out

    def record(self, key, slots):
        for j in range(len(key)):
            self.model.setdefault(tuple(key[: j + 1]), int(slots[j]))

    def reserve(self, n):
        if self.alloc.available_size() < n:
            self.tree.evict(n - self.alloc.available_size())
            self.sync_model()
        return self.alloc.alloc(n)

    def sync_model(self):
        """After eviction the tree holds a subset of the model; locked paths must survive."""
        now = tree_map(self.tree)
        assert all(self.model.get(k) == v for k, v in now.items())
        for key in self.locked_keys():
            assert all(tuple(key[: j + 1]) in now for j in range(len(key)))
        self.model = now

    def locked_keys(self):
        return [k for k, _ in self.pins] + [r.fill_ids[: len(r.prefix_indices)] for r in self.reqs]

    # -- token-level rules
    @rule(key=tokens)
    def insert(self, key):
        slots = self.reserve(len(key))
        if slots is None:
            return
        n = self.tree.insert(key, slots)
        assert n == len(self.expect_match(key))
        self.alloc.free(slots[:n])
        self.record(key, slots)

    @rule(key=tokens)
    def match(self, key):
        m = self.tree.match_prefix(key)
        assert m.indices.tolist() == self.expect_match(key)
        assert m.indices.dtype == torch.int64

    @rule(key=tokens)
    def pin(self, key):
        m = self.tree.match_prefix(key)
        self.tree.inc_lock_ref(m.last_node)
        self.pins.append((list(key[: len(m.indices)]), m.last_node))

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 10))
    def unpin(self, i):
        _, node = self.pins.pop(i % len(self.pins))
        self.tree.dec_lock_ref(node)

    @rule(n=st.integers(0, 30))
    def evict(self, n):
        before = self.tree.evictable_size()
        freed = self.tree.evict(n)
        assert freed >= min(n, before)
        assert self.tree.evictable_size() == before - freed
        self.sync_model()

    @precondition(lambda self: self.tree.total_size())
    @rule()
    def flush(self):
        if self.tree.protected_size():
            with pytest.raises(RuntimeError):
                self.tree.reset()
            return
        self.tree.reset()
        self.model = {}
        assert self.alloc.available_size() == self.SIZE - self.held()

    # -- request-level rules
    @precondition(lambda self: self.pool.available_size())
    @rule(prompt=prompts)
    def admit(self, prompt):
        self.reqs.append(new_req(self.tree, self.pool, prompt))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 10), rounds=st.lists(st.tuples(st.integers(1, 4), st.booleans()), min_size=1, max_size=4))
    def step(self, i, rounds):
        """A few scheduler rounds for one request: compute k positions, maybe cache the chunk."""
        r = self.reqs[i % len(self.reqs)]
        for k, cache in rounds:
            k = min(k, len(r.origin_input_ids) + len(r.output_ids) - r.kv_committed_len)
            if r.kv_committed_len + k > self.CTX:
                return
            slots = self.reserve(k)
            if slots is None:
                return
            compute(self.alloc, self.pool, r, k, slots)
            if cache:
                self.tree.cache_unfinished_req(r)
                self.record(r.fill_ids, r.prefix_indices)
                assert r.prefix_indices.tolist() == self.expect_match(r.fill_ids)
                row = self.pool.req_to_token[r.req_pool_idx, : r.kv_committed_len]
                assert row.tolist() == r.prefix_indices.tolist()

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 10))
    def finish(self, i):
        r = self.reqs.pop(i % len(self.reqs))
        row = self.pool.req_to_token[r.req_pool_idx].clone()
        seq = min(len(r.origin_input_ids) + len(r.output_ids) - 1, r.kv_committed_len)
        self.tree.cache_finished_req(r)
        self.record((r.origin_input_ids + r.output_ids)[:seq], row)
        assert r.req_pool_idx is None

    # -- invariants
    def held(self) -> int:
        return sum(r.kv_committed_len - len(r.prefix_indices) for r in self.reqs)

    @invariant()
    def consistent(self):
        self.tree.check_invariants()
        assert self.alloc.available_size() + self.tree.total_size() + self.held() == self.SIZE
        assert tree_map(self.tree) == self.model
        locked = {tuple(k[: j + 1]) for k in self.locked_keys() for j in range(len(k))}
        assert self.tree.protected_size() == len(locked)
        assert self.pool.available_size() == self.ROWS - len(self.reqs)


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
