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
        _check_checkpoint(Path(model))
        return cls(str(Path(model).resolve()), "auto", model)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_checkpoint(path: Path) -> None:
    """Weights and a tokenizer next to config.json: refused here, before the run folder, rather
    than by the trainer or an engine once they start."""
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model {str(path)!r} has a config.json but no *.safetensors weights: tandem loads "
                         f"safetensors checkpoints (an HF download of the model has them)")
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise ValueError(f"model {str(path)!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the "
                         f"tokenizer files of the model it was trained from into it")
