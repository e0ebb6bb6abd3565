"""HttpClient against servers that fail as real ones do, faked with aiohttp.web where `tandem serve`
cannot be made to: never answering, resetting, cutting a reply short, proxy HTML pages, 503s.
Each test bounds itself (asyncio.wait_for): a regression is a failure, never a hang."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from engine_client.http_client import HttpClient
from engine_client.http_errors import EngineTimeout, EngineUnreachable

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402
from engine.models.parallel_state import free_port

BOUND_S = 8.0
GREEDY = {"max_new_tokens": 2, "temperature": 0.0}


@contextlib.asynccontextmanager
async def fake_server(handler):
    """`handler` on /generate, /abort_request and /health of a free port -> its URL."""
    app = web.Application()
    for route in ("/generate", "/abort_request"):
        app.router.add_post(route, handler)
    app.router.add_get("/health", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)  # handlers still sleeping are not waited for
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def bounded(coro):
    return asyncio.run(asyncio.wait_for(coro, BOUND_S))


async def generate_from(handler, **client_kwargs):
    async with fake_server(handler) as url:
        client = HttpClient(url, **client_kwargs)
        try:
            return url, await client.async_generate(input_ids=[1, 2], sampling_params=GREEDY)
        finally:
            await client.aclose()
            client.close()


def failure_of(handler, **client_kwargs) -> BaseException:
    async def run():
        try:
            await generate_from(handler, **client_kwargs)
        except Exception as exc:
            return exc
        raise AssertionError("the request did not fail")

    return bounded(run())


def test_a_server_that_never_answers_times_out_after_timeout_s_naming_the_url():
    async def never(request):
        await asyncio.sleep(60)

    start = time.monotonic()
    exc = failure_of(never, timeout_s=0.3)
    assert isinstance(exc, EngineTimeout) and isinstance(exc, TimeoutError)
    assert "/generate: no answer within 0.3 s" in str(exc) and "http://127.0.0.1:" in str(exc)
    assert time.monotonic() - start < 3


def test_error_replies_surface_the_servers_message_and_the_url():
    async def sglang_400(request):
        return web.json_response({"object": "error", "message": "The input (9000 tokens) is longer than the "
                                  "model's context length", "type": "BadRequestError", "code": 400}, status=400)

    async def proxy_502(request):
        return web.Response(text="<html><body><h1>502 Bad Gateway</h1>" + "x" * 5000 + "</body></html>",
                            status=502, content_type="text/html")

    async def proxy_200(request):
        return web.Response(text="<html>please log in</html>", content_type="text/html")

    async def overloaded_503(request):
        return web.json_response({"error": {"message": "the engine is not running"}}, status=503)

    exc = failure_of(sglang_400)
    assert isinstance(exc, ValueError) and "longer than the model's context length" in str(exc)
    assert "/generate refused the request" in str(exc)
    exc = failure_of(proxy_502)
    assert type(exc) is RuntimeError and "HTTP 502: <html><body><h1>502 Bad Gateway</h1>" in str(exc)
    assert len(str(exc)) < 500 and "(5050 characters)" in str(exc)  # the page's start, not all of it
    exc = failure_of(proxy_200)
    assert type(exc) is RuntimeError and "not JSON" in str(exc) and "please log in" in str(exc)
    exc = failure_of(overloaded_503)
    assert isinstance(exc, EngineUnreachable) and "HTTP 503: the engine is not running" in str(exc)


def test_a_connection_reset_or_a_reply_cut_short_is_engine_unreachable():
    async def reset(request):
        request.transport.close()
        await asyncio.sleep(1)

    async def cut_short(request):
        response = web.StreamResponse()
        response.content_length = 1000
        await response.prepare(request)
        await response.write(b'{"text": "abc", ')
        request.transport.close()
        return response

    for handler, needle in ((reset, "Server disconnected"), (cut_short, "payload is not completed")):
        exc = failure_of(handler)
        assert isinstance(exc, EngineUnreachable) and isinstance(exc, ConnectionError)
        assert needle in str(exc) and "http://127.0.0.1:" in str(exc)


@pytest.mark.parametrize("library", ["aiohttp", "httpx"])
def test_a_stream_cut_off_mid_way_raises_engine_unreachable(library):
    from engine_client.async_http import AiohttpClient, HttpxClient

    async def cut_stream(request):
        response = web.StreamResponse()  # chunked: ends without its last chunk
        await response.prepare(request)
        await response.write(b'data: {"text": "a"}\n\n')
        await asyncio.sleep(0.05)
        request.transport.close()
        return response

    async def run():
        async with fake_server(cut_stream) as url:
            client = (AiohttpClient if library == "aiohttp" else HttpxClient)(url, None)
            lines = []
            try:
                with pytest.raises(EngineUnreachable, match="streaming"):
                    async for line in client.stream_lines("/generate", {}, {}):
                        lines.append(line)
            finally:
                await client.close()
            return lines

    assert 'data: {"text": "a"}' in bounded(run())


def test_wait_ready_waits_for_health_and_times_out_naming_the_url():
    calls = []

    async def starting_up(request):
        calls.append(1)
        return web.Response(status=503 if len(calls) < 3 else 200)

    async def run():
        async with fake_server(starting_up) as url:
            await asyncio.to_thread(HttpClient(url).wait_ready, 5.0, 0.01)
        return len(calls)

    assert bounded(run()) == 3
    port = free_port()  # a port nobody listens on
    start = time.monotonic()
    with pytest.raises(EngineTimeout, match=rf"127.0.0.1:{port} was not ready after 0.2 s .*ConnectError"):
        HttpClient(f"http://127.0.0.1:{port}").wait_ready(0.2, 0.05)
    assert time.monotonic() - start < 3


def test_connections_are_bounded_and_an_abort_reaches_requests_still_waiting():
    """300 requests at max_connections=8: never more than 8 at the server, all answered; then an
    abort_all while most wait: those answer "abort" without ever reaching the server."""
    state = {"now": 0, "most": 0, "seen": 0}
    release = asyncio.Event()

    async def counting(request):
        if request.path == "/abort_request":
            release.set()
            return web.json_response({})
        body = await request.json()
        state["now"] += 1
        state["seen"] += 1
        state["most"] = max(state["most"], state["now"])
        await (release.wait() if body["rid"].startswith("held") else asyncio.sleep(0.001))
        state["now"] -= 1
        return web.json_response({"text": "", "output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}})

    async def run():
        async with fake_server(counting) as url:
            client = HttpClient(url, max_connections=8)
            outs = await asyncio.gather(*[client.async_generate(input_ids=[i], sampling_params=GREEDY, rid=f"r{i}")
                                          for i in range(300)])
            assert state["most"] <= 8 and state["seen"] == 300 and all(o["output_ids"] == [1] for o in outs)
            state["seen"] = 0
            held = [asyncio.ensure_future(client.async_generate(input_ids=[i], sampling_params={"n": 2},
                                                                rid=f"held{i}")) for i in range(40)]
            while state["seen"] < 8:  # 8 at the server, 32 waiting here
                await asyncio.sleep(0.01)
            await client.async_abort_request(abort_all=True)
            outs = await asyncio.gather(*held)
            await client.aclose()
            return outs

    outs = bounded(run())
    assert state["seen"] == 8  # the 32 aborted while waiting never reached the server
    outs = [out if isinstance(out, list) else [out] for out in outs]  # the fake server answers one dict
    reasons = [[o["meta_info"]["finish_reason"]["type"] for o in out] for out in outs]
    assert reasons[:8] == [["length"]] * 8 and reasons[8:] == [["abort", "abort"]] * 32
    assert "before it was sent" in outs[-1][0]["meta_info"]["finish_reason"]["message"]


def test_an_abort_by_rid_reaches_a_waiting_request_and_its_samples():
    from engine_client.request_slots import RequestSlots

    async def run():
        slots = RequestSlots(1)
        async with slots.slot("first") as go_first:
            waiting = {rid: asyncio.ensure_future(_enter(slots, rid)) for rid in ("b-1", "b-12", "b-2")}
            await asyncio.sleep(0)
            slots.abort("b-1-0", abort_all=False)  # sample 0 of "b-1": not "b-12"
            slots.abort("b-2", abort_all=False)
        return go_first, {rid: await task for rid, task in waiting.items()}

    assert bounded(run()) == (True, {"b-1": False, "b-12": True, "b-2": False})


def test_an_abort_by_prefix_reaches_every_waiting_request_it_starts():
    from engine_client.request_slots import RequestSlots

    async def run():
        slots = RequestSlots(1)
        async with slots.slot("first"):
            waiting = {rid: asyncio.ensure_future(_enter(slots, rid)) for rid in ("lora::a", "lora::b", "other")}
            await asyncio.sleep(0)
            slots.abort("lora::", abort_all=False, prefix=True)  # Miles' abort of an adapter's requests
        return {rid: await task for rid, task in waiting.items()}

    assert bounded(run()) == {"lora::a": False, "lora::b": False, "other": True}


async def _enter(slots, rid: str) -> bool:
    async with slots.slot(rid) as go:
        return go


def test_a_connect_timeout_is_unreachable_so_the_group_goes_elsewhere():
    """A host that drops packets (not refusing them) times out connecting: nothing was sent, so it
    is an EngineUnreachable (a ConnectionError the rollout manager retries elsewhere), not a timeout."""
    import aiohttp
    import httpx

    from engine_client.http_errors import transport_error

    for exc in (httpx.ConnectTimeout("timed out"), aiohttp.ConnectionTimeoutError("timed out")):
        err = transport_error("POST http://10.0.0.9:30000/generate", exc, None)
        assert isinstance(err, EngineUnreachable) and "10.0.0.9:30000" in str(err) and "could not connect" in str(err)
