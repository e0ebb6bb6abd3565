"""Engine: the in-process API (mirrors sglang.Engine). Drives an EngineCore on a worker thread.

Callers validate and tokenize in their own thread (bad input raises ValueError there and never
reaches the core); the worker thread owns the core and is the only one that touches it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Union

import torch

from engine.config import ServerArgs
from engine.core.engine_core import AbortReq, EngineCore, FlushCacheReq, ReqOutput
from engine.core.control import (ContinueReq, DestroyWeightsGroupReq, FromGroup, InitWeightsGroupReq,
                                       PauseReq, Reply, SetWeightVersionReq, UpdateWeightsReq, check_pause_mode)
from engine.api.generate_stream import GenerateStream
from engine.api.request_builder import RequestBuilder

logger = logging.getLogger("tandem")

Sink = Callable[[ReqOutput], None]


class Engine:
    def __init__(self, **kwargs: Any) -> None:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        self.core = EngineCore(self.server_args)
        self.builder = RequestBuilder(self.core.tokenizer, self.core.parts.vocab_size,
                                      self.core.parts.context_len, self.server_args)
        self._inbox: "queue.Queue[tuple[Any, Optional[Future]]]" = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tandem-core", daemon=True)
        self._thread.start()

    # ---- generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompt: Union[str, list[str], None] = None,
        sampling_params: Union[dict, list[dict], None] = None,
        input_ids: Union[list[int], list[list[int]], None] = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        logprob_distribution: Optional[str] = None,
        rid: Union[str, list[str], None] = None,
    ) -> Union[dict, list[dict]]:
        reqs, single = self.builder.build(prompt, input_ids, sampling_params, return_logprob,
                                          logprob_start_len, top_logprobs_num, logprob_distribution, rid)
        results: dict[str, "queue.Queue[ReqOutput]"] = {r.rid: queue.Queue() for r in reqs}
        for r in reqs:
            self._submit(r, results[r.rid].put)
        outputs = [self._wait_final(results[r.rid]) for r in reqs]
        return outputs[0] if single else outputs

    def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                       logprob_start_len=-1, top_logprobs_num=0, logprob_distribution=None,
                       rid=None, stream: bool = False) -> GenerateStream:
        """`await` it for the final dict(s), or `async for` over cumulative chunks when stream=True."""
        reqs, single = self.builder.build(prompt, input_ids, sampling_params, return_logprob,
                                          logprob_start_len, top_logprobs_num, logprob_distribution,
                                          rid, stream=stream)
        loop = asyncio.get_running_loop()
        streams = GenerateStream(reqs, single, stream, loop)
        for r in reqs:
            self._submit(r, streams.sink_for(r.rid))
        return streams

    def _wait_final(self, q: "queue.Queue[ReqOutput]") -> dict:
        while True:
            out = q.get()
            if out.finished:
                return out.output

    def _submit(self, req_input: Any, sink: Sink) -> None:
        with self._lock:
            if req_input.rid in self._sinks:
                raise ValueError(f"rid {req_input.rid!r} is already in flight; rids must be unique")
            self._sinks[req_input.rid] = sink
        self._inbox.put((req_input, None))

    # ---- control -------------------------------------------------------------------------------
    def abort_request(self, rid: Optional[str] = None, abort_all: bool = False) -> None:
        self._inbox.put((AbortReq(None if abort_all else rid), None))

    def flush_cache(self) -> bool:
        return self._call(FlushCacheReq())

    # ---- RL control: pause, weight updates (engine/generation_control.py) ---------------------
    def pause_generation(self, mode: str = "abort") -> None:
        """abort: in-flight requests end with finish_reason abort; retract: they go back to the
        queue (KV freed to the cache) and resume on continue; in_place: they keep their KV.
        Requests sent while paused wait in the queue."""
        self._call(PauseReq(check_pause_mode(mode)))

    def continue_generation(self) -> None:
        self._call(ContinueReq())

    def update_weights_from_tensor(self, named_tensors: list, load_format: Optional[str] = None,
                                   flush_cache: bool = True, weight_version: Optional[str] = None
                                   ) -> tuple[bool, str]:
        """named_tensors: [(HF name, tensor)], any subset of the weights; with
        load_format="flattened_bucket", a weight_sync FlattenedBucket or its payload dict.
        -> (success, message); a bad name or shape changes nothing and says which."""
        if load_format not in (None, "direct", "flattened_bucket"):
            raise ValueError(f"load_format {load_format!r} is not supported; use None, 'direct' or "
                             "'flattened_bucket'")
        if load_format == "flattened_bucket":
            from weight_sync.bucket import FlattenedBucket

            named_tensors = FlattenedBucket.from_payload(named_tensors).unpack()
        return self._call(UpdateWeightsReq(_named_pairs(named_tensors), None, flush_cache, weight_version))

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                 weight_version: Optional[str] = None, flush_cache: bool = True
                                 ) -> tuple[bool, str]:
        """Every weight from a safetensors checkpoint of the same architecture -> (success, message)."""
        if load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {load_format!r} is not supported for disk updates; use 'auto'")
        return self._call(UpdateWeightsReq(None, str(model_path), flush_cache, weight_version))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> tuple[bool, str]:
        """Join the trainer's broadcast group as rank `rank_offset` (the trainer is rank 0 and
        joins at the same time); backend 'gloo' on the CPU."""
        return self._call(InitWeightsGroupReq(master_address, int(master_port), int(rank_offset),
                                              int(world_size), group_name, backend))

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: Optional[str] = None,
                                        load_format: Optional[str] = None) -> tuple[bool, str]:
        """Receive one broadcast per name from the group's rank 0, then load them (checked
        before any write) -> (success, message)."""
        if load_format is not None:
            raise ValueError(f"load_format {load_format!r} is not supported for distributed updates; use None")
        source = FromGroup(list(names), list(dtypes), [list(s) for s in shapes], group_name)
        return self._call(UpdateWeightsReq(None, None, flush_cache, weight_version, source))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        return self._call(DestroyWeightsGroupReq(group_name))

    def get_weight_version(self) -> str:
        return self.core.weight_version

    def update_weight_version(self, new_version: str) -> str:
        return self._call(SetWeightVersionReq(str(new_version)))

    def check_integrity(self) -> None:
        """Asserts free + cached + in use == pool size (runs on the core thread)."""
        self._call(lambda core: core.check_integrity())

    def _call(self, msg: Any) -> Any:
        fut: Future = Future()
        self._inbox.put((msg, fut))
        return fut.result()

    def shutdown(self) -> None:
        self._stopped.set()
        self._inbox.put((None, None))
        self._thread.join(timeout=30)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- worker thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped.is_set():
            block = not self.core.has_work()
            self._drain_inbox(block)
            if self.core.has_work():
                self._dispatch(self._safe_step())

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: Any, fut: Optional[Future]) -> None:
        if msg is None:
            return
        try:
            result = msg(self.core) if callable(msg) else self.core.handle(msg)
        except Exception as exc:  # a failing message must not kill the worker
            if fut is not None:
                fut.set_exception(exc)
            else:
                logger.exception("engine could not take message %s", type(msg).__name__)
                self._fail_message(msg, exc)
            return
        if isinstance(result, Reply):  # a control message: deliver what it finished, then answer
            self._dispatch(result.outputs)
            result = result.value
        if fut is not None:
            fut.set_result(result)
        elif isinstance(result, list):
            self._dispatch(result)

    def _fail_message(self, msg: Any, exc: Exception) -> None:
        rid = getattr(msg, "rid", None)
        if rid is None:
            return
        reason = {"type": "abort", "message": f"engine error: {type(exc).__name__}: {exc}"}
        output = {"text": "", "output_ids": [], "meta_info": {"id": rid, "finish_reason": reason}}
        self._dispatch([ReqOutput(rid, True, output)])

    def _safe_step(self) -> list[ReqOutput]:
        try:
            return self.core.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests of that batch")
            return self.core.fail_current_batch(f"engine error: {type(exc).__name__}: {exc}")

    def _dispatch(self, outputs: list[ReqOutput]) -> None:
        for out in outputs:
            with self._lock:
                sink = self._sinks.get(out.rid)
                if out.finished:
                    self._sinks.pop(out.rid, None)
            if sink is None:
                continue
            try:
                sink(out)
            except Exception:  # e.g. the caller's event loop is gone; the engine must live on
                logger.warning("dropping output for %s: its receiver is gone", out.rid)
                self.core.handle(AbortReq(out.rid, "receiver gone"))


def _named_pairs(named_tensors: Any) -> list[tuple[str, torch.Tensor]]:
    """list of (name, tensor), or a ValueError naming what was passed instead."""
    try:
        named = list(named_tensors)
    except TypeError:
        raise ValueError(f"named_tensors must be (name, tensor) pairs; got {type(named_tensors).__name__}") from None
    for item in named:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            held = f" holding {type(item[1]).__name__}" if isinstance(item, tuple) and len(item) == 2 else ""
            raise ValueError(f"named_tensors must be (name, tensor) pairs; got a {type(item).__name__}{held}")
    return named
