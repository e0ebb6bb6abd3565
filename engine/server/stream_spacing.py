"""StreamSpacing: bounds what cumulative /generate streams (SGLang's default) put on the wire.

A cumulative chunk re-sends every logprob so far, so a stream that asks for many top logprobs
costs O(tokens^2) bytes: 300 tokens x 1024 top logprobs is ~1.5 GB where the answer is ~9 MB.
Cumulative chunks may be skipped without losing anything (each holds all before it; SGLang itself
sends a reader that falls behind only the newest), so once a chunk carries more than
SMALL_CHUNK_ENTRIES logprob entries, the next goes out only when its output has grown by GROWTH
(or it is the last). The bytes sent then stay within ~GROWTH / (GROWTH - 1) = 3x the final answer
plus the small chunks; streams without big logprob lists (text, ids, a few top logprobs) send
every chunk as before. --incremental-streaming-output sends each logprob once instead.
"""

from __future__ import annotations

SMALL_CHUNK_ENTRIES = 8192  # ~250 KB of [logprob, id, null] entries: always sent
GROWTH = 1.5


class StreamSpacing:
    """Whether to send each cumulative chunk of one stream (several requests told apart by "index")."""

    def __init__(self) -> None:
        self._sent_tokens: dict[int, int] = {}  # index -> output tokens in the last chunk sent

    def __call__(self, chunk: dict) -> bool:
        meta = chunk.get("meta_info") or {}
        tokens = len(chunk.get("output_ids") or ())
        index = chunk.get("index", 0)
        send = (meta.get("finish_reason") is not None or _entries(meta, tokens) <= SMALL_CHUNK_ENTRIES
                or tokens >= GROWTH * self._sent_tokens.get(index, 0))
        if send:
            self._sent_tokens[index] = tokens
        return send


def _entries(meta: dict, tokens: int) -> int:
    """Logprob entries the chunk carries, from the newest position's list sizes (each position has
    the same number: one sampled + top_logprobs_num + the requested ids)."""
    per_token = 1
    for key in ("output_top_logprobs", "output_token_ids_logprobs"):
        lists = meta.get(key)
        if lists:
            per_token += len(lists[-1] or ())
    return per_token * tokens
