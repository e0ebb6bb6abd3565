"""The LoRA pool's grouped path (engine/lora/lora_pool.py, engine/kernels/lora_gemm.py) under Triton's CPU
interpreter, small sizes, float32: against the torch path (engine/lora/lora_batch.py, the oracle)
on a qkv, a gate_up and a down linear, with mixed adapters, base tokens, ranks below the pool's
and adapters targeting only some shards; a token's bits independent of its batch in
deterministic mode; eviction and pinning in a pool smaller than the adapters loaded.
Skipped where triton is absent (CI) and on CUDA machines (tests/gpu/test_lora_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from engine.testing.triton_for_tests import import_triton_or_skip

if torch.cuda.is_available():  # the interpreter flag would leak into the GPU tests' kernels
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
triton = import_triton_or_skip()

from engine.lora.adapter import LoRAAdapter  # noqa: E402
from engine.lora.lora_batch import LoRABatch  # noqa: E402
from engine.lora.lora_pool import LoRAPool  # noqa: E402
from tests.engine.lora_block import ALL_SHARDS, Block, block_inputs, make_adapter, run_block  # noqa: E402

MAX_RANK = 8
CPU = torch.device("cpu")


def _block(deterministic: bool = False) -> Block:
    return Block(32, 48, 4, 2, 8, deterministic)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    block = _block()
    adapters = {
        1: make_adapter(block, "a", 4, ALL_SHARDS, 1),
        2: make_adapter(block, "b", MAX_RANK, {"qkv_proj": ["k"], "down_proj": [None]}, 2),
        3: make_adapter(block, "c", 2, {"gate_up_proj": [1]}, 3),
    }
    return block, adapters


LORA_IDS = [1, None, 2, 3, 1, None, 2]
TOKENS = [5, 3, 1, 7, 2, 4, 6]


@torch.inference_mode()
@pytest.mark.parametrize("deterministic,dense", [(False, False), (False, True), (True, True)])
def test_triton_path_equals_torch_path(setup, deterministic, dense):
    """dense=True in deterministic mode still runs the grouped kernels (the pool's rule)."""
    block, adapters = setup
    x = block_inputs(block, sum(TOKENS), 0)
    pool = LoRAPool(block, 3, MAX_RANK, CPU, torch.float32, dense=dense)
    got = run_block(block, pool.prepare(LORA_IDS, TOKENS, adapters, deterministic), x)
    want = run_block(block, LoRABatch.build(LORA_IDS, TOKENS, adapters, CPU, deterministic), x)
    base = run_block(block, None, x)
    is_base = torch.repeat_interleave(torch.tensor([i is None for i in LORA_IDS]), torch.tensor(TOKENS))
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[name][is_base], base[name][is_base])  # base tokens untouched, bitwise
        assert not torch.allclose(got[name][~is_base], base[name][~is_base])  # the deltas are there


@torch.inference_mode()
def test_token_bits_independent_of_batch_in_deterministic_mode(setup):
    _, adapters = setup
    block = _block(deterministic=True)  # batch-invariant base linears too
    block.load_state_dict(setup[0].state_dict())
    x = block_inputs(block, sum(TOKENS), 1)
    pool = LoRAPool(block, 3, MAX_RANK, CPU, torch.float32)
    mixed = run_block(block, pool.prepare(LORA_IDS, TOKENS, adapters, True), x)
    start = 0
    for lora_id, n in zip(LORA_IDS, TOKENS):
        alone_x = {name: v[start:start + n] for name, v in x.items()}
        alone = run_block(block, pool.prepare([lora_id], [n], adapters, True), alone_x)
        for name in mixed:
            assert torch.equal(mixed[name][start:start + n], alone[name]), (lora_id, name)
        start += n


@torch.inference_mode()
def test_eviction_keeps_outputs_right_and_pinned_adapters_resident(setup):
    block, adapters = setup
    adapters = dict(adapters)
    adapters[2] = LoRAAdapter(**{**vars(adapters[2]), "pinned": True})
    pool = LoRAPool(block, 2, MAX_RANK, CPU, torch.float32, dense=False)
    for step, ids in enumerate([[1, 2], [3, None], [1], [3, 2], [None, 1]]):
        x = block_inputs(block, len(ids) * 3, 10 + step)
        got = run_block(block, pool.prepare(ids, [3] * len(ids), adapters, False), x)
        want = run_block(block, LoRABatch.build(ids, [3] * len(ids), adapters, CPU, False), x)
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
        assert 2 in pool.slot_of  # pinned: never evicted while loaded
    assert pool.loads == 6  # 1, 2; then 3, 1, 3, 1 each over the other (2, pinned, stays)
    del adapters[2]  # unloaded: its slot is free for the next batch
    pool.prepare([1, 3], [1, 1], adapters, False)
    assert 2 not in pool.slot_of and set(pool.slot_of) == {1, 3}
