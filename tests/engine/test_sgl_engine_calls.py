"""The calls RL frameworks make on sglang.Engine, made on tandem's Engine as they make them.

Sources (keyword names and value shapes copied from them):
- verl <= 2025-12 (verl/workers/rollout/sglang_rollout/sglang_rollout.py): an `AsyncEngine(Engine)`
  subclass awaiting `self.tokenizer_manager.*(obj, None)`; `async_generate(prompt=None,
  input_ids=..., image_data=[None...], return_logprob=True)`; prompt scoring with max_new_tokens 0
  and logprob_start_len 0; sglang.srt.weight_sync.utils.update_weights (LocalSerializedTensor).
- verl HEAD (async_sglang_server.py): `tokenizer_manager.generate_request(GenerateReqInput(...),
  None).__anext__()`, release/resume_memory_occupation(obj, None), flush_cache().
- verl's HttpServerAdapter (EngineBase): generate's keywords with None logprob options,
  custom_logit_processor=None, lora_path=None.
- SkyRL <= 2026-02 (inference_engines/sglang/sglang_engine.py): `async_generate(input_ids=[[...]],
  sampling_params={})`, tokenizer_manager's weight verbs with older SGLang's single name/dtype/shape.
- SGLang's Engine itself: generate(stream=True) as a sync iterator, `await async_generate(stream=True)`
  as an async iterator, update_weights_from_distributed's positional order.
SGLang's request classes are stood in for by dataclasses with its field names (no sglang here).
"""

from __future__ import annotations

import asyncio
import io
import os
import socket
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

REPO = Path(__file__).resolve().parents[2]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
IDS = [5, 6, 7, 8, 9]
META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version"}


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


# ---- generate / async_generate -------------------------------------------------------------------
def test_generate_with_engine_base_keywords(engine):
    """verl's HttpServerAdapter.generate passes every keyword, the unused ones as None."""
    out = engine.generate(prompt=None, sampling_params=GREEDY, input_ids=IDS, image_data=None, return_logprob=True,
                          logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=None, lora_path=None,
                          custom_logit_processor=None)
    assert set(out) >= {"text", "output_ids", "meta_info"} and META_KEYS <= set(out["meta_info"])
    assert len(out["output_ids"]) == 6 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    rows = out["meta_info"]["output_token_logprobs"]
    assert [tok for _, tok, _ in rows] == out["output_ids"] and all(isinstance(lp, float) for lp, _, _ in rows)


def test_sglang_engine_keywords_with_empty_values_pass(engine):
    ref = engine.generate(input_ids=IDS, sampling_params=GREEDY)
    out = engine.generate(input_ids=IDS, sampling_params=GREEDY, audio_data=None, video_data=None,
                          return_hidden_states=False, return_routed_experts=False, stream=False,
                          bootstrap_host=None, bootstrap_port=None, bootstrap_room=None, data_parallel_rank=0,
                          external_trace_header=None, rid="sgl-kw")
    assert out["output_ids"] == ref["output_ids"] and out["meta_info"]["id"] == "sgl-kw"


def test_verl_batch_async_generate_with_none_images(engine):
    async def run():
        return await engine.async_generate(prompt=None, sampling_params=GREEDY, return_logprob=True,
                                           input_ids=[IDS, [3, 4]], image_data=[None, None])

    outs = asyncio.run(run())
    assert isinstance(outs, list) and [o["meta_info"]["prompt_tokens"] for o in outs] == [5, 2]
    assert all(len(o["meta_info"]["output_token_logprobs"]) == 6 for o in outs)


def test_verl_prompt_scoring_with_zero_new_tokens(engine):
    """verl's calculate_log_probs: max_new_tokens 0, logprob_start_len 0; it zips
    input_token_logprobs[1:] into (logprob, token id) and expects the prompt's ids back."""
    async def run():
        return await engine.async_generate(prompt=None, input_ids=IDS, sampling_params={**GREEDY, "max_new_tokens": 0},
                                           return_logprob=True, logprob_start_len=0)

    out = asyncio.run(run())
    rows = out["meta_info"]["input_token_logprobs"]
    assert out["output_ids"] == [] and len(rows) == len(IDS) and rows[0][0] is None
    log_probs, token_ids = zip(*[(lp, tok) for lp, tok, _ in rows[1:]])
    assert list(token_ids) == IDS[1:] and all(lp <= 0.0 for lp in log_probs)


def test_skyrl_token_in_token_out(engine):
    async def run():
        return await engine.async_generate(input_ids=[IDS, [7, 8, 9]], sampling_params={"max_new_tokens": 4})

    outs = asyncio.run(run())
    assert [len(o["output_ids"]) <= 4 for o in outs] == [True, True]
    assert {o["meta_info"]["finish_reason"]["type"] for o in outs} <= {"length", "stop"}


def test_top_and_token_ids_logprobs_shapes(engine):
    out = engine.generate(input_ids=IDS, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2,
                          token_ids_logprob=[3, 4, 5])
    meta = out["meta_info"]
    assert len(meta["output_top_logprobs"]) == 6 and all(len(row) == 2 for row in meta["output_top_logprobs"])
    assert meta["output_top_logprobs"][0][0] == meta["output_token_logprobs"][0]  # greedy: the top one
    assert [[tok for _, tok, _ in row] for row in meta["output_token_ids_logprobs"]] == [[3, 4, 5]] * 6


def test_generate_stream_is_a_sync_iterator(engine):
    ref = engine.generate(input_ids=IDS, sampling_params=GREEDY)
    chunks = list(engine.generate(input_ids=IDS, sampling_params=GREEDY, stream=True))
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(set(lengths)) and chunks[-1]["output_ids"] == ref["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    batch = list(engine.generate(input_ids=[IDS, IDS], sampling_params=GREEDY, stream=True))
    assert {c["index"] for c in batch} == {0, 1}


def test_generate_stream_closed_early_aborts(engine):
    before = engine.get_stats().num_generated_tokens
    chunks = engine.generate(input_ids=IDS, sampling_params={**GREEDY, "max_new_tokens": 2000}, stream=True,
                             rid="closed-early")
    next(chunks)
    chunks.close()
    deadline = time.monotonic() + 60
    while engine.get_load()[0]["num_reqs"] and time.monotonic() < deadline:  # the abort lands between steps
        time.sleep(0.01)
    assert engine.get_load()[0]["num_reqs"] == 0
    # ended by the abort, not by its length: a stream that ran on would have made all 2000 tokens
    assert engine.get_stats().num_generated_tokens - before < 1000


def test_awaited_async_generate_stream_is_an_async_iterator(engine):
    """SGLang: `gen = await engine.async_generate(..., stream=True)`, then `async for`."""
    async def run():
        gen = await engine.async_generate(input_ids=IDS, sampling_params=GREEDY, stream=True)
        return [chunk async for chunk in gen]

    chunks = asyncio.run(run())
    assert chunks[-1]["output_ids"] == engine.generate(input_ids=IDS, sampling_params=GREEDY)["output_ids"]


@pytest.mark.parametrize("kwargs, named", [
    ({"image_data": ["http://x/cat.png"]}, "image_data"),
    ({"custom_logit_processor": '{"callable": "..."}'}, "custom_logit_processor"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"data_parallel_rank": 1}, "data_parallel_rank"),
    ({"session_params": {"id": "s"}}, "session_params"),
])
def test_unservable_keywords_are_refused_by_name(engine, kwargs, named):
    with pytest.raises(ValueError, match=named):
        engine.generate(input_ids=IDS, sampling_params=GREEDY, **kwargs)


def test_unknown_keyword_names_itself(engine):
    with pytest.raises(TypeError, match="return_text_in_logprob"):
        engine.generate(input_ids=IDS, sampling_params=GREEDY, return_text_in_logprob=True)


# ---- weights, memory, control --------------------------------------------------------------------
def test_update_weights_from_tensor_sglang_keywords(engine):
    before = _norm(engine)
    ok, message = engine.update_weights_from_tensor(named_tensors=[("model.norm.weight", torch.full((64,), 2.0))],
                                                    load_format=None, flush_cache=True)
    assert ok, message
    assert _norm(engine) == [2.0] * 64
    from weight_sync.bucket import FlattenedBucket

    bucket = FlattenedBucket.pack([("model.norm.weight", torch.tensor(before, dtype=torch.float32))]).to_payload()
    ok, message = engine.update_weights_from_tensor([serialize(bucket, as_text=True)], "flattened_bucket", False)
    assert ok, message  # SGLang's flattened_bucket form: one serialized bucket per TP rank
    assert _norm(engine) == before


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


def test_engine_control_calls(engine):
    assert engine.flush_cache() is True
    engine.abort_request(rid="", abort_all=True)
    engine.abort_request(rid="not-running")
    engine.pause_generation(mode="retract")
    engine.continue_generation()
    assert engine.release_memory_occupation(tags=["kv_cache", "weights"])[0]
    assert engine.resume_memory_occupation(tags=None)[0]
    info = engine.get_server_info()
    for key in ("model_path", "tp_size", "dtype", "enable_memory_saver", "max_total_num_tokens", "internal_states",
                "version", "skip_tokenizer_init"):
        assert key in info, key
    ok, message = engine.update_weights_from_disk(model_path=engine.server_args.model_path, load_format=None)
    assert ok, message


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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


# verl's SGLang server (async_sglang_server.py) builds its engine from this dict, one GPU, no TP/DP
VERL_LAUNCH = {"dtype": "float32", "mem_fraction_static": 0.5, "disable_cuda_graph": True, "enable_memory_saver": False,
               "base_gpu_id": 0, "gpu_id_step": 1, "tp_size": 1, "dp_size": 1, "ep_size": 1, "node_rank": 0,
               "load_format": "auto", "dist_init_addr": None, "nnodes": 1, "trust_remote_code": False,
               "max_running_requests": None, "log_level": "error", "mm_attention_backend": "fa3",
               "skip_tokenizer_init": True, "skip_server_warmup": True, "quantization": None,
               "json_model_override_args": "{}", "enable_metrics": True, "served_model_name": "policy"}


def test_engine_takes_verls_launch_arguments(tiny_model_dir):
    from engine import Engine
    from engine.server.served_model import ServedModel

    eng = Engine(model_path=tiny_model_dir, device="cpu", **VERL_LAUNCH)
    try:
        assert eng.server_args.served_model_name == "policy" and ServedModel.of(eng).name == "policy"
        assert len(eng.generate(input_ids=IDS, sampling_params=GREEDY)["output_ids"]) == 6
    finally:
        eng.shutdown()


@pytest.mark.parametrize("name, value, says", [
    ("base_gpu_id", 2, "CUDA_VISIBLE_DEVICES"), ("nnodes", 2, "one node"), ("dp_size", 4, "data-parallel"),
    ("quantization", "fp8", "bf16"), ("json_model_override_args", '{"rope_scaling": {}}', "config.json"),
    ("custom_weight_loader", ["skyrl.loader"], "update_weights_from_tensor"),
    ("enable_prefix_caching", False, "disable_radix_cache"), ("base_gpu_id", True, "CUDA_VISIBLE_DEVICES"),
])
def test_launch_arguments_that_matter_are_refused_by_name(tiny_model_dir, name, value, says):
    from engine.config import ServerArgs

    with pytest.raises(ValueError, match=f"{name}=.*not supported.*{says}"):
        ServerArgs.from_kwargs(model_path=tiny_model_dir, **{name: value})
    with pytest.raises(ValueError, match="unknown ServerArgs field.*no_such_flag"):
        ServerArgs.from_kwargs(model_path=tiny_model_dir, no_such_flag=1)
