"""sglang.Engine.generate's keywords that tandem takes but cannot serve.

RL frameworks pass them explicitly even for text-only rollouts (verl: `image_data=[None, ...]`,
`prompt=None`; SGLang's own adapters: `custom_logit_processor=None`, `data_parallel_rank=None`),
so an empty value (None, False, "", [], {}, or a batch of those) asks for nothing and is dropped.
A value that asks for something is refused by name, with what to do instead: ignoring it would
change what the caller gets (an image goes unseen, an asked-for output is missing).
"""

from __future__ import annotations

import numbers
from typing import Any

_MULTIMODAL = "tandem serves text-only models; pass text or input_ids without it"
_DISAGG = "tandem has no prefill/decode disaggregation; leave it None"
REFUSED = {
    "image_data": _MULTIMODAL,
    "audio_data": _MULTIMODAL,
    "video_data": _MULTIMODAL,
    "input_embeds": "tandem takes token ids (input_ids) or text, not embeddings",
    "return_hidden_states": "tandem does not return hidden states; leave it False",
    "return_entropy": "tandem does not return entropies; leave it False",
    "return_indexer_topk": "tandem serves no sparse-attention indexer (DeepSeek V3.2's); leave it False",
    "custom_logit_processor": "tandem runs no client-supplied code; use sampling_params logit_bias, or leave it None",
    "session_params": "tandem has no sessions; send each turn's whole prompt",
    # newer SGLang's sampling-support outputs (Miles' score centering asks for them)
    "sampling_logprobs_mode": "tandem's logprobs are the sampled token's under the model's distribution ('selected'); "
                              "'support' (renormalised over the top-k / top-p support) is not served",
    "return_sampling_mask": "tandem does not return output_token_sampling_mask / output_token_sampling_logprobs; "
                            "leave it False",
    "bootstrap_host": _DISAGG,
    "bootstrap_port": _DISAGG,
    "bootstrap_room": _DISAGG,
}
ASKS_NOTHING = {"sampling_logprobs_mode": "selected"}  # a value that is what tandem does anyway
DP_RANKS = ("data_parallel_rank", "routed_dp_rank")  # one rank here: 0 or None
IGNORED = ("external_trace_header",)  # tracing metadata: changes no output
I64 = (-2**63, 2**63 - 1)


def check_priority(priority: Any) -> None:
    """`priority`: an int (or None), taken and ignored, as SGLang does on a server without
    --enable-priority-scheduling (its default); tandem schedules first come, first served."""
    if priority is None:
        return
    if not isinstance(priority, numbers.Integral) or isinstance(priority, bool) or not I64[0] <= priority <= I64[1]:
        raise ValueError(f"priority must be a 64-bit int (or None), got {priority!r}")


def pop_sglang_only(kwargs: dict[str, Any]) -> None:
    """Removes REFUSED, DP_RANKS and IGNORED keywords from `kwargs`, raising a ValueError naming
    the first one that asks for something tandem cannot do."""
    for name, reason in REFUSED.items():
        if name in kwargs and asks(name, kwargs.pop(name)):
            raise ValueError(f"{name} is not supported: {reason}")
    for name in DP_RANKS:
        rank = kwargs.pop(name, None)
        if rank not in (None, 0):
            raise ValueError(f"{name}={rank!r}: tandem runs one data-parallel rank; pass 0 or None")
    for name in IGNORED:
        kwargs.pop(name, None)
    check_priority(kwargs.pop("priority", None))


def asks(name: str, value: Any) -> bool:
    """Whether field `name` set to `value` asks for something tandem would have to do differently."""
    return given(value) and value != ASKS_NOTHING.get(name)


def given(value: Any) -> bool:
    """Whether a value asks for something: not None/False/empty, nor a list of such values."""
    if isinstance(value, (list, tuple)):
        return any(given(v) for v in value)
    if isinstance(value, (dict, str)):
        return bool(value)
    return value is not None and value is not False
