"""Routed experts out (--enable-return-routed-experts, per-request return_routed_experts), as
SGLang sends them: meta_info["routed_experts"] = base64 of int32 [prompt + output - 1, layers,
top_k], -1 on dense layers. Oracle: HF transformers' router top-k over the same tokens."""

from __future__ import annotations

import pytest
import torch

from engine.core.routed_experts import decode_routed_experts
from tests.engine.conftest import random_prompts

GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def routes_engine(moe_mixed_model_dir):
    from engine import Engine

    eng = Engine(model_path=moe_mixed_model_dir, dtype="float32", device="cpu", enable_return_routed_experts=True,
                 enable_deterministic_inference=True)
    yield eng
    eng.shutdown()


def _routes(out: dict) -> torch.Tensor:
    return torch.from_numpy(decode_routed_experts(out["meta_info"]["routed_experts"], LAYERS, TOP_K).copy())


def _hf_routes(model_dir: str, tokens: list[int]) -> torch.Tensor:
    """HF's router top-k ids, per token, of every sparse layer, in one forward."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    seen = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out, l=l: seen.__setitem__(l, out[2]))
             for l, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")]
    with torch.no_grad():
        hf(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    out = torch.full((len(tokens), LAYERS, TOP_K), -1, dtype=torch.int32)
    for layer, ids in seen.items():
        out[:, layer] = ids.to(torch.int32)
    return out


def test_routes_equal_hf_router_topk(routes_engine, moe_mixed_model_dir):
    prompts = random_prompts(3, 1000, lengths=(5, 50), seed=11)
    outs = routes_engine.generate(input_ids=prompts, sampling_params=GREEDY, return_routed_experts=True)
    for prompt, out in zip(prompts, outs):
        tokens = prompt + out["output_ids"][:-1]
        routes = _routes(out)
        assert routes.shape == (len(tokens), LAYERS, TOP_K)
        assert (routes[:, 1] == -1).all() and (routes[:, 0] >= 0).all()  # layer 1 is dense (mlp_only_layers)
        assert torch.equal(routes, _hf_routes(moe_mixed_model_dir, tokens))


def test_cached_prefix_tokens_keep_their_routes(routes_engine):
    prompt = random_prompts(1, 1000, lengths=(40, 40), seed=12)[0]
    assert routes_engine.flush_cache()
    cold = routes_engine.generate(input_ids=prompt, sampling_params=GREEDY, return_routed_experts=True)
    warm = routes_engine.generate(input_ids=prompt + cold["output_ids"][:5], sampling_params=GREEDY,
                                  return_routed_experts=True)
    assert warm["meta_info"]["cached_tokens"] >= 40
    n = len(prompt) + 4  # cold's routed tokens that warm's prompt shares
    assert torch.equal(_routes(warm)[:n], _routes(cold)[:n])
    assert len(_routes(warm)) == len(prompt) + 5 + GREEDY["max_new_tokens"] - 1


def test_only_when_asked_and_per_prompt(routes_engine):
    prompts = random_prompts(2, 1000, lengths=(3, 9), seed=13)
    outs = routes_engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 3},
                                  return_routed_experts=[True, False])
    assert "routed_experts" in outs[0]["meta_info"] and "routed_experts" not in outs[1]["meta_info"]
    assert len(_routes(outs[0])) == len(prompts[0]) + len(outs[0]["output_ids"]) - 1


def test_start_len_returns_the_routes_from_that_position(routes_engine):
    """SGLang's routed_experts_start_len (miles' continued rollouts): positions [start, prompt +
    output - 1), the start echoed in meta_info; per prompt, up to the whole prompt; others refused."""
    prompts = random_prompts(2, 1000, lengths=(8, 8), seed=14)
    whole = routes_engine.generate(input_ids=prompts, sampling_params=GREEDY, return_routed_experts=True)
    parts = routes_engine.generate(input_ids=prompts, sampling_params=GREEDY, return_routed_experts=True,
                                   routed_experts_start_len=[5, 8])
    for full, part, start in zip(whole, parts, (5, 8)):
        assert full["meta_info"]["routed_experts_start_len"] == 0
        assert part["meta_info"]["routed_experts_start_len"] == start
        assert torch.equal(_routes(part), _routes(full)[start:])
        assert len(_routes(part)) == 8 + GREEDY["max_new_tokens"] - 1 - start
    for bad in (9, -1, True, 2.0):
        with pytest.raises(ValueError, match=r"routed_experts_start_len must be in \[0, 8\]"):
            routes_engine.generate(input_ids=prompts[0], sampling_params=GREEDY, return_routed_experts=True,
                                   routed_experts_start_len=bad)


def test_a_core_process_returns_the_same_routes(routes_engine, moe_mixed_model_dir):
    """The core encodes a step's routes; with --core-process they cross the pipe as the same strings.
    Requests of different lengths finish in one step: one gather for them all, split per request."""
    from engine import Engine

    prompts = random_prompts(4, 1000, lengths=(3, 30), seed=14)
    want = routes_engine.generate(input_ids=prompts, sampling_params=GREEDY, return_routed_experts=True)
    with Engine(model_path=moe_mixed_model_dir, dtype="float32", device="cpu", enable_return_routed_experts=True,
                enable_deterministic_inference=True, core_process=True) as eng:
        got = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_routed_experts=True)
    for w, g in zip(want, got, strict=True):
        assert isinstance(g["meta_info"]["routed_experts"], str)
        assert g["meta_info"]["routed_experts"] == w["meta_info"]["routed_experts"]
        assert len(_routes(g)) == len(prompts[got.index(g)]) + GREEDY["max_new_tokens"] - 1


def test_refused_without_the_server_flag(moe_mixed_model_dir):
    from engine import Engine

    eng = Engine(model_path=moe_mixed_model_dir, dtype="float32", device="cpu")
    try:
        with pytest.raises(ValueError, match="--enable-return-routed-experts"):
            eng.generate(input_ids=[1, 2, 3], return_routed_experts=True)
        with pytest.raises(ValueError, match="return_routed_experts must be a bool"):
            eng.generate(input_ids=[1, 2, 3], return_routed_experts="yes")
        assert eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})["output_ids"]
    finally:
        eng.shutdown()


def test_flag_refused_on_a_dense_model(tiny_model_dir):
    from engine import Engine

    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        Engine(model_path=tiny_model_dir, dtype="float32", device="cpu", enable_return_routed_experts=True)


def test_http_generate_returns_and_refuses(routes_engine, moe_mixed_model_dir):
    from fastapi.testclient import TestClient

    from engine import Engine
    from engine.server.http import create_app

    body = {"input_ids": [4, 5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_routed_experts": True}
    with TestClient(create_app(routes_engine)) as client:
        reply = client.post("/generate", json=body)
        assert reply.status_code == 200, reply.text
        direct = routes_engine.generate(input_ids=body["input_ids"], sampling_params=body["sampling_params"],
                                        return_routed_experts=True)
        assert reply.json()["meta_info"]["routed_experts"] == direct["meta_info"]["routed_experts"]
        part = client.post("/generate", json={**body, "routed_experts_start_len": 3}).json()["meta_info"]
        assert part["routed_experts_start_len"] == 3
        assert torch.equal(_routes({"meta_info": part}), _routes(direct)[3:])
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "return_routed_experts": True, "routed_experts_start_len": 2, "return_meta_info": True})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["meta_info"]["routed_experts_start_len"] == 2
        for bad in ({"routed_experts_start_len": 5}, {"routed_experts_start_len": "1"}, {"return_indexer_topk": True}):
            reply = client.post("/generate", json={**body, **bad})
            assert reply.status_code == 400 and next(iter(bad)) in reply.text, reply.text
        assert client.post("/generate", json={**body, "return_indexer_topk": False}).status_code == 200
    plain = Engine(model_path=moe_mixed_model_dir, dtype="float32", device="cpu")
    try:
        with TestClient(create_app(plain)) as client:
            reply = client.post("/generate", json=body)
            assert reply.status_code == 400 and "--enable-return-routed-experts" in reply.text, reply.text
            assert client.post("/generate", json={**body, "return_routed_experts": False}).status_code == 200
    finally:
        plain.shutdown()


def test_rollout_samples_carry_routes(routes_engine):
    from rollout.manager import RolloutManager

    manager = RolloutManager([routes_engine], return_routed_experts=True)
    prompts = random_prompts(2, 1000, lengths=(4, 12), seed=14)
    groups = manager.generate(prompts, {"max_new_tokens": 4, "temperature": 1.0}, n=2)
    for prompt, group in zip(prompts, groups):
        for sample in group:
            routes = decode_routed_experts(sample.routed_experts, LAYERS, TOP_K)
            assert len(routes) == len(prompt) + len(sample.response_ids) - 1
    assert RolloutManager([routes_engine]).generate(prompts, {"max_new_tokens": 2})[0][0].routed_experts is None


# ---- trainer parity: the Policy (engine model code) vs the deterministic engine ------------------
@pytest.fixture(scope="module")
def policy(moe_mixed_model_dir):
    from trainer_bridge.policy import Policy

    return Policy.from_pretrained(moe_mixed_model_dir)


@pytest.fixture(scope="module")
def rollouts(routes_engine):
    prompts = random_prompts(5, 1000, lengths=(1, 70), seed=15)
    params = [{"max_new_tokens": 6 + 3 * i, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True}
              for i in range(5)]
    outs = routes_engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                  return_routed_experts=True)
    return prompts, outs


def _engine_logprobs(out: dict) -> torch.Tensor:
    return torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]], dtype=torch.float32)


def test_policy_logprobs_and_routes_equal_the_rollout(policy, rollouts):
    prompts, outs = rollouts
    responses = [o["output_ids"] for o in outs]
    ours = policy.rollout_logprobs(prompts, responses)
    routes = policy.rollout_routes(prompts, responses)
    for out, lp, r in zip(outs, ours, routes):
        assert torch.equal(lp.detach(), _engine_logprobs(out))  # logprob diff 0
        assert torch.equal(r, _routes(out))  # route agreement 1.0


def test_policy_replays_given_routes(policy, rollouts):
    prompts, outs = rollouts
    responses = [o["output_ids"] for o in outs]
    given = [o["meta_info"]["routed_experts"] for o in outs]
    replayed = policy.rollout_logprobs(prompts, responses, routed_experts=given)
    for out, lp in zip(outs, replayed):  # the routes agree already, so replay changes no bit
        assert torch.equal(lp.detach(), _engine_logprobs(out))
    # other routes give other logprobs: the replay is really used (and stays differentiable)
    swapped = [(_routes(o) + 1) % 4 for o in outs]
    swapped = [torch.where(_routes(o) < 0, _routes(o), s) for o, s in zip(outs, swapped)]
    policy.zero_grad()
    moved = policy.rollout_logprobs(prompts, responses, routed_experts=swapped)
    assert not torch.equal(moved[0].detach(), replayed[0].detach())
    sum(lp.sum() for lp in moved).backward()
    grad = policy.model.model.layers[0].mlp.experts.gate_up_proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    policy.zero_grad()
    with pytest.raises(ValueError, match="expected"):
        policy.rollout_logprobs(prompts[:1], responses[:1], routed_experts=[_routes(outs[0])[:-1]])


def test_the_route_reader_encodes_each_request_s_slots_on_its_threads():
    """Many requests at once take the threaded encode: each string decodes to that request's slots' rows."""
    from engine.core.routed_experts import RouteReader

    gen = torch.Generator().manual_seed(0)
    routes = torch.randint(-1, 128, (200, 3, 8), dtype=torch.int32, generator=gen)
    slots = [torch.randperm(200, generator=gen)[:n] for n in (5, 1, 17, 40, 9, 33)]
    reader = RouteReader()
    for _ in range(2):  # the second read reuses what the first set up
        got = reader.read(routes, slots)
        assert len(got) == len(slots)
        for text, s in zip(got, slots):
            assert torch.equal(torch.from_numpy(decode_routed_experts(text, 3, 8).copy()), routes[s])
