"""--lora-paths entries, as SGLang reads them: PATH, NAME=PATH, or JSON
{"lora_name": str, "lora_path": str, "pinned": bool}. A bare PATH is also its name."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAPathSpec:
    lora_name: str
    lora_path: str
    pinned: bool = False


def parse_lora_path(spec: str) -> LoRAPathSpec:
    text = spec.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-paths entry {spec!r} is not valid JSON: {exc}") from None
        name, path = obj.get("lora_name"), obj.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ValueError(f"--lora-paths JSON entry {spec!r} needs string lora_name and lora_path")
        return LoRAPathSpec(name, path, bool(obj.get("pinned", False)))
    name, sep, path = text.partition("=")
    if not sep:
        return LoRAPathSpec(text, text)
    if not name or not path:
        raise ValueError(f"--lora-paths entry {spec!r} must be PATH, NAME=PATH or JSON")
    return LoRAPathSpec(name, path)
