"""SGLang's extra_key (the OpenAI routes' cache_salt, prime-rl's per-policy-version salt): a radix
cache namespace. Requests of different keys never share cached KV; the same key shares as
without one. On the tree alone (keyed trees beside an adapter's, dropped with it, forgotten when
emptied), through Engine.generate, /generate and the OpenAI routes."""

from __future__ import annotations

import pytest

from engine.kv.allocator import TokenSlotAllocator
from engine.kv.pool import ReqToTokenPool
from engine.kv.radix_cache import RadixCache

GEN = {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}
PROMPT = list(range(40, 80))  # 40 tokens, long enough to be cached past any rounding


def _put(tree, alloc, key, namespace):
    slots = alloc.alloc(len(key))
    alloc.free(slots[:tree.insert(key, slots, namespace)])


def test_keyed_trees_share_nothing_and_go_with_their_adapter():
    alloc = TokenSlotAllocator(64, debug=True)
    tree = RadixCache(alloc, ReqToTokenPool(4, 32, "cpu"))
    for namespace in (None, (None, "v1"), 7, (7, "v1")):
        _put(tree, alloc, [1, 2, 3, 4], namespace)
    assert tree.total_size() == 16
    assert tree.match_prefix([1, 2, 3, 4], (None, "v2")).indices.numel() == 0
    assert tree.drop_namespace(7) == 8  # the adapter's own tree and its keyed one
    assert 7 not in tree.roots and (7, "v1") not in tree.roots and tree.total_size() == 8
    tree.evict(16)  # emptied by eviction: keyed roots are forgotten, the base one stays
    assert set(tree.roots) == {None} and tree.total_size() == 0
    _put(tree, alloc, [5, 6], (None, "v3"))
    tree.reset()
    assert set(tree.roots) == {None}
    tree.check_invariants()


def _cached(engine, **kwargs) -> int:
    return engine.generate(input_ids=PROMPT, sampling_params=GEN, **kwargs)["meta_info"]["cached_tokens"]


def test_engine_generate_keys_partition_the_cache(engine):
    engine.flush_cache()
    assert _cached(engine, extra_key="v0") == 0
    assert _cached(engine, extra_key="v0") >= 39  # the same key: the prompt's prefix is reused
    assert _cached(engine, extra_key="v1") == 0  # a new policy version's salt: nothing shared
    assert _cached(engine) == 0 and _cached(engine, extra_key="") >= 39  # "" is no key, as SGLang's
    outs = engine.generate(input_ids=[PROMPT, PROMPT], sampling_params=GEN, extra_key=["v1", "v2"])
    assert [o["meta_info"]["cached_tokens"] for o in outs][1] == 0 and outs[0]["meta_info"]["cached_tokens"] >= 39
    with pytest.raises(ValueError, match="extra_key must be a string"):
        engine.generate(input_ids=PROMPT, sampling_params=GEN, extra_key=5)
    with pytest.raises(ValueError, match="extra_key has 1 values for 2 prompts"):
        engine.generate(input_ids=[PROMPT, PROMPT], sampling_params=GEN, extra_key=["v1"])


def test_routes_take_extra_key_and_cache_salt(engine, raw):
    engine.flush_cache()
    body = {"input_ids": PROMPT, "sampling_params": GEN, "extra_key": "s"}
    assert raw.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 0
    assert raw.post("/generate", json=body).json()["meta_info"]["cached_tokens"] >= 39
    assert raw.post("/generate", json={**body, "extra_key": "t"}).json()["meta_info"]["cached_tokens"] == 0
    bad = raw.post("/generate", json={**body, "extra_key": {"a": 1}})
    assert bad.status_code == 400 and "extra_key" in bad.text

    # the OpenAI routes: cache_salt then extra_key, joined (SGLang's rule): "a" + "b" is the key "ab"
    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1, "temperature": 0}
    first = raw.post("/v1/chat/completions", json={**chat, "cache_salt": "a", "extra_key": "b"})
    assert first.status_code == 200, first.text
    choice = raw.post("/v1/chat/completions", json={**chat, "return_token_ids": True}).json()["choices"][0]
    assert choice["prompt_token_ids"]  # the chat prompt's ids, sent again to /generate under each key
    ids = {"input_ids": choice["prompt_token_ids"], "sampling_params": GEN}
    assert raw.post("/generate", json={**ids, "extra_key": "ab"}).json()["meta_info"]["cached_tokens"] > 0
    assert raw.post("/generate", json={**ids, "extra_key": "ba"}).json()["meta_info"]["cached_tokens"] == 0
    assert raw.post("/v1/chat/completions", json={**chat, "cache_salt": 7}).status_code == 400


def test_http_client_sends_the_key():
    from engine.api.generate_request import GenerateRequest
    from engine_client.http_client import generate_body

    assert generate_body(GenerateRequest(input_ids=[1, 2], extra_key="v3"))["extra_key"] == "v3"
    assert "extra_key" not in generate_body(GenerateRequest(input_ids=[1, 2]))


def test_the_cache_report_counts_cached_prompt_tokens(engine_factory):
    """--enable-cache-report: usage.prompt_tokens_details.cached_tokens, as SGLang's (absent without it)."""
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    body = {"prompt": list(range(40, 80)), "max_tokens": 1, "temperature": 0}
    with TestClient(create_app(engine_factory(enable_cache_report=True))) as http:
        first = http.post("/v1/completions", json=body).json()["usage"]
        again = http.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["prompt_tokens_details"]["cached_tokens"] >= 39 and again["prompt_tokens"] == 40
