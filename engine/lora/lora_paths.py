"""--lora-paths entries, as SGLang reads them: PATH, NAME=PATH, or JSON
{"lora_name": str, "lora_path": str, "pinned": bool}. A bare PATH is also its name."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any


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


def lora_refs(specs: tuple[str, ...]) -> list[dict[str, Any]]:
    """The entries as /server_info shows them: SGLang's ServerArgs.lora_paths after its start-up
    normalisation, a list of LoRARef records {"lora_id", "lora_name", "lora_path", "pinned"} (its
    lora_id as SGLang 0.5.23 derives it: uuid5 of name and path, the same on every start)."""
    out = []
    for spec in map(parse_lora_path, specs):
        lora_id = uuid.uuid5(uuid.NAMESPACE_URL, f"{spec.lora_name}\0{spec.lora_path}").hex
        out.append({"lora_id": lora_id, "lora_name": spec.lora_name, "lora_path": spec.lora_path,
                    "pinned": spec.pinned})
    return out
