"""PEFT adapters on the tiny model for the LoRA tests: HF transformers + PEFT in float32 build them
(random non-zero lora_B, so the delta matters) and are the oracle of their outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45, 46], [300, 12, 800, 9, 77]]


def make_peft_adapter(model_path: str, out_dir: Path, seed: int, rank: int = 8, alpha: int = 16,
                      targets: list[str] = TARGETS) -> Path:
    """A PEFT LoRA of the tiny model, lora_A and lora_B drawn from `seed`, saved in PEFT's format."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                      lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(str(out_dir))
    return out_dir


def peft_greedy(model_path: str, adapter_dir: Path | None, prompts: list[list[int]], max_new_tokens: int = 8
                ) -> tuple[list[list[int]], list[list[float]]]:
    """HF (+ PEFT) float32 greedy decoding: output ids and each chosen token's logprob."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    ids_out, lps_out = [], []
    for prompt in prompts:
        ids, lps = list(prompt), []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                logprobs = torch.log_softmax(logits, -1)
                token = int(torch.argmax(logits))
                ids.append(token)
                lps.append(float(logprobs[token]))
        ids_out.append(ids[len(prompt):])
        lps_out.append(lps)
    return ids_out, lps_out


def engine_greedy(engine, prompts: list[list[int]], lora_path=None) -> tuple[list[list[int]], list[list[float]]]:
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, lora_path=lora_path)
    return ([o["output_ids"] for o in outs],
            [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs])
