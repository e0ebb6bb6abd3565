"""StreamedLogprobs: a streamed request's logprob lists, joined back in the front end.

The core sends each output position's logprobs once (ReqOutput.logprobs_from says where an
answer's lists start) and the prompt's only with the first answer, so its work and the pipe's
traffic stay linear in the output (engine/core/output.py). Here they are joined into SGLang's
cumulative lists: every answer handed on carries all logprobs so far, as before. The lists handed
on are copies (of references, no entry is rebuilt): the reader may hold a chunk while the next
one is joined. Called from one thread: the one that delivers the core's outputs.
"""

from __future__ import annotations

from typing import Any

from engine.core.messages import ReqInput, ReqOutput

OUTPUT_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
INPUT_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


class StreamedLogprobs:
    def __init__(self) -> None:
        self._joined: dict[str, dict[str, list]] = {}  # rid -> key -> list so far

    def fill(self, req: ReqInput, out: ReqOutput) -> None:
        if not (req.stream and req.return_logprob):
            return
        meta = out.output.get("meta_info", {})
        joined = self._joined.setdefault(out.rid, {})
        for key in INPUT_KEYS:
            if key in meta:
                joined[key] = meta[key]
            elif key in joined:
                meta[key] = joined[key]
        for key in OUTPUT_KEYS:
            if key in meta:
                so_far: list[Any] = joined.setdefault(key, [])
                del so_far[out.logprobs_from:]  # positions from there are (re)sent
                so_far.extend(meta[key])
                meta[key] = list(so_far)
        if out.finished:
            del self._joined[out.rid]
