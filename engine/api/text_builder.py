"""TextBuilder: the text of outputs, decoded in the front end rather than in the core.

The core detokenizes only requests with stop strings (it matches them against the text while
generating). For every other request it sends output ids alone and the front end decodes them
here with the same IncrementalDetokenizer (prompt tail as left context, the request's
special-token options): fed the same tokens in the same steps, it gives the text the core would
have built, chunk by chunk when streaming and once at the end otherwise. With the core in its
own process this keeps decoding off the scheduler's interpreter, as SGLang's detokenizer does.
Called from one thread: the one that delivers the core's outputs.
"""

from __future__ import annotations

from typing import Any

from engine.core.messages import ReqInput, ReqOutput
from engine.tokenizer import IncrementalDetokenizer, trims_stop_token


class TextBuilder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, IncrementalDetokenizer] = {}  # streamed requests in flight

    def fill(self, req: ReqInput, out: ReqOutput) -> None:
        """Sets out.output["text"] unless the core built it (or there is no tokenizer)."""
        if self.tokenizer is None or req.core_detokenizes:
            return
        ids = out.output["output_ids"]
        # SGLang's text leaves out the stop token a reply matched: never fed here (it is the last id)
        end = len(ids) - 1 if out.finished and trims_stop_token(
            out.output["meta_info"].get("finish_reason"), req.sampling_params.no_stop_trim) else len(ids)
        if not req.stream:
            if out.finished and ids:
                detokenizer = self._detokenizer(req)
                detokenizer.add(ids[:end])
                detokenizer.flush()
                out.output["text"] = detokenizer.text
            return
        if out.finished and not ids:  # an error answer (e.g. the core died): no tokens, no text
            self._streams.pop(req.rid, None)
            return
        detokenizer = self._streams.get(req.rid)
        if detokenizer is None:
            detokenizer = self._streams[req.rid] = self._detokenizer(req)
        detokenizer.add(ids[len(detokenizer.output_ids):end])
        if out.finished:
            detokenizer.flush()
            del self._streams[req.rid]
        out.output["text"] = detokenizer.text

    def _detokenizer(self, req: ReqInput) -> IncrementalDetokenizer:
        params = req.sampling_params
        return IncrementalDetokenizer(self.tokenizer, prompt_ids=req.input_ids,
                                      skip_special_tokens=params.skip_special_tokens,
                                      spaces_between_special_tokens=params.spaces_between_special_tokens)
