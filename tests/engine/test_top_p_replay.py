"""slime's top-p replay (custom_params.return_top_p_token_ids): each output token's kept ids and
their offsets, base64 int32 in the finished answer's meta_info. Oracle: HF's logits at every
position of the output, truncated by top_p / top_k / min_p as slime's SGLang patch truncates."""

from __future__ import annotations

import asyncio
import base64
from array import array

import pytest
import torch

from engine.sampling import nucleus
from engine.sampling.nucleus import KeptIds, nucleus_fields

PROMPT = [5, 17, 23, 42, 9, 81]
REPLAY = {"custom_params": {"return_top_p_token_ids": True}}


def _decode(meta: dict) -> list[list[int]]:
    ids = torch.frombuffer(bytearray(base64.b64decode(meta["top_p_token_ids"])), dtype=torch.int32).tolist()
    offsets = torch.frombuffer(bytearray(base64.b64decode(meta["top_p_token_offsets"])), dtype=torch.int32).tolist()
    assert offsets[0] == 0 and offsets[-1] == len(ids) and offsets == sorted(offsets)
    return [ids[a:b] for a, b in zip(offsets, offsets[1:])]


def _oracle_kept(hf_model, ids: list[int], params: dict) -> set[int]:
    """The kept set at the next position: rank < top_k, mass before it <= top_p, prob >= min_p x top1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1].double() / params["temperature"]
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(descending=True, stable=True)
    keep = (torch.cumsum(sorted_probs, 0) - sorted_probs) <= params.get("top_p", 1.0)
    if params.get("top_k", -1) > 0:
        keep &= torch.arange(len(probs)) < params["top_k"]
    keep &= sorted_probs >= sorted_probs[0] * params.get("min_p", 0.0)
    return set(order[keep].tolist())


@pytest.mark.parametrize("params", [
    {"temperature": 1.0, "top_p": 0.5},
    {"temperature": 0.7, "top_p": 0.9, "top_k": 20},
    {"temperature": 1.3, "min_p": 0.2},
])
def test_each_token_comes_with_the_set_its_sampler_kept(engine, hf_model, params):
    sp = {**params, **REPLAY, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 7}
    out = engine.generate(input_ids=PROMPT, sampling_params=sp, return_logprob=True)
    kept = _decode(out["meta_info"])
    assert len(kept) == len(out["output_ids"]) == 12
    context = list(PROMPT)
    for token, ids in zip(out["output_ids"], kept):
        assert token in ids and len(ids) == len(set(ids))
        want = _oracle_kept(hf_model, context, params)
        # the boundary token may part float32 (engine) from float64 (oracle) sums: at most one differs
        assert len(set(ids) ^ want) <= 1, (sorted(ids), sorted(want))
        context.append(token)
    again = engine.generate(input_ids=PROMPT, sampling_params=sp)  # the same seed: the same sets
    assert _decode(again["meta_info"]) == kept


def test_a_greedy_token_keeps_itself_and_other_requests_are_untouched(engine):
    sp = {"temperature": 0.0, "top_p": 0.9, "max_new_tokens": 6, "ignore_eos": True}
    batch = engine.generate(input_ids=[PROMPT, PROMPT], sampling_params=[{**sp, **REPLAY}, sp])
    assert _decode(batch[0]["meta_info"]) == [[t] for t in batch[0]["output_ids"]]
    assert "top_p_token_ids" not in batch[1]["meta_info"] and batch[1]["output_ids"] == batch[0]["output_ids"]


def test_the_ids_come_once_with_the_finished_chunk_of_a_stream(engine):
    sp = {"temperature": 1.0, "top_p": 0.8, "max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 3, **REPLAY}

    async def run():
        return [c async for c in engine.async_generate(input_ids=PROMPT, sampling_params=sp, stream=True)]

    chunks = asyncio.run(run())
    assert all("top_p_token_offsets" not in c["meta_info"] for c in chunks[:-1])
    assert len(_decode(chunks[-1]["meta_info"])) == 5
    whole = engine.generate(input_ids=PROMPT, sampling_params=sp)
    assert _decode(whole["meta_info"]) == _decode(chunks[-1]["meta_info"])


def test_kept_ids_orders_by_logprob_and_counts_the_finite(monkeypatch):
    processed = torch.tensor([[-1.0, float("-inf"), -0.5, -3.0],
                              [float("-inf"), -0.1, float("-inf"), float("-inf")],
                              [-2.0, -2.0, -2.0, -2.0]])
    want = {0: [2, 0, 3], 2: [0, 1, 2, 3]}  # by batch row (row 1 not asked); ties by id
    assert {r: list(a) for r, a in KeptIds.start(processed, [0, 2]).resolve().items()} == want
    monkeypatch.setattr(nucleus, "HEAD_COLUMNS", 2)  # rows keeping more than the head: read after
    assert {r: list(a) for r, a in KeptIds.start(processed, [0, 1, 2]).resolve().items()} == {**want, 1: [1]}
    fields = nucleus_fields([[2, 0, 3], [1], []])
    assert _decode(fields) == [[2, 0, 3], [1], []]
    assert base64.b64decode(fields["top_p_token_offsets"]) == bytes([0, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0])


def test_an_answer_after_a_failed_step_still_has_one_set_per_token():
    """results.error() may answer a request whose last token was taken but whose set was not
    recorded: the token stands for its own set, so the offsets stay tokens + 1 long."""
    from types import SimpleNamespace

    from engine.core.output import build_output
    from engine.sampling_params import SamplingParams
    from engine.scheduler.request import Req

    params = SamplingParams(temperature=1.0, top_p=0.5, custom_params={"return_top_p_token_ids": True})
    req = Req(rid="r", origin_input_ids=[1, 2], sampling_params=params, seed=5)
    req.output_ids, req.output_kept_ids = [7, 9], [array("i", [7, 3])]
    req.finished_reason = {"type": "abort", "message": "step failed"}
    meta = build_output(req, SimpleNamespace(weight_version="v"))["meta_info"]
    assert _decode(meta) == [[7, 3], [9]]


def test_sets_wider_than_the_head_read_the_same(engine, monkeypatch):
    sp = {"temperature": 1.0, "top_p": 0.9, **REPLAY, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 11}
    wide = _decode(engine.generate(input_ids=PROMPT, sampling_params=sp)["meta_info"])
    monkeypatch.setattr(nucleus, "HEAD_COLUMNS", 1)
    narrow = _decode(engine.generate(input_ids=PROMPT, sampling_params=sp)["meta_info"])
    assert narrow == wide and max(map(len, wide)) > 1
