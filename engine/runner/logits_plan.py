"""LogitsPlan: which hidden rows of a forward pass need logits, and what each row is for.

Every request needs the logits of its last new token (to sample). A request that asked for prompt
logprobs also needs the rows whose next token is a prompt token at or after logprob_start_len.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.scheduler.batch import ScheduleBatch


@dataclass
class LogitsPlan:
    rows: torch.Tensor  # [R] rows of the hidden states to project to logits
    last_rows: torch.Tensor  # [B] index into the projected rows: each request's last token
    prompt_rows: torch.Tensor  # [P] index into the projected rows, for prompt logprobs
    prompt_targets: torch.Tensor  # [P] the prompt token each of those rows predicts
    prompt_row_counts: list[int]  # [B] how many prompt rows belong to each request

    @property
    def rows_are_last(self) -> bool:
        """Each projected row is some request's last token, in order (every decode step)."""
        return self.num_prompt_rows == 0 and len(self.last_rows) == len(self.rows)

    @property
    def num_prompt_rows(self) -> int:
        return int(self.prompt_rows.numel())

    @classmethod
    def build(cls, batch: ScheduleBatch) -> "LogitsPlan":
        rows: list[int] = []
        last_rows: list[int] = []
        prompt_rows: list[int] = []
        targets: list[int] = []
        counts: list[int] = []
        offset = 0
        for req, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            count = 0
            if req.wants_input_logprobs:
                prompt = req.origin_input_ids
                first = max(start, req.logprob_start_len - 1, 0)
                for pos in range(first, min(start + n, len(prompt) - 1)):
                    prompt_rows.append(len(rows))
                    rows.append(offset + pos - start)
                    targets.append(prompt[pos + 1])
                    count += 1
            last = offset + n - 1
            if rows and rows[-1] == last:
                last_rows.append(len(rows) - 1)
            else:
                last_rows.append(len(rows))
                rows.append(last)
            counts.append(count)
            offset += n
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        return cls(as_tensor(rows), as_tensor(last_rows), as_tensor(prompt_rows), as_tensor(targets), counts)
