"""Request fields SGLang takes that tandem cannot serve. Ignoring them would change what the
client gets (an image it sent goes unseen, a session's history is left out, an asked-for output
is missing), so each is refused with a 400 naming it; an empty value (null, false, [], {}, or a
batch of those, as wrappers send for text-only prompts) asks for nothing and passes."""

from __future__ import annotations

from typing import Any

from engine.api.sglang_kwargs import REFUSED, asks

# /generate's body: the multimodal, embedding, session and entropy fields (return_hidden_states
# and custom_logit_processor have the body's own check, engine/server/protocol.py)
REFUSED_GENERATE_FIELDS = {name: REFUSED[name] for name in (
    "image_data", "video_data", "audio_data", "input_embeds", "session_params", "return_entropy",
    "return_indexer_topk", "sampling_logprobs_mode", "return_sampling_mask")}
REFUSED_OPENAI_FIELDS = {name: REFUSED[name] for name in (
    "session_params", "return_indexer_topk", "sampling_logprobs_mode", "return_sampling_mask")}


def refuse_given(values: dict[str, Any], reasons: dict[str, str]) -> None:
    """Raises a ValueError naming the first of `reasons`' fields that `values` sets."""
    for name, reason in reasons.items():
        if asks(name, values.get(name)):
            raise ValueError(f"{name} is not supported: {reason}")
