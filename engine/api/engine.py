"""Engine: the in-process API (mirrors sglang.Engine), in front of an EngineCore.

Callers validate and tokenize in their own thread (bad input raises ValueError there and never
reaches the core); the core runs on a worker thread or in its own process (`core_process`) and
is reached only by the messages of engine/core/messages.py.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional, Union


from engine.api.core_client import CoreClient, ThreadCoreClient
from engine.api.text_builder import TextBuilder
from engine.api.generate_request import GenerateRequest
from engine.api.generate_stream import GenerateStream
from engine.api.recorder import Recorder
from engine.api.request_builder import RequestBuilder
from engine.config import ServerArgs, configure_logging
from engine.core.messages import GetWeightsByNameReq, WeightsCheckerReq, WeightsChecksumReq
from engine.core.messages import WeightsGroupStatusReq
from engine.core.messages import (AbortReq, CheckIntegrityReq, ContinueReq, CoreInfo, DestroyWeightsGroupReq,
                                  FlushCacheReq, GetWeightVersionReq, InitWeightsGroupReq, PauseReq, ReleaseMemoryReq,
                                  ReqInput, ReqOutput, ResumeMemoryReq, SetWeightVersionReq, StatsReq, StatsSnapshot,
                                  UpdateWeightsReq, check_memory_tags, check_pause_mode)

logger = logging.getLogger("tandem")

Sink = Callable[[ReqOutput], None]
GROUP_POLL_S = 0.02  # how often init_weights_update_group asks whether the rendezvous finished


class Engine:
    def __init__(self, **kwargs: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        configure_logging(self.server_args.log_level)
        self._sinks: dict[str, Sink] = {}
        self._inputs: dict[str, ReqInput] = {}  # in flight: for the final text and the recorder
        self._lock = threading.Lock()
        self.tokenizer: Any = None  # loaded once the core says from where
        self.client: CoreClient = self._start_core()
        try:
            self.info: CoreInfo = self.client.info
            self.tokenizer = self._load_tokenizer()
            self.text_builder = TextBuilder(self.tokenizer)
            self.builder = RequestBuilder(self.tokenizer, self.info.vocab_size, self.info.context_len,
                                          self.server_args, self.info.max_total_num_tokens)
            self.recorder = Recorder.maybe_open(self.server_args.record_path, self.server_args.model_path)
        except BaseException:  # e.g. no tokenizer: the core (maybe a process) must not outlive the failure
            self.client.shutdown()
            raise

    def _start_core(self) -> CoreClient:
        if self.server_args.core_process:
            from engine.api.process_client import ProcessCoreClient

            return ProcessCoreClient(self.server_args, self._dispatch, on_core_death=self.fail_all_requests)
        return ThreadCoreClient(self.server_args, self._dispatch)

    def _load_tokenizer(self) -> Any:
        if self.server_args.skip_tokenizer_init:
            return None
        from engine.tokenizer import load_tokenizer

        return load_tokenizer(self.info.tokenizer_path)

    @property
    def local_core(self) -> Any:
        """The EngineCore when it runs on a thread here: for white-box tests only."""
        return getattr(self.client, "core", None)

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, *args: Any, **kwargs: Any) -> Union[dict, list[dict]]:
        """SGLang's Engine.generate: the arguments are GenerateRequest's fields (prompt,
        sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
        logprob_distribution, rid, token_ids_logprob), or one GenerateRequest. Blocks until done."""
        reqs, single = self.builder.build(GenerateRequest.of(*args, **kwargs))
        results: dict[str, "queue.Queue[ReqOutput]"] = {r.rid: queue.Queue() for r in reqs}
        for r in reqs:
            self._submit(r, results[r.rid].put)
        outputs = [self._wait_final(results[r.rid]) for r in reqs]
        return outputs[0] if single else outputs

    def async_generate(self, *args: Any, loop: Optional[asyncio.AbstractEventLoop] = None,
                       **kwargs: Any) -> GenerateStream:
        """generate's arguments (stream=True too). `await` it for the final dict(s), or `async
        for` over cumulative chunks when stream=True. Called off the event loop (a worker thread
        building a constrained request), `loop` is the event loop that will read the stream."""
        request = GenerateRequest.of(*args, **kwargs)
        reqs, single = self.builder.build(request)
        loop = loop or asyncio.get_running_loop()
        streams = GenerateStream(reqs, single, request.stream, loop)
        for r in reqs:
            self._submit(r, streams.sink_for(r.rid))
        return streams

    def _wait_final(self, q: "queue.Queue[ReqOutput]") -> dict:
        while True:
            out = q.get()
            if out.finished:
                return out.output

    def _submit(self, req_input: ReqInput, sink: Sink) -> None:
        with self._lock:
            if req_input.rid in self._sinks:
                raise ValueError(f"rid {req_input.rid!r} is already in flight; rids must be unique")
            self._sinks[req_input.rid] = sink
            self._inputs[req_input.rid] = req_input
        try:
            self.client.send(req_input)
        except BaseException:  # e.g. CoreDead: nothing will answer this request
            with self._lock:
                self._sinks.pop(req_input.rid, None)
                self._inputs.pop(req_input.rid, None)
            raise

    # ---- control -------------------------------------------------------------------------------
    def abort_request(self, rid: Optional[str] = None, abort_all: bool = False) -> None:
        """Abort the request `rid` (an unknown one is a no-op), or every request with abort_all.
        No rid and no abort_all aborts nothing, as in SGLang (an empty /abort_request body must
        not end every rollout in flight)."""
        if not abort_all and not rid:
            return
        self.client.send(AbortReq(None if abort_all else str(rid)))

    async def async_abort_request(self, rid: Optional[str] = None, abort_all: bool = False) -> None:
        """abort_request from an event loop: a message to the core, so it never blocks."""
        self.abort_request(rid, abort_all)

    def flush_cache(self) -> bool:
        return self._call(FlushCacheReq())

    # ---- RL control: pause, weight updates (engine/core/control.py) ----------------------------
    def pause_generation(self, mode: str = "abort") -> None:
        """abort: in-flight requests end with finish_reason abort; retract: they go back to the
        queue (KV freed to the cache) and resume on continue; in_place: they keep their KV.
        Requests sent while paused wait in the queue."""
        self._call(PauseReq(check_pause_mode(mode)))

    def continue_generation(self) -> None:
        self._call(ContinueReq())

    def update_weights(self, source: Any, flush_cache: bool = True, weight_version: Optional[str] = None
                       ) -> tuple[bool, str]:
        """Load one weight_sync WeightSource (tensors, a serialized payload, a checkpoint, a
        broadcast, or any new transport's source) between two steps -> (success, message). Every
        name, shape and dtype is checked before any write: a refused update changes nothing and
        says why. Then the radix cache is flushed (flush_cache) and the version set."""
        from weight_sync.base import WeightSource

        if not isinstance(source, WeightSource):
            raise ValueError(f"update_weights takes a weight_sync WeightSource; got {type(source).__name__}")
        try:
            return self._call(UpdateWeightsReq(source, flush_cache, weight_version))
        except RuntimeError as exc:  # raised while pickling for a core process, before anything was sent
            if "received from another process" not in str(exc):
                raise
            raise ValueError("these CUDA tensors were opened from another process's IPC handles and cannot be "
                             "shared on to the core process: pass the serialized payload to "
                             "update_weights_from_serialized instead") from exc

    def update_weights_from_tensor(self, named_tensors: list, load_format: Optional[str] = None,
                                   flush_cache: bool = True, weight_version: Optional[str] = None
                                   ) -> tuple[bool, str]:
        """named_tensors: [(HF name, tensor)], any subset of the weights; with
        load_format="flattened_bucket", a weight_sync FlattenedBucket or its payload dict; or either
        serialized (weight_sync.cuda_ipc.serialize bytes or text), which the core unpickles.
        -> (success, message); a bad name or shape changes nothing and says which."""
        from weight_sync.tensor import tensor_source

        return self.update_weights(tensor_source(named_tensors, load_format), flush_cache, weight_version)

    def update_weights_from_serialized(self, serialized: Union[bytes, str], load_format: Optional[str] = None,
                                       flush_cache: bool = True, weight_version: Optional[str] = None
                                       ) -> tuple[bool, str]:
        """One `serialized_named_tensors` entry (weight_sync.cuda_ipc.serialize or SGLang's
        MultiprocessingSerializer), unpickled through the allowlist by the core itself: CUDA IPC
        handles are opened in the process that loads them (a core process included)."""
        from weight_sync.tensor import SerializedSource

        return self.update_weights(SerializedSource(serialized, load_format), flush_cache, weight_version)

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                 weight_version: Optional[str] = None, flush_cache: bool = True
                                 ) -> tuple[bool, str]:
        """Every weight from a safetensors checkpoint of the same architecture -> (success, message)."""
        from weight_sync.disk import DiskSource

        return self.update_weights(DiskSource(str(model_path), load_format), flush_cache, weight_version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl", timeout_s: float = 30.0) -> tuple[bool, str]:
        """Join the trainer's broadcast group as rank `rank_offset` (the trainer is rank 0 and
        joins at the same time); backend 'gloo' on the CPU. The rendezvous runs off the core
        loop (generation goes on) and fails after `timeout_s` if the trainer never joins."""
        answer = self._call(InitWeightsGroupReq(master_address, int(master_port), int(rank_offset),
                                                int(world_size), group_name, backend, float(timeout_s)))
        while answer is None:  # forming: ask again shortly; each answer comes between two steps
            time.sleep(GROUP_POLL_S)
            answer = self._call(WeightsGroupStatusReq(group_name))
        return answer

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: Optional[str] = None,
                                        load_format: Optional[str] = None) -> tuple[bool, str]:
        """Receive one broadcast per name from the group's rank 0 (load_format="flattened_bucket":
        one for all, packed as SGLang's FlattenedTensorBucket), then load them (checked before any
        write) -> (success, message)."""
        from weight_sync.nccl import GroupSource

        source = GroupSource(list(names), list(dtypes), [list(s) for s in shapes], group_name, load_format)
        return self.update_weights(source, flush_cache, weight_version)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        return self._call(DestroyWeightsGroupReq(group_name))

    def get_weight_version(self) -> str:
        return self._call(GetWeightVersionReq())

    def update_weight_version(self, new_version: str) -> str:
        return self._call(SetWeightVersionReq(str(new_version)))

    # ---- colocated memory ----------------------------------------------------------------------
    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> tuple[bool, str]:
        """Free the GPU memory of `tags` (weights, kv_cache, cuda_graph; None = all) for a
        colocated trainer. Generation waits until everything is resumed."""
        return self._call(ReleaseMemoryReq(check_memory_tags(tags)))

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> tuple[bool, str]:
        """Bring `tags` back (weights first and KV last lets a weight update land between)."""
        return self._call(ResumeMemoryReq(check_memory_tags(tags)))

    # ---- state ---------------------------------------------------------------------------------
    def get_stats(self) -> StatsSnapshot:
        return self._call(StatsReq())

    def get_server_info(self) -> dict[str, Any]:
        """SGLang's shape: the server args, the derived limits and the internal states."""
        stats = self.get_stats()
        info = self.info
        return {
            **self.server_args.to_dict(),
            "version": _version(), "weight_version": stats.weight_version,
            "max_total_num_tokens": info.max_total_num_tokens, "context_len": info.context_len,
            "chunked_prefill_size": info.chunked_prefill_size, "max_running_requests": info.max_running_requests,
            "vocab_size": info.vocab_size, "device": info.device, "dtype": info.dtype,
            "attention_backend": info.attention_backend,
            "internal_states": [{"num_running_reqs": stats.num_running_reqs, "num_waiting_reqs": stats.num_waiting_reqs,
                                 "paused": stats.paused, "memory_released": list(stats.memory_released),
                                 "kv_token_usage": stats.kv_tokens_used / max(stats.kv_tokens_total, 1)}],
        }

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of the parameter an HF checkpoint name loads into."""
        return self._call(GetWeightsByNameReq(str(name), truncate_size))

    def get_weights_checksum(self) -> str:
        """sha256 hex over every parameter (SGLang's compute_weights_checksum): equal for equal
        weights on any engine; engine.core.weight_queries.weights_checksum hashes a trainer's."""
        return self._call(WeightsChecksumReq())

    def check_weights(self, action: str = "checksum", skip_tensor_list: Optional[list[str]] = None,
                      allow_quant_error: bool = False) -> dict:
        """SGLang's weights checker (Miles' --check-weight-update-equal): "snapshot", then
        "reset_tensors", then after a sync "compare" (success only if every tensor was rewritten to
        its snapshot); "checksum" hashes each tensor. {"success", "message"[, "checksums"]}."""
        return self._call(WeightsCheckerReq(str(action), tuple(skip_tensor_list or ()), bool(allow_quant_error)))

    def check_integrity(self) -> None:
        """Asserts free + cached + in use == pool size (checked on the core)."""
        self._call(CheckIntegrityReq())

    def is_alive(self) -> bool:
        return self.client.is_alive()

    def health(self) -> bool:
        """The clients' spelling of is_alive: True while the core runs."""
        return bool(self.is_alive())

    def _call(self, msg: Any) -> Any:
        return self.client.call(msg)

    def shutdown(self) -> None:
        self.client.shutdown()
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    def close(self) -> None:
        """The clients' spelling: an in-process engine is its own connection, so it shuts down."""
        self.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- outputs (on the client's thread) ------------------------------------------------------
    def _dispatch(self, outputs: list[ReqOutput]) -> None:
        for out in outputs:
            with self._lock:
                sink = self._sinks.get(out.rid)
                req_input = self._inputs.get(out.rid)
                if out.finished:
                    self._sinks.pop(out.rid, None)
                    self._inputs.pop(out.rid, None)
            if req_input is not None:
                self.text_builder.fill(req_input, out)
                if out.finished and self.recorder is not None:
                    self.recorder.record(req_input, out.output)
            if sink is None:
                continue
            try:
                sink(out)
            except Exception:  # e.g. the caller's event loop is gone; the engine must live on
                logger.warning("dropping output for %s: its receiver is gone", out.rid)
                self._abort_quietly(out.rid, "receiver gone")

    def _abort_quietly(self, rid: str, message: str) -> None:
        try:
            self.client.send(AbortReq(rid, message))
        except Exception:  # the core is gone: nothing is left to abort
            pass

    def fail_all_requests(self, message: str) -> None:
        """The core died: every request in flight ends with an error instead of waiting forever."""
        with self._lock:
            rids = list(self._sinks)
        self._dispatch([ReqOutput.error(rid, message) for rid in rids])


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("tandem")
    except Exception:
        return "0.1.0"
