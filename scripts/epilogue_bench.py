"""Time small_m_linear's fused epilogues on one CUDA GPU against the launches they replace.

At the Qwen3-0.6B / 8B o_proj and down_proj shapes, M in {1, 8}: the unfused chain
([silu_and_mul] + small_m_linear + the Triton RMSNorm with its residual add) against
small_m_linear_add_norm, and each piece alone (the plain and the gated gemv, the norm), timed as
scripts/decode_kernels_bench.py times (one CUDA graph of calls on weight copies beyond the L2).

    python scripts/epilogue_bench.py [--reps 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_kernels_bench import L2_BYTES, graph_time_us  # noqa: E402
from engine.kernels import small_m_linear as sml  # noqa: E402
from engine.kernels.batch_invariant.triton_norm import rms_norm  # noqa: E402
from engine.kernels.silu_and_mul import silu_and_mul  # noqa: E402

SHAPES = {"0.6b_o": (1024, 2048, False), "0.6b_down": (1024, 3072, True),
          "8b_o": (4096, 4096, False), "8b_down": (4096, 12288, True)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for name, (n, k, gated) in SHAPES.items():
        copies = max(4, -(-3 * L2_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, **bf) * 0.02 for _ in range(copies)]
        for m in (1, 8):
            x = torch.randn(m, 2 * k if gated else k, **bf)
            act = silu_and_mul(x, stepwise=False) if gated else x
            res, nw = torch.randn(m, n, **bf), torch.ones(n, **bf)
            y = sml.small_m_linear(act, ws[0])

            def unfused(w):
                a = silu_and_mul(x, stepwise=False) if gated else x
                return rms_norm(sml.small_m_linear(a, w), nw, 1e-6, res)

            t = {
                "unfused": graph_time_us([lambda w=w: unfused(w) for w in ws], args.reps),
                "fused": graph_time_us([lambda w=w: sml.small_m_linear_add_norm(x, w, None, res, nw, 1e-6, gated=gated)
                                        for w in ws], args.reps),
                "gemv": graph_time_us([lambda w=w: sml.small_m_linear(act, w) for w in ws], args.reps),
                "gemv_gated": graph_time_us([lambda w=w: sml.small_m_linear(x, w, gated=True) for w in ws], args.reps)
                if gated else float("nan"),
                "norm": graph_time_us([lambda: rms_norm(y, nw, 1e-6, res)] * 8, args.reps),
                "silu": graph_time_us([lambda: silu_and_mul(x, stepwise=False)] * 8, args.reps) if gated else float("nan"),
            }
            print(f"{name:>10} M={m} split {sml.choose_config(n, k).split_k}: "
                  + " | ".join(f"{key} {us:6.2f} us" for key, us in t.items()), flush=True)


if __name__ == "__main__":
    main()
