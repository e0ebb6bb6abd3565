"""Bad adapters and bad requests are refused with a ValueError naming the problem (the routes' 400),
and the engine keeps serving: rank over --max-lora-rank, modules --lora-target-modules does not
allow, unknown module names, shape mismatches, a half pair, more than --max-loaded-loras; lora_path
with LoRA off or naming an unknown adapter; the --lora-paths forms."""

from __future__ import annotations

import importlib.util
import json

import pytest

# peft (the oracle) is imported by the fixtures only: it imports triton, which the Triton
# interpreter tests must find unimported at collection (they set TRITON_INTERPRET first)
if importlib.util.find_spec("peft") is None:
    pytest.skip("needs peft (the test extra)", allow_module_level=True)

from tests.engine.lora_setup import GREEDY, PROMPTS, make_peft_adapter  # noqa: E402

ENGINE = {"dtype": "float32", "device": "cpu"}


@pytest.fixture(scope="module")
def adapter_dir(model_a, tmp_path_factory):
    return make_peft_adapter(model_a, tmp_path_factory.mktemp("lora") / "a", seed=1)


@pytest.fixture(scope="module")
def parts(adapter_dir):
    from safetensors.torch import load_file

    return json.loads((adapter_dir / "adapter_config.json").read_text()), load_file(adapter_dir / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def engine(model_a):
    from engine import Engine

    eng = Engine(model_path=model_a, **ENGINE, enable_lora=True, max_lora_rank=8, max_loaded_loras=2,
                 lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    yield eng
    eng.shutdown()


def _load(engine, config, tensors, name="x") -> dict:
    return engine.load_lora_adapter_from_tensors(name, tensors, config)


def test_rank_over_max_lora_rank(engine, parts):
    config, tensors = parts
    reply = _load(engine, {**config, "r": 16}, tensors)
    assert not reply["success"] and "LoRA rank 16 exceeds --max-lora-rank 8" in reply["error_message"]


def test_target_module_not_allowed(model_a, parts):
    from engine import Engine

    eng = Engine(model_path=model_a, **ENGINE, enable_lora=True, lora_target_modules=["q_proj", "v_proj"])
    try:
        reply = _load(eng, *parts)
    finally:
        eng.shutdown()
    assert not reply["success"] and "not allowed by --lora-target-modules" in reply["error_message"]
    assert "o_proj" in reply["error_message"]


def test_unknown_module_name(engine, parts):
    config, tensors = parts
    bad = dict(tensors)
    bad["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = bad.pop(
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    reply = _load(engine, config, bad)
    assert not reply["success"] and "unknown module 'model.layers.7.self_attn.q_proj'" in reply["error_message"]
    reply = _load(engine, config, {**tensors, "base_model.model.lm_head.weight": tensors[next(iter(tensors))]})
    assert not reply["success"] and "not a PEFT lora_A / lora_B weight" in reply["error_message"]


def test_shape_mismatch_and_half_pair(engine, parts):
    config, tensors = parts
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    reply = _load(engine, config, {**tensors, name: tensors[name][:, :4]})
    assert not reply["success"] and "lora_B has shape [64, 4], expected [64, 8]" in reply["error_message"]
    half = {k: v for k, v in tensors.items() if k != name}
    reply = _load(engine, config, half)
    assert not reply["success"] and "has lora_A but no lora_B" in reply["error_message"]


def test_unsupported_configs(engine, parts):
    config, tensors = parts
    for change, words in [({"use_dora": True}, "DoRA"), ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
                          ({"target_modules": ["embed_tokens"]}, "embed_tokens"), ({"r": 0}, "'r'")]:
        reply = _load(engine, {**config, **change}, tensors)
        assert not reply["success"] and words in reply["error_message"], (change, reply)


def test_max_loaded_loras_and_duplicate_names(engine, parts, adapter_dir):
    assert engine.load_lora_adapter("one", str(adapter_dir))["success"]
    assert _load(engine, *parts, name="two")["success"]
    dup = engine.load_lora_adapter("one", str(adapter_dir))
    assert not dup["success"] and "already loaded" in dup["error_message"]
    third = engine.load_lora_adapter("three", str(adapter_dir))
    assert not third["success"] and "the most --max-loaded-loras allows (2)" in third["error_message"]
    missing = engine.unload_lora_adapter("nope")
    assert not missing["success"] and "'nope' is not loaded" in missing["error_message"]
    for name in ("one", "two"):
        assert engine.unload_lora_adapter(name)["success"]
    no_dir = engine.load_lora_adapter("gone", "/nonexistent/adapter")
    assert not no_dir["success"] and "adapter_config.json does not exist" in no_dir["error_message"]
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]  # still serving


def test_request_naming_unknown_adapter_or_lora_off(engine, model_a):
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path=[None, "nope", None])
    with pytest.raises(ValueError, match="lora_path has 2 values for 3 prompts"):
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path=[None, None])
    from engine import Engine

    plain = Engine(model_path=model_a, **ENGINE)
    try:
        with pytest.raises(ValueError, match="lora_path needs the server started with --enable-lora"):
            plain.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="a")
        reply = plain.load_lora_adapter("a", "/x")
        assert not reply["success"] and "LoRA is not enabled" in reply["error_message"]
    finally:
        plain.shutdown()


def test_core_refuses_an_adapter_gone_since_the_front_end_checked(engine):
    from engine.core.messages import ReqInput
    from engine.sampling_params import SamplingParams

    out = engine.local_core.handle(ReqInput(rid="r", sampling_params=SamplingParams(max_new_tokens=1), seed=0,
                                            input_ids=[1, 2], lora_path="gone"))
    reason = out[0].output["meta_info"]["finish_reason"]
    assert reason["status_code"] == 400 and "unknown LoRA adapter 'gone'" in reason["message"]


def test_lora_paths_forms_and_server_args():
    from engine.config import ServerArgs
    from engine.lora.lora_paths import LoRAPathSpec, parse_lora_path

    assert parse_lora_path("/p/a") == LoRAPathSpec("/p/a", "/p/a")
    assert parse_lora_path("a=/p/a") == LoRAPathSpec("a", "/p/a")
    assert parse_lora_path('{"lora_name": "a", "lora_path": "/p", "pinned": true}') == LoRAPathSpec("a", "/p", True)
    with pytest.raises(ValueError, match="needs string lora_name and lora_path"):
        parse_lora_path('{"lora_name": "a"}')
    assert ServerArgs(model_path="m", lora_paths=["a=/p"]).enable_lora  # SGLang: --lora-paths turns it on
    # SGLang's other forms: {name: path} (Miles passes it so) and a list of objects
    named = ServerArgs(model_path="m", lora_paths={"a": "/p", "b=c": "/q"}).lora_paths
    assert [parse_lora_path(spec) for spec in named] == [LoRAPathSpec("a", "/p"), LoRAPathSpec("b=c", "/q")]
    objects = ServerArgs(model_path="m", lora_paths=[{"lora_name": "a", "lora_path": "/p", "pinned": True}]).lora_paths
    assert [parse_lora_path(spec) for spec in objects] == [LoRAPathSpec("a", "/p", True)]
    with pytest.raises(ValueError, match="lora_paths must be a list of strings"):
        ServerArgs(model_path="m", lora_paths={"a": 5})
    with pytest.raises(ValueError, match="max_loras_per_batch must be a positive integer"):
        ServerArgs(model_path="m", max_loras_per_batch=0)
    with pytest.raises(ValueError, match="tp_size 1 only"):
        ServerArgs(model_path="m", enable_lora=True, tp_size=2)


def test_serialized_lora_payloads_are_opened_off_the_step():
    """The worker opens them as it opens weight payloads: bounded in time, the core stepping meanwhile."""
    from engine.core.messages import LoadLoraReq
    from engine.core.payload_opener import PayloadOpener
    from engine.lora.tensor_payload import lora_tensors

    assert PayloadOpener.wants(LoadLoraReq("x", source=lora_tensors(b"payload", "flattened_bucket")))
    assert not PayloadOpener.wants(LoadLoraReq("x", source=lora_tensors({}, None)))
    with pytest.raises(ValueError, match="load_format 'zip' is not supported"):
        lora_tensors(b"payload", "zip")


def test_pinning_that_would_leave_no_pool_slot_is_refused(model_a, adapter_dir):
    """--max-loras-per-batch 2: one pinned adapter holds a slot, a second would leave none for the others."""
    from engine import Engine

    eng = Engine(model_path=model_a, **ENGINE, enable_lora=True, max_loras_per_batch=2)
    try:
        assert eng.load_lora_adapter("p1", str(adapter_dir), pinned=True)["success"]
        reply = eng.load_lora_adapter("p2", str(adapter_dir), pinned=True)
        assert not reply["success"] and "would leave no pool slot" in reply["error_message"]
        assert eng.load_lora_adapter("p2", str(adapter_dir))["success"]  # unpinned: fine
        assert eng.unload_lora_adapter("p1")["success"]
        assert eng.load_lora_adapter("p3", str(adapter_dir), pinned=True)["success"]  # p1's pin went with it
    finally:
        eng.shutdown()
