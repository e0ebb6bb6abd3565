"""The LoRA pool's dense path (engine/lora/pool_batch.py: every slot's shrink in one GEMM, each
token's own slot kept, one accumulating GEMM per shard), which is plain torch and so runs on the
CPU without Triton: against the torch path (engine/lora/lora_batch.py, the oracle) with mixed
adapters, base tokens, ranks below the pool's and adapters targeting only some shards; base rows
bitwise untouched; eviction; and the pool's buffers laid out as the grouped kernels read them."""

from __future__ import annotations

import pytest
import torch

from engine.lora.lora_batch import LoRABatch
from engine.lora.lora_pool import LoRAPool
from tests.engine.lora_block import ALL_SHARDS, Block, block_inputs, make_adapter, run_block

MAX_RANK = 8
CPU = torch.device("cpu")
LORA_IDS = [1, None, 2, 3, 1, None, 2]
TOKENS = [5, 3, 1, 7, 2, 4, 6]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    block = Block(32, 48, 4, 2, 8)
    adapters = {
        1: make_adapter(block, "a", 4, ALL_SHARDS, 1),
        2: make_adapter(block, "b", MAX_RANK, {"qkv_proj": ["k"], "down_proj": [None]}, 2),
        3: make_adapter(block, "c", 2, {"gate_up_proj": [1]}, 3),
    }
    return block, adapters


def _check(block, pool, adapters, ids, tokens, seed):
    x = block_inputs(block, sum(tokens), seed)
    batch = pool.prepare(ids, tokens, adapters, False)
    assert batch.dense
    got = run_block(block, batch, x)
    want = run_block(block, LoRABatch.build(ids, tokens, adapters, CPU, False), x)
    base = run_block(block, None, x)
    is_base = torch.repeat_interleave(torch.tensor([i is None for i in ids]), torch.tensor(tokens))
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[name][is_base], base[name][is_base])  # adds exact zeros to base rows
    return got, base, is_base


@torch.inference_mode()
def test_dense_path_equals_torch_path(setup):
    block, adapters = setup
    got, base, is_base = _check(block, LoRAPool(block, 3, MAX_RANK, CPU, torch.float32), adapters, LORA_IDS, TOKENS, 0)
    for name in got:
        assert not torch.allclose(got[name][~is_base], base[name][~is_base])  # the deltas are there


@torch.inference_mode()
def test_dense_path_across_evictions(setup):
    block, adapters = setup
    pool = LoRAPool(block, 2, MAX_RANK, CPU, torch.float32)
    for step, ids in enumerate([[1, 2], [3, None], [1], [3, 2], [None, 1]]):
        _check(block, pool, adapters, ids, [3] * len(ids), 10 + step)
    assert pool.loads == 6  # 1, 2; 3 over 1; 1 over 2; 2 over 1; 1 over 3 (2 slots, least recently used out)


@torch.inference_mode()
def test_pool_b_view_is_slot_major_over_row_major_storage(setup):
    """b [S, out, R] (grouped kernels, slot loads) and b_rows [out, S * R] (dense expand) share storage."""
    block, adapters = setup
    pool = LoRAPool(block, 3, MAX_RANK, CPU, torch.float32)
    pool.prepare([1], [2], adapters, False)
    buf, slot = pool.modules["down_proj"], pool.slot_of[1]
    b = adapters[1].modules["down_proj"].shards[0].lora_b  # [out, r]
    r = b.shape[1]
    assert buf.b.shape == (3, buf.b_rows.shape[0], MAX_RANK)
    assert torch.equal(buf.b[slot, :, :r], b)
    assert torch.equal(buf.b_rows[:, slot * MAX_RANK:slot * MAX_RANK + r], b)
    assert not buf.b_rows[:, slot * MAX_RANK + r:(slot + 1) * MAX_RANK].any()  # padded to the pool's rank


def test_torch_path_adds_to_a_custom_functions_output_with_gradients(setup):
    """A trainer's pass: on the GPU the base linear's output comes from a custom autograd Function
    (batch-invariant matmul), whose output views can't be written in place; the torch path then adds
    to a copy, with the same values and gradients reaching the adapter."""
    block, adapters = setup

    class Identity(torch.autograd.Function):  # returns its input as-is, like such Functions may
        @staticmethod
        def forward(ctx, t):
            return t

        @staticmethod
        def backward(ctx, g):
            return g

    module = adapters[1].modules["down_proj"]
    lora_a = module.lora_a.clone().requires_grad_(True)
    adapter = type(adapters[1])(**{**vars(adapters[1]), "modules": {"down_proj": type(module)(
        lora_a, module.shards, module.scaling)}})
    x = block_inputs(block, 6, 3)["down_proj"]
    base = block.down_proj(x).detach().requires_grad_(True)
    batch = LoRABatch.build([1, None], [4, 2], {1: adapter}, CPU, False)
    got = batch.apply("down_proj", x, Identity.apply(base))
    want = LoRABatch.build([1, None], [4, 2], adapters, CPU, False).apply("down_proj", x, base.detach().clone())
    assert torch.equal(got.detach(), want)
    got.sum().backward()
    assert lora_a.grad is not None and lora_a.grad.abs().sum() > 0


def test_pool_allocates_only_the_modules_targets_allow(setup):
    """--lora-target-modules q_proj v_proj: buffers for the attention's qkv only (o, gate_up and
    down would be memory no adapter can use)."""
    block, _ = setup
    full = LoRAPool(block, 2, MAX_RANK, CPU, torch.float32)
    qv = LoRAPool(block, 2, MAX_RANK, CPU, torch.float32, targets=["q_proj", "v_proj"])
    down = LoRAPool(block, 2, MAX_RANK, CPU, torch.float32, targets=["down_proj", "up_proj"])
    assert set(full.modules) == {"qkv_proj", "gate_up_proj", "down_proj"}
    assert set(qv.modules) == {"qkv_proj"} and set(down.modules) == {"gate_up_proj", "down_proj"}
    assert qv.nbytes < full.nbytes
