"""ServerArgs: every engine knob in one frozen dataclass, named after SGLang's flags."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.attention.registry import backend_names, deterministic_backends, get_backend_spec
from engine.sglang_launch_args import drop_sglang_launch_args
from engine.weight_version import check_version

SCHEDULE_POLICIES = ("fcfs", "lpm")
GRAMMAR_BACKENDS = ("auto", "thread", "process")
SAMPLING_DEFAULTS = ("model", "openai")
ATTENTION_BACKENDS = backend_names()  # engine/attention/registry.py
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy", "safetensors")
LOGPROB_DISTRIBUTIONS = ("original", "processed")
CHAT_METADATA_FORMATS = ("spans", "weight_version")
TOOL_CALL_PARSERS = ("qwen25", "qwen", "hermes")  # one format: <tool_call>{json}</tool_call>
REASONING_PARSERS = ("qwen3", "qwen3-thinking", "deepseek-r1")  # <think>...</think>
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMAT = "[%(asctime)s] %(message)s"


@dataclass(frozen=True)
class ServerArgs:
    model_path: str
    tokenizer_path: Optional[str] = None
    dtype: str = "auto"
    device: str = "auto"  # "auto" -> cuda when available, else cpu
    load_format: str = "auto"
    random_seed: int = 0
    tp_size: int = 1  # tensor parallelism: ranks 1..N-1 in their own processes (engine/runner/tp_*.py)
    context_length: Optional[int] = None
    # memory
    mem_fraction_static: Optional[float] = None
    max_total_tokens: Optional[int] = None
    max_running_requests: Optional[int] = None
    enable_memory_saver: bool = False  # weights/KV in torch-memory-saver regions (release_memory_occupation)
    enable_weights_cpu_backup: bool = False  # keep a host copy of released weights (else the next update rewrites them)
    # scheduling
    chunked_prefill_size: Optional[int] = None  # None: chosen by device; -1: no chunking
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    enable_deterministic_inference: bool = False
    # MoE models: keep each token's top-k expert ids per layer with its KV slot, so a request with
    # return_routed_experts gets meta_info["routed_experts"] (SGLang's flag; R3 routing replay)
    enable_return_routed_experts: bool = False
    # LoRA adapters (engine/lora/): SGLang's flags
    enable_lora: bool = field(default=False, metadata={"help": (
        "serve LoRA adapters: per-request lora_path, /load_lora_adapter, /unload_lora_adapter, "
        "/load_lora_adapter_from_tensors (on when --lora-paths is given)")})
    lora_paths: tuple[str, ...] = field(default=(), metadata={"help": (
        "LoRA adapters (PEFT's format) to load at start: each PATH, NAME=PATH, or JSON "
        '{"lora_name": str, "lora_path": str, "pinned": bool}')})
    max_loras_per_batch: int = field(default=8, metadata={"help": (
        "the most distinct LoRA adapters one batch runs, the base model counted as one, as in SGLang "
        "(requests of other adapters wait)")})
    max_lora_rank: Optional[int] = field(default=None, metadata={"help": (
        "an adapter of a higher rank is refused (default: any rank)")})
    lora_target_modules: tuple[str, ...] = field(default=(), metadata={"help": (
        "modules adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj or "
        "all-linear (default: all of them); an adapter targeting others is refused")})
    max_loaded_loras: Optional[int] = field(default=None, metadata={"help": (
        "the most LoRA adapters loaded at once; loading one more is refused (default: no limit)")})
    lora_backend: Optional[str] = field(default=None, metadata={"help": (
        "LoRA kernels: triton (a device pool of --max-loras-per-batch slots of rank --max-lora-rank, "
        "under CUDA graphs: dense GEMMs over the slots in normal mode, grouped Triton GEMMs in "
        "deterministic mode; csgmv is taken as triton), grouped (the grouped Triton GEMMs in both "
        "modes) or torch_native (per-adapter matmuls, no graphs for LoRA batches); default triton on "
        "CUDA, torch_native on the CPU")})
    # numerics / kernels
    attention_backend: Optional[str] = None
    disable_cuda_graph: bool = False
    disable_cascade_attn: bool = field(default=False, metadata={"help": (
        "decode without shared-prefix (cascade) attention: by default, in normal mode, rows whose "
        "cached prompt is the same KV (GRPO's n samples) read it once per tile of rows, not once "
        "each (triton backend)")})
    disable_overlap_schedule: bool = False
    enable_mixed_chunk: bool = False
    cuda_graph_max_bs: Optional[int] = None
    # the scheduler + model in their own process; None: a thread for the in-process API, a process
    # for `tandem serve` on a GPU (HTTP at 0.90x in-process throughput vs 0.85x on a thread, H200)
    core_process: Optional[bool] = None
    # structured output: xgrammar's matchers on a thread of the core ("thread") or in a process of
    # their own ("process": no GIL shared with the core loop; engine/grammar/matcher_server.py);
    # "auto": the process on a GPU (0.83-0.93x of free decoding where the thread gave 0.65-0.92x,
    # H200 bs 64, docs/benchmarks.md), the thread on the CPU (no overlap to win there)
    grammar_backend: str = "auto"
    # grammar bounds (engine/grammar/grammar_limits.py): a grammar past one is its request's 400
    grammar_max_bytes: int = field(default=256 << 10, metadata={"help": (
        "a grammar's text (json_schema, regex, ebnf, structural_tag) over this many bytes is a "
        "400")})
    grammar_max_schema_nodes: int = field(default=20_000, metadata={"help": (
        "a JSON schema / structural tag with more objects, arrays and members is a 400")})
    grammar_compile_timeout: float = field(default=10.0, metadata={"help": (
        "seconds a grammar may take to compile (in a killable worker); past it, a 400")})
    grammar_compile_workers: int = field(default=2, metadata={"help": (
        "worker processes that compile grammars under the time limit (one kept for grammars of at "
        "most 8 KiB)")})
    grammar_cache_bytes: int = field(default=256 << 20, metadata={"help": (
        "bytes of compiled grammars the core keeps (least recently used dropped first)")})
    grammar_step_timeout: float = field(default=15.0, metadata={"help": (
        "seconds the grammar process (--grammar-backend process) may take to answer a step; past "
        "it its constrained requests abort and the others decode on")})
    # chat completions' unset temperature / top_p / top_k / min_p / repetition_penalty: the
    # checkpoint's generation_config.json ("model", SGLang's default) or OpenAI's (1.0, 1.0, ...)
    sampling_defaults: str = "model"
    # outputs
    skip_tokenizer_init: bool = False
    logprob_distribution: str = "original"
    record_path: Optional[str] = None  # append one JSON line per finished request (tandem replay)
    # server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None  # generation and info routes (or env TANDEM_API_KEY)
    admin_api_key: Optional[str] = None  # control routes: pause, weights, abort, flush (or env TANDEM_ADMIN_API_KEY)
    log_level: str = "info"  # the "tandem" and "engine" loggers, set at Engine start (configure_logging)
    # request limits (HTTP and in-process): a request past one is a 400 naming the limit
    max_n: int = 1024  # samples per prompt
    max_batch_requests: int = 8192  # prompts x n in one call
    max_body_bytes: int = 1 << 30  # the tensor-carrying routes' bodies (weight and LoRA payloads)
    max_generate_body_bytes: int = 256 << 20  # /generate, /v1/*, /tokenize and /detokenize bodies
    max_control_body_bytes: int = 16 << 20  # every other route's (pause, abort, weight group names, ...)
    max_prompt_bytes: Optional[int] = field(default=None, metadata={"help": (
        "the most UTF-8 bytes of one prompt's text (or a rendered chat template), checked before tokenizing; "
        "default: the context length x the longest token's bytes (a longer text cannot fit the context)")})
    # browsers and client-supplied templates (engine/server/origin_guard.py, engine/server/openai.py)
    allowed_origins: tuple[str, ...] = field(default=(), metadata={"help": (
        "browser origins (scheme://host[:port]) whose requests may call the control routes (pause, weights, "
        "flush, memory, abort); any other request with an Origin header, or marked by the browser "
        "Sec-Fetch-Site: cross-site/same-site, is a 403. Clients that send neither header are unaffected")})
    trust_request_chat_template: bool = field(default=False, metadata={"help": (
        "let chat requests bring their own Jinja chat template (chat_template, or chat_template_kwargs' "
        "chat_template), rendered in the server; refused with a 400 otherwise (vLLM's flag)")})
    health_check_timeout: float = 20.0  # /health_generate: seconds for a 1-token probe to answer
    tool_call_parser: Optional[str] = field(default=None, metadata={"help": (
        "chat replies' tool calls as the model writes them (<tool_call>{json}</tool_call>: Qwen2.5/3, Hermes) "
        "returned as tool_calls with tool_choice auto (SGLang's flag; unset: they stay the content)")})
    reasoning_parser: Optional[str] = field(default=None, metadata={"help": (
        "chat replies' <think>...</think> returned as reasoning_content (SGLang's flag): qwen3 thinking first "
        "unless chat_template_kwargs turn enable_thinking off, qwen3-thinking / deepseek-r1 always; unset: it "
        "stays the content")})
    enable_cache_report: bool = field(default=False, metadata={"help": (
        "OpenAI replies' usage carries prompt_tokens_details.cached_tokens (SGLang's flag)")})
    weight_version: str = field(default="default", metadata={"help": (
        "the weights' version at start (SGLang's --weight-version): meta_info's weight_version until an "
        "update names another")})
    served_model_name: Optional[str] = field(default=None, metadata={"help": (
        "the model id /v1/models lists and OpenAI replies carry (SGLang's flag); default: the model path")})
    # OpenAI replies' `metadata`: SGLang 0.5.23's {"weight_version", "weight_versions": [spans]}, or
    # 0.5.6's {"weight_version"} alone, which the `openai` package's Dict[str, str] accepts
    chat_metadata_format: str = field(default="spans", metadata={"help": (
        "the `metadata` of non-streamed /v1/chat/completions and /v1/completions replies: 'spans' is "
        "SGLang 0.5.23's (weight_version plus the weight_versions spans); 'weight_version' is 0.5.6's "
        "(weight_version only), which clients validating replies with the openai package need")})
    # streaming: a client whose socket takes nothing for stream_stall_timeout seconds, or leaves
    # more than max_unread_stream_bytes unread, is cut off and its requests aborted (stream_watch.py)
    stream_stall_timeout: float = field(default=30.0, metadata={"help": (
        "seconds a streaming client may leave its stream unread (its socket taking nothing) before it "
        "is cut off and its requests aborted")})
    max_unread_stream_bytes: int = field(default=64 << 20, metadata={"help": (
        "bytes of a stream's output a client may leave unread before it is cut off and its requests aborted")})
    custom_pull_weights_pre_read_hook: Optional[str] = field(default=None, metadata={"help": (
        "slime's: import path (module.function) of a hook(source_dir, target_version) that /pull_weights "
        "calls before it reads published weights (a shared filesystem that needs a refresh first)")})
    # SGLang's flag: streamed /generate chunks carry only what is new
    incremental_streaming_output: bool = field(default=False, metadata={"help": (
        "SGLang's: streamed /generate chunks carry only what is new (text, output_ids, output_* logprobs) "
        "instead of everything so far")})

    def __post_init__(self) -> None:
        _check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        _check_choice("grammar_backend", self.grammar_backend, GRAMMAR_BACKENDS)
        _check_choice("sampling_defaults", self.sampling_defaults, SAMPLING_DEFAULTS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("logprob_distribution", self.logprob_distribution, LOGPROB_DISTRIBUTIONS)
        _check_choice("log_level", self.log_level, LOG_LEVELS)
        _check_choice("chat_metadata_format", self.chat_metadata_format, CHAT_METADATA_FORMATS)
        if self.tool_call_parser is not None:
            _check_choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        if self.reasoning_parser is not None:
            _check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        if not isinstance(self.weight_version, str):
            raise ValueError(f"weight_version must be a string, got {self.weight_version!r}")
        check_version(self.weight_version, "weight_version")
        if self.attention_backend is not None:
            _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
            if self.enable_deterministic_inference and not get_backend_spec(self.attention_backend).supports_deterministic:
                raise ValueError(f"attention_backend {self.attention_backend!r} has no deterministic mode: "
                                 f"deterministic inference needs the {' or '.join(deterministic_backends())} backend")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0:
            raise ValueError("chunked_prefill_size must be positive, or -1 to disable chunking; got 0")
        for name in ("max_total_tokens", "max_running_requests", "context_length"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        for name in ("max_n", "max_batch_requests", "max_body_bytes", "max_generate_body_bytes", "max_control_body_bytes",
                     "grammar_max_bytes", "grammar_max_schema_nodes", "grammar_compile_workers",
                     "max_unread_stream_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        self._check_lora()
        if self.max_prompt_bytes is not None and self.max_prompt_bytes <= 0:
            raise ValueError(f"max_prompt_bytes must be a positive integer, got {self.max_prompt_bytes}")
        if isinstance(self.allowed_origins, str) or not all(isinstance(o, str) for o in self.allowed_origins):
            raise ValueError(f"allowed_origins must be a list of origins (scheme://host[:port]), "
                             f"got {self.allowed_origins!r}")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))  # argparse gives a list
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("grammar_compile_timeout", "grammar_step_timeout", "stream_stall_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.grammar_cache_bytes < 0:
            raise ValueError(f"grammar_cache_bytes must be >= 0, got {self.grammar_cache_bytes}")
        if self.health_check_timeout <= 0:
            raise ValueError(f"health_check_timeout must be > 0 seconds, got {self.health_check_timeout}")
        if self.max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens must be positive, got {self.max_prefill_tokens}")
        if self.schedule_conservativeness <= 0:
            raise ValueError("schedule_conservativeness must be > 0")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")

    def _check_lora(self) -> None:
        object.__setattr__(self, "lora_paths", _lora_path_specs(self.lora_paths))
        for name in ("lora_paths", "lora_target_modules"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))  # argparse gives a list
        if self.lora_paths:  # SGLang: --lora-paths turns LoRA on
            object.__setattr__(self, "enable_lora", True)
        if self.max_loras_per_batch <= 0:
            raise ValueError(f"max_loras_per_batch must be a positive integer, got {self.max_loras_per_batch}")
        for name in ("max_lora_rank", "max_loaded_loras"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.max_loaded_loras is not None and len(self.lora_paths) > self.max_loaded_loras:
            raise ValueError(f"--lora-paths names {len(self.lora_paths)} adapters but max_loaded_loras is "
                             f"{self.max_loaded_loras}")
        if self.lora_backend not in (None, "triton", "csgmv", "grouped", "torch_native"):
            raise ValueError(f"lora_backend must be triton, csgmv, grouped or torch_native, got {self.lora_backend!r}")
        if self.enable_lora and self.tp_size > 1:
            raise ValueError("LoRA adapters are served with tp_size 1 only")

    def to_dict(self) -> dict[str, Any]:
        """Every field, with secrets left out (for /get_server_info)."""
        out = dataclasses.asdict(self)
        for secret in ("api_key", "admin_api_key"):
            if out.get(secret) is not None:
                out[secret] = "<set>"
        return out

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        """Build from keyword arguments, naming any that are not ServerArgs fields (sglang.Engine's
        launch arguments tandem has no field for pass when they change nothing: sglang_launch_args)."""
        drop_sglang_launch_args(kwargs)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown ServerArgs field(s): {', '.join(unknown)}")
        return cls(**kwargs)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def configure_logging(level: str) -> None:
    """ServerArgs.log_level, applied when an Engine starts: the level of tandem's loggers ("tandem",
    and "engine" above every module's own), and of the root handler that logging.basicConfig
    installs when the process has none yet (an application's own logging setup is kept)."""
    numeric = getattr(logging, level.upper())
    logging.basicConfig(level=numeric, format=LOG_FORMAT)
    for name in ("tandem", "engine"):
        logging.getLogger(name).setLevel(numeric)


def _lora_path_specs(value: Any) -> Any:
    """SGLang's other lora_paths forms as --lora-paths entries: {name: path} (what Miles passes) and
    [{"lora_name", "lora_path", "pinned"}, ...]; anything else is checked as it is."""
    if isinstance(value, dict):  # as JSON objects: a name may hold "="
        return tuple(json.dumps({"lora_name": name, "lora_path": path}) if isinstance(path, str) else (name, path)
                     for name, path in value.items())
    if isinstance(value, (list, tuple)) and any(isinstance(v, dict) for v in value):
        return tuple(json.dumps(v) if isinstance(v, dict) else v for v in value)
    return value
