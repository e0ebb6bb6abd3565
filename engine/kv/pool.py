"""KV storage: KVPool (one K and one V tensor per layer, indexed by token slot) and
ReqToTokenPool (the req_to_token table mapping a request's positions to slots)."""

from __future__ import annotations

from collections import deque

import torch


class KVPool:
    """Token-slot KV storage. Slot 0 is a padding slot never handed out: padded tokens
    write there, so kernels never need a branch for them."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
        routes_shape: tuple[int, int] | None = None,
    ):
        """routes_shape: (layers, top_k) of an MoE model whose routed experts are kept per slot
        (--enable-return-routed-experts): `routed_experts` [size + 1, layers, top_k] int32, -1
        where no expert was routed (dense layers); the MoE layers write it (engine/models/moe.py)."""
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.routed_experts = (None if routes_shape is None else
                               torch.full((size + 1, *routes_shape), -1, dtype=torch.int32, device=self.device))

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        routes = 0 if self.routed_experts is None else self.routed_experts[0].numel() * 4
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem + routes

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [T, H, D] into slots loc [T], cast to the pool dtype."""
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)


class ReqToTokenPool:
    """Rows of the req_to_token table; a running request owns one row."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device):
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=self.device)
        self.generation = 0  # bumped whenever rows change hands (SharedPrefixFinder's plan key)
        self.clear()

    def clear(self) -> None:
        self._free = deque(range(self.size))
        self._is_free = [True] * self.size
        self.generation += 1
        self._written: list[tuple[int, int, int]] = []  # (row, start, end) since take_written

    def take_written(self, skip_rows: "set[int] | frozenset[int]" = frozenset()) -> torch.Tensor | None:
        """[3, n] (row, column, slot) of the entries `write` changed since the last call, with the
        slots the table holds now; rows in skip_rows left out. Device copies of the table (the
        runner's mirror, tensor-parallel ranks' tables) apply these before the next pass: a
        prefill's commit rewrites its row to the radix tree's slots (freeing its duplicates),
        and a copy left at the freed slots reads whatever reuses them."""
        ranges = [(r, a, b) for r, a, b in self._written if r not in skip_rows and b > a]
        self._written = []
        if not ranges:
            return None
        rows = torch.cat([torch.full((b - a,), r, dtype=torch.int64) for r, a, b in ranges])
        cols = torch.cat([torch.arange(a, b, dtype=torch.int64) for _, a, b in ranges])
        return torch.stack([rows, cols, self.req_to_token[rows.to(self.device), cols.to(self.device)].cpu()])

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        idx = self._free.popleft()
        self._is_free[idx] = False
        self.generation += 1
        return idx

    def free(self, idx: int) -> None:
        if not 0 <= idx < self.size:
            raise ValueError(f"req_to_token row {idx} out of range 0..{self.size - 1}")
        if self._is_free[idx]:
            raise RuntimeError(f"double free of req_to_token row {idx}")
        self._is_free[idx] = True
        self._free.append(idx)
        self.generation += 1

    def write_decode(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """One slot per request (a decode step): req_to_token[rows[i], positions[i]] = slots[i]."""
        if positions.numel() and int(positions.max()) >= self.max_context_len:
            raise ValueError(f"position {int(positions.max())} outside context of {self.max_context_len}")
        self.req_to_token[rows, positions] = slots.to(device=self.device, dtype=torch.int64)

    def write(self, idx: int, start: int, slots: torch.Tensor) -> None:
        """Write slots into row idx at positions [start, start + len(slots))."""
        end = start + slots.numel()
        if start < 0 or end > self.max_context_len:
            raise ValueError(f"positions [{start}, {end}) outside context of {self.max_context_len}")
        self.req_to_token[idx, start:end] = slots.to(device=self.device, dtype=torch.int64)
        self._written.append((idx, start, end))
