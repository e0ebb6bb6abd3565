"""sglang.Engine's launch arguments that ServerArgs has no field for (engine/sglang_launch_args.py),
as verl's SGLang server passes them: neutral values start an engine, the rest are refused by name."""

from __future__ import annotations

import pytest

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
IDS = [5, 6, 7, 8, 9]


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
