"""StreamDelta: SGLang's `--incremental-streaming-output` for /generate. Each streamed chunk
carries only what is new since the previous chunk of the same request: `text`, `output_ids` and
the output-side logprob lists; everything else in meta_info (counts, finish_reason, input
logprobs) is as in the cumulative chunk. What SGLang's tokenizer manager does
(`_INCREMENTAL_STREAMING_META_INFO_KEYS`, `_slice_streaming_output_meta_info`), and what slime's
streaming rollout reads with `--sglang-incremental-streaming-output`. Cumulative chunks re-send
every logprob so far: 300 tokens x 1024 top logprobs is ~1.5 GB on the wire, ~10 MB incremental.
"""

from __future__ import annotations

INCREMENTAL_KEYS = frozenset({"output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"})


class StreamDelta:
    """Turns one stream's cumulative chunks (of one request, or several told apart by "index")
    into incremental ones."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, int]] = {}  # index -> (output tokens, text chars) sent

    def __call__(self, chunk: dict) -> dict:
        index = chunk.get("index", 0)
        tokens, chars = self._sent.get(index, (0, 0))
        ids, text = chunk["output_ids"], chunk["text"]
        self._sent[index] = (len(ids), len(text))
        meta = dict(chunk["meta_info"])
        for key in INCREMENTAL_KEYS & meta.keys():
            meta[key] = meta[key][tokens:]
        return {**chunk, "text": text[chars:], "output_ids": ids[tokens:], "meta_info": meta}
