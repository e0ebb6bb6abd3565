"""SGLang's token_ids_logprob: the logprobs of chosen ids at every output (and prompt) position.

Oracles: the full distribution at each position, read from output_top_logprobs with
top_logprobs_num = vocab size (the engine's own full log_softmax), and HF transformers' logits on
the same weights for the processed distribution and the prompt positions."""

from __future__ import annotations

import pytest
import torch

GREEDY = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
SAMPLED = {"max_new_tokens": 5, "temperature": 0.7, "top_k": 20, "sampling_seed": 11, "ignore_eos": True}
PROMPT = [7, 8, 9, 10, 11, 12, 13]
IDS = [40, 3, 17, 3, 200]  # unsorted, with a repeat: kept as asked


@pytest.fixture(scope="module")
def vocab(engine):
    return engine.local_core.parts.vocab_size


def _full(entries) -> dict[int, float]:
    return {tok: lp for lp, tok, _ in entries}


def _values(rows, ids):
    """Checks each row's ids are the requested ones, in order; returns the values."""
    assert all([tok for _, tok, _ in row] == ids for row in rows)
    return [[lp for lp, _, _ in row] for row in rows]


def _flat(rows):
    return [v for row in rows for v in row]


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_output_values_are_the_full_distribution_at_each_position(engine, vocab, params):
    ids = IDS + list(range(vocab))  # every id as well: the sampled one is among them
    out = engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True,
                          top_logprobs_num=vocab, token_ids_logprob=ids)
    meta = out["meta_info"]
    rows = meta["output_token_ids_logprobs"]
    assert len(rows) == len(out["output_ids"]) == 5
    values = _values(rows, ids)
    for i, (row, tops) in enumerate(zip(values, meta["output_top_logprobs"])):
        full = _full(tops)
        assert len(full) == vocab
        assert row == [full[t] for t in ids]  # bit for bit: the same log_softmax
        lp, tok, _ = meta["output_token_logprobs"][i]
        assert row[len(IDS) + tok] == lp  # the sampled token's own logprob, the same number
    assert meta["input_token_ids_logprobs"] == []  # logprob_start_len -1: no prompt positions (SGLang's [])
    # the common path is unchanged: the same tokens and logprobs without the ids
    plain = engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True)
    assert plain["output_ids"] == out["output_ids"]
    assert [e[0] for e in plain["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in meta["output_token_logprobs"]], abs=1e-5)  # (a cached prefix rounds differently)
    assert "output_token_ids_logprobs" not in plain["meta_info"]


def test_processed_distribution_follows_output_token_logprobs(engine, hf_model, vocab):
    params = {"max_new_tokens": 4, "temperature": 0.5, "sampling_seed": 3, "ignore_eos": True}
    out = engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True,
                          logprob_distribution="processed", token_ids_logprob=IDS + list(range(vocab)))
    meta = out["meta_info"]
    logits = _hf_logits(hf_model, PROMPT + out["output_ids"])
    for i, row in enumerate(_values(meta["output_token_ids_logprobs"], IDS + list(range(vocab)))):
        ref = torch.log_softmax(logits[len(PROMPT) - 1 + i] / 0.5, -1)
        assert row[: len(IDS)] == pytest.approx(ref[IDS].tolist(), abs=1e-5, rel=1e-6)
        lp, tok, _ = meta["output_token_logprobs"][i]
        assert row[len(IDS) + tok] == lp


@pytest.mark.parametrize("params", [
    {"temperature": 0.5},  # tempered
    {"temperature": 1.0, "top_k": 3},  # truncated: the rest -inf
    {"temperature": 1.0, "logit_bias": {"67": 100.0}},  # biased: 67 leads with logprob ~0
])
def test_processed_top_logprobs_come_from_the_processed_distribution(engine, hf_model, params):
    """A row's top logprobs are of the distribution its token's logprob is of (SGLang's one
    distribution a row): under "processed", the temperature's, truncation's and bias's; under
    "original" the raw logits' still."""
    sp = {"max_new_tokens": 3, "sampling_seed": 5, "ignore_eos": True, **params}
    outs = [engine.generate(input_ids=PROMPT, sampling_params=sp, return_logprob=True, top_logprobs_num=4,
                            logprob_distribution=d) for d in ("processed", "original")]
    processed, original = (o["meta_info"] for o in outs)
    logits = _hf_logits(hf_model, PROMPT + outs[0]["output_ids"])
    for i, (top, (lp, tok, _)) in enumerate(zip(processed["output_top_logprobs"], processed["output_token_logprobs"])):
        raw = logits[len(PROMPT) - 1 + i]
        if "logit_bias" in params:
            raw = raw.clone()
            raw[67] += 100.0
            assert tok == 67 and top[0][1] == 67 and lp > -1e-3
        if "top_k" in params:  # the three largest kept, the rest -inf
            kept = raw.topk(3).indices
            raw = torch.full_like(raw, float("-inf")).index_copy(0, kept, raw[kept])
            assert top[3][0] == float("-inf")
        ref = torch.log_softmax(raw / params["temperature"], -1)
        assert [e[0] for e in top[:3]] == pytest.approx(ref.topk(3).values.tolist(), abs=1e-5)
        assert [e[1] for e in top[:3]] == ref.topk(3).indices.tolist()
        assert tok in [e[1] for e in top] and dict((t, v) for v, t, _ in top)[tok] == lp  # the token's own value
    plain = torch.log_softmax(_hf_logits(hf_model, PROMPT + outs[1]["output_ids"])[len(PROMPT) - 1], -1)
    assert [e[0] for e in original["output_top_logprobs"][0]] == pytest.approx(plain.topk(4).values.tolist(), abs=1e-5)


@pytest.mark.parametrize("start", [0, 3])
def test_input_positions(engine, hf_model, start):
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True,
                          logprob_start_len=start, token_ids_logprob=IDS)
    meta = out["meta_info"]
    rows = meta["input_token_ids_logprobs"]
    assert len(rows) == len(meta["input_token_logprobs"]) == len(PROMPT) - start
    assert rows[0] is None  # as SGLang's prompt lists: the first entry is null at any start
    rows = rows[1:]
    logits = _hf_logits(hf_model, PROMPT)
    first = start + 1
    for pos, row in zip(range(first, len(PROMPT)), _values(rows, IDS)):
        ref = torch.log_softmax(logits[pos - 1], -1)
        assert row == pytest.approx(ref[IDS].tolist(), abs=1e-5, rel=1e-6)
    assert len(meta["output_token_ids_logprobs"]) == 5
    # asking for the prompt's own ids gives input_token_logprobs' numbers, bit for bit
    own = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True,
                          logprob_start_len=start, token_ids_logprob=PROMPT)["meta_info"]
    for pos, row in zip(range(first, len(PROMPT)), own["input_token_ids_logprobs"][1:]):
        assert row[pos][0] == own["input_token_logprobs"][pos - start][0]


def test_input_positions_across_chunks_match_one_pass(engine_factory, engine):
    """A prompt cut into chunks gathers the ids at each chunk's rows: the same values as in one pass."""
    prompt = list(range(20, 60))
    whole = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True,
                            logprob_start_len=0, token_ids_logprob=IDS)
    chunked = engine_factory(chunked_prefill_size=8).generate(
        input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0, token_ids_logprob=IDS)
    a, b = whole["meta_info"]["input_token_ids_logprobs"], chunked["meta_info"]["input_token_ids_logprobs"]
    assert len(a) == len(b) == len(prompt) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:]):
        assert [e[1] for e in x] == [e[1] for e in y] == IDS
        assert [e[0] for e in x] == pytest.approx([e[0] for e in y], abs=1e-5)


def test_per_prompt_lists_in_a_batch(engine):
    prompts = [PROMPT, [5, 6, 7], [30, 31, 32, 33]]
    lists = [[9, 1], [], [4, 4, 100, 2]]  # the second prompt asks for none
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                           logprob_start_len=1, token_ids_logprob=lists)
    for prompt, ids, out in zip(prompts, lists, outs):
        meta = out["meta_info"]
        if not ids:
            assert "output_token_ids_logprobs" not in meta and "input_token_ids_logprobs" not in meta
            continue
        alone = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True,
                                logprob_start_len=1, token_ids_logprob=ids)["meta_info"]
        for key in ("output_token_ids_logprobs", "input_token_ids_logprobs"):
            got, want = meta[key], alone[key]
            assert len(got) == len(want)
            if key.startswith("input"):  # the first entry is null
                assert got[0] is None and want[0] is None
                got, want = got[1:], want[1:]
            assert _flat(_values(got, ids)) == pytest.approx(_flat(_values(want, ids)), abs=1e-5, rel=1e-6)
        assert len(meta["input_token_ids_logprobs"]) == len(prompt) - 1
    # one flat list is every prompt's
    shared = engine.generate(input_ids=prompts[:2], sampling_params=GREEDY, return_logprob=True,
                             token_ids_logprob=[9, 1])
    assert all([e[1] for e in row] == [9, 1] for o in shared for row in o["meta_info"]["output_token_ids_logprobs"])


def test_n_samples_each_get_the_ids(engine, vocab):
    params = {**SAMPLED, "n": 3}
    outs = engine.generate(input_ids=[PROMPT, [5, 6, 7]], sampling_params=params, return_logprob=True,
                           top_logprobs_num=vocab, token_ids_logprob=[[17, 40], [3]])
    assert len(outs) == 6
    for j, out in enumerate(outs):
        ids = [17, 40] if j < 3 else [3]
        meta = out["meta_info"]
        for row, tops in zip(_values(meta["output_token_ids_logprobs"], ids), meta["output_top_logprobs"]):
            assert row == [_full(tops)[t] for t in ids]


def test_overlap_schedule_gives_the_same_values(engine_factory):
    """Lookahead decode steps (PendingResult read after the next launch), mixed with rows that ask
    for nothing, penalties (sampling after the commit) and the processed distribution."""
    prompts = [[5 + i, 6, 7 + i, 8] for i in range(6)]
    params = [{"max_new_tokens": 6 + i, "temperature": 1.0 if i % 2 else 0.0, "sampling_seed": i, "ignore_eos": True}
              for i in range(6)]
    params[3]["frequency_penalty"] = 1.5
    lists = [[3, 9], [], [200, 1, 1], [4], [], [17, 40, 2]]
    kwargs = dict(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=1,
                  token_ids_logprob=lists)
    plain = engine_factory(enable_deterministic_inference=True)
    overlapped = engine_factory(enable_deterministic_inference=True)
    overlapped.local_core.overlap = True
    for distribution in ("original", "processed"):
        want = plain.generate(**kwargs, logprob_distribution=distribution)
        got = overlapped.generate(**kwargs, logprob_distribution=distribution)
        for key in ("output_token_ids_logprobs", "input_token_ids_logprobs", "output_token_logprobs"):
            assert [o["meta_info"].get(key) for o in got] == [o["meta_info"].get(key) for o in want]
    assert overlapped.local_core.stats.num_lookahead_steps > 3


def test_without_return_logprob_nothing_is_computed_or_returned(engine):
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, token_ids_logprob=IDS)
    assert "output_token_ids_logprobs" not in out["meta_info"]


@pytest.mark.parametrize("bad", [
    [True, 2], [1.0], ["3"], [-1], [10 ** 9], 5, "1,2", {"a": 1}, [[1], 2], [[1]] * 2,
])
def test_bad_values_are_refused_naming_the_argument(engine, bad):
    with pytest.raises(ValueError, match="token_ids_logprob"):
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, token_ids_logprob=bad)


def test_more_ids_than_the_vocabulary_are_refused_before_they_are_read(engine):
    """Millions of ids (each a value per position of the reply) are refused by their count."""
    vocab = engine.local_core.parts.vocab_size
    too_many = 2 * vocab + 1
    with pytest.raises(ValueError, match=f"token_ids_logprob has {too_many} ids, more than twice the vocabulary's {vocab}"):
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, token_ids_logprob=[1] * too_many)
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, token_ids_logprob=[1] * 2 * vocab)
    assert len(out["meta_info"]["output_token_ids_logprobs"][0]) == 2 * vocab


def test_ids_times_positions_are_bounded(engine, monkeypatch):
    """The work a request asks for (ids x (prompt logprob rows + new tokens)) is bounded: past it a
    400 naming the three knobs; at it the request runs."""
    import engine.api.request_builder as builder

    monkeypatch.setattr(builder, "MAX_ID_LOGPROBS", 5 * (len(PROMPT) + 4))
    ids = [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"token_ids_logprob asks for 5 ids at .* positions .* fewer ids"):
        engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 5}, return_logprob=True,
                        token_ids_logprob=ids, logprob_start_len=0)
    out = engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 4}, return_logprob=True,
                          token_ids_logprob=ids, logprob_start_len=0)
    assert len(out["meta_info"]["output_token_ids_logprobs"]) == 4


def test_list_per_prompt_must_match_the_prompts(engine):
    with pytest.raises(ValueError, match="token_ids_logprob has 3 lists for 2 prompts"):
        engine.generate(input_ids=[PROMPT, [5, 6]], sampling_params=GREEDY, return_logprob=True,
                        token_ids_logprob=[[1], [2], [3]])


# ---- HTTP ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(engine):
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    with TestClient(create_app(engine)) as c:
        yield c


def test_http_generate_body(client, engine):
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0,
            "token_ids_logprob": IDS}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    direct = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
                             token_ids_logprob=IDS)["meta_info"]
    for key in ("output_token_ids_logprobs", "input_token_ids_logprobs"):
        want = [None if row is None else [list(e) for e in row] for row in direct[key]]
        assert meta[key] == want  # JSON: [lp, id, null]
    assert meta["input_token_ids_logprobs"][0] is None
    # batch: one list per prompt
    batch = client.post("/generate", json={**body, "input_ids": [PROMPT, [5, 6]], "token_ids_logprob": [[1], [2, 3]]})
    assert batch.status_code == 200, batch.text
    assert [[e[1] for e in o["meta_info"]["output_token_ids_logprobs"][0]] for o in batch.json()] == [[1], [2, 3]]


def test_http_return_text_in_logprobs(client, engine):
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 2,
            "token_ids_logprob": IDS, "return_text_in_logprobs": True}
    meta = client.post("/generate", json=body).json()["meta_info"]
    texts = [engine.tokenizer.decode([t]) for t in IDS]
    for key in ("output_token_ids_logprobs", "input_token_ids_logprobs"):
        rows = meta[key][1:] if key.startswith("input") else meta[key]  # the prompt's first entry is null
        assert rows and all([e[2] for e in row] == texts for row in rows)


def test_http_stream_carries_the_ids(client):
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "token_ids_logprob": [5],
            "stream": True}
    with client.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        chunks = [line for line in resp.iter_lines() if line.startswith("data: {")]
    import json

    last = json.loads(chunks[-1][len("data: "):])
    assert len(last["meta_info"]["output_token_ids_logprobs"]) == 5


@pytest.mark.parametrize("bad", [[True], [-3], "x", [[1], [2]], [1.5]])
def test_http_bad_values_are_400(client, bad):
    resp = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True,
                                          "token_ids_logprob": bad})
    assert resp.status_code == 400, resp.text
    assert "token_ids_logprob" in resp.text


def test_recorder_keeps_the_argument(engine_factory, tmp_path):
    import json

    path = tmp_path / "run.jsonl"
    eng = engine_factory(record_path=str(path))
    eng.generate(input_ids=[PROMPT, [5, 6]], sampling_params=GREEDY, return_logprob=True,
                 token_ids_logprob=[[3, 1], []])
    eng.generate(input_ids=PROMPT, sampling_params=GREEDY, token_ids_logprob=[3])  # no logprobs: none asked
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["token_ids_logprob"] for line in lines] == [[3, 1], None, None]
