"""SGLang's LoRA routes: /load_lora_adapter, /unload_lora_adapter, /load_lora_adapter_from_tensors.

Replies are SGLang's {"success", "error_message", "loaded_adapters"}, 400 on failure. The tensors
route's `serialized_tensors` is a serialized payload (base64 text) that the core opens through
the weight payloads' allowlist unpickler: a payload naming anything but tensors is refused
unrun. These routes change what the server serves, so they take the admin key.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.server.protocol import UnknownFields, _Lenient
from weight_sync.cuda_ipc import PAYLOAD_ERRORS

LORA_ROUTES = ("/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter_from_tensors")


class LoadLoRAAdapterRequest(_Lenient):
    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapterRequest(_Lenient):
    lora_name: str


class LoadLoRAAdapterFromTensorsRequest(_Lenient):
    lora_name: str
    config_dict: dict[str, Any]
    serialized_tensors: str
    load_format: Optional[str] = None
    pinned: bool = False
    added_tokens_config: Optional[dict[str, Any]] = None


def add_lora_routes(app: FastAPI, engine: Any, unknown: UnknownFields) -> None:
    @app.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> JSONResponse:
        unknown.note("/load_lora_adapter", req)
        return _reply(await asyncio.to_thread(engine.load_lora_adapter, req.lora_name, req.lora_path, req.pinned))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> JSONResponse:
        unknown.note("/unload_lora_adapter", req)
        return _reply(await asyncio.to_thread(engine.unload_lora_adapter, req.lora_name))

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(req: LoadLoRAAdapterFromTensorsRequest) -> JSONResponse:
        unknown.note("/load_lora_adapter_from_tensors", req)
        if req.added_tokens_config:
            return _reply({"success": False, "error_message": "added_tokens_config is not supported: adapters "
                                                              "cannot add tokens", "loaded_adapters": None})

        def load() -> dict:
            try:
                return engine.load_lora_adapter_from_tensors(
                    req.lora_name, config_dict=req.config_dict, serialized_tensors=req.serialized_tensors,
                    load_format=req.load_format, pinned=req.pinned)
            except PAYLOAD_ERRORS as exc:  # refused while being carried to a core process
                return {"success": False, "error_message": str(exc), "loaded_adapters": None}

        return _reply(await asyncio.to_thread(load))


def _reply(result: dict) -> JSONResponse:
    return JSONResponse(result, status_code=200 if result.get("success") else 400)
