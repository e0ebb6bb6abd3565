"""Issue 27, item 11: the core sends a streamed request's logprobs once each (output positions
as they come, the prompt's with the first answer) and the front end joins them: every streamed
chunk still carries SGLang's cumulative lists, equal to the unstreamed answer's at the end; and
the core's work per chunk no longer grows with the output (300 tokens x 1024 top logprobs
streamed took minutes before, seconds now)."""

from __future__ import annotations

import asyncio
import time

from engine.api.streamed_logprobs import StreamedLogprobs
from engine.core.messages import ReqOutput

LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
                "input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def _stream(eng, **kwargs) -> list[dict]:
    async def run() -> list[dict]:
        return [chunk async for chunk in eng.async_generate(stream=True, **kwargs)]

    return asyncio.run(run())


def _ids(value):
    """Token ids of a logprob list (values may differ in the last bits between runs: not deterministic mode)."""
    if isinstance(value, list):
        return [_ids(v) for v in value]
    return value if isinstance(value, int) or value is None else None


def test_streamed_chunks_are_cumulative_and_end_equal_to_the_unstreamed_answer(engine_factory):
    eng = engine_factory()
    kwargs = dict(input_ids=[5, 6, 7, 8, 9], sampling_params={"max_new_tokens": 24, "temperature": 0.0,
                                                              "ignore_eos": True},
                  return_logprob=True, logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=[1, 2])
    chunks = _stream(eng, **kwargs)
    whole = eng.generate(**kwargs)
    assert len(chunks) > 1
    for chunk in chunks:
        n, meta = len(chunk["output_ids"]), chunk["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == n
        assert len(meta["output_token_ids_logprobs"]) == n
        assert len(meta["input_token_logprobs"]) == 5 and len(meta["input_top_logprobs"]) == 5
    final = chunks[-1]
    assert final["output_ids"] == whole["output_ids"]
    for key in LOGPROB_KEYS:
        assert _ids(final["meta_info"][key]) == _ids(whole["meta_info"][key]), key


def test_the_core_sends_each_logprob_once_and_the_front_end_joins_them():
    class Streamed:
        stream, return_logprob = True, True

    joiner = StreamedLogprobs()
    first = ReqOutput("r", False, {"output_ids": [1], "meta_info": {
        "input_token_logprobs": [[None, 5, None]], "output_token_logprobs": [[-0.1, 1, None]]}})
    second = ReqOutput("r", False, {"output_ids": [1, 2], "meta_info": {
        "output_token_logprobs": [[-0.2, 2, None]]}}, logprobs_from=1)
    joiner.fill(Streamed(), first)
    held = first.output["meta_info"]["output_token_logprobs"]
    joiner.fill(Streamed(), second)
    meta = second.output["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.1, 1, None], [-0.2, 2, None]]
    assert meta["input_token_logprobs"] == [[None, 5, None]]
    assert held == [[-0.1, 1, None]]  # a chunk already handed on is not changed by the next one
    final = ReqOutput("r", True, {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-0.3, 2, None]]}},
                      logprobs_from=1)  # position 1 sent again: it replaces
    joiner.fill(Streamed(), final)
    assert final.output["meta_info"]["output_token_logprobs"] == [[-0.1, 1, None], [-0.3, 2, None]]
    assert joiner._joined == {}


def test_streaming_300_tokens_with_1024_top_logprobs_takes_seconds(engine_factory):
    eng = engine_factory()
    started = time.monotonic()
    chunks = _stream(eng, input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 300, "temperature": 0.0,
                                                                   "ignore_eos": True},
                     return_logprob=True, top_logprobs_num=1024)
    took = time.monotonic() - started
    print(f"300 tokens x 1024 top logprobs streamed in {took:.1f} s ({len(chunks)} chunks)")
    assert len(chunks[-1]["meta_info"]["output_top_logprobs"]) == 300
    assert took < 60  # 160 s when the core rebuilt every list so far for each chunk
