"""sglang.Engine's launch arguments that ServerArgs has no field for, as RL frameworks pass them.

verl's SGLang server builds its engine from one dict (base_gpu_id, gpu_id_step, node_rank, nnodes,
dist_init_addr, dp_size, ep_size, trust_remote_code, mm_attention_backend, skip_server_warmup,
quantization, json_model_override_args, enable_metrics, ...), SkyRL's from another. A value that
changes nothing here is dropped; one that asks for what tandem does not do is refused by name,
with what to do instead. Anything else unknown stays an error (ServerArgs.from_kwargs).
"""

from __future__ import annotations

from typing import Any

# name -> (the values that change nothing here, what to do otherwise)
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "base_gpu_id": ((0, None), "pick the GPU with CUDA_VISIBLE_DEVICES or device='cuda:N'"),
    "gpu_id_step": ((1, None), "one engine uses one GPU per tensor-parallel rank, in order"),
    "node_rank": ((0, None), "tandem's engine runs on one node"),
    "nnodes": ((1, None), "tandem's engine runs on one node"),
    "dist_init_addr": ((None, ""), "tandem's engine runs on one node"),
    "dp_size": ((1, None), "start one engine per data-parallel replica (rollout's router spreads the requests)"),
    "ep_size": ((1, None), "experts are not sharded across ranks in tandem"),
    "pp_size": ((1, None), "tandem has no pipeline parallelism; use tp_size"),
    "quantization": ((None, ""), "tandem serves bf16 / fp16 / fp32 weights"),
    "json_model_override_args": ((None, "", "{}"), "edit the checkpoint's config.json instead"),
    "speculative_algorithm": ((None, ""), "tandem has no speculative decoding"),
    "enable_draft_weights_cpu_backup": ((None, False), "tandem has no draft model"),
    "custom_weight_loader": ((None, []), "tandem loads weights itself; push them with update_weights_from_tensor"),
    "enable_prefix_caching": ((None, True), "pass disable_radix_cache=True"),
    "kv_cache_dtype": (("auto", None), "tandem's KV cache is in the model's dtype"),
    "page_size": ((1, None), "tandem's KV cache pages hold one token each"),
    "allow_auto_truncate": ((False, None), "a prompt over the context length is refused with a 400: shorten it"),
    "chat_template": ((None, ""), "tandem renders the tokenizer's chat template (tokenizer_config.json): put "
                                  "yours there, or send chat_template per request with --trust-request-chat-template"),
}
# settings with no effect on tandem's outputs: multimodal attention, tracing, logging and metrics
# (always on at /metrics), ports, timeouts and all-reduce choices of SGLang's own multi-process
# setup, remote code and hub downloads (tandem builds only the architectures it has, from a local
# folder), the start-up warm-up request, kernel and CUDA-graph choices, stream chunking, queue limits
IGNORED = ("mm_attention_backend", "enable_metrics", "nccl_port", "dist_timeout", "trust_remote_code",
           "skip_server_warmup", "sampling_backend", "enable_trace", "otlp_traces_endpoint", "enable_p2p_check",
           "disable_custom_all_reduce", "decode_log_interval", "watchdog_timeout", "log_requests",
           "log_requests_level", "file_storage_path", "download_dir", "revision", "tokenizer_mode",
           "triton_attention_num_kv_splits", "enable_torch_compile", "torch_compile_max_bs",
           "num_continuous_decode_steps", "stream_interval", "cuda_graph_bs", "max_queued_requests")
# how `tandem serve` takes them as SGLang's flags: on/off switches, lists, else one value
SWITCHES = ("trust_remote_code", "enable_metrics", "skip_server_warmup", "enable_trace", "enable_p2p_check",
            "disable_custom_all_reduce", "log_requests", "enable_torch_compile", "enable_draft_weights_cpu_backup",
            "allow_auto_truncate")
LISTS = ("cuda_graph_bs", "custom_weight_loader")
NOT_FLAGS = ("enable_prefix_caching",)  # vLLM's Engine argument, not an SGLang flag


def drop_sglang_launch_args(kwargs: dict[str, Any]) -> None:
    """Removes NEUTRAL and IGNORED arguments from `kwargs`; a NEUTRAL one set to a value that
    matters raises a ValueError naming it."""
    for name, (neutral, instead) in NEUTRAL.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if not any(value == v and type(value) is type(v) for v in neutral):
                raise ValueError(f"{name}={value!r} is not supported (an SGLang launch argument): {instead}")
    for name in IGNORED:
        kwargs.pop(name, None)
