"""The HF transformers baseline: `generate` on the engine's weights, all requests in one batch.

This is what a trainer without a serving engine does (TRL's default): left-padded prompts,
greedy, every row decoding to the same length. Throughput counts the tokens the workload asked
for (sum of output lengths); with mixed output lengths HF still decodes every row to the
longest, which is its real cost.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch
from torch import nn

from tandem.bench import device as dev
from tandem.bench.hf_weights import copy_into_hf
from tandem.bench.workload import Workload

logger = logging.getLogger("tandem")


def build_hf_model(model_path: str, engine_model: nn.Module, dtype: torch.dtype,
                   device: torch.device) -> nn.Module:
    """An HF model of the checkpoint's config, built on the device, holding the engine's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device(device):  # random init on the device is quick; the copy then overwrites it
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    copy_into_hf(engine_model, model)
    return model.eval()


def pad_left(input_ids: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in input_ids)
    ids = torch.full((len(input_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(input_ids), width), dtype=torch.long)
    for row, seq in enumerate(input_ids):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq):] = 1
    return ids.to(device), mask.to(device)


def hf_generate(model: nn.Module, input_ids: list[list[int]], new_tokens: int,
                device: torch.device) -> tuple[torch.Tensor, float]:
    """-> (generated ids [rows, new_tokens], wall seconds)."""
    pad_id = _pad_id(model)
    ids, mask = pad_left(input_ids, pad_id, device)
    dev.synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, pad_token_id=pad_id, temperature=None, top_p=None, top_k=None,
        )
    dev.synchronize(device)
    return out[:, ids.shape[1]:], time.perf_counter() - start


def run_hf(model: nn.Module, workload: Workload, device: torch.device, runs: int) -> dict[str, Any]:
    """Warm up on a small batch, then `runs` timed passes of the whole workload."""
    new_tokens = max(workload.output_lens)
    hf_generate(model, workload.input_ids[:2], 2, device)
    per_run, generated = [], None
    for i in range(runs):
        dev.reset_peak_memory(device)
        generated, wall = hf_generate(model, workload.input_ids, new_tokens, device)
        per_run.append({
            "wall_s": wall,
            "output_tokens": workload.total_output_tokens,
            "generated_tokens": int(generated.numel()),
            "output_tok_s": workload.total_output_tokens / wall,
            "input_tok_s": workload.total_input_tokens / wall,
            "peak_memory_gb": dev.peak_memory_gb(device),
        })
        logger.info("HF run %d/%d: %.1f output tok/s", i + 1, runs, per_run[-1]["output_tok_s"])
    return {"runs": per_run, "output_ids": generated.tolist() if generated is not None else None,
            "attn_implementation": getattr(model.config, "_attn_implementation", None)}


def agreement(tandem_ids: list[list[int]], hf_ids: Optional[list[list[int]]]) -> Optional[float]:
    """Fraction of requests whose tandem output equals HF's greedy output (HF rows are cut to
    each request's length), over the requests HF ran. Expect 1.0 in float32; bf16 rounding flips near-tied argmaxes."""
    if not hf_ids:
        return None
    same = sum(1 for t, h in zip(tandem_ids, hf_ids) if list(t) == list(h[: len(t)]))
    return same / min(len(tandem_ids), len(hf_ids))  # HF may have run the first requests only


def _pad_id(model: nn.Module) -> int:
    for source in (model.generation_config, model.config):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return 0
