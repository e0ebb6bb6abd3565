"""sglang.Engine's tokenizer_manager as RL frameworks await it, on tandem's Engine.tokenizer_manager.

Sources: verl <= 2025-12 (an `AsyncEngine(Engine)` subclass awaiting `self.tokenizer_manager.*(obj,
None)`; sglang.srt.weight_sync.utils.update_weights with LocalSerializedTensor); verl HEAD
(async_sglang_server.py: `tokenizer_manager.generate_request(GenerateReqInput(...), None).__anext__()`,
release/resume_memory_occupation(obj, None), flush_cache()); SkyRL <= 2026-02 (the weight verbs with
older SGLang's single name/dtype/shape); sglang.Engine's positional update_weights_from_distributed.
SGLang's request classes are stood in for by dataclasses with its field names (no sglang here).
"""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import textwrap
import time
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from weight_sync.cuda_ipc import serialize
from engine.models.parallel_state import free_port

REPO = Path(__file__).resolve().parents[2]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
IDS = [5, 6, 7, 8, 9]


# ---- stand-ins for SGLang's io_struct dataclasses (field names and defaults as 0.5.9) ----------
@dataclass
class GenerateReqInput:
    text: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    image_data: Any = None
    return_logprob: Any = None
    logprob_start_len: Any = None
    top_logprobs_num: Any = None
    token_ids_logprob: Any = None
    stream: bool = False
    rid: Any = None
    return_routed_experts: bool = False
    return_hidden_states: bool = False
    custom_logit_processor: Any = None
    lora_path: Any = None


@dataclass
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


@dataclass
class UpdateWeightsFromDistributedReqInput:  # SkyRL's SGLang (0.4.x): one tensor per call
    name: str
    dtype: Any
    shape: list
    group_name: str = "weight_update_group"


@dataclass
class InitWeightsUpdateGroupReqInput:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass
class ReleaseMemoryOccupationReqInput:
    tags: Optional[list] = None


@dataclass
class ResumeMemoryOccupationReqInput:
    tags: Optional[list] = None


@pytest.fixture
def local_serialized_tensor(monkeypatch):
    """SGLang's LocalSerializedTensor (a dataclass of `values`) in a module registered under its
    SGLang path, so pickle writes the bytes SGLang's trainer side writes."""
    module_name = "sglang.srt.model_executor.model_runner"

    @dataclass
    class LocalSerializedTensor:
        values: list

    LocalSerializedTensor.__module__ = module_name
    LocalSerializedTensor.__qualname__ = "LocalSerializedTensor"
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    sys.modules[module_name].LocalSerializedTensor = LocalSerializedTensor
    return LocalSerializedTensor


def mp_serialize(obj: Any) -> bytes:
    """SGLang's MultiprocessingSerializer.serialize: ForkingPickler with torch's reductions."""
    import torch.multiprocessing  # noqa: F401

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def _norm(eng: Any) -> list:
    return eng.get_weights_by_name("model.norm.weight")


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory()


def test_tokenizer_manager_stream_closed_early_aborts(engine):
    """A streamed generate_request the caller stops reading (aclose) ends its request, as
    generate(stream=True)'s iterator does: nothing decodes for nobody."""
    before = engine.get_stats().num_generated_tokens

    async def run():
        chunks = engine.tokenizer_manager.generate_request(
            GenerateReqInput(input_ids=IDS, sampling_params={**GREEDY, "max_new_tokens": 2000}, stream=True,
                             rid="tm-closed"), None)
        first = await chunks.__anext__()
        await chunks.aclose()
        deadline = time.monotonic() + 60  # the loop stays up: only the abort can end the request early
        while engine.get_load()[0]["num_reqs"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return first

    assert asyncio.run(run())["meta_info"]["id"] == "tm-closed"
    assert engine.get_load()[0]["num_reqs"] == 0
    assert engine.get_stats().num_generated_tokens - before < 1000  # aborted, not run to its length


def test_tokenizer_manager_update_with_abort_all_requests(engine):
    """SGLang's abort_all_requests=True: the running request ends (abort) and the update lands,
    where flush_cache=True alone refuses an update while a request holds KV."""
    before = _norm(engine)

    async def run():
        gen = engine.async_generate(input_ids=IDS, sampling_params={**GREEDY, "max_new_tokens": 3000})
        while not engine.get_load()[0]["num_reqs"]:
            await asyncio.sleep(0.01)
        payload = serialize([("model.norm.weight", torch.full((64,), 3.0))], as_text=True)
        reply = await engine.tokenizer_manager.update_weights_from_tensor(
            UpdateWeightsFromTensorReqInput([payload], abort_all_requests=True), None)
        return reply, await gen

    (ok, message), out = asyncio.run(run())
    try:
        assert ok, message
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and _norm(engine) == [3.0] * 64
    finally:
        assert engine.update_weights_from_tensor([("model.norm.weight", torch.tensor(before))])[0]


class AsyncEngine:
    """verl's AsyncEngine, method for method (its base: sglang.Engine, here tandem's)."""

    async def release_memory_occupation(self, tags: Optional[list[str]] = None):
        obj = ReleaseMemoryOccupationReqInput() if tags is None else ReleaseMemoryOccupationReqInput(tags=tags)
        return await self.tokenizer_manager.release_memory_occupation(obj, None)

    async def resume_memory_occupation(self, tags: Optional[list[str]] = None):
        obj = ResumeMemoryOccupationReqInput() if tags is None else ResumeMemoryOccupationReqInput(tags=tags)
        return await self.tokenizer_manager.resume_memory_occupation(obj, None)

    async def update_weights_from_tensor(self, update_weights_request):
        return await self.tokenizer_manager.update_weights_from_tensor(update_weights_request, None)

    async def flush_cache(self):
        return await self.tokenizer_manager.flush_cache()

    async def abort_request(self, rid: str = "", abort_all: bool = False):
        return self.tokenizer_manager.abort_request(rid=rid, abort_all=abort_all)


def test_verl_async_engine_sleep_sync_wake(tiny_model_dir, local_serialized_tensor):
    from engine import Engine

    eng = type("VerlAsyncEngine", (AsyncEngine, Engine), {})(model_path=tiny_model_dir, dtype="float32",
                                                             device="cpu")
    try:
        before = _norm(eng)

        async def cycle():
            gen = asyncio.ensure_future(eng.async_generate(input_ids=IDS, sampling_params=GREEDY))
            await eng.abort_request(abort_all=True)
            await gen
            await eng.release_memory_occupation(tags=["kv_cache", "weights"])
            await eng.resume_memory_occupation(tags=["weights"])
            # sglang.srt.weight_sync.utils.update_weights: per-rank payloads under LocalSerializedTensor
            named = [("model.norm.weight", local_serialized_tensor(values=[mp_serialize(torch.full((64,), 3.0))]))]
            reply = await eng.update_weights_from_tensor(
                UpdateWeightsFromTensorReqInput(serialized_named_tensors=[mp_serialize(named)], load_format=None))
            await eng.resume_memory_occupation(tags=["kv_cache"])
            flushed = await eng.flush_cache()
            out = await eng.tokenizer_manager.generate_request(
                GenerateReqInput(input_ids=IDS, sampling_params=GREEDY, return_logprob=True, rid="verl-1"),
                None).__anext__()
            return reply, flushed, out

        reply, flushed, out = asyncio.run(cycle())
        assert reply == (True, reply[1]) and flushed.success is True
        assert _norm(eng) == [3.0] * 64 != before
        assert out["meta_info"]["id"] == "verl-1" and len(out["meta_info"]["output_token_logprobs"]) == 6
    finally:
        eng.shutdown()


def test_tokenizer_manager_refuses_clearly(engine):
    async def skyrl_custom_loader():
        obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[serialize([("ipc_request", torch.zeros(4))])],
                                              load_format="skyrl.sglang_engine.sglang_custom_weight_loader",
                                              flush_cache=False)
        return await engine.tokenizer_manager.update_weights_from_tensor(obj, None)

    with pytest.raises(ValueError, match="load_format"):
        asyncio.run(skyrl_custom_loader())
    with pytest.raises(AttributeError, match="score_request"):
        engine.tokenizer_manager.score_request
    assert engine.tokenizer_manager.server_args is engine.server_args  # an instance attribute, read through


TRAINER = textwrap.dedent("""
    import sys, torch
    from weight_sync.bucket import FlattenedBucket
    from weight_sync.nccl import WeightGroup
    group = WeightGroup("127.0.0.1", int(sys.argv[1]), 0, 2, "weight_update_group", backend="gloo", timeout_s=60)
    group.broadcast(torch.full((64,), 4.0), src=0)
    bucket = FlattenedBucket.pack([("model.norm.weight", torch.full((64,), 5.0))])
    group.broadcast(bucket.flattened_tensor, src=0)
    print("trainer done", flush=True)
    import os
    os._exit(0)
""")


def test_broadcast_skyrl_single_tensor_then_sglang_positional_bucket(engine_factory):
    eng = engine_factory()
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port)], env=dict(os.environ, PYTHONPATH=str(REPO)),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        async def skyrl():
            tm = eng.tokenizer_manager
            ok, message = await tm.init_weights_update_group(InitWeightsUpdateGroupReqInput(
                master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
                backend="gloo"), None)
            assert ok, message
            return await tm.update_weights_from_distributed(
                UpdateWeightsFromDistributedReqInput(name="model.norm.weight", dtype=torch.float32, shape=[64]), None)

        ok, message = asyncio.run(skyrl())
        assert ok, message
        assert _norm(eng) == [4.0] * 64
        # sglang.Engine's positional order: names, dtypes, shapes, group_name, flush_cache, load_format
        ok, message = eng.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "weight_update_group", True,
                                                          "flattened_bucket")
        assert ok, message
        assert _norm(eng) == [5.0] * 64
        assert "trainer done" in trainer.communicate(timeout=60)[0]
    finally:
        trainer.kill()
        eng.destroy_weights_update_group("weight_update_group")
