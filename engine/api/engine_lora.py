"""EngineLoRA: Engine's LoRA verbs (SGLang's names), each one core message.

Replies are SGLang's {"success", "error_message", "loaded_adapters"}. Unloading an adapter that
requests still use waits for them, as SGLang does (the adapter takes no new request meanwhile),
for at most `timeout_s`; then the unload is refused and the adapter serves again. Mixed into
Engine, which supplies `_call` and `builder` (whose LoRANames learns every reply's adapters).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from engine.core.messages import LoadLoraReq, UnloadLoraReq

UNLOAD_POLL_S = 0.01
UNLOAD_TIMEOUT_S = 60.0


class EngineLoRA:
    builder: Any

    def _call(self, msg: Any) -> Any:
        raise NotImplementedError

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) under lora_name."""
        return self._lora_call(LoadLoraReq(lora_name, lora_path=lora_path, pinned=bool(pinned)))

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any = None, config_dict: Optional[dict] = None,
                                       load_format: Optional[str] = None, pinned: bool = False,
                                       serialized_tensors: Any = None, expected_checksums: Optional[dict] = None
                                       ) -> dict:
        """An adapter from its tensors and PEFT config (SGLang's Engine order). tensors: in memory
        ({name: tensor}, pairs, or with load_format "flattened_bucket" a bucket payload), or that
        serialized (bytes or base64 text, as `serialized_tensors` of the HTTP route too), which the
        core opens through the weight payloads' allowlist unpickler. expected_checksums ({name: sha256
        hex of the tensor's bytes}, Miles' --check-weight-update-equal): a tensor that differs refuses
        the load."""
        from engine.lora.tensor_payload import lora_tensors

        payload = serialized_tensors if serialized_tensors is not None else tensors
        if payload is None:
            return {"success": False, "error_message": "serialized_tensors is required", "loaded_adapters": None}
        try:
            source = lora_tensors(payload, load_format)
        except ValueError as exc:  # an unknown load_format
            return {"success": False, "error_message": str(exc), "loaded_adapters": None}
        if expected_checksums is not None and not (isinstance(expected_checksums, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in expected_checksums.items())):
            return {"success": False, "error_message": "expected_checksums must map tensor names to sha256 hex strings",
                    "loaded_adapters": None}
        return self._lora_call(LoadLoraReq(lora_name, config_dict=config_dict, source=source, pinned=bool(pinned),
                                           expected_checksums=expected_checksums or None))

    def unload_lora_adapter(self, lora_name: str, timeout_s: float = UNLOAD_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        reply = self._call(UnloadLoraReq(lora_name))
        while reply is None:  # requests still use it: ask again until they are done
            if time.monotonic() > deadline:
                return self._lora_call(UnloadLoraReq(lora_name, cancel=True))
            time.sleep(UNLOAD_POLL_S)
            reply = self._call(UnloadLoraReq(lora_name))
        self.builder.lora.update(reply.get("loaded_adapters"))
        return reply

    def _lora_call(self, msg: Any) -> dict:
        reply = self._call(msg)
        self.builder.lora.update(reply.get("loaded_adapters"))
        return reply
