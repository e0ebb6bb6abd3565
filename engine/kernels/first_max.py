"""first_max: a block's maximum and the first index holding it, with torch.argmax's rules (the
lowest index wins ties, a NaN wins over every number), as one Triton helper for the two-stage
row reductions (engine/kernels/greedy_logprob.py, gumbel_argmax.py): stage 1 over a chunk's
values and positions, stage 2 over the chunks' maxima and indices, in order."""

from __future__ import annotations

import triton
import triton.language as tl

NO_INDEX = tl.constexpr(2147483647)  # where nothing is a hit (a jit function reads globals as constexprs)


@triton.jit
def first_max(values, indices):
    """-> (max of values, NaN if any is NaN; the smallest index where it is)."""
    has_nan = tl.max((values != values).to(tl.int32), axis=0) > 0
    top = tl.max(values, axis=0)
    hit = tl.where(has_nan, values != values, values == top)
    return tl.where(has_nan, float("nan"), top), tl.min(tl.where(hit, indices, NO_INDEX), axis=0)
