"""Multi-LoRA serving against HF transformers + PEFT (float32) on the tiny model: the oracle's greedy
tokens and logprobs; mixed batches (two adapters + the base) equal to each run alone, bitwise in
deterministic mode; the base untouched by loaded adapters; adapters from tensors (plain and
flattened bucket); the radix cache never shared across adapters; unload while in use waits."""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest

# peft (the oracle) is imported by the fixtures only: it imports triton, which the Triton
# interpreter tests must find unimported at collection (they set TRITON_INTERPRET first)
if importlib.util.find_spec("peft") is None:
    pytest.skip("needs peft (the test extra)", allow_module_level=True)

from tests.engine.lora_setup import GREEDY, PROMPTS, engine_greedy, make_peft_adapter, peft_greedy  # noqa: E402

ENGINE = {"dtype": "float32", "device": "cpu"}


@pytest.fixture(scope="module")
def adapters(model_a, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {"a": make_peft_adapter(model_a, root / "a", seed=1), "b": make_peft_adapter(model_a, root / "b", seed=2)}


@pytest.fixture(scope="module")
def oracle(model_a, adapters):
    """HF + PEFT greedy (ids, logprobs) per adapter, None for the base model."""
    return {name: peft_greedy(model_a, path, PROMPTS) for name, path in [("a", adapters["a"]), ("b", adapters["b"]),
                                                                          (None, None)]}


@pytest.fixture(scope="module")
def lora_engine(model_a, adapters):
    from engine import Engine

    eng = Engine(model_path=model_a, **ENGINE, lora_paths=[f"a={adapters['a']}", f"b={adapters['b']}"])
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def det_engine(model_a, adapters):
    from engine import Engine

    eng = Engine(model_path=model_a, **ENGINE, enable_deterministic_inference=True,
                 lora_paths=[f"a={adapters['a']}", f"b={adapters['b']}"])
    yield eng
    eng.shutdown()


def _max_diff(xs, ys) -> float:
    return max(abs(x - y) for rx, ry in zip(xs, ys) for x, y in zip(rx, ry))


@pytest.mark.parametrize("name", ["a", "b", None])
def test_greedy_tokens_and_logprobs_equal_hf_peft(lora_engine, oracle, name):
    ids, lps = engine_greedy(lora_engine, PROMPTS, name)
    want_ids, want_lps = oracle[name]
    assert ids == want_ids
    assert _max_diff(lps, want_lps) < 1e-5


def test_adapters_change_the_outputs(oracle):
    """The oracle itself: random non-zero lora_B, so each adapter's tokens differ from the base's."""
    assert oracle["a"][0] != oracle[None][0] and oracle["b"][0] != oracle[None][0]
    assert oracle["a"][0] != oracle["b"][0]


def test_mixed_batch_equals_each_alone_bitwise_deterministic(det_engine, oracle):
    names = ["a", "b", None]
    mixed = det_engine.generate(input_ids=PROMPTS * 3, sampling_params=GREEDY, return_logprob=True,
                                lora_path=[n for n in names for _ in PROMPTS])
    for k, name in enumerate(names):
        alone = det_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, lora_path=name)
        for got, want in zip(mixed[k * len(PROMPTS):(k + 1) * len(PROMPTS)], alone):
            assert got["output_ids"] == want["output_ids"]
            assert got["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]  # bitwise
        assert [o["output_ids"] for o in alone] == oracle[name][0]


def test_base_bitwise_unchanged_by_loaded_adapters(model_a, det_engine):
    from engine import Engine

    plain = Engine(model_path=model_a, **ENGINE, enable_deterministic_inference=True)
    try:
        want = plain.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    finally:
        plain.shutdown()
    got = det_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    assert [o["meta_info"]["output_token_logprobs"] for o in got] == \
        [o["meta_info"]["output_token_logprobs"] for o in want]


def test_max_loras_per_batch_holds_and_others_wait(model_a, adapters, oracle):
    from engine import Engine

    eng = Engine(model_path=model_a, **ENGINE, max_loras_per_batch=1,
                 lora_paths=[f"a={adapters['a']}", f"b={adapters['b']}"])
    seen: list[int] = []
    runner = eng.local_core.runner
    forward_batch = runner._forward_batch

    def recording(batch, inflight):
        seen.append(len({r.lora_id for r in batch.reqs}))
        return forward_batch(batch, inflight)

    runner._forward_batch = recording
    try:
        outs = eng.generate(input_ids=PROMPTS * 3, sampling_params=GREEDY, lora_path=["a"] * 3 + ["b"] * 3 + [None] * 3)
    finally:
        eng.shutdown()
    # one adapter a pass (the base counts as one, as in SGLang): b's and the base's requests waited
    assert max(seen) == 1 and len(seen) >= 3 * GREEDY["max_new_tokens"]
    assert [o["output_ids"] for o in outs] == oracle["a"][0] + oracle["b"][0] + oracle[None][0]


def _adapter_tensors(path):
    import json

    from safetensors.torch import load_file

    return json.loads((path / "adapter_config.json").read_text()), load_file(path / "adapter_model.safetensors")


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_load_from_serialized_tensors_gives_the_disk_adapters_outputs(lora_engine, adapters, oracle, load_format):
    from weight_sync.bucket import FlattenedBucket
    from weight_sync.cuda_ipc import serialize

    config, tensors = _adapter_tensors(adapters["b"])
    payload = FlattenedBucket.pack(list(tensors.items())).to_payload() if load_format else tensors
    name = f"t-{load_format}"
    reply = lora_engine.load_lora_adapter_from_tensors(name, serialize(payload, as_text=True), config, load_format)
    assert reply["success"], reply
    assert name in reply["loaded_adapters"] and reply["loaded_adapters"][name] is None
    try:
        assert engine_greedy(lora_engine, PROMPTS, name)[0] == oracle["b"][0]
    finally:
        assert lora_engine.unload_lora_adapter(name)["success"]


def test_radix_cache_never_shared_across_adapters(lora_engine, adapters, oracle):
    prompt = [list(range(100, 140))]
    one = {"max_new_tokens": 1, "temperature": 0.0}
    cached = lambda name: lora_engine.generate(input_ids=prompt, sampling_params=one, lora_path=name)[0][  # noqa: E731
        "meta_info"]["cached_tokens"]
    assert lora_engine.flush_cache()
    assert cached("a") == 0
    assert cached("b") == 0  # a's prefix is not b's
    assert cached(None) == 0  # nor the base's
    assert cached("a") == 39  # a's own prefix is reused
    # an unloaded adapter's KV goes with it: reloaded under the same name, nothing is cached
    assert lora_engine.unload_lora_adapter("a")["success"]
    assert lora_engine.load_lora_adapter("a", str(adapters["a"]))["success"]
    assert cached("a") == 0
    lora_engine.check_integrity()
    assert engine_greedy(lora_engine, PROMPTS, "a")[0] == oracle["a"][0]


def test_unload_waits_for_the_adapters_requests(lora_engine, adapters):
    lora_engine.pause_generation(mode="retract")  # requests wait in the queue, using their adapter
    done: list = []
    worker = threading.Thread(target=lambda: done.append(
        lora_engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="b")))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while lora_engine.get_stats().num_waiting_reqs == 0:  # queued, holding its adapter
            assert time.monotonic() < deadline, "the request never reached the queue"
            time.sleep(0.01)
        refused = lora_engine.unload_lora_adapter("b", timeout_s=0.3)
        assert not refused["success"] and "in use" in refused["error_message"] and "b" in refused["loaded_adapters"]
    finally:
        lora_engine.continue_generation()
    worker.join(60)
    assert done and len(done[0]["output_ids"]) == GREEDY["max_new_tokens"]
    reply = lora_engine.unload_lora_adapter("b")
    assert reply["success"] and "b" not in reply["loaded_adapters"]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'b'"):
        lora_engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="b")
    assert lora_engine.load_lora_adapter("b", str(adapters["b"]))["success"]


def test_prefill_equals_decode_with_an_adapter_deterministic(det_engine):
    """DESIGN section 4 property 3 with LoRA: a decoded token's logprob, re-read as part of a prompt
    under the same adapter (its prefix from the radix cache), is bitwise the same."""
    prompt = PROMPTS[1]
    out = det_engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, lora_path="a")
    decoded = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    again = det_engine.generate(input_ids=prompt + out["output_ids"], sampling_params={**GREEDY, "max_new_tokens": 1},
                                return_logprob=True, logprob_start_len=len(prompt) - 1, lora_path="a")
    reread = [lp for lp, _, _ in again["meta_info"]["input_token_logprobs"][1:]]  # the first entry is null
    assert reread == decoded
    base = det_engine.generate(input_ids=prompt + out["output_ids"], sampling_params={**GREEDY, "max_new_tokens": 1},
                               return_logprob=True, logprob_start_len=len(prompt) - 1)
    assert [lp for lp, _, _ in base["meta_info"]["input_token_logprobs"][1:]] != decoded  # the adapter's, not the base's


def test_core_process_serves_adapters(model_a, adapters, oracle):
    """The core in its own process: a serialized payload is opened there (off its step), requests
    name the adapter, an unknown one is refused by the front end."""
    from engine import Engine
    from weight_sync.cuda_ipc import serialize

    config, tensors = _adapter_tensors(adapters["a"])
    eng = Engine(model_path=model_a, **ENGINE, core_process=True, enable_lora=True)
    try:
        assert eng.load_lora_adapter_from_tensors("a", serialize(tensors), config)["success"]
        assert engine_greedy(eng, PROMPTS, "a")[0] == oracle["a"][0]
        assert engine_greedy(eng, PROMPTS)[0] == oracle[None][0]
        with pytest.raises(ValueError, match="unknown LoRA adapter 'b'"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="b")
    finally:
        eng.shutdown()
