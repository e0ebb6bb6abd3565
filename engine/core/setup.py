"""Builds the parts of an EngineCore from ServerArgs: model, pools, caches, scheduler, runner.

Derived values (pool size, chunk size, running-request cap, context length) are computed here,
once, and announced in one start-up line.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from transformers import AutoConfig

from engine.attention.registry import BackendSpec, default_backend, get_backend_spec
from engine.config import ServerArgs
from engine.core.startup_clock import StartupClock
from engine.models.parallel_state import check_tp_size, kv_heads_per_rank
from engine.runner.tp_driver import TPDriver
from engine.runner.tp_messages import KVPlan
from engine.kv.allocator import TokenSlotAllocator
from engine.kv.chunk_cache import ChunkCache
from engine.kv.pool import KVPool, ReqToTokenPool
from engine.kv.radix_cache import RadixCache
from engine.models.loader import load_model, resolve_dtype
from engine.scheduler.request import Req
from engine.runner.memory import MemoryPlan, plan_memory
from engine.runner.memory_saver import MemorySaver
from engine.runner.model_runner import ModelRunner, RunnerConfig
from engine.scheduler.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger("tandem")


@dataclass
class CoreParts:
    scheduler: Scheduler
    runner: ModelRunner
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    context_len: int
    vocab_size: int
    memory: MemoryPlan
    make_detokenizer: Callable[[Req], Any]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError:  # torch lists every device type it knows, at length
        raise ValueError(f"device {name!r} is not a torch device: use auto, cpu, cuda or cuda:N") from None


def load_hf_config(model_path: str) -> Any:
    """The checkpoint's config.json; a path that is not a local checkpoint is a FileNotFoundError saying
    so (transformers would take it for a hub repo id and complain about its characters)."""
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        what = "does not exist" if not os.path.exists(model_path) else "has no config.json"
        raise FileNotFoundError(f"model_path {model_path!r} {what}: pass a local HF checkpoint directory "
                                f"(build a small one with `tandem tiny-model --out DIR`)")
    return AutoConfig.from_pretrained(model_path)


def build_core_parts(args: ServerArgs) -> CoreParts:
    clock = StartupClock()
    with clock.phase("config"):
        hf_config = load_hf_config(args.model_path)
    with clock.phase("device"):  # torch's first look at the GPU brings up the CUDA driver (cuInit)
        device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, hf_config, device)
    backend = get_backend_spec(args.attention_backend or default_backend(device.type))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    backend.check_model(str(dtype).removeprefix("torch."), head_dim, device.type)  # fail before the model loads
    tp = _start_tensor_parallel(args, device, hf_config)
    try:
        return _build(args, hf_config, device, dtype, backend, head_dim, tp, clock)
    except BaseException:  # the other ranks must not outlive a failed start
        if tp is not None:
            tp.stop()
        raise


def _start_tensor_parallel(args: ServerArgs, device: torch.device, hf_config: Any) -> Optional[TPDriver]:
    """tp_size > 1: the other ranks' processes, joined in one group (engine/runner/tp_*.py)."""
    if args.tp_size == 1:
        return None
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    check_tp_size(args.tp_size, hf_config.num_attention_heads, num_kv_heads)
    return TPDriver(args, device)


def _build(args: ServerArgs, hf_config: Any, device: torch.device, dtype: torch.dtype, backend: BackendSpec,
           head_dim: int, tp: Optional[TPDriver], clock: StartupClock) -> CoreParts:
    deterministic = args.enable_deterministic_inference
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    if tp is not None:  # this rank's kv heads only
        num_kv_heads = kv_heads_per_rank(num_kv_heads, args.tp_size)
    saver = MemorySaver(args.enable_memory_saver, device, weights_cpu_backup=args.enable_weights_cpu_backup)
    with saver.region("weights"), clock.phase("weights"):  # release_memory_occupation frees these regions
        model = load_model(args.model_path, hf_config, dtype, device, args.load_format, deterministic=deterministic,
                           tp=tp.group if tp is not None else None)
    context_len = args.context_length or int(getattr(hf_config, "max_position_embeddings", 4096))
    routes = routes_shape(args, hf_config)
    with clock.phase("lora_pool"):
        lora_pool = _lora_pool(args, model, device, dtype)
    memory = plan_memory(args, model, device, hf_config.num_hidden_layers, num_kv_heads, head_dim, dtype, context_len,
                         extra_bytes_per_token=4 * routes[0] * routes[1] if routes else 0,
                         extra_static_bytes=lora_pool.nbytes if lora_pool is not None else 0)
    with saver.region("kv_cache"), clock.phase("kv_pool"):
        kv_pool = KVPool(memory.max_total_num_tokens, hf_config.num_hidden_layers, num_kv_heads, head_dim, dtype, device,
                         routes_shape=routes)
    with clock.phase("scheduler"):  # the host's request-to-token table: [max running + 1, context + 1]
        # +1 row: the chunked request holds a row while it is neither running nor waiting
        req_pool = ReqToTokenPool(memory.max_running_requests + 1, context_len + 1, "cpu")
        if tp is not None:  # the other ranks size their pools as rank 0's: slot ids are rank 0's
            tp.send_plan(KVPlan(memory.max_total_num_tokens, req_pool.size, context_len))
        allocator = TokenSlotAllocator(memory.max_total_num_tokens)
        cache = ChunkCache(allocator, req_pool) if args.disable_radix_cache else RadixCache(allocator, req_pool)
        scheduler = Scheduler(_scheduler_config(args, memory), cache, allocator, req_pool)
    with clock.phase("tokenizer"):
        tokenizer = None if args.skip_tokenizer_init else _load_tokenizer(args)
        eos = _eos_token_ids(args.model_path, hf_config, tokenizer)
    vocab_size = int(hf_config.vocab_size)
    runner_cfg = RunnerConfig(device, dtype, backend.name, eos, vocab_size,
                              cuda_graph_max_bs=0 if tp is not None else _cuda_graph_max_bs(args, device, backend, memory),
                              deterministic=deterministic, cascade_attn=not args.disable_cascade_attn)
    with clock.phase("runner"):  # CUDA graphs, sampler warm-up
        runner = ModelRunner(runner_cfg, model, kv_pool, req_pool, memory_saver=saver, tp=tp, lora_pool=lora_pool)
    logger.info(
        "tandem ready: model=%s device=%s dtype=%s tp_size=%d max_total_num_tokens=%d chunked_prefill_size=%s "
        "max_running_requests=%d context_len=%d available_mem=%.2f GB %s",
        args.model_path, device, str(dtype).replace("torch.", ""), args.tp_size, memory.max_total_num_tokens,
        memory.chunked_prefill_size, memory.max_running_requests, context_len, memory.available_gb, clock.summary(),
    )
    return CoreParts(scheduler, runner, tokenizer, eos, context_len, vocab_size, memory,
                     lambda req: _make_detokenizer(tokenizer, req))


def _lora_pool(args: ServerArgs, model: Any, device: torch.device, dtype: torch.dtype) -> Optional[Any]:
    """The LoRA device pool (engine/lora/lora_pool.py), or None: LoRA off, or the torch path (the
    CPU's default; the pool there only under TRITON_INTERPRET=1, its deterministic kernels being Triton's)."""
    backend = args.lora_backend or ("triton" if device.type == "cuda" else "torch_native")
    if not args.enable_lora or backend == "torch_native":
        return None
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"lora_backend {backend!r} needs a CUDA device; use torch_native on {device.type}")
    from engine.lora.lora_config import LORA_TARGETS, expand_targets
    from engine.lora.lora_pool import LoRAPool, pool_rank

    pool = LoRAPool(model, args.max_loras_per_batch, pool_rank(args.max_lora_rank, args.lora_paths), device, dtype,
                    dense=backend != "grouped", targets=expand_targets(args.lora_target_modules) or LORA_TARGETS)
    logger.info("LoRA pool: %d slots of rank %d, %.2f GB", pool.num_slots, pool.max_rank, pool.nbytes / 2**30)
    return pool


def routes_shape(args: ServerArgs, hf_config: Any) -> Optional[tuple[int, int]]:
    """(layers, top_k) of the routes kept per KV slot with --enable-return-routed-experts (SGLang's
    shape: every hidden layer, dense ones -1); None without the flag."""
    if not args.enable_return_routed_experts:
        return None
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    if not top_k:
        raise ValueError("--enable-return-routed-experts needs a mixture-of-experts model; "
                         f"{args.model_path!r} has no num_experts_per_tok in its config")
    return int(hf_config.num_hidden_layers), int(top_k)


def _cuda_graph_max_bs(args: ServerArgs, device: torch.device, backend: BackendSpec, memory: MemoryPlan) -> int:
    """Largest decode batch captured in a CUDA graph; 0 = no graphs."""
    if device.type != "cuda" or not backend.supports_cuda_graph or args.disable_cuda_graph:
        return 0
    # H200-class memory: decode large GRPO groups (32 prompts x 16 samples) in one graph; the
    # 51 graphs to bs 512 and their activations, which 80 GB GPUs keep for the KV cache
    big = torch.cuda.get_device_properties(device).total_memory >= 120 * 2**30
    return min(args.cuda_graph_max_bs or (512 if big else 256), memory.max_running_requests)


def _scheduler_config(args: ServerArgs, memory: MemoryPlan) -> SchedulerConfig:
    return SchedulerConfig(
        max_running_requests=memory.max_running_requests,
        chunked_prefill_size=memory.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        schedule_policy=args.schedule_policy,
        schedule_conservativeness=args.schedule_conservativeness,
        enable_mixed_chunk=args.enable_mixed_chunk,
        max_loras_per_batch=args.max_loras_per_batch if args.enable_lora else None,
    )


def _load_tokenizer(args: ServerArgs) -> Any:
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(args.tokenizer_path or args.model_path)


def _eos_token_ids(model_path: str, hf_config: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (hf_config, _generation_config(model_path)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def _generation_config(model_path: str) -> Optional[Any]:
    try:
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None


def _make_detokenizer(tokenizer: Any, req: Req) -> Any:
    from engine.tokenizer import IncrementalDetokenizer

    params = req.sampling_params
    return IncrementalDetokenizer(
        tokenizer,
        prompt_ids=req.origin_input_ids,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
    )
