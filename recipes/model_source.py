"""ModelSource: where a recipe's weights come from, for the engines and the trainer alike.

`model` is a tiny_model preset ("tiny" builds a small random model locally; real-shape presets
such as "qwen3-0.6b" ship config + tokenizer only and load random weights, load_format "dummy")
or a path to an HF checkpoint directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSource:
    path: str
    load_format: str  # "auto" (the checkpoint's safetensors) or "dummy" (random weights)
    label: str

    @classmethod
    def resolve(cls, model: str, seed: int = 0) -> "ModelSource":
        from engine.testing.tiny_model import PRESETS, tiny_model_path

        if model in PRESETS:
            path = tiny_model_path(preset=model, seed=seed)
            has_weights = any(path.glob("*.safetensors"))
            return cls(str(path), "auto" if has_weights else "dummy",
                       f"{model} preset" + ("" if has_weights else " (random weights)"))
        if not (Path(model) / "config.json").exists():
            raise ValueError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with a "
                             f"config.json (download an HF checkpoint, e.g. `huggingface-cli download Qwen/Qwen3-0.6B "
                             f"--local-dir DIR`, and pass --model DIR)")
        return cls(str(Path(model).resolve()), "auto", model)
