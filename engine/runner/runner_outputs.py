"""RunnerOutputs: the ModelRunner's outputs (a mixin, as RunnerMemory): sampling the next tokens,
the grammar masks they are sampled under, and every logprob the requests asked for (the chosen
token's, top-k, token_ids_logprob, the prompt's).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from engine.grammar.bitmask_ring import BitmaskRing
from engine.grammar.mask_prefetch import MaskPrefetch
from engine.kernels.device_copy import h2d
from engine.runner.logits_plan import LogitsPlan
from engine.runner.pending_result import PendingResult
from engine.sampling.logprobs import (gather_token_logprobs, greedy_with_logprobs, original_logprobs, top_k_of,
                                      top_logprobs)
from engine.sampling.nucleus import KeptIds, replay_rows
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch import SamplingBatch, SamplingRow
from engine.scheduler.batch import ScheduleBatch


class RunnerOutputs:
    """Reads the runner's config, device, sampler, log_softmax and grammar_masks / grammar_bitmasks."""

    config: Any  # RunnerConfig
    device: torch.device
    sampler: Sampler
    log_softmax: Any
    grammar_masks: MaskPrefetch
    grammar_bitmasks: BitmaskRing

    def _sample(self, batch: ScheduleBatch, plan: LogitsPlan, logits: torch.Tensor) -> PendingResult:
        last = logits if plan.rows_are_last else logits[h2d(plan.last_rows, self.device)]
        wants_ids = any(r.token_ids_logprob for r in batch.reqs)  # token_ids_logprob: rare, off by default
        if all(_plain_greedy(r) for r in batch.reqs):  # the common rollout/bench case: no setup
            # the fused kernel's sum order differs from log_softmax's: with top logprobs asked for,
            # the chosen token's value must stay the top-1 entry bit for bit (SGLang's check)
            if not wants_ids and not any(r.top_logprobs_num for r in batch.reqs):
                next_ids, chosen = greedy_with_logprobs(last, self.log_softmax)
                return self._finish_sample(batch, plan, logits, last, next_ids, chosen)
            next_ids = torch.argmax(last, dim=-1)
            original = original_logprobs(last, self.log_softmax)
            pending = self._finish_sample(batch, plan, logits, last, next_ids,
                                          gather_token_logprobs(original, next_ids))
            if wants_ids:  # plain greedy: the processed distribution is the original one
                pending.token_ids = self._token_ids_logprobs(batch, original, None)
            return pending
        seq_lens = batch.seq_lens()
        rows = [self._sampling_row(r, pos) for r, pos in zip(batch.reqs, seq_lens)]
        sampling = SamplingBatch.build(rows, self.config.vocab_size, self.device)
        sampling.grammar_bitmask = self.grammar_bitmasks.to_device(self._grammar_bitmask(batch))
        kept_rows = [i for i in replay_rows(batch.reqs) if not batch.reqs[i].sampling_params.is_greedy]
        processed_top = any(r.top_logprobs_num and r.logprob_distribution == "processed" for r in batch.reqs)
        processed_all = None
        if wants_ids or kept_rows or processed_top:
            out, original, processed_all = self.sampler.sample_with_distributions(last, sampling)
        else:  # no [B, V] held while prompt or top logprobs take their memory; RL's case fused, except
            # where normal mode's top logprobs (torch's log_softmax) must hold the token's value bit for bit
            fused = sampling.plain_sampled and (self.log_softmax is not None
                                                or not any(r.top_logprobs_num for r in batch.reqs))
            out = self.sampler.sample(last, sampling, fused=fused)
        chosen, processed_rows = out.original_logprobs, None
        if any(r.logprob_distribution == "processed" for r in batch.reqs):
            processed_rows = h2d(torch.tensor([r.logprob_distribution == "processed" for r in batch.reqs]), self.device)
            chosen = torch.where(processed_rows, out.processed_logprobs, out.original_logprobs)
        pending = self._finish_sample(batch, plan, logits, last, out.next_token_ids, chosen,
                                      (processed_all, processed_rows) if processed_top else None)
        if wants_ids:
            pending.token_ids = self._token_ids_logprobs(batch, original, processed_all)
        if kept_rows:  # a greedy row keeps its token: the host records that
            pending.kept = KeptIds.start(processed_all, kept_rows)
        return pending

    def use_grammar_backend(self, masks: Any, bitmasks: BitmaskRing) -> None:
        """The grammar process's client and its shared ring in place of this runner's mask thread
        (engine/grammar/matcher_client.py)."""
        self.grammar_masks.shutdown()
        self.grammar_masks, self.grammar_bitmasks = masks, bitmasks

    def prefetch_grammar_mask(self, batch: ScheduleBatch) -> None:
        """Start filling the bitmask `batch` (a launched lookahead step) will sample with; its rows'
        matchers have taken every committed token (engine/grammar/mask_prefetch.py)."""
        self.grammar_masks.start(batch, self._live_grammars(batch), self.grammar_bitmasks)  # no-op without live rows

    def _grammar_bitmask(self, batch: ScheduleBatch) -> Optional[torch.Tensor]:
        prefetched = self.grammar_masks.take(batch)
        if prefetched is not None:
            return prefetched
        return self.grammar_masks.fill_now(self._live_grammars(batch), self.grammar_bitmasks)

    @staticmethod
    def _live_grammars(batch: ScheduleBatch) -> list:
        # a request that finished while this step's forward ran ahead needs no mask (its token is dropped)
        return [None if r.finished else r.grammar for r in batch.reqs]

    def _token_ids_logprobs(self, batch: ScheduleBatch, original: torch.Tensor,
                            processed: Optional[torch.Tensor]) -> torch.Tensor:
        """[B, W] logprobs of each row's token_ids_logprob (padded to the longest), under the
        distribution its sampled token's logprob uses: one gather (two with processed rows)."""
        index = h2d(_padded_ids([r.token_ids_logprob for r in batch.reqs]), self.device)
        values = original.gather(1, index)
        wants_processed = [r.logprob_distribution == "processed" and bool(r.token_ids_logprob) for r in batch.reqs]
        if processed is not None and any(wants_processed):
            rows = h2d(torch.tensor(wants_processed), self.device).unsqueeze(1)
            values = torch.where(rows, processed.gather(1, index), values)
        return values

    def _finish_sample(self, batch: ScheduleBatch, plan: LogitsPlan, logits: torch.Tensor, last: torch.Tensor,
                       next_ids: torch.Tensor, chosen: torch.Tensor,
                       processed: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> PendingResult:
        """processed: (the processed logprobs [B, V], which rows ask for them [B]): those rows take
        their top logprobs from the distribution their token's logprob comes from."""
        pending = PendingResult.start(batch, next_ids, chosen)
        k = max((r.top_logprobs_num for r in batch.reqs), default=0)
        if k:
            pending.top = top_logprobs(last, k, self.log_softmax)
            if processed is not None:
                logprobs, rows = processed
                values, ids = top_k_of(logprobs, k)
                pending.top = (torch.where(rows[:, None], values, pending.top[0]),
                               torch.where(rows[:, None], ids, pending.top[1]))
        if plan.num_prompt_rows:
            rows_t, targets = h2d(plan.prompt_rows, self.device), h2d(plan.prompt_targets, self.device)
            prompt_logprobs = original_logprobs(logits[rows_t], self.log_softmax)  # once, for both below
            pending.input_values = gather_token_logprobs(prompt_logprobs, targets)
            if k:  # input_top_logprobs: the top k at each prompt position too
                pending.input_top = top_k_of(prompt_logprobs, k)
            id_lists = [r.token_ids_logprob if n else None for r, n in zip(batch.reqs, plan.prompt_row_counts)]
            if any(id_lists):  # input_token_ids_logprobs: each prompt row gathers its request's ids
                per_row = torch.repeat_interleave(_padded_ids(id_lists), torch.tensor(plan.prompt_row_counts), dim=0)
                pending.input_token_ids = prompt_logprobs.gather(1, h2d(per_row, self.device))
        pending.prompt_row_counts = plan.prompt_row_counts
        return pending

    def _sampling_row(self, req, position: int) -> SamplingRow:
        """position: where the sampled token will sit (the counter of its seeded noise)."""
        params = req.sampling_params
        suppress: list[int] = []
        if len(req.output_ids) < params.min_new_tokens:
            suppress = list(self.config.eos_token_ids) + list(params.stop_token_ids or [])
        return SamplingRow(
            params=params, seed=req.seed, position=position,
            prompt_ids=req.origin_input_ids, output_ids=req.output_ids, suppress_ids=suppress,
        )


def _padded_ids(id_lists: list[Optional[list[int]]]) -> torch.Tensor:
    """[B, W] int64 host tensor: each row's ids, then zeros (read, never reported)."""
    width = max(len(ids) for ids in id_lists if ids)
    flat: list[int] = []
    for ids in id_lists:
        ids = ids or []
        flat.extend(ids)
        flat.extend([0] * (width - len(ids)))
    return torch.tensor(flat, dtype=torch.int64).view(len(id_lists), width)


def _plain_greedy(req) -> bool:
    """Greedy with nothing that reshapes the logits: argmax of the raw logits, and the processed
    distribution equals the original one."""
    p = req.sampling_params
    return (p.is_greedy and req.grammar is None and not p.logit_bias and p.repetition_penalty == 1.0
            and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0 and len(req.output_ids) >= p.min_new_tokens)

