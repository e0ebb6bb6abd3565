"""The text of a finished request, decoded in the front end rather than in the core.

The core detokenizes only what it must see as text while generating: streamed requests (each
chunk carries the text so far) and requests with stop strings (matched against the text). For
every other request it sends output ids alone, and the front end decodes them here, with the
same IncrementalDetokenizer (prompt tail as left context, the request's special-token options),
so the text is the one the core would have built. With the core in its own process this keeps
decoding off the scheduler's interpreter, as SGLang's detokenizer process does.
"""

from __future__ import annotations

from typing import Any

from engine.core.messages import ReqInput
from engine.tokenizer import IncrementalDetokenizer


def decode_final_text(tokenizer: Any, req: ReqInput, output_ids: list[int]) -> str:
    params = req.sampling_params
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=req.input_ids,
                                         skip_special_tokens=params.skip_special_tokens,
                                         spaces_between_special_tokens=params.spaces_between_special_tokens)
    detokenizer.add(output_ids)
    detokenizer.flush()
    return detokenizer.text
