"""SGLang drop-in: the bodies slime, Miles and SGLang's own tests send, and the reply fields they
read (shared/reference/sglang-rl-api.md, addendum A1-A4)."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient

from engine.server.http import create_app

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def slime_body(input_ids: list[int]) -> dict:
    """slime's rollout /generate body (slime/rollout/sglang_rollout.py)."""
    return {"input_ids": input_ids, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 4,
                                "stop": None, "stop_token_ids": None, "skip_special_tokens": False,
                                "no_stop_trim": True, "spaces_between_special_tokens": False,
                                "ignore_eos": True}}


def test_slime_generate_body_matches_in_process_api(client, engine):
    resp = client.post("/generate", json=slime_body([5, 6, 7, 8]))
    assert resp.status_code == 200, resp.text
    out = resp.json()
    direct = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY, return_logprob=True)
    assert out["output_ids"] == direct["output_ids"]
    assert [tok for _, tok, _ in out["meta_info"]["output_token_logprobs"]] == direct["output_ids"]
    assert out["meta_info"]["weight_version"] == "default"


def test_null_sampling_fields_take_their_defaults(client):
    """SGLang 0.5.23: an explicit null selects the field's default."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {**GREEDY, "top_k": None, "min_p": None, "n": None}}
    nulls = client.post("/generate", json=body)
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["output_ids"] == client.post("/generate", json={**body, "sampling_params": GREEDY}).json()[
        "output_ids"]


def test_unknown_fields_are_ignored_and_logged_once(client, engine, caplog):
    miles = {**slime_body([5, 6, 7, 8]), "return_routed_experts": False, "return_indexer_topk": False,
             "routed_dp_rank": None, "extra_key": None, "some_future_field": {"x": 1}}
    with caplog.at_level(logging.DEBUG, logger="tandem"):
        first = client.post("/generate", json=miles)
        second = client.post("/generate", json=miles)
    assert first.status_code == second.status_code == 200, first.text
    assert first.json()["output_ids"] == second.json()["output_ids"]
    logged = [r.getMessage() for r in caplog.records if "some_future_field" in r.getMessage()]
    assert len(logged) == 1 and "ignoring unknown field" in logged[0]
    # Miles' weight-sync bodies carry `selector`
    paused = client.post("/pause_generation", json={"mode": "retract", "selector": "all"})
    assert paused.status_code == 200
    assert client.post("/continue_generation", json={"selector": "all"}).status_code == 200


def test_return_text_in_logprobs_and_input_logprobs(client, engine):
    body = {"input_ids": [5, 6, 7], "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 2, "return_text_in_logprobs": True}
    meta = client.post("/generate", json=body).json()["meta_info"]
    tok = engine.tokenizer
    assert [e[2] for e in meta["output_token_logprobs"]] == [tok.decode([e[1]]) for e in meta["output_token_logprobs"]]
    assert meta["input_token_logprobs"][0][0] is None and [e[1] for e in meta["input_token_logprobs"]] == [5, 6, 7]
    for pos in meta["output_top_logprobs"]:
        assert len(pos) == 2 and all(isinstance(e[2], str) for e in pos)
    # greedy: the chosen token is the top-1 entry, bit for bit (SGLang's run_logprob_check)
    assert [pos[0] for pos in meta["output_top_logprobs"]] == meta["output_token_logprobs"]


def test_flush_cache_get_and_post(client):
    for method in ("GET", "POST"):
        resp = client.request(method, "/flush_cache")
        assert resp.status_code == 200 and resp.text.startswith("Cache flushed.")


def test_info_routes(client, engine, tiny_model_dir):
    info = client.get("/get_model_info").json()
    assert info == client.get("/model_info").json()
    assert info["model_path"] == tiny_model_dir and info["weight_version"] == "default"
    assert client.get("/get_weight_version").json() == {"weight_version": "default"}
    server = client.get("/get_server_info").json()
    assert set(server) == set(client.get("/server_info").json())
    # slime's and Miles' launchers compare these with what they asked for
    assert server["enable_memory_saver"] is False and server["tp_size"] == 1 and server["dp_size"] == 1
    assert server["context_len"] == engine.info.context_len and server["dtype"] == "float32"
    assert server["api_key"] is None and "admin_api_key" in server
    assert server["num_gpus"] == 1


def test_server_info_counts_the_gpus_of_tensor_parallel_ranks(client, engine, monkeypatch):
    """slime's external-engine setup takes num_gpus first to size the weight-sync group."""
    real = engine.server_info
    monkeypatch.setattr(engine, "server_info", lambda stats: {**real(stats), "tp_size": 4})
    server = client.get("/server_info").json()
    assert server["tp_size"] == 4 and server["num_gpus"] == 4


def test_v1_models_and_card(client, engine, tiny_model_dir):
    models = client.get("/v1/models").json()
    card = models["data"][0]
    assert card["id"] == tiny_model_dir and card["max_model_len"] == engine.info.context_len
    assert client.get(f"/v1/models/{tiny_model_dir}").json() == card
    missing = client.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_v1_loads_counts_requests(engine_factory):
    """slime's abort_servers_until_idle sums num_total_reqs over `loads`."""
    eng = engine_factory()
    with TestClient(create_app(eng)) as c:
        assert c.get("/v1/loads").json()["loads"][0]["num_total_reqs"] == 0
        c.post("/pause_generation", json={"mode": "retract"})
        worker = threading.Thread(target=eng.generate, kwargs={"input_ids": [[5, 6]] * 3, "sampling_params": GREEDY})
        worker.start()
        deadline = time.monotonic() + 10
        while eng.get_stats().num_waiting_reqs < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        busy = c.get("/v1/loads").json()["loads"][0]
        assert busy["num_waiting_reqs"] == 3 and busy["num_total_reqs"] == 3
        c.post("/continue_generation")
        worker.join(timeout=30)
        assert c.get("/v1/loads").json()["loads"][0]["num_total_reqs"] == 0


def test_health_generate(engine_factory):
    eng = engine_factory(health_check_timeout=30)
    with TestClient(create_app(eng)) as c:
        assert c.get("/health_generate").status_code == 200
        c.post("/pause_generation", json={"mode": "retract"})
        start = time.monotonic()
        paused = c.get("/health_generate")  # said at once, not after the probe's 30 s
        assert paused.status_code == 503 and time.monotonic() - start < 10
        assert "generation is paused (/continue_generation resumes it)" in paused.json()["message"]
        c.post("/continue_generation")
        assert c.get("/health_generate").status_code == 200
        c.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        released = c.get("/health_generate")
        assert released.status_code == 503 and "its memory is released (kv_cache" in released.json()["message"]
        c.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
        assert c.get("/health_generate").status_code == 200
        assert eng.get_stats().num_waiting_reqs == 0
        eng.shutdown()
        assert c.get("/health").status_code == 503
        assert c.get("/health_generate").status_code == 503


def test_health_generate_probe_that_times_out_is_aborted(engine_factory, monkeypatch):
    """Stale counters (they said generating) and a pause: the probe waits out its timeout, is a
    503, and its request does not stay queued."""
    from engine.server import info_routes

    monkeypatch.setattr(info_routes, "_not_generating", lambda stats: None)
    eng = engine_factory(health_check_timeout=0.5)
    with TestClient(create_app(eng)) as c:
        c.post("/pause_generation", json={"mode": "retract"})
        assert c.get("/health_generate").status_code == 503
        c.post("/continue_generation")
        assert c.get("/health_generate").status_code == 200
        assert eng.get_stats().num_waiting_reqs == 0  # the timed-out probe was aborted


def test_get_weights_by_name_reads_hf_names(client, tiny_model_dir):
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    checkpoint = {k: v for path in safetensors_files(tiny_model_dir) for k, v in load_file(path).items()}
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.norm.weight", "model.embed_tokens.weight"):
        for method in ("GET", "POST"):  # SGLang's tests send a JSON body with GET
            resp = client.request(method, "/get_weights_by_name", json={"name": name, "truncate_size": 3})
            assert resp.status_code == 200, resp.text
            assert torch.tensor(resp.json()).equal(checkpoint[name][:3].float())
    assert len(client.post("/get_weights_by_name", json={"name": "model.norm.weight"}).json()) == min(
        100, checkpoint["model.norm.weight"].shape[0])
    missing = client.post("/get_weights_by_name", json={"name": "model.nope.weight"})
    assert missing.status_code == 400 and "model.nope.weight" in missing.json()["message"]


def test_weights_checksum_tracks_updates(engine_factory, other_model_dir, tiny_model_dir):
    from engine import Engine
    from engine.core.weight_queries import weights_checksum

    a, b = engine_factory(), engine_factory()
    assert a.get_weights_checksum() == b.get_weights_checksum()  # equal weights, equal hash
    before = a.get_weights_checksum()
    ok, message, _ = a.update_weights_from_disk(other_model_dir)
    assert ok, message
    after = a.get_weights_checksum()
    with Engine(model_path=other_model_dir, dtype="float32", device="cpu") as fresh:
        assert after == fresh.get_weights_checksum() != before
        oracle = weights_checksum(fresh.local_core.runner.model.named_parameters())  # white-box oracle
    assert after == oracle and len(after) == 64


def test_update_from_disk_updates_served_model_path(engine_factory, other_model_dir, tiny_model_dir):
    eng = engine_factory()
    with TestClient(create_app(eng)) as c:
        resp = c.post("/update_weights_from_disk", json={"model_path": other_model_dir, "selector": "all"})
        assert resp.status_code == 200 and resp.json()["success"], resp.text
        assert c.get("/model_info").json()["model_path"] == other_model_dir
        assert c.get("/get_server_info").json()["model_path"] == other_model_dir
        assert c.get("/v1/models").json()["data"][0]["id"] == tiny_model_dir  # the served name stays


def test_destroy_weights_update_group(client):
    resp = client.post("/destroy_weights_update_group", json={"group_name": "never-made"})
    assert resp.status_code == 400 and resp.json()["success"] is False and "never-made" in resp.json()["message"]


def test_profile_writes_a_trace_with_the_core_ops(tmp_path, engine_factory):
    eng = engine_factory()
    with TestClient(create_app(eng)) as c:
        assert c.post("/start_profile", json={"output_dir": str(tmp_path)}).text == "Start profiling.\n"
        assert c.post("/start_profile", json={"output_dir": str(tmp_path)}).status_code == 400  # one at a time
        c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY})
        stop = c.post("/stop_profile")
        assert stop.status_code == 200 and stop.text.startswith("Stop profiling.")
        trace = json.loads((tmp_path / stop.text.split("Trace: ")[1].strip()).read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        assert "aten::mm" in names or "aten::addmm" in names  # the core thread's matmuls are in it
        assert c.post("/stop_profile").status_code == 400
        # num_steps: stops by itself after that many forward passes
        c.post("/start_profile", json={"output_dir": str(tmp_path / "steps"), "num_steps": 2})
        c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY})
        deadline = time.monotonic() + 10
        while not list((tmp_path / "steps").glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list((tmp_path / "steps").glob("*.json"))) == 1
        assert c.post("/stop_profile").status_code == 400  # already stopped


def test_profile_start_step_waits_for_forward_passes(tmp_path, engine_factory):
    """slime's / Miles' body: start_step (begin after that many more passes), num_steps, profile_by_stage."""
    eng = engine_factory()
    out = tmp_path / "later"
    with TestClient(create_app(eng)) as c:
        body = {"output_dir": str(out), "start_step": 3, "num_steps": 2, "profile_by_stage": False,
                "record_shapes": False, "with_stack": False}
        assert c.post("/start_profile", json=body).text == "Start profiling.\n"
        assert c.post("/start_profile", json=body).status_code == 400  # one scheduled at a time
        time.sleep(0.3)
        assert not list(out.glob("*.json"))  # no pass yet: not started
        deadline = time.monotonic() + 20
        while not list(out.glob("*.json")) and time.monotonic() < deadline:  # traffic, as in a training run
            c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {**GREEDY, "max_new_tokens": 2}})
            time.sleep(0.02)
        assert len(list(out.glob("*.json"))) == 1  # started after 3 passes, stopped 2 later
        assert c.post("/start_profile", json={**body, "start_step": 1000}).status_code == 200
        assert "had not started" in c.post("/stop_profile").text  # a scheduled start is called off
        # called off, then another scheduled at once: the first's task must not start the second's
        assert c.post("/start_profile", json={**body, "output_dir": str(tmp_path / "a"), "start_step": 1}).status_code == 200
        c.post("/stop_profile")
        assert c.post("/start_profile", json={**body, "output_dir": str(tmp_path / "b"), "start_step": 10 ** 6}).status_code == 200
        c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {**GREEDY, "max_new_tokens": 4}})
        time.sleep(0.3)
        assert not list((tmp_path / "a").glob("*.json")) and "had not started" in c.post("/stop_profile").text
        # a bounded profile stopped by hand: its step count must not stop the next, open-ended one
        assert c.post("/start_profile", json={"output_dir": str(tmp_path / "c"), "num_steps": 3}).status_code == 200
        c.post("/stop_profile")
        assert c.post("/start_profile", json={"output_dir": str(tmp_path / "d")}).status_code == 200
        c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {**GREEDY, "max_new_tokens": 8}})
        time.sleep(0.3)
        stop = c.post("/stop_profile")
        assert stop.status_code == 200 and "/d/" in stop.text, stop.text
        blocker = tmp_path / "file"
        blocker.write_text("x")
        bad_dir = c.post("/start_profile", json={**body, "output_dir": str(blocker / "traces")})
        assert bad_dir.status_code == 400 and "cannot be created" in bad_dir.text  # answered, not only logged
        for bad, word in (({"start_step": -1}, "start_step"), ({"num_steps": 0}, "num_steps"), ({"num_steps": True}, "num_steps"),
                          ({"profile_by_stage": True}, "profile_by_stage"), ({"activities": ["TPU"]}, "TPU")):
            resp = c.post("/start_profile", json={**body, **bad})
            assert resp.status_code == 400 and word in resp.text, resp.text


@pytest.mark.parametrize("path", ["/health", "/get_model_info", "/v1/models", "/v1/loads", "/get_server_info"])
def test_read_routes_answer_200(client, path):
    assert client.get(path).status_code == 200


def test_input_top_logprobs_match_hf(client, tiny_model_dir):
    """SGLang's meta_info.input_top_logprobs: per prompt position (the first is null, at any start) the top k
    [logprob, id, text] under the original distribution; oracle: HF transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32,
                                              attn_implementation="eager").eval()
    prompt = [5, 17, 99, 3, 250, 8]
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected_values, expected_ids = torch.topk(logprobs[:-1], 3, dim=-1)
    for start in (0, 2):
        body = {"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True,
                "logprob_start_len": start, "top_logprobs_num": 3}
        meta = client.post("/generate", json=body).json()["meta_info"]
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(meta["input_token_logprobs"]) == len(prompt) - start
        assert tops[0] is None and meta["input_token_logprobs"][0][0] is None  # SGLang: null at any start
        for pos in range(start + 1, len(prompt)):  # predicts prompt[pos] from prompt[:pos]
            entry = tops[pos - start]
            assert [e[1] for e in entry] == expected_ids[pos - 1].tolist()
            assert [e[0] for e in entry] == pytest.approx(expected_values[pos - 1].tolist(), abs=1e-4)
    plain = client.post("/generate", json={**body, "top_logprobs_num": 0}).json()["meta_info"]
    assert "input_top_logprobs" not in plain


def test_stop_regex_in_generate_body(client):
    """SGLang's sampling_params.stop_regex (a string or a list): the run ends at the first match
    and finish_reason names the pattern; a pattern that does not compile is a 400 naming it."""
    base = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    ref = client.post("/generate", json={"text": "The quick brown fox", "sampling_params": base}).json()
    ok = client.post("/generate", json={"text": "The quick brown fox",
                                        "sampling_params": {**base, "stop_regex": ["\\S\\s"]}})
    assert ok.status_code == 200, ok.text
    out = ok.json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "\\S\\s"}
    assert out["output_ids"] == ref["output_ids"][: len(out["output_ids"])]
    bad = client.post("/generate", json={"text": "hi", "sampling_params": {**base, "stop_regex": "(unclosed"}})
    assert bad.status_code == 400 and "stop_regex" in bad.text


def test_prompt_logprob_lists_have_sglangs_shape(client):
    """SGLang's prompt lists: the default start (-1) gives empty lists (no KeyError for clients that
    read them); a start k gives len(prompt) - k entries whose first value is null, the rest equal
    to the whole prompt's (a client that keeps entry 0 and skips nulls sums the same as on SGLang)."""
    prompt = [5, 17, 99, 3, 250, 8]
    body = {"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 2}
    meta = client.post("/generate", json=body).json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
    whole = client.post("/generate", json={**body, "logprob_start_len": 0}).json()["meta_info"]
    for start in (1, 4):
        part = client.post("/generate", json={**body, "logprob_start_len": start}).json()["meta_info"]
        rows = part["input_token_logprobs"]
        assert [tok for _, tok, _ in rows] == prompt[start:]
        assert rows[0][0] is None and part["input_top_logprobs"][0] is None
        want = whole["input_token_logprobs"][start + 1:]  # (a cached prefix: other shapes, float noise)
        assert [tok for _, tok, _ in rows[1:]] == [tok for _, tok, _ in want]
        assert [lp for lp, _, _ in rows[1:]] == pytest.approx([lp for lp, _, _ in want], abs=1e-4)
        tops = [[tok for _, tok, _ in entry] for entry in part["input_top_logprobs"][1:]]
        assert tops == [[tok for _, tok, _ in entry] for entry in whole["input_top_logprobs"][start + 1:]]
