"""TokenSlotAllocator, KVPool and ReqToTokenPool."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.allocator import TokenSlotAllocator
from engine.kv.pool import KVPool, ReqToTokenPool


def test_alloc_takes_from_front_and_free_appends():
    a = TokenSlotAllocator(6)
    assert a.available_size() == 6
    assert a.alloc(2).tolist() == [1, 2]
    a.free(torch.tensor([2, 1]))
    assert a.alloc(4).tolist() == [3, 4, 5, 6]
    assert a.alloc(2).tolist() == [2, 1]  # freed slots come back in free order
    assert a.available_size() == 0


def test_alloc_never_partial_and_zero():
    a = TokenSlotAllocator(3)
    assert a.alloc(4) is None
    assert a.available_size() == 3
    assert a.alloc(0).numel() == 0
    assert a.alloc(3).tolist() == [1, 2, 3]
    assert a.alloc(1) is None
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_alloc_returns_independent_tensor_across_wraparound():
    a = TokenSlotAllocator(4)
    first = a.alloc(3)
    a.free(first)
    wrapped = a.alloc(3)  # starts at ring position 3, wraps to 0
    assert wrapped.tolist() == [4, 1, 2]
    assert wrapped.dtype == torch.int64
    a.free(wrapped)
    assert a.available_size() == 4
    assert sorted(a.alloc(4).tolist()) == [1, 2, 3, 4]


def test_free_empty_and_clear():
    a = TokenSlotAllocator(5, debug=True)
    a.free(torch.empty(0, dtype=torch.int64))
    a.alloc(5)
    a.clear()
    assert a.available_size() == 5
    assert a.alloc(5).tolist() == [1, 2, 3, 4, 5]


def test_double_free_detected():
    a = TokenSlotAllocator(4, debug=True)
    s = a.alloc(2)
    a.free(s)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(s[:1])
    with pytest.raises(RuntimeError, match="double free"):
        a.free(torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="out of range"):
        a.free(torch.tensor([0]))


def test_overfull_free_detected_without_debug():
    a = TokenSlotAllocator(2)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(torch.tensor([1]))


def test_zero_size_pool():
    a = TokenSlotAllocator(0)
    assert a.available_size() == 0
    assert a.alloc(1) is None
    assert a.alloc(0).numel() == 0


class AllocatorMachine(RuleBasedStateMachine):
    """The ring buffer behaves like a FIFO deque of free slots."""

    SIZE = 9

    def __init__(self):
        super().__init__()
        self.alloc = TokenSlotAllocator(self.SIZE, debug=True)
        self.model = deque(range(1, self.SIZE + 1))
        self.held: list[int] = []

    @rule(n=st.integers(0, 5))
    def do_alloc(self, n):
        out = self.alloc.alloc(n)
        if n > len(self.model):
            assert out is None
            return
        expect = [self.model.popleft() for _ in range(n)]
        assert out.tolist() == expect
        self.held += expect

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def do_free(self, data):
        k = data.draw(st.integers(1, len(self.held)))
        picked = data.draw(st.permutations(self.held))[:k]
        self.alloc.free(torch.tensor(picked))
        self.model.extend(picked)
        self.held = [s for s in self.held if s not in picked]

    @rule()
    def do_clear(self):
        self.alloc.clear()
        self.model = deque(range(1, self.SIZE + 1))
        self.held = []

    @invariant()
    def sizes_agree(self):
        assert self.alloc.available_size() == len(self.model)
        assert self.alloc.available_size() + len(self.held) == self.SIZE


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


# ---- pools ------------------------------------------------------------------------------------
def test_kv_pool_shapes_and_write():
    pool = KVPool(size=8, num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.bfloat16, device="cpu")
    assert pool.size == 8
    assert len(pool.k_buffer) == len(pool.v_buffer) == 2
    assert pool.get_key_buffer(1).shape == (9, 3, 4)  # slot 0 is padding
    assert pool.get_value_buffer(0).dtype == torch.bfloat16
    assert pool.bytes_per_token == 2 * 2 * 3 * 4 * 2
    loc = torch.tensor([1, 5])
    k = torch.randn(2, 3, 4, dtype=torch.float32)
    v = torch.randn(2, 3, 4, dtype=torch.float32)
    pool.set_kv_buffer(1, loc, k, v)
    assert torch.equal(pool.get_key_buffer(1)[loc], k.to(torch.bfloat16))
    assert torch.equal(pool.get_value_buffer(1)[loc], v.to(torch.bfloat16))
    assert pool.get_key_buffer(0).abs().sum() == 0  # other layers untouched


def test_kv_pool_bytes_per_token_matches_guide():
    # Qwen3-0.6B: 28 layers, 8 KV heads, head_dim 128, 16-bit -> 114,688 bytes per token
    pool = KVPool(size=1, num_layers=28, num_kv_heads=8, head_dim=128, dtype=torch.float16, device="cpu")
    assert pool.bytes_per_token == 114_688


def test_req_to_token_pool():
    p = ReqToTokenPool(size=2, max_context_len=6, device="cpu")
    assert p.req_to_token.shape == (2, 6) and p.req_to_token.dtype == torch.int64
    a, b = p.alloc(), p.alloc()
    assert {a, b} == {0, 1}
    assert p.alloc() is None and p.available_size() == 0
    p.write(a, 2, torch.tensor([7, 8, 9]))
    assert p.req_to_token[a].tolist() == [0, 0, 7, 8, 9, 0]
    with pytest.raises(ValueError):
        p.write(a, 4, torch.tensor([1, 2, 3]))
    p.free(a)
    assert p.available_size() == 1
    with pytest.raises(RuntimeError, match="double free"):
        p.free(a)
    with pytest.raises(ValueError):
        p.free(5)
    assert p.alloc() == a
