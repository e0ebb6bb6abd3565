"""The sampler's Triton kernels compiled at start-up, side by side, rather than one by one at the
first sampled request (a rollout's first step would stall for seconds on each compile).

Each kernel's warm-up is a list of calls on zeros: every specialisation the engine launches
(batch 1 and 2, the logits' dtypes: float32 from an eager forward, the model's from the CUDA
graphs; tempered or not). `compile_side_by_side` hands their compiles to a pool in one dry pass
(engine/kernels/compile_ahead.py); `warms` then runs them for real, loading what the pool built.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Iterable

import torch

from engine.kernels.compile_ahead import CompileAhead, compile_ahead_mode

logger = logging.getLogger(__name__)


def noise_calls(fn: Callable, device: torch.device, vocab_size: int) -> list[Callable]:
    """gumbel_argmax(logprobs, seeds, positions) at batch 1 and 2 (torch.compile specialises 1)."""
    return [functools.partial(_noise_call, fn, device, vocab_size, bs) for bs in (1, 2)]


def fused_calls(fn: Callable, device: torch.device, vocab_size: int,
                dtypes: Iterable[torch.dtype]) -> list[Callable]:
    """gumbel_sample(logits, temperatures, seeds, positions) for each logits dtype, at T = 1 and tempered."""
    return [functools.partial(_fused_call, fn, device, vocab_size, dtype, tempered)
            for dtype in dict.fromkeys(dtypes) for tempered in (False, True)]


def compile_side_by_side(calls: list[Callable]) -> None:
    """The calls' Triton compiles on a pool (unless TANDEM_COMPILE_AHEAD=0); what fails here
    compiles, or fails, at its real launch."""
    if not calls or compile_ahead_mode() == "0":
        return
    try:
        ahead = CompileAhead()
        with ahead.dry_pass():
            for call in calls:
                ahead.run(call)
        report = ahead.wait()
        logger.debug("sampler: %d kernels compiled ahead in %.1f s", report.submitted, report.seconds)
    except Exception as exc:  # an older Triton: the warm-up compiles one by one
        logger.debug("sampler: no compiling ahead (%s: %s)", type(exc).__name__, exc)


def warms(calls: list[Callable], what: str, instead: str) -> bool:
    """Run the calls (their compiles); False, with a warning, when one fails."""
    try:
        for call in calls:
            call()
        return True
    except Exception as exc:  # no working compiler here
        logger.warning("sampler: %s failed (%s: %s); %s", what, type(exc).__name__, exc, instead)
        return False


def _noise_call(fn: Callable, device: torch.device, vocab_size: int, bs: int) -> None:
    fn(torch.zeros(bs, vocab_size, device=device), *_keys(bs, device))


def _fused_call(fn: Callable, device: torch.device, vocab_size: int, dtype: torch.dtype, tempered: bool) -> None:
    temperatures = torch.ones(2, device=device) if tempered else None
    fn(torch.zeros(2, vocab_size, device=device, dtype=dtype), temperatures, *_keys(2, device))


def _keys(bs: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    zeros = torch.zeros(bs, dtype=torch.int64, device=device)
    return zeros, zeros
