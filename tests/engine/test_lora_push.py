"""A LoRA push's fast path on the CPU: names resolved once per model (LoRATargets), tensors copied
once into aligned views of few engine buffers (lay_out: values, alignment, no aliasing of the
sender, gradients for the trainer), a pool slot written by foreach ops (equal to the op-by-op
copy it replaced), and through the engine: a pushed bucket overwritten afterwards leaves outputs
unchanged, and refusals keep their messages once the names are cached."""

from __future__ import annotations

import pytest
import torch

from engine.lora.lora_layout import ALIGN_BYTES, lay_out

ENGINE = {"dtype": "float32", "device": "cpu"}
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42, 43]]
CPU = torch.device("cpu")


def _bucket_modules(r: int = 3):
    """Two modules' (A, B) pairs as views of one flat sender buffer (odd sizes: padding needed)."""
    shapes = {"m1": [((r, 24), (5, r)), ((r, 24), (7, r))], "m2": [((r, 40), (9, r))]}
    numel = sum(a[0] * a[1] + b[0] * b[1] for pairs in shapes.values() for a, b in pairs)
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    modules, at = {}, 0
    for name, pairs in shapes.items():
        modules[name] = []
        for a_shape, b_shape in pairs:
            views = []
            for shape in (a_shape, b_shape):
                views.append(flat[at:at + shape[0] * shape[1]].view(shape))
                at += shape[0] * shape[1]
            modules[name].append(tuple(views))
    return flat, modules


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_copies_once_into_aligned_views(dtype):
    flat, modules = _bucket_modules()
    expected = {m: (torch.cat([a for a, _ in pairs]).to(dtype), [b.to(dtype, copy=True) for _, b in pairs])
                for m, pairs in modules.items()}
    placed = lay_out(modules, CPU, dtype)
    flat.fill_(7.0)  # the sender's next step: the engine's copy must not change
    for m, (lora_a, lora_b) in placed.items():
        assert torch.equal(lora_a, expected[m][0]) and lora_a.shape == (3 * len(modules[m]), modules[m][0][0].shape[1])
        assert all(torch.equal(b, e) for b, e in zip(lora_b, expected[m][1]))
        for t in (lora_a, *lora_b):
            assert t.dtype == dtype and t.is_contiguous() and t.data_ptr() % ALIGN_BYTES == 0
            assert t.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    buffers = {t.untyped_storage().data_ptr() for lora_a, lora_b in placed.values() for t in (lora_a, *lora_b)}
    assert len(buffers) == 3  # A by in_features (24, 40), and every B


def test_layout_gradients_reach_each_tensor():
    """The trainer builds its adapter through lay_out: each parameter gets exactly its own gradient."""
    _, modules = _bucket_modules()
    leaves = {m: [(a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in pairs]
              for m, pairs in modules.items()}
    placed = lay_out(leaves, CPU, torch.float32)
    g = torch.Generator().manual_seed(1)
    weights = {m: (torch.randn(a.shape, generator=g), [torch.randn(b.shape, generator=g) for b in bs])
               for m, (a, bs) in placed.items()}
    loss = sum((placed[m][0] * wa).sum() + sum((b * wb).sum() for b, wb in zip(placed[m][1], wbs))
               for m, (wa, wbs) in weights.items())
    loss.backward()
    for m, pairs in leaves.items():
        wa, wbs = weights[m]
        r = pairs[0][0].shape[0]
        for k, (a, b) in enumerate(pairs):
            assert torch.equal(a.grad, wa[k * r:(k + 1) * r]) and torch.equal(b.grad, wbs[k])


def test_slot_writer_equals_the_op_by_op_copy():
    """A rank-2 adapter on one shard written over a full rank-8 one: the slot holds exactly what
    zeroing and copying shard by shard gives; the other slot is untouched."""
    from engine.lora.lora_pool import LoRAPool
    from tests.engine.lora_block import ALL_SHARDS, Block, make_adapter

    block = Block(32, 48, 4, 2, 8)
    pool = LoRAPool(block, 2, 8, CPU, torch.float32)
    full, small = make_adapter(block, "a", 8, ALL_SHARDS, 1), make_adapter(block, "c", 2, {"gate_up_proj": [1]}, 3)
    pool._load(1, 11, full)
    before = {n: (m.a[1].clone(), m.b[1].clone()) for n, m in pool.modules.items()}
    pool._load(0, 10, full)
    pool._load(0, 12, small)
    for name, buf in pool.modules.items():
        a, b = torch.zeros_like(buf.a[0]), torch.zeros_like(buf.b[0])
        module = small.modules.get(name)
        for shard in module.shards if module is not None else ():
            p = next(k for k, rows in enumerate(buf.shard_rows) if rows.start == shard.rows.start)
            a[p * 8:p * 8 + 2] = module.lora_a[shard.cols]
            b[shard.rows, :2] = shard.lora_b
        assert torch.equal(buf.a[0], a) and torch.equal(buf.b[0], b), name
        assert torch.equal(buf.a[1], before[name][0]) and torch.equal(buf.b[1], before[name][1]), name
    assert pool.scaling[0] == small.config.scaling and pool.loads == 3


def test_targets_are_resolved_once_per_model(model_a):
    from transformers import AutoConfig

    from engine.lora.lora_targets import lora_targets
    from engine.models.loader import load_model

    model = load_model(model_a, AutoConfig.from_pretrained(model_a), torch.float32, "cpu", "dummy")
    targets = lora_targets(model)
    assert lora_targets(model) is targets
    q = targets.by_hf["model.layers.1.self_attn.q_proj"]
    assert (q.module_name, q.shard_id, q.rows, q.in_features) == ("model.layers.1.self_attn.qkv_proj", "q",
                                                                  slice(0, 64), 64)
    up = targets.by_hf["model.layers.0.mlp.up_proj"]
    assert (up.module_name, up.shard_id, up.rows, up.in_features) == ("model.layers.0.mlp.gate_up_proj", 1,
                                                                      slice(128, 256), 64)
    assert len(targets.by_hf) == 2 * 7  # two layers, seven linears each


@pytest.fixture(scope="module")
def engine(model_a):
    from engine import Engine

    eng = Engine(model_path=model_a, **ENGINE, enable_lora=True, max_lora_rank=8, max_loaded_loras=4,
                 enable_deterministic_inference=True)  # outputs compared bit for bit
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def pushed(model_a):
    """A trainer's rank-8 adapter in one flattened bucket (tandem/lora_sync_trainer.py's layout)."""
    from engine.lora.peft_format import peft_config_dict
    from engine.testing.random_lora import fill_random_lora, lora_shapes, lora_tensor_specs
    from weight_sync.bucket import FlattenedBucket

    shapes = lora_shapes(model_a)
    config = peft_config_dict(8, 16.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    bucket = FlattenedBucket.empty([(n, s, torch.float32) for n, s in lora_tensor_specs(shapes, 8)], CPU)
    fill_random_lora(bucket.unpack(), 1)
    return config, bucket


def _greedy(engine, name):
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, lora_path=name)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def test_a_pushed_bucket_overwritten_after_the_load_leaves_outputs_unchanged(engine, pushed):
    from engine.testing.random_lora import fill_random_lora

    config, bucket = pushed
    assert engine.load_lora_adapter_from_tensors("push", bucket.to_payload(), config, "flattened_bucket")["success"]
    try:
        first = _greedy(engine, "push")
        assert first != _greedy(engine, None)
        adapter = next(a for a in engine.local_core.lora.registry.by_id.values() if a.name == "push")
        sender = bucket.flattened_tensor.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() != sender
                   for m in adapter.modules.values() for t in (m.lora_a, *[s.lora_b for s in m.shards]))
        fill_random_lora(bucket.unpack(), 2)  # the trainer's next step, in the same buffer
        assert _greedy(engine, "push") == first
    finally:
        assert engine.unload_lora_adapter("push")["success"]


def test_refusals_keep_their_messages_once_names_are_cached(engine, pushed):
    config, bucket = pushed
    assert engine.load_lora_adapter_from_tensors("warm", bucket.to_payload(), config, "flattened_bucket")["success"]
    assert engine.unload_lora_adapter("warm")["success"]
    good = dict(bucket.unpack())
    down_b = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = [
        ({**good, down_b: good[down_b][:, :4]},
         "model.layers.1.mlp.down_proj: lora_B has shape [64, 4], expected [64, 8] (rank 8)"),
        ({k: v for k, v in good.items() if k != down_b}, "model.layers.1.mlp.down_proj has lora_A but no lora_B"),
        ({**good, q_a.replace("layers.0", "layers.7"): good[q_a]}, "unknown module 'model.layers.7.self_attn.q_proj'"),
        ({**good, q_a: good[q_a].double()[0]}, f"tensor {q_a!r} must be a 2-D floating tensor"),
    ]
    for tensors, message in cases:
        reply = engine.load_lora_adapter_from_tensors("bad", tensors, config)
        assert not reply["success"] and message in reply["error_message"], (message, reply)
    reply = engine.load_lora_adapter_from_tensors("bad", good, {**config, "target_modules": ["k_proj"]})
    assert not reply["success"] and "is for a module outside target_modules (k_proj)" in reply["error_message"]
    assert "bad" not in engine.load_lora_adapter_from_tensors("ok", good, config)["loaded_adapters"]
    assert engine.unload_lora_adapter("ok")["success"]
