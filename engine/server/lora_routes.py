"""SGLang's LoRA routes: /load_lora_adapter, /unload_lora_adapter, /load_lora_adapter_from_tensors.

Replies are SGLang's {"success", "error_message", "loaded_adapters"}, 400 on failure. The tensors
route's `serialized_tensors` is a serialized payload (base64 text) that the core opens through
the weight payloads' allowlist unpickler: a payload naming anything but tensors is refused
unrun. SGLang 0.5.18's form, `serialized_named_tensors` (one payload per tensor-parallel rank,
Miles sends it), is taken too: its first entry is loaded (the engine shards for its own ranks).
`upsert` replaces an adapter of that name. These routes change what the server serves, so they
take the admin key.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import model_validator

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
    serialized_tensors: Optional[str] = None
    serialized_named_tensors: Optional[list[Optional[str]]] = None  # SGLang 0.5.18: one per TP rank
    load_format: Optional[str] = None
    pinned: bool = False
    upsert: bool = False
    added_tokens_config: Optional[dict[str, Any]] = None
    expected_checksums: Any = None

    @model_validator(mode="after")
    def _one_payload(self) -> "LoadLoRAAdapterFromTensorsRequest":
        if (self.serialized_tensors is None) == (self.serialized_named_tensors is None):
            raise ValueError("send the adapter's tensors in exactly one of serialized_tensors (one payload) or "
                             "serialized_named_tensors (a list, one payload per tensor-parallel rank)")
        if self.serialized_named_tensors is not None and not (self.serialized_named_tensors
                                                              and isinstance(self.serialized_named_tensors[0], str)):
            raise ValueError("serialized_named_tensors must be a non-empty list whose first entry is a payload")
        if self.expected_checksums:
            raise ValueError("expected_checksums is not supported: tandem does not verify adapter checksums "
                             "(leave it null; /weights_checker checksums the loaded weights)")
        return self

    @property
    def payload(self) -> str:
        return self.serialized_tensors if self.serialized_tensors is not None else self.serialized_named_tensors[0]


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
            if req.upsert and not _unloaded(engine, req.lora_name):
                return {"success": False, "error_message": f"upsert: adapter {req.lora_name!r} could not be unloaded",
                        "loaded_adapters": None}
            try:
                return engine.load_lora_adapter_from_tensors(
                    req.lora_name, config_dict=req.config_dict, serialized_tensors=req.payload,
                    load_format=req.load_format, pinned=req.pinned)
            except PAYLOAD_ERRORS as exc:  # refused while being carried to a core process
                return {"success": False, "error_message": str(exc), "loaded_adapters": None}

        result = await asyncio.to_thread(load)
        if req.upsert and not result.get("success"):  # as SGLang's upsert: the old one is gone too
            result["error_message"] = (f"upsert of {req.lora_name!r}: the adapter of that name was unloaded and "
                                       f"the new one was refused ({result.get('error_message')}); load it again")
        return _reply(result)


def _unloaded(engine: Any, name: str) -> bool:
    """Unload `name` if it is loaded (an upsert replaces it); -> whether it is gone."""
    return name not in (engine.unload_lora_adapter(name).get("loaded_adapters") or {})


def _reply(result: dict) -> JSONResponse:
    return JSONResponse(result, status_code=200 if result.get("success") else 400)
