"""LoRANames: the front end's view of the loaded LoRA adapters, to refuse a request naming an
unknown one (or any, with LoRA off) with a ValueError before it reaches the core. Updated from
every load/unload reply; the core checks again (an adapter may go in between)."""

from __future__ import annotations

from typing import Any, Iterable, Optional


class LoRANames:
    def __init__(self, enabled: bool, loaded: Iterable[tuple[str, Optional[str]]] = ()) -> None:
        self.enabled = enabled
        self.loaded: dict[str, Optional[str]] = dict(loaded)  # name -> path

    def update(self, loaded_adapters: Any) -> None:
        if isinstance(loaded_adapters, dict):
            self.loaded = dict(loaded_adapters)

    def check(self, lora_path: Any) -> Optional[str]:
        """One prompt's lora_path: None (the base model) or a loaded adapter's name or path."""
        if lora_path is None:
            return None
        if not self.enabled:
            raise ValueError("lora_path needs the server started with --enable-lora (or --lora-paths)")
        if not isinstance(lora_path, str):
            raise ValueError(f"lora_path must be an adapter name, a list of them (one per prompt) or null; "
                             f"got {type(lora_path).__name__}")
        if lora_path not in self.loaded and lora_path not in self.loaded.values():
            raise ValueError(f"unknown LoRA adapter {lora_path!r}; loaded: {', '.join(sorted(self.loaded)) or 'none'}")
        return lora_path
