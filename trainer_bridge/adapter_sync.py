"""push_adapter: LoRA RL's weight sync, the adapter alone into every engine (SGLang's LoRA verbs).

As Miles / slime drive SGLang: unload the previous adapter, then /load_lora_adapter_from_tensors
the new one under the same name with its PEFT config; rollouts name it in `lora_path`. A new load
gets a fresh adapter id, so the radix cache never serves the old adapter's prefixes to the new
one (no flush needed). The engine's weight version is then set, so samples record which push
generated them. The loop pushes only between rollouts (none in flight), so the moment between
unload and load serves nobody. Bytes moved: the adapter's tensors, per engine.
"""

from __future__ import annotations

from typing import Any, Sequence

from weight_sync.base import WeightSyncError, on_all_engines
from trainer_bridge.trainable_lora import ADAPTER_NAME, TrainableLoRA


def push_adapter(engines: Sequence[Any], lora: TrainableLoRA, weight_version: str, replace: bool,
                 name: str = ADAPTER_NAME) -> int:
    """-> bytes sent to each engine. replace: an adapter of this name is loaded (a later push)."""
    tensors = lora.named_tensors()
    config = lora.config_dict()

    def load(engine: Any) -> None:
        if replace:
            _check(engine.unload_lora_adapter(name), engine, "unload")
        _check(engine.load_lora_adapter_from_tensors(name, tensors=tensors, config_dict=config), engine, "load")
        engine.update_weight_version(weight_version)

    on_all_engines(engines, load)
    return sum(t.numel() * t.element_size() for _, t in tensors)


def _check(reply: Any, engine: Any, verb: str) -> None:
    if not isinstance(reply, dict) or not reply.get("success"):
        message = reply.get("error_message") if isinstance(reply, dict) else reply
        raise WeightSyncError(f"{verb}ing LoRA adapter {ADAPTER_NAME!r} on engine {engine!r} failed: {message}")
