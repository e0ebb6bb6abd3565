"""The checkpoint's config.json as the engine reads it, without importing transformers where it can.

Importing transformers is ~1.3 s of `tandem serve`'s start on the device (its dependency check and
lazy-import machinery), paid on the engine core's critical path only to read one JSON file. For the
model types the engine serves, a config.json that states every value the engine reads is used as
it stands (`CheckpointConfig`); one that leaves such a value to transformers' per-model defaults,
asks for sliding-window layers, or names another type goes through `AutoConfig`, so no default is
ever guessed here. tests/engine/test_checkpoint_config.py holds the two readers to the same values.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any, Optional

# what every decoder reads (engine/models/decoder.py, layers.py, core/setup.py)
_DENSE = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
          "rms_norm_eps", "vocab_size", "hidden_act", "max_position_embeddings", "tie_word_embeddings")
_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
        "mlp_only_layers")
# per model type, the values transformers would otherwise fill from its own defaults (llama's and
# qwen2's head_dim default to hidden_size / heads, as the engine's does; Qwen3's to 128)
STATED_KEYS: dict[str, tuple[str, ...]] = {
    "llama": _DENSE + ("attention_bias", "mlp_bias"),
    "qwen2": _DENSE,
    "qwen3": _DENSE + ("head_dim", "attention_bias"),
    "qwen2_moe": _DENSE + _MOE + ("shared_expert_intermediate_size",),
    "qwen3_moe": _DENSE + _MOE + ("head_dim", "attention_bias"),
}


class CheckpointConfig(SimpleNamespace):
    """config.json's keys as attributes (what the engine's getattr calls read off an HF config)."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def missing_config_file(model_path: str) -> Optional[str]:
    """Why `model_path` is not a local checkpoint, or None when its config.json exists."""
    if os.path.isfile(os.path.join(model_path, "config.json")):
        return None
    what = "does not exist" if not os.path.exists(model_path) else "has no config.json"
    return (f"model_path {model_path!r} {what}: pass a local HF checkpoint directory "
            f"(build a small one with `tandem tiny-model --out DIR`)")


def load_hf_config(model_path: str) -> Any:
    """The checkpoint's config; a path that is not a local checkpoint is a FileNotFoundError saying
    so (transformers would take it for a hub repo id and complain about its characters)."""
    problem = missing_config_file(model_path)
    if problem:
        raise FileNotFoundError(problem)
    fast = read_stated_config(model_path)
    if fast is not None:
        return fast
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def read_stated_config(model_path: str) -> Optional[CheckpointConfig]:
    """config.json as it stands when it states everything the engine reads for its model type;
    None when transformers must fill something in (or the file is not a JSON object)."""
    raw = read_checkpoint_json(model_path)
    stated = STATED_KEYS.get(raw.get("model_type"))
    if stated is None or any(key not in raw for key in stated):
        return None
    if "rope_parameters" not in raw and "rope_theta" not in raw:
        return None
    if raw.get("use_sliding_window") and "layer_types" not in raw:
        return None  # transformers derives the sliding layers, which the decoder then refuses by name
    return CheckpointConfig(**raw)


def read_checkpoint_json(model_path: str, name: str = "config.json") -> dict:
    """One of the checkpoint's JSON files (config.json, generation_config.json) as a dict; {} when
    it is missing or not a JSON object."""
    try:
        with open(os.path.join(model_path, name), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}
