"""The sampling kernels compile for the H200 (sm_90) on a machine without a GPU.

Triton's CPU interpreter runs what the GPU compiler refuses (a jit function reading a plain module
global did: NameError at the first launch on the device, caught by the sampler's warm-up, which
then sampled eagerly). triton.compile builds PTX and a cubin for a named target with no device, so
CI catches such errors. In a subprocess: the interpreter tests set TRITON_INTERPRET=1 in this one.
"""

from __future__ import annotations

import importlib.util

import pytest

# not imported here: the interpreter tests need to be the first to import triton in this process
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from tests.kernels.sm90_subprocess import run_for_sm90  # noqa: E402

SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels import greedy_logprob, gumbel_argmax, gumbel_sample, token_bitmask
from engine.kernels.batch_invariant import triton_norm

TYPES = {"x_ptr": "*bf16", "t_ptr": "*fp32", "stats_ptr": "*fp32", "seed_ptr": "*i64", "pos_ptr": "*i64",
         "max_ptr": "*fp64", "idx_ptr": "*i32", "ids_ptr": "*i64", "original_ptr": "*fp32", "processed_ptr": "*fp32",
         "V": "i32", "stride_x": "i32", "NUM_CHUNKS": "i32"}


def signature_of(fn):
    return {name: TYPES.get(name, "constexpr") for name in fn.arg_names}

KERNELS = [
    (gumbel_argmax._chunk_kernel, {"x_ptr": "*fp32", "seed_ptr": "*i64", "pos_ptr": "*i64", "max_ptr": "*fp64",
                                   "idx_ptr": "*i32", "V": "i32", "stride_x": "i32", "NUM_CHUNKS": "i32",
                                   "CHUNK": "constexpr"}, {"CHUNK": gumbel_argmax.CHUNK}),
    (gumbel_argmax._merge_kernel, {"max_ptr": "*fp64", "idx_ptr": "*i32", "ids_ptr": "*i64", "NUM_CHUNKS": "i32",
                                   "BLOCK": "constexpr"}, {"BLOCK": 128}),
    (greedy_logprob._chunk_kernel, {"x_ptr": "*fp32", "max_ptr": "*fp32", "idx_ptr": "*i32", "sum_ptr": "*fp32",
                                    "V": "i32", "stride_x": "i32", "NUM_CHUNKS": "i32", "CHUNK": "constexpr"},
     {"CHUNK": greedy_logprob.CHUNK}),
    (greedy_logprob._merge_kernel, {"max_ptr": "*fp32", "idx_ptr": "*i32", "sum_ptr": "*fp32", "ids_ptr": "*i64",
                                    "logprob_ptr": "*fp32", "NUM_CHUNKS": "i32", "BLOCK": "constexpr"}, {"BLOCK": 64}),
    (triton_norm._greedy_log_softmax_kernel, {"x_ptr": "*fp32", "ids_ptr": "*i64", "logprob_ptr": "*fp32",
                                              "V": "i32", "stride_x": "i32", "BLOCK": "constexpr"}, {"BLOCK": 4096}),
    (token_bitmask._masked_kernel, {"x_ptr": "*fp32", "mask_ptr": "*i32", "out_ptr": "*fp32", "V": "i32",
                                    "stride_x": "i32", "stride_m": "i32", "stride_o": "i32", "BLOCK": "constexpr"},
     {"BLOCK": token_bitmask.BLOCK}),
]
KERNELS += [(fn, signature_of(fn), {"TEMPERED": tempered, **constexprs})
            for tempered in (False, True)
            for fn, constexprs in [(gumbel_sample._stats_kernel, {"BLOCK": 4096}),
                                   (gumbel_sample._chunk_kernel, {"CHUNK": gumbel_sample.CHUNK}),
                                   (gumbel_sample._merge_kernel, {"BLOCK": 128})]]
for fn, signature, constexprs in KERNELS:
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm.get("cubin"), fn.__name__
    print("compiled", fn.__name__)
"""


def test_sampling_kernels_compile_for_sm90():
    done = run_for_sm90(SCRIPT)
    assert done.stdout.count("compiled") == 12
