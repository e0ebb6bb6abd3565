"""Sampler: logits -> next tokens plus their original and processed logprobs.

Pipeline per row (every step vectorised over the batch and skipped when no row needs it):
  original  = log_softmax(raw fp32 logits)
  penalties : repetition (HF: over prompt+output), then frequency/presence (over output)
  logit_bias: added to the penalised logits (SGLang: after the penalties)
  min_new_tokens: banned stop ids -> -inf; grammar: tokens the row's grammar forbids -> -inf
  temperature, then top-k / top-p / min-p as -inf masks (SGLang semantics: all three
  thresholds are taken on the same post-temperature distribution)
  processed = log_softmax(result)
Greedy rows take argmax of the penalised (and biased) logits. Sampled rows take
argmax(processed + Gumbel(seed, position, id)): the noise is a counter-based hash, so a row's
token depends only on its own logits, seed and position, never on the batch.
On CUDA, with TANDEM_FUSED_SAMPLE=1, a batch of rows sampled at their temperatures with nothing
else reshaping them (RL's rollouts: `SamplingBatch.plain_sampled`) takes
engine/kernels/gumbel_sample.py instead: the same function in two reads of the logits, no [B, V]
written. Off by default until its speed and its current tests are measured on a GPU.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, NamedTuple, Optional

import torch

from engine.kernels import batch_invariant, optional_kernel
from engine.sampling.logprobs import LogSoftmax, gather_token_logprobs, original_logprobs
from engine.sampling.sampler_warmup import compile_side_by_side, fused_calls, noise_calls, warms
from engine.sampling.sampling_batch import SamplingBatch
from engine.sampling.seeds import gumbel_argmax
from engine.sampling.token_mask import masked_logits, unpack_forbidden

logger = logging.getLogger(__name__)


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [B] int64
    original_logprobs: torch.Tensor  # [B] float32, under log_softmax(raw logits)
    processed_logprobs: torch.Tensor  # [B] float32, under the distribution sampled from


class Sampler:
    """`compile=True` fuses the noise hash into one kernel on CUDA (about 25x faster than eager
    at B=256, V=152k on an H200; identical tokens); the first call per shape class compiles
    (~6 s), so warm it up. CPU always runs eager. By default the hand-written Triton kernel
    (engine/kernels/gumbel_argmax.py) draws instead: the same tokens, no torch.compile at start-up
    (an H100, 8B shape: `tandem serve` ready in 20.4 s vs 27.1 on empty caches) and 1.9% more T=1
    throughput (0.6B, 256 x (512, 256)); TANDEM_TRITON_GUMBEL=0 takes torch.compile's.

    `log_softmax`: the kernel for both logprob distributions; deterministic mode passes the
    batch-invariant one (engine.kernels.batch_invariant.log_softmax)."""

    def __init__(self, compile: bool = True, log_softmax: Optional[LogSoftmax] = None) -> None:
        self._compile = compile
        self._compiled: Optional[Callable] = None
        self._log_softmax = log_softmax
        # the fused kernel's logprobs on float32 are the batch-invariant log_softmax's bits
        self._fused_ok = compile and (log_softmax is None or log_softmax is batch_invariant.log_softmax)

    def warmup(self, device: torch.device, vocab_size: int,
               logits_dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
        """Compile the sampling kernels now rather than on the first sampled request (a rollout's
        first step would stall for seconds), side by side (engine/sampling/sampler_warmup.py).
        `logits_dtypes`: what the forward passes hand over (float32 eager, the model's from the
        CUDA graphs). A fused kernel that fails leaves the log_softmax path; a Triton noise kernel
        that fails falls back to torch.compile's, that one to eager (the same tokens, slower)."""
        if not self._compile or device.type != "cuda":
            return
        fused, noise = self._fused_kernel(device), self._gumbel_argmax(device)
        if self._log_softmax is not None:  # deterministic mode hands the fused kernel float32 only
            logits_dtypes = (torch.float32,)
        fused_warmup = fused_calls(fused, device, vocab_size, logits_dtypes) if fused is not None else []
        noise_warmup = noise_calls(noise, device, vocab_size)
        triton_noise = noise is _triton_gumbel_argmax()
        if fused_warmup:  # up to fourteen compiles: side by side (the noise kernel's two alone: one by one, as before)
            compile_side_by_side(fused_warmup + (noise_warmup if triton_noise else []))
        if fused is not None and not warms(fused_warmup, "the fused sampling kernel", "log_softmax's path instead"):
            self._fused_ok = False
        if triton_noise:
            if warms(noise_warmup, "the Triton noise kernel", "torch.compile's instead"):
                return
            self._compiled = noise = torch.compile(gumbel_argmax, dynamic=True)
        if not warms(noise_calls(noise, device, vocab_size), "torch.compile", "sampling runs eager"):
            self._compile, self._compiled, self._fused_ok = False, None, False

    def sample(self, logits: torch.Tensor, batch: SamplingBatch, fused: bool = True) -> SampleOutput:
        """`fused`: engine.kernels.gumbel_sample where it applies (CUDA, a plain sampled batch)."""
        kernel = self._fused_kernel(logits.device) if fused and batch.plain_sampled else None
        if kernel is None:
            return self.sample_with_distributions(logits, batch)[0]
        if self._log_softmax is not None:  # deterministic: float32 in, for the batch-invariant bits
            logits = logits.float()
        temperatures = batch.temperatures.view(-1) if batch.need_temperature else None
        return SampleOutput(*kernel(logits, temperatures, batch.seeds, batch.positions))

    def _fused_kernel(self, device: torch.device) -> Optional[Callable]:
        """engine.kernels.gumbel_sample (two reads of the logits, no [B, V] written) on CUDA,
        under TANDEM_FUSED_SAMPLE=1 (off by default: not yet measured on a GPU)."""
        if device.type != "cuda" or not self._fused_ok or os.environ.get("TANDEM_FUSED_SAMPLE", "0") != "1":
            return None
        module = optional_kernel("gumbel_sample")
        return None if module is None else module.gumbel_sample

    def sample_with_distributions(self, logits: torch.Tensor, batch: SamplingBatch
                                  ) -> tuple[SampleOutput, torch.Tensor, torch.Tensor]:
        """sample, plus both whole [B, V] logprob tensors, original and processed (for the
        logprobs of other ids: token_ids_logprob)."""
        raw = logits.float()
        penalised = apply_penalties(raw, batch)
        processed = log_softmax_processed(penalised, batch, self._log_softmax)
        tokens = self._pick(penalised, processed, batch)
        # nothing reshaped the distribution (T = 1, no penalties or truncation: GRPO's rollouts):
        # the processed logprobs are the original ones, the same function of the same tensor
        unchanged = penalised is raw and not (batch.need_temperature or batch.need_truncation)
        original = processed if unchanged else original_logprobs(raw, self._log_softmax)
        out = SampleOutput(
            next_token_ids=tokens,
            original_logprobs=gather_token_logprobs(original, tokens),
            processed_logprobs=gather_token_logprobs(processed, tokens),
        )
        return out, original, processed

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        return self.sample(logits, batch)

    def _pick(
        self, penalised: torch.Tensor, processed: torch.Tensor, batch: SamplingBatch
    ) -> torch.Tensor:
        # greedy uses the logits, not processed logprobs: log_softmax rounding can create ties
        greedy = torch.argmax(penalised, dim=-1) if batch.any_greedy else None
        if batch.all_greedy:
            return greedy
        sampled = self._gumbel_argmax(processed.device)(processed, batch.seeds, batch.positions)
        return sampled if greedy is None else torch.where(batch.is_greedy, greedy, sampled)

    def _gumbel_argmax(self, device: torch.device) -> Callable:
        if not self._compile or device.type != "cuda":
            return gumbel_argmax
        if self._compiled is None:
            self._compiled = _triton_gumbel_argmax() or torch.compile(gumbel_argmax, dynamic=True)
        return self._compiled


def _triton_gumbel_argmax() -> Optional[Callable]:
    """engine.kernels.gumbel_argmax's kernel where Triton imports, unless TANDEM_TRITON_GUMBEL=0."""
    module = optional_kernel("gumbel_argmax") if os.environ.get("TANDEM_TRITON_GUMBEL", "1") == "1" else None
    return None if module is None else module.gumbel_argmax


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalties, logit_bias, the min_new_tokens ban and the grammar mask on fp32 logits; returns a
    new tensor when changed (the raw logits stay for the original logprobs)."""
    x = logits
    if batch.need_repetition:
        pen = batch.repetition_penalties.unsqueeze(1)
        scaled = torch.where(x > 0, x / pen, x * pen)
        x = torch.where(batch.seen_mask, scaled, x)
    if batch.need_freq_presence:
        counts = batch.output_counts
        x = x - batch.frequency_penalties.unsqueeze(1) * counts
        x = x - batch.presence_penalties.unsqueeze(1) * (counts > 0).float()
    if batch.logit_bias is not None:  # before the bans: a biased token stays banned
        x = x + batch.logit_bias
    if batch.suppress_mask is not None:
        return x.masked_fill(_banned_ids(batch), float("-inf"))
    if batch.grammar_bitmask is not None:  # one pass on CUDA (engine/sampling/token_mask.py)
        return masked_logits(x, batch.grammar_bitmask)
    return x


def _banned_ids(batch: SamplingBatch) -> torch.Tensor:
    """min_new_tokens' ban and the grammar's mask; where together they leave a row nothing (the
    grammar allows only a stop token), the grammar wins: its output is complete."""
    suppress = batch.suppress_mask
    if batch.grammar_bitmask is None:
        return suppress
    grammar = unpack_forbidden(batch.grammar_bitmask, suppress.shape[-1])
    both = suppress | grammar
    return torch.where(both.all(dim=-1, keepdim=True), grammar, both)


def log_softmax_processed(penalised: torch.Tensor, batch: SamplingBatch,
                          log_softmax: Optional[LogSoftmax] = None) -> torch.Tensor:
    """Temperature and top-k/top-p/min-p on penalised logits -> [B, V] float32 logprobs."""
    x = penalised
    if batch.need_temperature:  # x / 1.0 is x, bit for bit: no pass over [B, V] for it
        x = x / batch.temperatures
    if batch.need_truncation:
        x = x.masked_fill(_truncation_mask(x, batch), float("-inf"))
    if log_softmax is not None:
        return log_softmax(x)
    return torch.log_softmax(x, dim=-1)


def _truncation_mask(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] bool: tokens cut by top-k, top-p or min-p. The most likely token always survives."""
    probs = torch.softmax(x, dim=-1)
    drop = torch.zeros_like(x, dtype=torch.bool)
    if batch.need_top_k or batch.need_top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        sorted_drop = torch.zeros_like(drop)
        if batch.need_top_k:
            ranks = torch.arange(x.shape[-1], device=x.device).unsqueeze(0)
            sorted_drop |= ranks >= batch.top_ks.unsqueeze(1)
        if batch.need_top_p:
            # rows with top_p = 1 keep everything: their float32 cumsum can pass 1.0 in the tail,
            # which would cut tokens only when a neighbour's top_p < 1 switches this step on
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            cuts = (batch.top_ps < 1.0).unsqueeze(1)
            sorted_drop |= (mass_before > batch.top_ps.unsqueeze(1)) & cuts
        drop = drop.scatter(1, order, sorted_drop)
    if batch.need_min_p:
        threshold = probs.max(dim=-1, keepdim=True).values * batch.min_ps.unsqueeze(1)
        drop |= probs < threshold
    return drop
