"""Shared-prefix (cascade) decode: the rows of a decode batch whose cached prompt is the same KV.

GRPO samples n completions of each prompt, and with the radix cache their prompt's K/V are the
same pool slots. Plain decode attention streams every row's whole context from HBM: at the 8B
shape, 1024-token prompts and bs 512 that is ~87 GB a step against 16 GB of weights. Grouping the
rows that share a prefix lets one program read the prefix's K/V once for up to a tile of rows
(phase A, engine/kernels/shared_prefix_attention.py); each row then attends its own suffix
(phase B, the split-KV kernel from the prefix's end), the two partials merged by log-sum-exp.

Normal mode only: the merge point moves a row's rounding with the batch it is in, which
deterministic mode forbids (DESIGN section 4). Host code only (the scheduler's req_to_token copy);
the backend turns a plan into device tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

MIN_SHARED_LEN = 64  # a shorter shared prefix is not worth a second pass per layer
MIN_SAVED_KEYS = 4096  # keys per layer phase A must spare the batch before a plan is made


@dataclass
class SharedPrefixPlan:
    """Groups of batch rows with a common prefix: group i's members are rows[starts[i] :
    starts[i] + sizes[i]] and share keys [0, lens[i]). prefix_lens[r] is row r's shared length
    (0: the row attends all of its keys itself)."""

    batch_size: int
    rows: list[int]
    starts: list[int]
    sizes: list[int]
    lens: list[int]
    _tables: dict = field(default_factory=dict)  # packed host tables per (max members, max blocks)

    @property
    def prefix_lens(self) -> list[int]:
        out = [0] * self.batch_size
        for start, size, length in zip(self.starts, self.sizes, self.lens):
            for row in self.rows[start:start + size]:
                out[row] = length
        return out

    def blocks(self, max_members: int) -> list[tuple[int, int, int, int]]:
        """Phase A's work units: (first index into rows, members, a member's batch row, shared
        length); a group wider than max_members is cut into near-equal blocks."""
        out = []
        for start, size, length in zip(self.starts, self.sizes, self.lens):
            pieces = -(-size // max_members)
            for i in range(pieces):
                a, b = start + size * i // pieces, start + size * (i + 1) // pieces
                out.append((a, b - a, self.rows[a], length))
        return out

    def packed(self, max_members: int, pad_to: Optional[int] = None) -> torch.Tensor:
        """int32 host tensor [n + 4 * nb + n]: prefix_lens, the block table (4 rows of nb
        columns) and rows, n = bs. pad_to (a CUDA graph's size): n = nb = pad_to, padding rows
        share nothing, unused blocks have 0 members. One copy to the device carries the plan."""
        key = (max_members, pad_to)
        if key not in self._tables:  # a plan lives while its batch does: built once
            self._tables[key] = self._packed(max_members, pad_to)
        return self._tables[key]

    def _packed(self, max_members: int, pad_to: Optional[int]) -> torch.Tensor:
        blocks = self.blocks(max_members)
        n = self.batch_size if pad_to is None else pad_to
        nb = len(blocks) if pad_to is None else pad_to
        if len(blocks) > nb or self.batch_size > n:
            raise ValueError(f"a shared-prefix plan of {self.batch_size} rows, {len(blocks)} blocks "
                             f"does not fit {n} rows")
        table = torch.zeros((4, nb), dtype=torch.int32)
        if blocks:
            table[:, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32).T
        lens = torch.zeros(n, dtype=torch.int32)
        lens[:self.batch_size] = torch.tensor(self.prefix_lens, dtype=torch.int32)
        rows = torch.zeros(n, dtype=torch.int32)
        rows[:len(self.rows)] = torch.tensor(self.rows, dtype=torch.int32)
        return torch.cat([lens, table.flatten(), rows])


class SharedPrefixFinder:
    """Finds a decode batch's shared prefixes from the host slot table. Rows whose first slot is
    the same are candidates; a group's shared length is the longest common prefix of their slot
    rows, below every member's current position. The last plan is kept while the batch holds the
    same requests in the same rows, and no row changed hands since (`generation`, the table's
    count of row allocations and frees): a retracted request comes back with other slots."""

    def __init__(self, min_shared_len: int = MIN_SHARED_LEN, min_saved_keys: int = MIN_SAVED_KEYS) -> None:
        self.min_shared_len = min_shared_len
        self.min_saved_keys = min_saved_keys
        self._last_reqs: list = []
        self._last_key: tuple = ()
        self._last_plan: Optional[SharedPrefixPlan] = None

    def find(self, reqs: Sequence, req_to_token: torch.Tensor, req_pool_indices: Sequence[int],
             seq_lens: Sequence[int], generation: int = 0) -> Optional[SharedPrefixPlan]:
        key = (generation, tuple(req_pool_indices))
        if (key == self._last_key and len(reqs) == len(self._last_reqs)
                and all(a is b for a, b in zip(reqs, self._last_reqs))):
            return self._last_plan
        self._last_reqs, self._last_key = list(reqs), key
        self._last_plan = shared_prefix_plan(req_to_token, req_pool_indices, seq_lens,
                                             self.min_shared_len, self.min_saved_keys)
        return self._last_plan


def shared_prefix_plan(req_to_token: torch.Tensor, req_pool_indices: Sequence[int], seq_lens: Sequence[int],
                       min_shared_len: int = MIN_SHARED_LEN,
                       min_saved_keys: int = MIN_SAVED_KEYS) -> Optional[SharedPrefixPlan]:
    """The plan for one decode batch, or None when sharing would spare fewer than min_saved_keys
    key reads per layer. req_to_token: the host slot table; row r of the batch is table row
    req_pool_indices[r] with seq_lens[r] keys (its last one the token being decoded)."""
    bs = len(seq_lens)
    if bs < 2:
        return None
    idx = torch.tensor(list(req_pool_indices), dtype=torch.int64)
    lens = torch.tensor(list(seq_lens), dtype=torch.int64)
    candidates: dict[int, list[int]] = {}
    for row, (slot, n) in enumerate(zip(req_to_token[idx, 0].tolist(), seq_lens)):
        if n > min_shared_len:  # the decoded token is never shared: n - 1 keys at most
            candidates.setdefault(slot, []).append(row)
    groups: list[tuple[list[int], int]] = []
    for members in candidates.values():
        if len(members) > 1:
            _split(req_to_token, idx, lens, members, min_shared_len, groups)
    saved = sum((len(m) - 1) * length for m, length in groups)
    if saved < min_saved_keys:
        return None
    rows, starts, sizes, shared = [], [], [], []
    for members, length in groups:
        starts.append(len(rows))
        rows.extend(members)
        sizes.append(len(members))
        shared.append(length)
    return SharedPrefixPlan(bs, rows, starts, sizes, shared)


def _split(req_to_token: torch.Tensor, idx: torch.Tensor, lens: torch.Tensor, members: list[int],
           min_shared_len: int, out: list[tuple[list[int], int]]) -> None:
    """Appends (rows, shared length) groups of `members` (rows whose slot rows start alike), as a
    radix tree would: rows that go on sharing past the first column where the group differs form
    their own groups (GRPO's n samples of each prompt behind one chat template), rows left alone
    there share the group's common prefix with each other."""
    member_t = torch.tensor(members)
    width = int(lens[member_t].min()) - 1  # every member's own decoded token excluded
    table = req_to_token[idx[member_t], :width]
    differs = (table != table[0]).any(0)
    length = int(differs.int().argmax()) if bool(differs.any()) else width
    if length < width:  # split where the rows part ways
        parts: dict[int, list[int]] = {}
        for row, slot in zip(members, table[:, length].tolist()):
            parts.setdefault(slot, []).append(row)
        alone = [p[0] for p in parts.values() if len(p) == 1]
        for part in parts.values():
            if len(part) > 1:
                _split(req_to_token, idx, lens, part, min_shared_len, out)
        members = alone
    if len(members) > 1 and length >= min_shared_len:
        out.append((members, length))
