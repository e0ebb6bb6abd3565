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
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union


from engine.api.core_client import CoreClient, ThreadCoreClient
from engine.api.early_aborts import EXACT, NAMED, PREFIX, EarlyAborts
from engine.api.streamed_logprobs import StreamedLogprobs
from engine.api.text_builder import TextBuilder
from engine.api.generate_request import GenerateRequest
from engine.api.generate_stream import GenerateStream, ReceiverGone, SyncStream
from engine.api.recorder import Recorder
from engine.api.request_builder import RequestBuilder
from engine.api.weight_session import WeightUpdateSession
from engine.config import ServerArgs, configure_logging
from engine.api.engine_lora import EngineLoRA
from engine.api.engine_state import EngineState
from engine.api.engine_weights import EngineWeights
from engine.core.messages import (AbortReq, ContinueReq, CoreInfo, FlushCacheReq, PauseReq, ReqInput, ReqOutput,
                                  check_pause_mode)

if TYPE_CHECKING:
    from engine.api.core_spawn import SpawnedCore

logger = logging.getLogger("tandem")

Sink = Callable[[ReqOutput], None]


class Engine(EngineState, EngineWeights, EngineLoRA):
    """Generation, pause and lifetime here; counters and server info in EngineState, weights and
    colocated memory in EngineWeights, LoRA adapters in EngineLoRA."""

    def __init__(self, spawned_core: Optional["SpawnedCore"] = None, **kwargs: Any) -> None:
        """kwargs: ServerArgs fields. spawned_core: the core process, already started for these
        arguments (engine/api/core_spawn.py; `tandem serve` starts it before its own imports)."""
        self._spawned_core = spawned_core
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        configure_logging(self.server_args.log_level)
        self._sinks: dict[str, Sink] = {}
        self._inputs: dict[str, ReqInput] = {}  # in flight: for the final text and the recorder
        self._lock = threading.Lock()
        self._early_aborts = EarlyAborts()  # aborts a request still being built would miss
        self.weight_session = WeightUpdateSession()  # begin/end_weight_update, its routes' too
        self.model_path = self.server_args.model_path  # the checkpoint served: a disk update's since
        self._stats_call: Optional[Future] = None  # recent_stats's call in flight
        self.tokenizer: Any = None  # loaded once the core says from where
        self.client: CoreClient = self._start_core()
        try:
            self.info: CoreInfo = self.client.info
            self.tokenizer = self._load_tokenizer()
            self.text_builder = TextBuilder(self.tokenizer)
            self.streamed_logprobs = StreamedLogprobs()
            self.builder = RequestBuilder(self.tokenizer, self.info.vocab_size, self.info.context_len,
                                          self.server_args, self.info.max_total_num_tokens)
            self.builder.lora.update(dict(self.info.lora_adapters))
            self.recorder = Recorder.maybe_open(self.server_args.record_path, self.server_args.model_path)
        except BaseException:  # e.g. no tokenizer: the core (maybe a process) must not outlive the failure
            self.client.shutdown()
            raise

    def _start_core(self) -> CoreClient:
        if self.server_args.core_process:
            from engine.api.process_client import ProcessCoreClient

            return ProcessCoreClient(self.server_args, self._dispatch, on_core_death=self._core_died,
                                     spawned=self._spawned_core)
        if self._spawned_core is not None:
            self._spawned_core.kill()
            raise ValueError("a spawned core process needs core_process=True")
        return ThreadCoreClient(self.server_args, self._dispatch, on_core_death=self._core_died)

    def _load_tokenizer(self) -> Any:
        if self.server_args.skip_tokenizer_init:
            return None
        from engine.tokenizer import load_tokenizer

        return load_tokenizer(self.info.tokenizer_path)

    @property
    def tokenizer_manager(self) -> Any:
        """sglang.Engine's tokenizer_manager, as far as RL frameworks await it directly."""
        from engine.api.tokenizer_manager import TokenizerManagerShim

        return TokenizerManagerShim(self)

    @property
    def local_core(self) -> Any:
        """The EngineCore when it runs on a thread here: for white-box tests only."""
        return getattr(self.client, "core", None)

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, *args: Any, **kwargs: Any) -> Union[dict, list[dict], Iterator[dict]]:
        """SGLang's Engine.generate: the arguments are GenerateRequest's fields (prompt,
        sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
        logprob_distribution, rid, token_ids_logprob), or one GenerateRequest. Blocks until done;
        stream=True returns an iterator of cumulative chunks instead, as SGLang's does."""
        since = self.abort_mark()
        request = GenerateRequest.of(*args, **kwargs)
        reqs, single = self.builder.build(request)
        if request.stream:
            chunks = SyncStream(reqs, single, self._abort_quietly)
            self._submit_all(reqs, [chunks.sink()] * len(reqs), since)
            return iter(chunks)
        results: dict[str, "queue.Queue[ReqOutput]"] = {r.rid: queue.Queue() for r in reqs}
        self._submit_all(reqs, [results[r.rid].put for r in reqs], since)
        outputs = [self._wait_final(results[r.rid]) for r in reqs]
        return outputs[0] if single else outputs

    def async_generate(self, *args: Any, loop: Optional[asyncio.AbstractEventLoop] = None,
                       aborts_since: Optional[int] = None, **kwargs: Any) -> GenerateStream:
        """generate's arguments (stream=True too). `await` it for the final dict(s), or `async
        for` over cumulative chunks when stream=True. Called off the event loop (a worker thread
        building a constrained request), `loop` is the event loop that will read the stream.
        aborts_since: abort_mark() when the request's handling began (now by default): an abort
        since then that names it ends it, though it came before its rid was sent."""
        since = self.abort_mark() if aborts_since is None else aborts_since
        request = GenerateRequest.of(*args, **kwargs)
        reqs, single = self.builder.build(request)
        loop = loop or asyncio.get_running_loop()
        streams = GenerateStream(reqs, single, request.stream, loop, abort=self._abort_quietly)
        self._submit_all(reqs, [streams.sink_for(r.rid) for r in reqs], since)
        return streams

    def abort_mark(self) -> int:
        """Where the aborts stand: pass it to async_generate when a request's handling began."""
        return self._early_aborts.mark()

    def _wait_final(self, q: "queue.Queue[ReqOutput]") -> dict:
        while True:
            out = q.get()
            if out.finished:
                return out.output

    def _submit(self, req_input: ReqInput, sink: Sink) -> None:
        self._submit_all([req_input], [sink])

    def _submit_all(self, reqs: list[ReqInput], sinks: list[Sink], aborts_since: Optional[int] = None) -> None:
        """Every rid is checked and registered before the batch is sent, so a batch refused for a
        rid already in flight submits nothing (nothing decodes for nobody). The batch reaches the
        core whole: its requests are scheduled together however busy the host is. Those an abort
        since `aborts_since` names are aborted again once sent (engine/api/early_aborts.py)."""
        with self._lock:
            busy = next((r.rid for r in reqs if r.rid in self._sinks), None)
            if busy is not None:
                raise ValueError(f"rid {busy!r} is already in flight; rids must be unique")
            for r, sink in zip(reqs, sinks):
                self._sinks[r.rid] = sink
                self._inputs[r.rid] = r
        try:
            self.client.send_all(reqs)
        except BaseException:  # e.g. CoreDead: none of them was sent
            with self._lock:
                for r in reqs:
                    self._sinks.pop(r.rid, None)
                    self._inputs.pop(r.rid, None)
            raise
        if aborts_since is not None:  # checked after the send: a later abort reaches the core after them
            for rid in self._early_aborts.named([r.rid for r in reqs], aborts_since):
                self._abort_quietly(rid, AbortReq.message)

    # ---- control -------------------------------------------------------------------------------
    def abort_request(self, rid: Optional[str] = None, abort_all: bool = False, prefix: bool = False) -> None:
        """Abort the request `rid` (an unknown one is a no-op; with `prefix`, every request whose rid
        starts with it), or every request with abort_all. No rid and no abort_all aborts nothing, as
        in SGLang (an empty /abort_request body must not end every rollout in flight)."""
        if not abort_all and not rid:
            return
        target, prefix = None if abort_all else str(rid), bool(prefix) and not abort_all
        with self._lock:  # first: a request sent after this checks for it; in flight, the rid names only itself
            how = PREFIX if prefix else EXACT if target in self._sinks else NAMED
            self._early_aborts.record(target, how)
        self.client.send(AbortReq(target, prefix=prefix))

    async def async_abort_request(self, rid: Optional[str] = None, abort_all: bool = False,
                                  prefix: bool = False) -> None:
        """abort_request from an event loop: a message to the core, so it never blocks."""
        self.abort_request(rid, abort_all, prefix)

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

    def is_alive(self) -> bool:
        return self.client.is_alive()

    def health(self) -> bool:
        """The clients' spelling of is_alive: True while the core runs."""
        return bool(self.is_alive())

    def _call(self, msg: Any) -> Any:
        return self.client.call(msg)

    def shutdown(self) -> None:
        builder = getattr(self, "builder", None)
        if builder is not None:
            builder.grammars.close()  # requests still checking a grammar answer now (GrammarUnavailable: a 503)
        self.client.shutdown()
        # requests in flight end now, as a core process's do when it stops (a thread core's stop
        # is quiet: their callers would otherwise wait forever)
        self._fail_in_flight("the engine core is shut down", status_code=503)
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
                self.streamed_logprobs.fill(req_input, out)
                self.text_builder.fill(req_input, out)
                if req_input.return_prompt_token_ids:  # SGLang's: beside text and meta_info, every chunk
                    out.output["prompt_token_ids"] = list(req_input.input_ids)
                if out.finished and self.recorder is not None:
                    self.recorder.record(req_input, out.output)
            if sink is None:
                continue
            try:
                sink(out)
            except ReceiverGone:  # the caller dropped its stream (e.g. `break`): nobody reads on
                if not out.finished:
                    self._abort_quietly(out.rid, "stream dropped by its reader")
            except Exception:  # e.g. the caller's event loop is gone; the engine must live on
                logger.warning("dropping output for %s: its receiver is gone", out.rid)
                self._abort_quietly(out.rid, "receiver gone")

    def _abort_quietly(self, rid: str, message: str) -> None:
        try:
            self.client.send(AbortReq(rid, message))
        except Exception:  # the core is gone: nothing is left to abort
            pass

    def fail_all_requests(self, message: str, status_code: Optional[int] = None) -> None:
        """Every request in flight ends with an abort and `message` instead of waiting forever
        (the core died, or the server is shutting down); those still checking their grammar get
        GrammarUnavailable (a 503 naming `message`)."""
        builder = getattr(self, "builder", None)
        if builder is not None:
            builder.grammars.close(message)
        self._fail_in_flight(message, status_code)

    def _fail_in_flight(self, message: str, status_code: Optional[int]) -> None:
        with self._lock:
            rids = list(self._sinks)
        self._dispatch([ReqOutput.error(rid, message, status_code) for rid in rids])

    def _core_died(self, why: str) -> None:
        """Status 503: the HTTP routes answer these requests as SGLang answers a dead scheduler."""
        self.fail_all_requests(why, status_code=503)

