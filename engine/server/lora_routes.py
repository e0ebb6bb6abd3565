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
import threading
from functools import partial
from typing import Any, Callable, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import StrictBool, model_validator

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
    upsert: StrictBool = False
    added_tokens_config: Optional[dict[str, Any]] = None
    expected_checksums: Optional[dict[str, str]] = None  # Miles: name -> sha256 hex of the tensor's bytes

    @model_validator(mode="after")
    def _one_payload(self) -> "LoadLoRAAdapterFromTensorsRequest":
        if (self.serialized_tensors is None) == (self.serialized_named_tensors is None):
            raise ValueError("send the adapter's tensors in exactly one of serialized_tensors (one payload) or "
                             "serialized_named_tensors (a list, one payload per tensor-parallel rank)")
        if self.serialized_named_tensors is not None and not (self.serialized_named_tensors
                                                              and isinstance(self.serialized_named_tensors[0], str)):
            raise ValueError("serialized_named_tensors must be a non-empty list whose first entry is a payload")
        return self

    @property
    def payload(self) -> str:
        return self.serialized_tensors if self.serialized_tensors is not None else self.serialized_named_tensors[0]


def add_lora_routes(app: FastAPI, engine: Any, unknown: UnknownFields) -> None:
    upserts = threading.Lock()  # one upsert at a time: concurrent ones of a name unload each other's

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

        load = partial(_load_from_tensors, engine, req)
        result = await asyncio.to_thread(partial(_upsert, engine, req.lora_name, load, upserts) if req.upsert else load)
        return _reply(result)


def _load_from_tensors(engine: Any, req: LoadLoRAAdapterFromTensorsRequest) -> dict:
    try:
        return engine.load_lora_adapter_from_tensors(
            req.lora_name, config_dict=req.config_dict, serialized_tensors=req.payload,
            load_format=req.load_format, pinned=req.pinned, expected_checksums=req.expected_checksums)
    except PAYLOAD_ERRORS as exc:  # refused while being carried to a core process
        return {"success": False, "error_message": str(exc), "loaded_adapters": None}


def _upsert(engine: Any, name: str, load: Callable[[], dict], lock: threading.Lock) -> dict:
    """SGLang's order, unload then load; requests naming the adapter in between are refused. A
    refused new adapter leaves none of that name, and the reply says so."""
    with lock:
        reply = engine.unload_lora_adapter(name)
        removed = bool(reply.get("success"))
        if not removed and name in (reply.get("loaded_adapters") or {}):
            return {"success": False, "error_message": f"upsert: adapter {name!r} could not be unloaded: "
                    f"{reply.get('error_message')}", "loaded_adapters": reply.get("loaded_adapters")}
        result = load()
    if removed and not result.get("success"):
        result["error_message"] = (f"upsert of {name!r}: the adapter of that name was unloaded and the new one "
                                   f"was refused ({result.get('error_message')}); load it again")
    return result


def _reply(result: dict) -> JSONResponse:
    return JSONResponse(result, status_code=200 if result.get("success") else 400)
