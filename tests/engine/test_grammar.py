"""Structured output (engine/grammar): sampled outputs always match their grammar.

Oracles: `re.fullmatch` / `json.loads` plus a hand check of the schema for every output; the
unconstrained model (HF) for the original logprobs; the same request alone for retraction,
batching and deterministic mode (a row's token depends only on its logits, seed and position).
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")

from engine.sampling_params import SamplingParams  # noqa: E402
from tests.engine.conftest import random_prompts  # noqa: E402

PROMPTS = ["hello", "the cat", "a b c", "1 2 3"]
CODE = "[0-9]{3}-[a-z]{2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer"},
        "tags": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                 "additionalProperties": False},
    },
    "required": ["color", "size", "tags"],
    "additionalProperties": False,
}


def sampled(n: int, max_new_tokens: int = 24, **grammar) -> list[dict]:
    return [{"temperature": 1.0, "max_new_tokens": max_new_tokens, "sampling_seed": 100 + i, **grammar}
            for i in range(n)]


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"color", "size", "tags"}, text
    assert value["color"] in ("red", "green", "blue") and type(value["size"]) is int, text
    assert set(value["tags"]) == {"ok"} and type(value["tags"]["ok"]) is bool, text


def test_regex_outputs_match(engine):
    outs = engine.generate(PROMPTS * 4, sampling_params=sampled(16, regex=CODE))
    for out in outs:
        assert re.fullmatch(CODE, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert len({o["text"] for o in outs}) > 4  # really sampled: the grammar leaves choices


def test_json_schema_outputs_parse_and_validate(engine):
    outs = engine.generate(PROMPTS * 3, sampling_params=sampled(12, max_new_tokens=160, json_schema=json.dumps(SCHEMA)))
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        check_schema(out["text"])


def test_ebnf_and_mixed_batch(engine):
    """Constrained and free rows in one batch: only the constrained rows are masked."""
    ebnf = 'root ::= "yes" | "no" | "maybe"'
    params = sampled(4, ebnf=ebnf) + sampled(4, max_new_tokens=6)
    outs = engine.generate(PROMPTS * 2, sampling_params=params)
    assert all(o["text"] in ("yes", "no", "maybe") for o in outs[:4]), [o["text"] for o in outs[:4]]
    free = engine.generate(PROMPTS, sampling_params=sampled(4, max_new_tokens=6))
    assert [o["output_ids"] for o in outs[4:]] == [o["output_ids"] for o in free]


STRUCTURE_SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
                    "additionalProperties": False}


def test_structural_tag_sampled(engine):
    """xgrammar's format: a tag whose body follows its content format (a regex: a JSON body lets
    the random tiny model run on in whitespace)."""
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "end": "</f>",
                                                 "content": {"type": "regex", "pattern": '\\{"a": "[xy]"\\}'}}}
    outs = engine.generate(PROMPTS, sampling_params=sampled(4, max_new_tokens=80, structural_tag=json.dumps(tag)))
    for out in outs:
        match = re.fullmatch(r"(?s)<f>(.*)</f>", out["text"])
        assert match and out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
        assert json.loads(match.group(1)) in ({"a": "x"}, {"a": "y"}), out["text"]


def test_structural_tag_sglang_form(engine):
    """SGLang's older form (structures + triggers): free text, then a schema-bound body once a
    trigger appears. Checked on the matcher: the tokens of a valid text pass, a wrong body does not."""
    from engine.grammar import GrammarCompiler, RequestGrammar

    tag = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": STRUCTURE_SCHEMA, "end": "</f>"}],
           "triggers": ["<f>"]}
    compiler = GrammarCompiler(engine.tokenizer, engine.local_core.parts.vocab_size, (0, 2))
    compiled = compiler.compile("structural_tag", json.dumps(tag))
    assert compiler.compile("structural_tag", json.dumps(tag)) is compiled  # cached per spec

    def accepts(text: str) -> bool:
        grammar = RequestGrammar(compiled)
        return all(grammar.accept(t) for t in engine.tokenizer.encode(text, add_special_tokens=False))

    assert accepts('say <f>{"a": "x"}</f> done')
    assert not accepts('say <f>{"a": "z"}</f>')
    assert not accepts('say <f>{"b": "x"}</f>')
    engine.generate("hello", sampling_params=sampled(1, max_new_tokens=8, structural_tag=json.dumps(tag))[0])


def test_bounded_json_strings_never_hold_a_raw_control_character():
    """xgrammar's character of a string with maxLength/minLength admits U+0000..U+001F, which
    json.loads refuses; tandem's schema grammar excludes them there as in unbounded strings."""
    from xgrammar.testing import _is_grammar_accept_string

    from engine.grammar.compiler import _json_schema_grammar

    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8},
                                               "b": {"type": "string", "minLength": 1}}, "required": ["a", "b"]}
    grammar = _json_schema_grammar(json.dumps(schema))
    assert _is_grammar_accept_string(grammar, '{"a": "x y", "b": "z"}')
    for bad in ('{"a": "x\x10", "b": "z"}', '{"a": "x", "b": "\x03"}', '{"a": "123456789", "b": "z"}'):
        assert not _is_grammar_accept_string(grammar, bad), bad


def test_min_new_tokens_yields_to_a_complete_grammar(engine):
    """min_new_tokens bans EOS, but once the grammar allows only EOS the grammar wins (no row of
    all -inf); before that the ban holds."""
    outs = engine.generate(PROMPTS, sampling_params=sampled(4, regex="[a-z]{2,40}", min_new_tokens=6))
    for out in outs:
        assert re.fullmatch("[a-z]{2,40}", out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop"
        assert len(out["output_ids"]) >= 6 or len(out["text"]) == 40, out
    short = engine.generate("hello", sampling_params={"regex": "ab", "min_new_tokens": 5, "max_new_tokens": 10})
    assert short["text"] == "ab" and short["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_that_accepts_nothing_aborts_saying_so(engine, ignore_eos):
    """`root ::= root` matches no string: no token is allowed at the first step. The request ends
    with an abort naming the grammar, also where the token the empty row gave is a stop token
    (the tiny model's token 0 is an EOS id), never a plain "stop"; the engine serves on."""
    out = engine.generate("hello", sampling_params={"ebnf": "root ::= root", "max_new_tokens": 4,
                                                    "ignore_eos": ignore_eos})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "grammar" in reason["message"], reason
    assert engine.generate("hello", sampling_params={"max_new_tokens": 2, "temperature": 0})["meta_info"][
        "completion_tokens"] == 2


@pytest.mark.parametrize("params, problem", [
    ({"regex": "[0-9"}, "invalid regex"),
    ({"json_schema": "{not json"}, "invalid json_schema"),
    ({"json_schema": json.dumps({"type": "no-such-type"})}, "invalid json_schema"),
    ({"ebnf": "root ::= undefined_rule"}, "invalid ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one of"),
    ({"regex": 5}, "regex must be a string"),
    ({"structural_tag": json.dumps({"type": "structural_tag"})}, "invalid structural_tag"),
])
def test_bad_grammar_is_a_value_error(engine, params, problem):
    with pytest.raises(ValueError, match=problem) as refused:
        engine.generate("hello", sampling_params=params)
    assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.cc:\d+", str(refused.value))  # not xgrammar's C++ log prefix
    assert re.fullmatch(CODE, engine.generate("hello", sampling_params={"regex": CODE})["text"])  # still serving


def test_logprobs_original_unmasked_processed_masked(engine, hf_model):
    prompt = [7, 8, 9, 10, 11]
    out = engine.generate(input_ids=prompt, sampling_params={"regex": CODE, "temperature": 1.0, "sampling_seed": 5},
                          return_logprob=True)
    processed = engine.generate(input_ids=prompt, sampling_params={"regex": CODE, "temperature": 1.0, "sampling_seed": 5},
                                return_logprob=True, logprob_distribution="processed")
    assert processed["output_ids"] == out["output_ids"]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + out["output_ids"]])).logits[0].float()
    pairs = zip(out["meta_info"]["output_token_logprobs"], processed["meta_info"]["output_token_logprobs"])
    for i, ((orig, tok, _), (proc, _, _)) in enumerate(pairs):
        raw = torch.log_softmax(logits[len(prompt) - 1 + i], -1)[tok].item()
        assert abs(orig - raw) <= 1e-4  # original: the raw logits, no mask
        assert proc >= orig - 1e-5  # the mask removes mass, so the kept token gains
    assert proc > orig  # the last token (EOS) is among few allowed ones


def test_retracted_constrained_requests_resume_exactly(engine_factory, engine):
    """Retraction keeps output_ids and the matcher moved only on committed tokens, so a retracted
    request ends exactly as it does alone."""
    vocab = engine.local_core.parts.vocab_size
    prompts = random_prompts(24, vocab, lengths=(4, 24), seed=3)
    params = sampled(24, max_new_tokens=64, regex="[a-z]{100}")  # ~35 tokens
    alone = [engine.generate(input_ids=p, sampling_params=s)["output_ids"] for p, s in zip(prompts, params)]
    # a low conservativeness admits on a forecast far below what the grammar forces out: retraction
    small = engine_factory(max_total_tokens=300, chunked_prefill_size=64, schedule_conservativeness=0.2)
    outs = small.generate(input_ids=prompts, sampling_params=params)
    assert small.local_core.scheduler.num_retractions > 0
    assert any(o["meta_info"]["num_retractions"] > 0 for o in outs)
    assert [o["output_ids"] for o in outs] == alone
    assert all(re.fullmatch("[a-z]{100}", o["text"]) for o in outs)
    small.check_integrity()


def test_deterministic_mode_same_alone_and_batched(engine_factory):
    eng = engine_factory(enable_deterministic_inference=True)
    params = sampled(6, max_new_tokens=160, json_schema=json.dumps(SCHEMA))
    prompts = PROMPTS + PROMPTS[:2]
    batched = eng.generate(prompts, sampling_params=params)
    alone = [eng.generate(p, sampling_params=s) for p, s in zip(prompts, params)]
    assert [o["output_ids"] for o in batched] == [o["output_ids"] for o in alone]
    for out in batched:
        check_schema(out["text"])


def test_sampling_params_grammar_fields():
    assert SamplingParams.from_dict({"json_schema": "{}"}).validate().json_schema == "{}"
    with pytest.raises(ValueError, match=r"at most one of .*\['json_schema', 'regex'\]"):
        SamplingParams.from_dict({"json_schema": "{}", "regex": "a"}).validate()


# ---- HTTP ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    with TestClient(create_app(engine)) as c:
        yield c


def test_http_generate_regex_and_bad_grammar(client):
    body = {"text": "hello", "sampling_params": {"regex": CODE, "temperature": 1.0, "sampling_seed": 1}}
    assert re.fullmatch(CODE, client.post("/generate", json=body).json()["text"])
    bad = client.post("/generate", json={"text": "hello", "sampling_params": {"regex": "[0-9"}})
    assert bad.status_code == 400 and "invalid regex" in bad.json()["message"]


def test_openai_response_format(client):
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    body = {"prompt": "hello", "max_tokens": 160, "temperature": 1.0, "seed": 3, "n": 3, "response_format": schema}
    for choice in client.post("/v1/completions", json=body).json()["choices"]:
        check_schema(choice["text"])
    body["response_format"] = {"type": "json_object"}
    for choice in client.post("/v1/completions", json=body).json()["choices"]:
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["text"]), dict)
    body["response_format"] = {"type": "json_schema", "schema": SCHEMA}  # SGLang's shortcut: the same
    for choice in client.post("/v1/completions", json=body).json()["choices"]:
        check_schema(choice["text"])
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x"}}
    bad = client.post("/v1/completions", json=body)
    assert bad.status_code == 400 and "schema" in bad.json()["message"]


class _GatedCompiler:
    """The core's compiler, held at a gate: a compile that takes as long as the test wants."""

    def __init__(self, make, gate) -> None:
        self.inner, self.gate, self.calls = make(), gate, 0

    def cached(self, kind, spec):
        return self.inner.cached(kind, spec) if self.gate.is_set() else None

    def compile(self, kind, spec):
        self.calls += 1
        assert self.gate.wait(60), "the test never opened the gate"
        return self.inner.compile(kind, spec)


class _GatedCheck:
    """The front end's grammar check, held at a gate."""

    def __init__(self, inner, gate) -> None:
        self.inner, self.gate, self.calls = inner, gate, 0

    def check(self, kind, spec):
        self.calls += 1
        assert self.gate.wait(60), "the test never opened the gate"
        return self.inner.check(kind, spec)

    def close(self):
        self.inner.close()


def _gate_core_compiles(eng) -> tuple[threading.Event, list]:
    core, gate, made = eng.local_core, threading.Event(), []
    make = core.grammars._make_compiler

    def gated():
        made.append(_GatedCompiler(make, gate))
        return made[0]

    core.grammars._make_compiler = gated
    return gate, made


def test_a_compiling_grammar_never_stalls_running_requests(engine_factory):
    """The core compiles on a worker thread: while a grammar compiles, free requests are served
    to the end; the constrained one waits (counted as waiting), then runs and matches."""
    eng = engine_factory()
    gate, made = _gate_core_compiles(eng)
    constrained: list = []
    waiting = threading.Thread(target=lambda: constrained.append(
        eng.generate("hello", sampling_params=sampled(1, regex=CODE)[0])))
    waiting.start()
    deadline = time.monotonic() + 30
    while not (made and made[0].calls) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert made and made[0].calls == 1, "the core never started compiling"
    free = eng.generate(PROMPTS, sampling_params=sampled(4, max_new_tokens=12))  # served meanwhile
    assert [len(o["output_ids"]) for o in free] == [12] * 4 or all(o["meta_info"]["finish_reason"] for o in free)
    assert not constrained and eng.get_stats().num_waiting_reqs == 1
    gate.set()
    waiting.join(30)
    assert constrained and re.fullmatch(CODE, constrained[0]["text"]), constrained
    eng.check_integrity()


def test_a_request_aborted_while_its_grammar_compiles_ends_at_once(engine_factory):
    eng = engine_factory()
    gate, made = _gate_core_compiles(eng)
    answer: list = []
    waiting = threading.Thread(target=lambda: answer.append(
        eng.generate("hello", sampling_params=sampled(1, regex=CODE)[0], rid="compiling")))
    waiting.start()
    deadline = time.monotonic() + 30
    while not (made and made[0].calls) and time.monotonic() < deadline:
        time.sleep(0.01)
    eng.abort_request("compiling")
    waiting.join(10)
    gate.set()
    assert answer and answer[0]["meta_info"]["finish_reason"]["type"] == "abort", answer
    assert eng.get_stats().num_waiting_reqs == 0
    out = eng.generate("hello", sampling_params=sampled(1, regex=CODE)[0])
    assert re.fullmatch(CODE, out["text"]) and made[0].inner.cached("regex", CODE) is not None
    eng.check_integrity()


def test_a_grammar_compiling_in_the_front_end_never_stalls_the_event_loop(engine_factory):
    """The HTTP route builds a constrained request on a worker thread: while its compile is held,
    the event loop answers other requests; then the request is served."""
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    eng = engine_factory()
    gate = threading.Event()
    front = _GatedCheck(eng.builder.grammars, gate)
    eng.builder.grammars = front
    with TestClient(create_app(eng)) as client:
        answers: list = []
        body = {"text": "hello", "sampling_params": {"regex": CODE, "temperature": 1.0, "sampling_seed": 2}}
        chat = {"messages": [{"role": "user", "content": "hi"}], "regex": CODE, "max_tokens": 24}
        posting = [threading.Thread(target=lambda: answers.append(client.post("/generate", json=body))),
                   threading.Thread(target=lambda: answers.append(client.post("/v1/chat/completions", json=chat)))]
        for thread in posting:
            thread.start()
        deadline = time.monotonic() + 30
        while front.calls < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert front.calls == 2, "the routes never started compiling"
        start = time.monotonic()
        free = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
        assert free.status_code == 200 and time.monotonic() - start < 10 and not answers
        gate.set()
        for thread in posting:
            thread.join(30)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    texts = [a.json().get("text") or a.json()["choices"][0]["message"]["content"] for a in answers]
    assert all(re.fullmatch(CODE, t) for t in texts), texts
