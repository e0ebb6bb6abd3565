"""LoRARegistry: the adapters loaded in the core, by name, each under a fresh id.

The id is what requests and the radix cache carry: reloading a name gives a new id, so the old
adapter's cached prefixes can never serve the new one (they are dropped at unload anyway). An
adapter being unloaded takes no new requests at once; it goes when the requests using it have
finished (SGLang waits the same way), see engine/core/lora_control.py.
"""

from __future__ import annotations

import itertools
from typing import Optional

from engine.lora.adapter import LoRAAdapter


class LoRARegistry:
    def __init__(self, max_loaded: Optional[int]) -> None:
        self.max_loaded = max_loaded
        self.by_id: dict[int, LoRAAdapter] = {}
        self._ids: dict[str, int] = {}  # name -> id of the adapters that take requests
        self._unloading: dict[str, int] = {}  # name -> id of adapters waiting for their requests to end
        self._next_id = itertools.count(1)

    def names(self) -> list[str]:
        return sorted(self._ids)

    def loaded_adapters(self) -> dict[str, Optional[str]]:
        """SGLang's `loaded_adapters` reply field: name -> path (None when loaded from tensors)."""
        return {name: self.by_id[i].path for name, i in sorted(self._ids.items())}

    def check_can_add(self, name: str) -> None:
        """Before building an adapter (which may be large): a ValueError if it cannot be added."""
        if not name or not isinstance(name, str):
            raise ValueError(f"lora_name must be a non-empty string; got {name!r}")
        if name in self._ids or name in self._unloading:
            raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first to replace it")
        held = len(self._ids) + len(self._unloading)
        if self.max_loaded is not None and held >= self.max_loaded:
            raise ValueError(f"{held} LoRA adapters are loaded, the most --max-loaded-loras allows "
                             f"({self.max_loaded}); unload one first")

    def add(self, adapter: LoRAAdapter) -> int:
        self.check_can_add(adapter.name)
        lora_id = next(self._next_id)
        self.by_id[lora_id] = adapter
        self._ids[adapter.name] = lora_id
        return lora_id

    def pinned_ids(self) -> frozenset[int]:
        return frozenset(i for i in self.by_id if self.by_id[i].pinned)

    def resolve(self, name_or_path: str) -> int:
        """A request's lora_path -> adapter id: the adapter's name, or the path it was loaded from."""
        if name_or_path in self._ids:
            return self._ids[name_or_path]
        for name, lora_id in self._ids.items():
            if self.by_id[lora_id].path == name_or_path:
                return lora_id
        if name_or_path in self._unloading:
            raise ValueError(f"LoRA adapter {name_or_path!r} is being unloaded")
        raise ValueError(f"unknown LoRA adapter {name_or_path!r}; loaded: {', '.join(self.names()) or 'none'}")

    def start_unload(self, name: str) -> int:
        """Stop taking requests for `name`; returns its id (ValueError if not loaded)."""
        if name in self._unloading:
            return self._unloading[name]
        if name not in self._ids:
            raise ValueError(f"LoRA adapter {name!r} is not loaded; loaded: {', '.join(self.names()) or 'none'}")
        lora_id = self._ids.pop(name)
        self._unloading[name] = lora_id
        return lora_id

    def cancel_unload(self, name: str) -> None:
        """The caller gave up waiting: the adapter takes requests again."""
        if name in self._unloading:
            self._ids[name] = self._unloading.pop(name)

    def finish_unload(self, name: str) -> None:
        lora_id = self._unloading.pop(name)
        del self.by_id[lora_id]
