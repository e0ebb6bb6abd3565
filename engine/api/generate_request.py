"""GenerateRequest: one generate call, the same object from the HTTP body, Engine.generate's
keywords or a Ray/HTTP client, to the RequestBuilder that turns it into core messages.

The fields are SGLang's `Engine.generate` keywords, in tandem's positional order, with their
defaults decided here once. Nothing is checked here: RequestBuilder validates every field (it
knows the vocabulary, the context length and the limits) and normalises the logprob options.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from engine.api.sglang_kwargs import pop_sglang_only

IdLists = Union[list[int], list[list[int]]]


@dataclass
class GenerateRequest:
    prompt: Union[str, list[str], None] = None  # text; or input_ids (both: input_ids is the prompt)
    sampling_params: Any = None  # a dict / SamplingParams, or one per prompt
    input_ids: Optional[IdLists] = None
    # these three: one value, or one per prompt (SGLang's batch form)
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[int, list[int]] = -1  # -1: no prompt logprobs
    top_logprobs_num: Union[int, list[int]] = 0
    logprob_distribution: Optional[str] = None  # "original" | "processed"; None: the server's default
    rid: Union[str, list[str], None] = None
    token_ids_logprob: Optional[IdLists] = None  # ids whose logprobs every position reports
    stream: bool = False
    return_routed_experts: Union[bool, list[bool]] = False  # MoE: needs --enable-return-routed-experts
    # a LoRA adapter's name (or path) for every prompt, or one per prompt (None: the base model)
    lora_path: Union[str, list[Optional[str]], None] = None
    # the first position whose routes come back (SGLang's: a continued rollout holds the earlier ones)
    routed_experts_start_len: Union[int, list[int]] = 0
    return_prompt_token_ids: bool = False  # each output's prompt ids, as "prompt_token_ids"
    # SGLang's cache salt: prompts of different keys never share cached KV (one key, or one per prompt)
    extra_key: Union[str, list[Optional[str]], None] = None

    @classmethod
    def of(cls, *args: Any, **kwargs: Any) -> "GenerateRequest":
        """Engine.generate's arguments (SGLang's keywords, or positionally in field order), or a
        GenerateRequest passed as it is. SGLang's keywords tandem cannot serve pass when empty and
        are refused by name otherwise (engine/api/sglang_kwargs.py); a None logprob option is its
        default, as sglang.Engine's signature has it. Any other unknown keyword is a TypeError."""
        if len(args) == 1 and not kwargs and isinstance(args[0], cls):
            return args[0]
        pop_sglang_only(kwargs)
        unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
        if unknown:  # named here, with what is taken, rather than by the dataclass's __init__
            raise TypeError(f"generate got unexpected keyword argument(s) {', '.join(unknown)}; it takes "
                            f"{', '.join(f.name for f in fields(cls))} (and sglang.Engine's image_data, "
                            "custom_logit_processor, ... when empty)")
        for name, default in NONE_MEANS_DEFAULT.items():
            if name in kwargs and kwargs[name] is None:
                kwargs[name] = default
        return cls(*args, **kwargs)


# sglang.Engine.generate's defaults are None for these (verl's adapters pass them so)
NONE_MEANS_DEFAULT = {"return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0, "stream": False,
                      "return_routed_experts": False, "routed_experts_start_len": 0, "return_prompt_token_ids": False}
