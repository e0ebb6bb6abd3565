"""/abort_request while a request is still being built ends it: a constrained /generate whose
grammar is being checked, a chat request whose template is being rendered (before the engine sees
it), and slime's end-of-rollout abort_all. Real sockets: the abort comes while the request waits."""

from __future__ import annotations

import threading

import httpx
import pytest

import engine.server.openai as openai_module
from tests.hold import Hold

LONG = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("route", ["generate", "chat"])
@pytest.mark.parametrize("abort", [{"rid": "slow-1"}, {"abort_all": True}])
def test_an_abort_while_the_request_is_built_ends_it(engine_factory, live_server_factory, monkeypatch, route, abort):
    eng = engine_factory()
    server = live_server_factory(eng)
    hold = Hold()
    if route == "generate":
        monkeypatch.setattr(eng.builder, "build", hold.around(eng.builder.build))
        # constrained: built on a worker thread (a plain one is built on the loop, which the hold would stop)
        path, body = "/generate", {"input_ids": [5, 6, 7], "sampling_params": {**LONG, "regex": "(ab)+"},
                                   "rid": "slow-1"}
    else:
        monkeypatch.setattr(openai_module, "_chat_prompt_ids", hold.around(openai_module._chat_prompt_ids))
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "rid": "slow-1",
                                              "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    replies: dict = {}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        thread = threading.Thread(target=lambda: replies.update(r=http.post(path, json=body)))
        thread.start()
        assert hold.started.wait(30)
        assert http.post("/abort_request", json=abort).status_code == 200
        hold.release.set()
        thread.join(60)
        reply = replies["r"].json()
        if route == "generate":
            assert reply["meta_info"]["finish_reason"]["type"] == "abort", reply["meta_info"]
            assert len(reply["output_ids"]) < LONG["max_new_tokens"]
        else:
            assert reply["choices"][0]["finish_reason"] == "abort", reply
        after = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {**LONG, "max_new_tokens": 3}})
        assert after.json()["meta_info"]["finish_reason"]["type"] == "length"  # the next one runs
