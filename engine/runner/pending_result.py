"""PendingResult: a launched forward pass whose outputs are still on their way to the host.

Sampled ids and logprobs travel in one pinned buffer behind a CUDA event, so the host can
schedule (and launch) the next step before reading them: that is the overlap scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.sampling.nucleus import KeptIds
from engine.scheduler.batch import BatchResult, ScheduleBatch


@dataclass
class PendingResult:
    batch: ScheduleBatch
    next_token_ids: torch.Tensor  # [B] int64 on the device: input ids of a lookahead step
    host: torch.Tensor  # [2B] float64: ids then logprobs (copy in flight on CUDA)
    event: Optional[torch.cuda.Event]
    top: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # top-k (values, ids) on the device
    input_values: Optional[torch.Tensor] = None  # prompt logprobs on the device
    prompt_row_counts: Optional[list[int]] = None
    input_top: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # top-k at prompt positions
    token_ids: Optional[torch.Tensor] = None  # [B, W] token_ids_logprob values (padded rows)
    input_token_ids: Optional[torch.Tensor] = None  # [P, W] the same at prompt positions
    kept: Optional[KeptIds] = None  # custom_params.return_top_p_token_ids: the kept sets

    @classmethod
    def start(cls, batch: ScheduleBatch, next_ids: torch.Tensor, logprobs: torch.Tensor) -> "PendingResult":
        packed = torch.cat([next_ids.double(), logprobs.double()])  # ids < 2**53 stay exact
        if packed.device.type != "cuda":
            return cls(batch, next_ids, packed, None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(batch, next_ids, host, event)

    def resolve(self) -> BatchResult:
        if self.event is not None:
            self.event.synchronize()
        values = self.host.tolist()
        n = self.batch.batch_size
        result = BatchResult(next_token_ids=[int(v) for v in values[:n]], logprobs=values[n:])
        result.top_logprobs = self._top_lists()
        result.input_logprobs = self._input_lists()
        result.input_top_logprobs = self._input_top_lists()
        if self.token_ids is not None:
            result.token_ids_logprobs = self._token_ids_lists()
        if self.input_token_ids is not None:
            result.input_token_ids_logprobs = self._input_token_ids_lists()
        if self.kept is not None:
            result.kept_ids = self.kept.resolve()
        return result

    def _token_ids_lists(self) -> list[Optional[list[float]]]:
        values = self.token_ids.tolist()
        return [values[i][: len(r.token_ids_logprob)] if r.token_ids_logprob else None
                for i, r in enumerate(self.batch.reqs)]

    def _input_token_ids_lists(self) -> list[list[list[float]]]:
        """Per request, per prompt row: one value per requested id."""
        values = self.input_token_ids.tolist()
        out, offset = [], 0
        for r, n in zip(self.batch.reqs, self.prompt_row_counts or [0] * self.batch.batch_size):
            width = len(r.token_ids_logprob or ())
            out.append([row[:width] for row in values[offset : offset + n]] if width else [])
            offset += n
        return out

    def _top_lists(self) -> list:
        reqs = self.batch.reqs
        if self.top is None:
            return [None] * len(reqs)
        values, ids = self.top[0].tolist(), self.top[1].tolist()
        return [list(zip(values[i][: r.top_logprobs_num], ids[i][: r.top_logprobs_num])) if r.top_logprobs_num
                else None for i, r in enumerate(reqs)]

    def _input_top_lists(self) -> list[list[list[tuple[float, int]]]]:
        """Per request, per prompt row: its top_logprobs_num (logprob, id) pairs."""
        reqs = self.batch.reqs
        if self.input_top is None:
            return [[] for _ in reqs]
        values, ids = self.input_top[0].tolist(), self.input_top[1].tolist()
        out, offset = [], 0
        for r, n in zip(reqs, self.prompt_row_counts or [0] * len(reqs)):
            k = r.top_logprobs_num
            out.append([list(zip(values[j][:k], ids[j][:k])) for j in range(offset, offset + n)] if k else [])
            offset += n
        return out

    def _input_lists(self) -> list[list[float]]:
        counts = self.prompt_row_counts or [0] * self.batch.batch_size
        values = self.input_values.tolist() if self.input_values is not None else []
        out, offset = [], 0
        for n in counts:
            out.append(values[offset : offset + n])
            offset += n
        return out
