"""ScheduleBatch: what the scheduler decided to run this step, still on the host."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.scheduler.request import Req
from engine.forward_batch import ForwardMode


@dataclass
class ScheduleBatch:
    forward_mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int]  # tokens of each request whose KV is already in the pool
    extend_lens: list[int]  # tokens each request computes now
    out_cache_loc: torch.Tensor  # [sum(extend_lens)] int64 CPU, KV slots of the new tokens
    # overlap: every request feeds the token sampled by the previous, still unresolved, decode
    # step; the runner takes input ids from that step's device tensor
    lookahead: bool = False
    lookahead_rows: Optional[list[int]] = None  # row of each request in that previous step
    sample_after_commit: bool = False  # lookahead whose sampling reads the previous step's tokens
    num_decode_rows: int = 0  # mixed chunk: the last rows are running requests decoding one token

    @property
    def num_prefill_rows(self) -> int:
        return len(self.reqs) - self.num_decode_rows

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    def input_ids(self) -> list[int]:
        ids: list[int] = []
        for req, start, n in zip(self.reqs, self.prefix_lens, self.extend_lens):
            ids.extend(req.fill_slice(start, start + n))
        return ids

    def positions(self) -> list[int]:
        out: list[int] = []
        for start, n in zip(self.prefix_lens, self.extend_lens):
            out.extend(range(start, start + n))
        return out

    def seq_lens(self) -> list[int]:
        return [p + n for p, n in zip(self.prefix_lens, self.extend_lens)]

    def samples_kept(self) -> list[bool]:
        """A chunk that ends inside the prompt samples nothing worth keeping."""
        return [not req.is_chunked and req.sampling_params.max_new_tokens > 0 for req in self.reqs]


@dataclass
class BatchResult:
    next_token_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the request's chosen distribution
    top_logprobs: list[Optional[list[tuple[float, int]]]] = field(default_factory=list)
    # per request: logprobs of prompt tokens computed by this pass, in position order
    input_logprobs: list[list[float]] = field(default_factory=list)
    input_top_logprobs: list[list[list[tuple[float, int]]]] = field(default_factory=list)  # when top_logprobs_num
    # token_ids_logprob (empty when no request of the batch asks): per request, one value per id
    token_ids_logprobs: list[Optional[list[float]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[list[float]]] = field(default_factory=list)  # per prompt row
    kept_ids: dict = field(default_factory=dict)  # by batch row: its sampled token's kept set (array("i"))
