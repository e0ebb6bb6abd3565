"""A careless caller of Engine.generate / abort_request: every bad argument is a ValueError naming
it, raised before anything reaches the core, and the engine keeps serving with nothing left in
flight (no KV slot held, not paused)."""

from __future__ import annotations

import math

import pytest

from engine.sampling_params import SamplingParams

GEN = {"max_new_tokens": 2, "temperature": 0.0}


def _clean(engine) -> None:
    stats = engine.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.paused) == (0, 0, False)
    engine.check_integrity()  # free + cached + in use == pool: no slot leaked
    assert engine.generate(input_ids=[5, 6], sampling_params=GEN)["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("field,value", [
    ("temperature", float("inf")), ("temperature", float("nan")), ("repetition_penalty", float("inf")),
    ("top_p", float("-inf")), ("frequency_penalty", float("nan")), ("temperature", 10 ** 400),
])
def test_non_finite_sampling_floats_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        SamplingParams.from_dict({field: value})


@pytest.mark.parametrize("field,value,words", [
    ("repetition_penalty", 1e-46, "repetition_penalty must be in [1e-06, 2]"),  # float32's 0: logits inf / NaN
    ("repetition_penalty", 1e-7, "repetition_penalty must be in [1e-06, 2]"),
    ("repetition_penalty", 0, "repetition_penalty must be in [1e-06, 2]"),
    ("repetition_penalty", 2.5, "repetition_penalty must be in [1e-06, 2]"),  # SGLang's upper bound
    ("temperature", 1e39, "temperature must be >= 0 (and a float32)"),  # inf in float32
    ("logit_bias", {"1" * 5000: 1.0}, "logit_bias keys must be token ids"),  # not Python's int() digit limit
])
def test_sampling_values_past_float32_or_sglangs_ranges_are_refused(field, value, words):
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({field: value}).validate(vocab_size=100)
    assert words in str(err.value) and "sys.set_int_max_str_digits" not in str(err.value)


def test_the_edges_of_those_ranges_are_served(engine):
    for params in ({"repetition_penalty": 2.0}, {"repetition_penalty": 1e-6}, {"temperature": 3e38}):
        out = engine.generate(input_ids=[5, 6, 5], sampling_params={**GEN, **params, "ignore_eos": True},
                              return_logprob=True, logprob_distribution="processed")
        logprobs = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        assert len(logprobs) == 2 and all(math.isfinite(v) for v in logprobs), (params, logprobs)


@pytest.mark.parametrize("sampling_params,message", [
    ("temperature=0", "sampling_params must be a dict .* got str"),
    (5, "sampling_params must be a dict .* got int"),
    ([1], "sampling_params must be a dict .* got int"),
    # slime's top-p replay with nothing truncated: every id of the vocab, every token (set top_p < 1)
    ({"max_new_tokens": 2, "custom_params": {"return_top_p_token_ids": True}}, "sets none of them .* top_p < 1"),
])
def test_sampling_params_of_the_wrong_type(engine, sampling_params, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(input_ids=[5, 6], sampling_params=sampling_params)
    _clean(engine)


@pytest.mark.parametrize("kwargs,message", [
    ({"input_ids": 5}, "input_ids must be a list of ints .* got int"),
    ({"input_ids": {5: 6}}, "input_ids must be a list of ints .* got dict"),  # it iterated as [5]
    ({"prompt": 5}, "prompt must be a string or a list of strings, got int"),
    ({"prompt": "\ud800"}, r"prompt is not valid Unicode text: it has a lone surrogate '\\ud800' at character 0"),
    ({"prompt": ["ok", "a\udfffb"]}, "lone surrogate .* at character 1"),
    ({"input_ids": [5, 6], "rid": 5}, "rid must be a string or a list of strings"),
    ({"input_ids": [5, 6], "rid": {"a": 1}}, "rid must be a string or a list of strings"),
    ({"input_ids": [5, 6], "rid": [None]}, "rid must be a string or a list of strings"),
    ({"input_ids": [5, 6], "return_logprob": "yes"}, "return_logprob must be a bool, got str"),
    ({"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": True}, "logprob_start_len must be -1"),
    ({"input_ids": [5, 6], "return_logprob": True, "logprob_distribution": []}, "logprob_distribution must be one of"),
    ({"input_ids": [5, 6], "return_logprob": True, "logprob_distribution": ""}, "logprob_distribution must be one of"),
])
def test_bad_generate_arguments(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(sampling_params=GEN, **kwargs)
    _clean(engine)


def test_top_logprobs_num_true_is_refused_not_a_failed_step(engine):
    """True passed isinstance(int) and reached torch.topk in the core, which failed the whole batch's step."""
    with pytest.raises(ValueError, match="top_logprobs_num must be an int in \\[0, 1024\\], got True"):
        engine.generate(input_ids=[5, 6], sampling_params=GEN, return_logprob=True, top_logprobs_num=True)
    out = engine.generate(input_ids=[5, 6], sampling_params=GEN, return_logprob=True, top_logprobs_num=1)
    assert len(out["meta_info"]["output_top_logprobs"]) == 2
    _clean(engine)


def test_abort_with_no_rid_aborts_nothing(engine):
    """SGLang: no rid and no abort_all is a no-op; it used to abort every request in flight."""
    import threading

    results = {}
    engine.pause_generation("in_place")  # the request waits, so it is surely in flight below
    try:
        worker = threading.Thread(target=lambda: results.update(out=engine.generate(
            input_ids=[5, 6], sampling_params=GEN, rid="keep-me")))
        worker.start()
        for _ in range(200):
            if engine.get_stats().num_waiting_reqs == 1:
                break
            threading.Event().wait(0.01)
        engine.abort_request()
        engine.abort_request("")
        engine.abort_request("no-such-rid")
    finally:
        engine.continue_generation()
    worker.join(timeout=30)
    assert results["out"]["meta_info"]["finish_reason"]["type"] == "length"
    _clean(engine)


@pytest.mark.parametrize("stop", [{"stop": ["a"]}, {"stop_regex": "a+"}])
def test_stop_text_without_a_tokenizer_is_refused(engine_factory, stop):
    """skip_tokenizer_init: no text is ever built, so a stop string could never match (it was
    accepted and ignored)."""
    eng = engine_factory(skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init .* use stop_token_ids"):
        eng.generate(input_ids=[5, 6], sampling_params={**GEN, **stop})
    assert eng.generate(input_ids=[5, 6], sampling_params={**GEN, "stop_token_ids": [7]})["output_ids"]
