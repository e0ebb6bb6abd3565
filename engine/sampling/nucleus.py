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
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from engine.kernels.device_copy import h2d

if array("i").itemsize != 4:  # the int32 arrays below are C ints
    raise ImportError("engine.sampling.nucleus needs a 32-bit C int")

HEAD_COLUMNS = 1024  # ids a row sends to the host with the step's outputs; a wider set is read after


@dataclass
class KeptIds:
    """A step's kept sets on their way to the host, as its sampled ids travel (PendingResult): each
    row's first HEAD_COLUMNS ids and the counts copied behind an event, so reading them does not
    wait for the next step the overlap scheduler launched meanwhile. A row keeping more (a flat
    distribution) is read from the device at resolve, which does wait."""
    rows: list[int]  # batch rows
    ids: torch.Tensor  # [R, V] int32 on the device, most likely first, the kept ones leading
    head: torch.Tensor  # [R, min(V, HEAD_COLUMNS)] int32 on the host
    counts: torch.Tensor  # [R] int64 on the host
    event: Optional[torch.cuda.Event]

    @classmethod
    def start(cls, processed: torch.Tensor, rows: list[int]) -> "KeptIds":
        """processed [B, V] logprobs (-inf where cut): the kept ids of `rows`, finite there, by
        descending logprob (ties by id)."""
        chosen = processed.index_select(0, h2d(torch.tensor(rows), processed.device))
        ids = torch.sort(chosen, dim=-1, descending=True, stable=True).indices.to(torch.int32)
        counts = (chosen > float("-inf")).sum(dim=-1)
        head = ids[:, :HEAD_COLUMNS]
        if ids.device.type != "cuda":
            return cls(rows, ids, head, counts, None)
        host_head = torch.empty(head.shape, dtype=head.dtype, pin_memory=True)
        host_counts = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host_head.copy_(head, non_blocking=True)
        host_counts.copy_(counts, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(rows, ids, host_head, host_counts, event)

    def resolve(self) -> dict[int, array]:
        """By batch row: its kept ids as an int32 array (~4 bytes an id held, not a Python int's ~36)."""
        if self.event is not None:
            self.event.synchronize()
        sizes = self.counts.tolist()
        width = self.head.shape[1]
        head = self.head.numpy()
        wide = [i for i, n in enumerate(sizes) if n > width]
        rest = dict(zip(wide, self.ids[wide, : max(sizes[i] for i in wide)].cpu().numpy())) if wide else {}  # one copy
        return {row: array("i", (rest[i] if i in rest else head[i])[:n].tobytes())
                for i, (row, n) in enumerate(zip(self.rows, sizes))}


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
