"""Request fields SGLang takes that tandem cannot serve. Ignoring them would change what the
client gets (an image it sent goes unseen, a session's history is left out, an asked-for output
is missing), so each is refused with a 400 naming it; an empty value (null, false, [], {}, or a
batch of those, as wrappers send for text-only prompts) asks for nothing and passes."""

from __future__ import annotations

from typing import Any

_MULTIMODAL = "tandem serves text-only models; send text or input_ids without it"
REFUSED_GENERATE_FIELDS = {
    "image_data": _MULTIMODAL,
    "video_data": _MULTIMODAL,
    "audio_data": _MULTIMODAL,
    "input_embeds": "tandem takes token ids (input_ids) or text, not embeddings",
    "session_params": "tandem has no sessions (/open_session); send each turn's whole prompt",
    "return_entropy": "tandem does not return entropies; leave it false",
}
REFUSED_OPENAI_FIELDS = {name: REFUSED_GENERATE_FIELDS[name] for name in ("session_params",)}


def given(value: Any) -> bool:
    """Whether a value asks for something: not null/false/empty, nor a list of such values."""
    if isinstance(value, (list, tuple)):
        return any(given(v) for v in value)
    if isinstance(value, (dict, str)):
        return bool(value)
    return value is not None and value is not False


def refuse_given(values: dict[str, Any], reasons: dict[str, str]) -> None:
    """Raises a ValueError naming the first of `reasons`' fields that `values` sets."""
    for name, reason in reasons.items():
        if given(values.get(name)):
            raise ValueError(f"{name} is not supported: {reason}")
