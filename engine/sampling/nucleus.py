"""The kept set of each sampled token (its "nucleus"), for slime's top-p replay.

slime rolls out with top_p < 1 and trains on the same truncated distribution: each request sets
`custom_params.return_top_p_token_ids` and reads back, once it finishes, every output token's
kept ids (`meta_info.top_p_token_ids`, flattened) and where each token's run starts
(`top_p_token_offsets`, one more than the tokens), both base64 int32 (its SGLang patch's format).
The kept ids are those the sampler could draw: finite in the processed distribution (top-k, top-p,
min-p, a grammar's mask, bans), most likely first (ties by id). A greedy row keeps its token.
"""

from __future__ import annotations

import base64
from array import array

import torch


def kept_ids(processed: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """processed [B, V] logprobs (-inf where cut), rows [R] int64 on its device -> ([R, V] int32 ids
    by descending logprob, the kept first; [R] how many are kept). Stays on the device."""
    chosen = processed.index_select(0, rows)
    order = torch.sort(chosen, dim=-1, descending=True, stable=True).indices
    return order.to(torch.int32), (chosen > float("-inf")).sum(dim=-1)


def kept_lists(ids: torch.Tensor, counts: torch.Tensor) -> list[list[int]]:
    """kept_ids' result on the host: each row's kept ids (one copy as wide as the widest row)."""
    sizes = counts.tolist()
    width = max(sizes, default=0)
    rows = ids[:, :width].tolist()
    return [row[:n] for row, n in zip(rows, sizes)]


def encode_int32(values: list[int]) -> str:
    """base64 of little-endian int32s, as slime decodes them (torch.frombuffer(..., torch.int32))."""
    packed = array("i", values)
    if packed.itemsize != 4:
        raise RuntimeError("this platform's C int is not 32 bits")
    return base64.b64encode(packed.tobytes()).decode("ascii")


def nucleus_fields(per_token: list[list[int]]) -> dict[str, str]:
    """meta_info's top_p_token_ids / top_p_token_offsets of a finished request."""
    flat: list[int] = []
    offsets = [0]
    for ids in per_token:
        flat.extend(ids)
        offsets.append(len(flat))
    return {"top_p_token_ids": encode_int32(flat), "top_p_token_offsets": encode_int32(offsets)}
