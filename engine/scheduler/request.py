"""Req: one generation request as the scheduler sees it (token ids, lengths, outputs), and
RequestOptions, what it asks for beside its prompt (shared with the core's ReqInput message)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch

from engine.sampling_params import SamplingParams


@dataclass(eq=False)  # Req keeps identity semantics (it is hashed and compared as an object)
class RequestOptions:
    """One sample of a generate call, beside its prompt: written once here for the core's
    ReqInput message and the scheduler's Req. Validated and normalised by the front end's
    RequestBuilder (without return_logprob the other logprob options are off)."""
    rid: str
    sampling_params: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[list[int]] = None  # SGLang's: these ids' logprobs at every position
    logprob_distribution: str = "original"
    stream: bool = False
    return_routed_experts: bool = False  # meta_info["routed_experts"] at the end (needs the server flag)
    routed_experts_start_len: int = 0  # the routes returned are positions [this, seq_len - 1)
    lora_path: Optional[str] = None  # the LoRA adapter's name (or path); None: the base model
    # SGLang's extra_key (the OpenAI routes' cache_salt): a radix-cache namespace, so requests of
    # different keys never share a prefix's KV (prime-rl salts by policy version)
    extra_key: Optional[str] = None


@dataclass(eq=False)  # identity: requests are compared as objects, never by value
class Req(RequestOptions):
    origin_input_ids: list[int] = field(kw_only=True)
    output_ids: list[int] = field(default_factory=list)
    # KV bookkeeping (see engine/kv): what this round computes (`fill_ids`) and what it already owns;
    # None: every token so far, read lazily (a decode step must not copy the whole sequence)
    _fill_ids: Optional[list[int]] = field(default_factory=list, repr=False)
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    req_pool_idx: Optional[int] = None
    kv_committed_len: int = 0  # positions whose KV is in the pool
    extend_input_len: int = 0  # tokens computed by the current round
    is_chunked: bool = False  # prefill cut by the chunk budget; continues next round
    cached_tokens: int = 0
    num_retractions: int = 0
    arrival: int = 0  # its number among the requests queued (RequestQueues.add_request)
    to_abort: Optional[str] = None  # abort message, set by abort_request while running
    finished_reason: Optional[dict] = None
    # engine.grammar.RequestGrammar when the request is constrained (set by the core; opaque here)
    grammar: Any = None
    # the id of the LoRA adapter lora_path names (set by the core); its radix cache namespace
    lora_id: Optional[int] = None

    # logprobs: values only; token ids are origin_input_ids / output_ids
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[Optional[float]] = field(default_factory=list)
    input_logprobs_done: bool = False
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # token_ids_logprob: per position, one value per requested id (in its order)
    output_token_ids_logprobs: list[list[float]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[float]] = field(default_factory=list)
    # custom_params.return_top_p_token_ids: per output token, the ids its sampler kept (engine/sampling/nucleus.py)
    output_kept_ids: list = field(default_factory=list)  # of array("i")
    streamed_logprobs: int = 0  # output positions whose logprobs a streamed answer already carried

    # text, for stop strings and streaming (set by the core)
    detokenizer: Any = None
    detokenized_len: int = 0  # output tokens already fed to the detokenizer
    text: str = ""
    stop_text_len: Optional[int] = None  # where a matched stop string starts
    stop_regex_checked: int = 0  # characters of text already searched for stop_regex
    stop_scan: Optional[list[int]] = None  # a stream's hold-back search, per stop string (finish.stop_prefix_len)

    created_time: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    weight_spans: list[tuple[str, int]] = field(default_factory=list)  # (version, first output index)

    @classmethod
    def from_input(cls, msg: Any) -> "Req":
        """msg: an engine.core.messages.ReqInput (RequestOptions plus its input_ids)."""
        options = {f.name: getattr(msg, f.name) for f in fields(RequestOptions)}
        if not msg.return_logprob:  # the logprob options mean nothing without it (whoever built msg)
            options.update(logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None)
        elif not msg.token_ids_logprob:
            options["token_ids_logprob"] = None
        return cls(origin_input_ids=list(msg.input_ids), **options)

    @property
    def cache_namespace(self) -> Any:
        """The radix-cache tree this request's KV lives in: its adapter's, split by extra_key."""
        return self.lora_id if self.extra_key is None else (self.lora_id, self.extra_key)

    def note_weight_version(self, version: str) -> None:
        """Called as each output token is committed: opens a span when the weights changed."""
        if not self.weight_spans or self.weight_spans[-1][0] != version:
            self.weight_spans.append((version, len(self.output_ids) - 1))

    # ---- lengths -------------------------------------------------------------------------------
    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def fill_ids(self) -> list[int]:
        """The tokens this round's KV covers once computed (a prefill: the prompt, or its chunk)."""
        return self.all_ids if self._fill_ids is None else self._fill_ids

    @fill_ids.setter
    def fill_ids(self, ids: list[int]) -> None:
        self._fill_ids = ids

    def fill_all(self) -> None:
        """fill_ids = every token so far (prompt + outputs), in O(1): each decode step sets it
        for every running request, and a 16k-token sequence copied per request per step cost
        more than the step's device time at batch 256."""
        self._fill_ids = None

    @property
    def fill_len(self) -> int:
        return self.seq_len if self._fill_ids is None else len(self._fill_ids)

    def fill_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building fill_ids (a decode row reads its last token)."""
        if self._fill_ids is not None:
            return self._fill_ids[start:end]
        n = len(self.origin_input_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return (self.origin_input_ids[start:end] + self.output_ids[: max(end - n, 0)])

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)

    @property
    def wants_input_logprobs(self) -> bool:
        return self.logprob_start_len >= 0 and not self.input_logprobs_done

    def max_prefix_len(self) -> int:
        """Longest prefix the cache may serve: the last token is always computed (its logits
        sample the next token), and prompt logprobs from position k need logits from k-1."""
        cap = self.fill_len - 1
        if self.wants_input_logprobs:
            cap = min(cap, max(self.logprob_start_len - 1, 0))
        return max(cap, 0)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None
