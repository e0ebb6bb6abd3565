"""/generate bodies SGLang takes that tandem once refused (GenerateReqInput in io_struct.py): null
for any top-level field (its default), return_logprob / logprob_start_len / top_logprobs_num as
one value per prompt of a batch, and one string rid for a batch (SGLang names the items rid_i)."""

from __future__ import annotations

import pytest

GEN = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
BATCH = [[5, 6, 7], [8, 9, 10, 11]]


def _post(client, body: dict):
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_nulls_mean_the_defaults(client, engine):
    out = _post(client, {"input_ids": [5, 6], "sampling_params": GEN, "return_logprob": None,
                         "logprob_start_len": None, "top_logprobs_num": None, "stream": None, "rid": None,
                         "return_text_in_logprobs": None, "token_ids_logprob": None, "lora_path": None})
    assert "output_token_logprobs" not in out["meta_info"]
    assert out["output_ids"] == engine.generate(input_ids=[5, 6], sampling_params=GEN)["output_ids"]


def test_logprob_fields_per_prompt(client, engine):
    outs = _post(client, {"input_ids": BATCH, "sampling_params": GEN, "return_logprob": [True, False],
                          "logprob_start_len": [0, 1], "top_logprobs_num": [2, 0]})
    first, second = (o["meta_info"] for o in outs)
    assert "output_token_logprobs" not in second and "input_token_logprobs" not in second
    direct = engine.generate(input_ids=BATCH[0], sampling_params=GEN, return_logprob=True, logprob_start_len=0,
                             top_logprobs_num=2)["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):  # batched: equal to float rounding
        assert [e[1] for e in first[key]] == [e[1] for e in direct[key]], key
        assert [e[0] for e in first[key]] == pytest.approx([e[0] for e in direct[key]], abs=1e-4), key
    assert [[e[1] for e in pos] for pos in first["output_top_logprobs"]] == [
        [e[1] for e in pos] for pos in direct["output_top_logprobs"]]
    outs = _post(client, {"input_ids": BATCH, "sampling_params": GEN, "return_logprob": True,
                          "logprob_start_len": [0, 1], "top_logprobs_num": [0, 3]})
    assert [len(o["meta_info"]["input_token_logprobs"]) for o in outs] == [3, 3]
    assert "output_top_logprobs" not in outs[0]["meta_info"]
    assert [len(p) for p in outs[1]["meta_info"]["output_top_logprobs"]] == [3, 3]


def test_per_prompt_values_are_checked(client):
    body = {"input_ids": BATCH, "sampling_params": GEN, "return_logprob": True}
    for field, value, expect in (("return_logprob", [True], "return_logprob has 1 values for 2 prompts"),
                                 ("logprob_start_len", [0, 9], "logprob_start_len must be -1"),
                                 ("top_logprobs_num", [1, -1], "top_logprobs_num must be an int")):
        resp = client.post("/generate", json={**body, field: value})
        assert resp.status_code == 400 and expect in resp.json()["message"], resp.text


def test_logprob_start_len_without_logprobs_is_ignored(client):
    """SGLang reads logprob_start_len only with return_logprob: a client that always sends one
    (past a short prompt) gets its tokens, not a 400."""
    out = client.post("/generate", json={"input_ids": BATCH[0], "sampling_params": GEN, "logprob_start_len": 100})
    assert out.status_code == 200 and "input_token_logprobs" not in out.json()["meta_info"]
    asked = client.post("/generate", json={"input_ids": BATCH[0], "sampling_params": GEN, "logprob_start_len": 100,
                                           "return_logprob": True})
    assert asked.status_code == 400 and "logprob_start_len must be -1" in asked.json()["message"]


def test_an_empty_rid_is_no_name(client, engine):
    """rid "" (which /abort_request takes for none) gets a fresh id, so two clients sending it at
    once do not collide (it was one 200 and "rid '' is already in flight" for the others)."""
    import concurrent.futures

    body = {"input_ids": BATCH[0], "sampling_params": GEN, "rid": ""}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda _: client.post("/generate", json=body), range(3)))
    assert [r.status_code for r in outs] == [200] * 3
    ids = [r.json()["meta_info"]["id"] for r in outs]
    assert len(set(ids)) == 3 and "" not in ids
    batch = _post(client, {"input_ids": BATCH, "sampling_params": GEN, "rid": ["", "named-9"]})
    assert batch[0]["meta_info"]["id"] not in ("", "named-9") and batch[1]["meta_info"]["id"] == "named-9"


def test_one_rid_for_a_batch_names_each_item(client):
    outs = _post(client, {"input_ids": BATCH, "sampling_params": GEN, "rid": "group-7"})
    assert [o["meta_info"]["id"] for o in outs] == ["group-7_0", "group-7_1"]
    single = _post(client, {"input_ids": BATCH[0], "sampling_params": GEN, "rid": "alone-7"})
    assert single["meta_info"]["id"] == "alone-7"
