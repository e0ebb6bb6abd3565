"""Models + loader + torch-native attention against HF transformers (eager) as the oracle."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.attention.torch_native import TorchNativeAttentionBackend
from engine.models.decoder import head_dim_of
from engine.models.loader import load_model, resolve_dtype
from engine.models.registry import get_model_class
from engine.forward_batch import ForwardBatch, ForwardMode

try:
    from engine.kv.pool import KVPool
except ImportError:  # stand-in with the same API while the pool is being written

    class KVPool:  # type: ignore[no-redef]
        def __init__(self, size, num_layers, num_kv_heads, head_dim, dtype, device):
            shape = (size + 1, num_kv_heads, head_dim)
            self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

        def get_key_buffer(self, layer_id):
            return self.k_buffer[layer_id]

        def get_value_buffer(self, layer_id):
            return self.v_buffer[layer_id]

        def set_kv_buffer(self, layer_id, loc, k, v):
            self.k_buffer[layer_id][loc] = k.to(self.k_buffer[layer_id].dtype)
            self.v_buffer[layer_id][loc] = v.to(self.v_buffer[layer_id].dtype)


TOL = 1e-4
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=False),
    "llama": lambda: transformers.LlamaConfig(**SMALL, rope_parameters=dict(LLAMA3_ROPE),
                                              tie_word_embeddings=False),
    # MoE: 4 experts top-2; layer 1 dense (mlp_only_layers) in Qwen3-MoE; Qwen2-MoE's shared expert
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, head_dim=16, tie_word_embeddings=False, num_experts=4,
                                                     num_experts_per_tok=2, moe_intermediate_size=32,
                                                     norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SMALL, tie_word_embeddings=False, num_experts=4,
                                                     num_experts_per_tok=2, moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=48, norm_topk_prob=False),
}


class PagedRunner:
    """Drives a model through ForwardBatches over a real KV pool with scattered slots."""

    def __init__(self, model, config, size=512, max_reqs=4, max_ctx=128, device="cpu"):
        self.model = model
        self.device = torch.device(device)
        self.pool = KVPool(size, config.num_hidden_layers, config.num_key_value_heads,
                           head_dim_of(config), torch.float32, self.device)
        self.req_to_token = torch.zeros(max_reqs, max_ctx, dtype=torch.int64, device=self.device)
        gen = torch.Generator().manual_seed(0)
        self.free = (torch.randperm(size, generator=gen) + 1).tolist()  # slot 0 is padding
        self.cached = [0] * max_reqs
        self.backend = TorchNativeAttentionBackend()

    def extend(self, rows: list[int], chunks: list[list[int]]) -> list[torch.Tensor]:
        """Append chunks[i] to request row rows[i]; returns each chunk's logits [n_i, vocab]."""
        prefix = [self.cached[r] for r in rows]
        lens = [len(c) for c in chunks]
        positions, locs = [], []
        for r, p, n in zip(rows, prefix, lens):
            slots = torch.tensor([self.free.pop() for _ in range(n)], device=self.device)
            self.req_to_token[r, p : p + n] = slots
            self.cached[r] = p + n
            positions.append(torch.arange(p, p + n, device=self.device))
            locs.append(slots)
        seq_lens = [p + n for p, n in zip(prefix, lens)]
        decode = all(n == 1 for n in lens) and all(p > 0 for p in prefix)
        dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=dev([t for c in chunks for t in c]),
            positions=torch.cat(positions), out_cache_loc=torch.cat(locs),
            req_pool_indices=dev(rows), seq_lens=dev(seq_lens),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=lens,
            req_to_token=self.req_to_token, kv_pool=self.pool, attn_backend=self.backend,
        )
        self.backend.init_forward_metadata(fb)
        with torch.inference_mode():
            hidden = self.model(fb.input_ids, fb.positions, fb)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.split(lens))


def _randomize(hf_model):
    """HF's init leaves norms at 1 and biases at 0; perturb all so every weight matters."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def _save_hf(kind, path, **save_kwargs):
    config = CONFIGS[kind]()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    _randomize(hf)
    hf.save_pretrained(path, **save_kwargs)
    return hf, transformers.AutoConfig.from_pretrained(path)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _prompt(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_close(ours, ref):
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff}"


@pytest.fixture(params=list(CONFIGS))
def pair(request, tmp_path):
    hf, config = _save_hf(request.param, tmp_path)
    model = load_model(str(tmp_path), config, torch.float32, "cpu", "auto")
    return hf, model, config


def test_full_prompt_matches_hf(pair):
    hf, model, config = pair
    ids = _prompt(40, seed=2)
    (logits,) = PagedRunner(model, config).extend([0], [ids])
    ref = _hf_logits(hf, ids)
    assert ref.abs().max() > 0.5  # the comparison is not trivially small numbers
    _assert_close(logits, ref)


def test_prefix_extend_then_decode_matches_hf(pair):
    hf, model, config = pair
    ids = _prompt(36, seed=3)
    ref = _hf_logits(hf, ids)
    runner = PagedRunner(model, config)
    k, m = 11, 30
    (first,) = runner.extend([0], [ids[:k]])
    (second,) = runner.extend([0], [ids[k:m]])
    _assert_close(first, ref[:k])
    _assert_close(second, ref[k:m])
    for t in range(m, len(ids)):
        (step,) = runner.extend([0], [[ids[t]]])
        _assert_close(step, ref[t : t + 1])


def test_mixed_batch_matches_hf(pair):
    hf, model, config = pair
    prompts = [_prompt(n, seed=10 + n) for n in (23, 7, 15)]
    runner = PagedRunner(model, config)
    # a cached prefix for the last request, so one batch mixes fresh and prefixed sequences
    runner.extend([2], [prompts[2][:5]])
    outs = runner.extend([0, 1, 2], [prompts[0], prompts[1], prompts[2][5:]])
    _assert_close(outs[0], _hf_logits(hf, prompts[0]))
    _assert_close(outs[1], _hf_logits(hf, prompts[1]))
    _assert_close(outs[2], _hf_logits(hf, prompts[2])[5:])
    # then a batched decode step over all three
    nxt = [3, 4, 5]
    steps = runner.extend([0, 1, 2], [[t] for t in nxt])
    for p, t, step in zip(prompts, nxt, steps):
        _assert_close(step, _hf_logits(hf, p + [t])[-1:])


def test_tied_embeddings_share_storage(tmp_path):
    _, config = _save_hf("qwen3", tmp_path)
    model = load_model(str(tmp_path), config, torch.float32, "cpu", "auto")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "model.layers.0.self_attn.qkv_proj.weight" in names


def test_sharded_checkpoint_loads(tmp_path):
    hf, config = _save_hf("qwen2", tmp_path, max_shard_size="100KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    model = load_model(str(tmp_path), config, torch.float32, "cpu", "safetensors")
    ids = _prompt(9, seed=4)
    (logits,) = PagedRunner(model, config).extend([0], [ids])
    _assert_close(logits, _hf_logits(hf, ids))


def _rewrite(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def test_unknown_tensor_is_named(tmp_path):
    _, config = _save_hf("llama", tmp_path)
    _rewrite(tmp_path, lambda t: t.__setitem__("model.layers.0.self_attn.foo.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.foo\.weight"):
        load_model(str(tmp_path), config, torch.float32, "cpu", "auto")


def test_wrong_shape_is_named(tmp_path):
    _, config = _save_hf("llama", tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(tmp_path, lambda t: t.__setitem__(name, torch.zeros(3, 64)))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_model(str(tmp_path), config, torch.float32, "cpu", "auto")


def test_missing_tensor_is_named(tmp_path):
    _, config = _save_hf("qwen2", tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(tmp_path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_model(str(tmp_path), config, torch.float32, "cpu", "auto")


def test_bad_payload_leaves_model_untouched(pair):
    _, model, _ = pair
    before = {n: p.clone() for n, p in model.named_parameters()}
    good = ("model.norm.weight", torch.zeros(64))
    bad = ("model.layers.0.mlp.gate_proj.weight", torch.zeros(5, 5))
    with pytest.raises(ValueError, match="gate_proj"):
        model.load_weights([good, bad])
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_engine_names_load_whole_stacked_params(pair):
    _, model, _ = pair
    params = dict(model.named_parameters())
    new = torch.randn_like(params["model.layers.0.self_attn.qkv_proj.weight"])
    loaded = model.load_weights([("model.layers.0.self_attn.qkv_proj.weight", new)])
    assert torch.equal(params["model.layers.0.self_attn.qkv_proj.weight"], new)
    assert ("model.layers.0.self_attn.qkv_proj.weight", "k") in loaded


def test_dummy_load_is_seeded_and_reads_no_weights(tmp_path):
    config = CONFIGS["qwen3"]()
    config.architectures = ["Qwen3ForCausalLM"]
    a = load_model(str(tmp_path), config, torch.float32, "cpu", "dummy")
    b = load_model(str(tmp_path), config, torch.float32, "cpu", "dummy")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert torch.all(a.model.norm.weight == 1)
    assert abs(a.model.embed_tokens.weight.std().item() - 0.02) < 0.005
    (logits,) = PagedRunner(a, config).extend([0], [_prompt(5, seed=0)])
    assert torch.isfinite(logits).all()


def test_bfloat16_build_keeps_rope_in_float32(tmp_path):
    config = CONFIGS["llama"]()
    config.architectures = ["LlamaForCausalLM"]
    model = load_model(str(tmp_path), config, torch.bfloat16, "cpu", "dummy")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32


def test_rope_matches_hf_llama3():
    config = CONFIGS["llama"]()
    ours = get_model_class("LlamaForCausalLM")(config).model.rotary_emb
    theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    assert torch.equal(ours.inv_freq, theirs.inv_freq)


def test_registry_rejects_unknown_architecture():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_resolve_dtype():
    config = transformers.Qwen3Config(dtype="bfloat16")
    assert resolve_dtype("auto", config, "cpu") == torch.float32
    assert resolve_dtype("auto", config, "cuda") == torch.bfloat16
    assert resolve_dtype("float16", config, "cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", config, "cpu")
