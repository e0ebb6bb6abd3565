"""The BackendSpec registry is the one list of attention backends, and each spec tells the truth
about its class: CUDA-graph hooks, deterministic mode, start-up checks, the trainer's twin."""

import dataclasses

import pytest
import torch

from engine import config
from engine.attention.base import AttentionBackend
from engine.attention.registry import (BACKENDS, BackendSpec, create_attention_backend, default_backend,
                                       deterministic_backends, get_backend_spec)
from engine.config import ServerArgs
from engine.core import setup
from trainer_bridge import packed_attention

GRAPH_HOOKS = ("init_cuda_graph_state", "init_forward_metadata_capture", "init_forward_metadata_replay")


def test_config_choices_come_from_the_registry():
    assert config.ATTENTION_BACKENDS == ("torch", "triton", "flashinfer") == tuple(s.name for s in BACKENDS)
    with pytest.raises(ValueError, match="attention_backend must be one of torch, triton, flashinfer; got 'nope'"):
        ServerArgs(model_path="m", attention_backend="nope")


@pytest.mark.parametrize("spec", BACKENDS, ids=lambda s: s.name)
def test_the_spec_matches_its_class(spec):
    cls = spec.load()
    assert issubclass(cls, AttentionBackend)
    overridden = {hook: getattr(cls, hook) is not getattr(AttentionBackend, hook) for hook in GRAPH_HOOKS}
    assert overridden == {hook: spec.supports_cuda_graph for hook in GRAPH_HOOKS}
    if spec.supports_deterministic:
        assert create_attention_backend(spec.name, deterministic=True).deterministic is True
        ServerArgs(model_path="m", attention_backend=spec.name, enable_deterministic_inference=True)
    else:
        with pytest.raises(ValueError, match="no deterministic mode"):
            create_attention_backend(spec.name, deterministic=True)
        with pytest.raises(ValueError, match=f"'{spec.name}' has no deterministic mode: deterministic "
                                             "inference needs the torch or triton backend"):
            ServerArgs(model_path="m", attention_backend=spec.name, enable_deterministic_inference=True)


def test_a_backend_without_graph_support_says_so():
    backend = create_attention_backend("torch")
    with pytest.raises(NotImplementedError, match="TorchNativeAttentionBackend does not support CUDA graphs"):
        backend.init_cuda_graph_state(1, 8, 2, 1, 16, torch.device("cpu"))


def test_graphs_follow_the_spec():
    args = ServerArgs(model_path="m")
    no_graphs = dataclasses.replace(get_backend_spec("triton"), supports_cuda_graph=False)
    # decided before any CUDA call or memory plan (None: never read): no graphs for a spec
    # without them, nor off the GPU
    assert setup._cuda_graph_max_bs(args, torch.device("cuda"), no_graphs, None) == 0
    assert setup._cuda_graph_max_bs(args, torch.device("cpu"), get_backend_spec("triton"), None) == 0


def test_start_up_checks_name_the_problem():
    flashinfer = get_backend_spec("flashinfer")
    flashinfer.check_model("bfloat16", 128, "cuda")
    with pytest.raises(ValueError, match="'flashinfer' supports float16 and bfloat16 only, got float32"):
        flashinfer.check_model("float32", 128, "cuda")
    with pytest.raises(ValueError, match="supports head_dim 64, 128, 256, this model has 16: use "
                                         "--attention-backend torch or triton"):
        flashinfer.check_model("bfloat16", 16, "cuda")
    with pytest.raises(ValueError, match="'flashinfer' runs on cuda, not cpu"):
        flashinfer.check_model("bfloat16", 128, "cpu")
    get_backend_spec("torch").check_model("float32", 16, "cpu")


def test_defaults_and_loaders():
    assert default_backend("cuda") == "triton" and default_backend("cpu") == "torch"
    assert deterministic_backends() == ("torch", "triton")
    spec = BackendSpec("mine", lambda: type("Mine", (AttentionBackend,), {"forward": lambda *a: None}),
                       supports_cuda_graph=False, supports_deterministic=False)
    assert spec.load().__name__ == "Mine"


def test_every_deterministic_backend_has_a_trainer_twin():
    """PackedAttention must reproduce each deterministic backend's bits: a new one needs a packed
    forward in trainer_bridge/packed_attention.py."""
    assert set(packed_attention.KERNELS) == set(deterministic_backends()) == set(packed_attention.PACKED_FORWARDS)
    assert packed_attention.default_split_size("torch") == 64
    assert packed_attention.default_split_size("triton") == 256
    assert packed_attention.PackedAttention().kernel(torch.device("cpu")) == "torch"
