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
from typing import Sequence

import torch

if array("i").itemsize != 4:  # the int32 arrays above are C ints
    raise ImportError("engine.sampling.nucleus needs a 32-bit C int")


def kept_ids(processed: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """processed [B, V] logprobs (-inf where cut), rows [R] int64 on its device -> ([R, V] int32 ids
    by descending logprob, the kept first; [R] how many are kept). Stays on the device."""
    chosen = processed.index_select(0, rows)
    order = torch.sort(chosen, dim=-1, descending=True, stable=True).indices
    return order.to(torch.int32), (chosen > float("-inf")).sum(dim=-1)


def kept_lists(ids: torch.Tensor, counts: torch.Tensor) -> list[array]:
    """kept_ids' result on the host: each row's kept ids as int32 arrays (~4 bytes an id held,
    not a Python int's ~36); only the kept entries cross and become Python objects."""
    sizes = counts.tolist()
    width = max(sizes, default=0)
    head = ids[:, :width]
    kept = head[torch.arange(width, device=ids.device) < counts.unsqueeze(1)]  # row-major: row 0's, row 1's...
    flat = array("i", kept.cpu().numpy().tobytes())
    out, start = [], 0
    for n in sizes:
        out.append(flat[start:start + n])
        start += n
    return out


def encode_int32(values: Sequence[int]) -> str:
    """base64 of int32s in this host's byte order (little-endian on every platform torch runs on),
    as slime decodes them (torch.frombuffer(..., dtype=torch.int32))."""
    packed = values if isinstance(values, array) else array("i", values)
    return base64.b64encode(packed.tobytes()).decode("ascii")


def nucleus_fields(per_token: Sequence[Sequence[int]]) -> dict[str, str]:
    """meta_info's top_p_token_ids / top_p_token_offsets of a finished request."""
    flat = array("i")
    offsets = [0]
    for ids in per_token:
        flat.extend(ids)
        offsets.append(len(flat))
    return {"top_p_token_ids": encode_int32(flat), "top_p_token_offsets": encode_int32(offsets)}


def replay_rows(reqs: Sequence) -> list[int]:
    """The batch rows whose requests asked for their kept ids (custom_params read first: it is None
    for nearly every request, so a batch without replay pays one attribute read a row)."""
    return [i for i, r in enumerate(reqs) if r.sampling_params.custom_params and r.sampling_params.return_top_p_token_ids]
