"""Which final replies are shaped on the event loop: /generate's small plain outputs only."""

from __future__ import annotations

from types import SimpleNamespace

from engine.server import generate_routes


def _out(**meta):
    return {"text": "hi", "output_ids": [1, 2], "meta_info": meta}


def test_small_counts_every_large_part_of_an_output():
    assert generate_routes._small(_out())
    assert generate_routes._small([_out(), _out()])
    assert not generate_routes._small(_out(routed_experts="A" * 20_000))  # a MoE prompt's routing, base64
    assert not generate_routes._small(_out(output_token_logprobs=[[-0.1, 1, None]] * 600))
    assert not generate_routes._small(_out(input_top_logprobs=[None, [[-0.1, 1, None]] * 20] * 30))
    assert not generate_routes._small({"text": "x" * 20_000, "output_ids": [], "meta_info": {}})


def test_only_generate_replies_as_its_outputs_are():
    engine = SimpleNamespace(tokenizer=None, server_args=SimpleNamespace(incremental_streaming_output=False))
    openai = SimpleNamespace(**{name: None for name in (
        "completion_request", "completion_response", "completion_events", "chat_request", "chat_response",
        "chat_events")})
    routes = {route.path: route for route in generate_routes.generation_routes(engine, openai)}
    generate = routes["/generate"]
    assert generate.plain_reply(SimpleNamespace(return_text_in_logprobs=False))
    assert not generate.plain_reply(SimpleNamespace(return_text_in_logprobs=True))  # a decode per entry
    body = SimpleNamespace(echo=True, logprobs=5)
    assert not routes["/v1/completions"].plain_reply(body) and not routes["/v1/chat/completions"].plain_reply(body)
