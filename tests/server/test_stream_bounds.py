"""Issue 27, item 2: a streaming client that never reads is cut off within its bound (stalled
for stream_stall_timeout, or more than max_unread_stream_bytes unread), its request aborted in
the core (KV freed) and the server's memory back where it was; item 11: streamed logprobs as
increments with --incremental-streaming-output (SGLang's flag), < 50 MB for 300 tokens x 1024 top
logprobs where cumulative chunks send ~1.5 GB. Real sockets (uvicorn on a thread)."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time

import httpx

from tests.server.test_disconnect import assert_freed, idle, wait_until

LONG = {"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True}
UNREAD_BODY = {"input_ids": [5, 6, 7, 8], "sampling_params": LONG, "stream": True, "return_logprob": True,
               "top_logprobs_num": 20}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb * 1024


def open_unread_stream(port: int, body: dict) -> socket.socket:
    """POST a streamed /generate on a socket with a small receive buffer, and never read it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def read_stream(url: str, body: dict) -> tuple[int, list[dict]]:
    """A client that reads everything: (bytes received, chunks)."""
    size, chunks = 0, []
    with httpx.Client(base_url=url, timeout=300) as http:
        with http.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                size += len(line) + 2
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
    return size, chunks


def test_a_stream_that_is_never_read_is_aborted_and_its_memory_freed(engine_factory, live_server_factory):
    eng = engine_factory(stream_stall_timeout=2.0)
    server = live_server_factory(eng)
    short = {**UNREAD_BODY, "sampling_params": {**LONG, "max_new_tokens": 300}}
    read_stream(server.url, short)  # warm-up: the allocator's pools, first-step costs
    gc.collect()
    before = rss_bytes()
    sock = open_unread_stream(server.port, UNREAD_BODY)
    try:
        wait_until(lambda: eng.get_stats().num_running_reqs == 1, timeout=10)
        started = time.monotonic()
        # aborted once its socket took nothing for 2 s: well before its 3000 tokens are decoded
        took = wait_until(lambda: idle(eng), timeout=60)
        generated = eng.get_stats().num_generated_tokens
        assert generated < 300 + 3000, generated  # it did not run to the end
        print(f"unread stream aborted {took:.1f} s after it started decoding")
        assert time.monotonic() - started < 60
    finally:
        sock.close()
    assert_freed(eng)
    gc.collect()
    after = rss_bytes()
    print(f"RSS before {before / 2**20:.0f} MiB, after {after / 2**20:.0f} MiB")
    assert after <= before * 1.10, (before, after)
    # the server serves the next client as before
    size, chunks = read_stream(server.url, {**short, "sampling_params": {**LONG, "max_new_tokens": 8}})
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_unread_bytes_over_the_limit_abort_the_stream(engine_factory, live_server_factory):
    """The stall bound is far off (600 s); the byte bound (256 KiB) cuts the client off."""
    eng = engine_factory(stream_stall_timeout=600.0, max_unread_stream_bytes=256 << 10)
    server = live_server_factory(eng)
    sock = open_unread_stream(server.port, UNREAD_BODY)
    try:
        wait_until(lambda: eng.get_stats().num_running_reqs == 1, timeout=10)
        took = wait_until(lambda: idle(eng), timeout=60)
        print(f"aborted {took:.1f} s after it started decoding")
    finally:
        sock.close()
    assert eng.get_stats().num_generated_tokens < 3000
    assert_freed(eng)


def test_a_slow_reader_gets_every_token_with_unread_chunks_coalesced(engine_factory):
    """A reader that falls behind still gets a complete stream: unread chunks are coalesced into
    the newest (cumulative) one, nothing is lost and nothing piles up."""
    eng = engine_factory()

    async def read_late() -> list[dict]:
        stream = eng.async_generate(input_ids=[5, 6, 7, 8], sampling_params={**LONG, "max_new_tokens": 64},
                                    stream=True, return_logprob=True, top_logprobs_num=20)
        chunks = [await stream.__anext__()]
        for _ in range(600):  # the request finishes meanwhile
            if idle(eng):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.1)  # its final output reaches the stream
        held = stream.unread_bytes()
        return chunks + [chunk async for chunk in stream], held

    chunks, held = asyncio.run(read_late())
    final = chunks[-1]
    assert len(final["output_ids"]) == 64 and len(final["meta_info"]["output_top_logprobs"]) == 64
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert len(chunks) < 10  # coalesced while unread (64 without)
    assert 0 < held < 64 * 21 * 64  # one output held, not 64 (estimated size, ~32 B per logprob)


def test_incremental_streaming_sends_logprobs_once(engine_factory, live_server_factory):
    """300 tokens with 1024 top logprobs: incremental chunks send each logprob once (< 50 MB),
    and joined they equal the unstreamed answer; cumulative chunks (SGLang's default) carry all so far."""
    eng = engine_factory(incremental_streaming_output=True)
    server = live_server_factory(eng)
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {**LONG, "max_new_tokens": 300}, "stream": True,
            "return_logprob": True, "top_logprobs_num": 1024}
    size, chunks = read_stream(server.url, body)
    print(f"incremental: {len(chunks)} chunks, {size / 1e6:.1f} MB")
    assert size < 50e6
    whole = eng.generate(input_ids=[5, 6, 7, 8], sampling_params=body["sampling_params"], return_logprob=True,
                         top_logprobs_num=1024)
    joined_ids = [t for c in chunks for t in c["output_ids"]]
    joined_tops = [pos for c in chunks for pos in c["meta_info"]["output_top_logprobs"]]
    joined_lps = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert joined_ids == whole["output_ids"] and len(joined_ids) == 300
    expected = whole["meta_info"]["output_token_logprobs"]
    assert [tok for _, tok, _ in joined_lps] == [tok for _, tok, _ in expected]
    assert max(abs(a[0] - b[0]) for a, b in zip(joined_lps, expected)) < 1e-4  # not deterministic mode
    assert [[e[1] for e in pos] for pos in joined_tops] == [[e[1] for e in pos] for pos in
                                                           whole["meta_info"]["output_top_logprobs"]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 300  # counts stay cumulative, as in SGLang
    assert len(chunks) > 1


def test_cumulative_streaming_is_sglangs_default(engine_factory, live_server_factory):
    eng = engine_factory()
    server = live_server_factory(eng)
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {**LONG, "max_new_tokens": 16}, "stream": True,
            "return_logprob": True, "top_logprobs_num": 2}
    _, chunks = read_stream(server.url, body)
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 16
    assert all(len(c["meta_info"]["output_top_logprobs"]) == len(c["output_ids"]) for c in chunks)


def test_cumulative_streaming_of_many_logprobs_is_bounded(engine_factory, live_server_factory):
    """SGLang's default (cumulative) chunks with 1024 top logprobs x 300 tokens: chunks past ~250 KB
    go out only as the output grows by half (engine/server/stream_spacing.py), so the stream sends
    < 50 MB (every chunk: ~1.5 GB) and its last chunk is the whole answer."""
    eng = engine_factory()
    server = live_server_factory(eng)
    params = {**LONG, "max_new_tokens": 300}
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": params, "stream": True,
            "return_logprob": True, "top_logprobs_num": 1024}
    size, chunks = read_stream(server.url, body)
    print(f"cumulative: {len(chunks)} chunks, {size / 1e6:.1f} MB")
    assert size < 50e6
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 300 and len(chunks) > 5
    assert all(len(c["meta_info"]["output_top_logprobs"]) == len(c["output_ids"]) for c in chunks)
    whole = eng.generate(input_ids=[5, 6, 7, 8], sampling_params=params, return_logprob=True, top_logprobs_num=1024)
    last = chunks[-1]
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    assert [[e[1] for e in pos] for pos in last["meta_info"]["output_top_logprobs"]] == \
        [[e[1] for e in pos] for pos in whole["meta_info"]["output_top_logprobs"]]


def test_stream_spacing_sends_small_and_final_chunks_and_spaces_big_ones():
    from engine.server.stream_spacing import StreamSpacing

    def chunk(tokens: int, top: int, index: int = 0, done: bool = False) -> dict:
        meta = {"finish_reason": {"type": "length"} if done else None,
                "output_top_logprobs": [[[0.0, 1, None]] * top] * tokens}
        return {"index": index, "output_ids": [1] * tokens, "meta_info": meta}

    small = StreamSpacing()
    assert all(small(chunk(t, 2)) for t in range(1, 200))  # small chunks: every one
    big = StreamSpacing()
    sent = [t for t in range(1, 301) if big(chunk(t, 1024, done=t == 300))]
    assert sent[:8] == [1, 2, 3, 4, 5, 6, 7, 11] and sent[-1] == 300  # under ~8k entries, then spaced; the last kept
    assert all(b >= 1.5 * a for a, b in zip(sent[6:-1], sent[7:-1]))
    two = StreamSpacing()  # n > 1: each index spaced on its own
    assert two(chunk(20, 1024, index=0)) and two(chunk(20, 1024, index=1))
    assert not two(chunk(21, 1024, index=1))
