"""AttentionScene: sequences with fixed random q/k/v per position on a KV pool, and the
ForwardBatches that run any part of them through an attention backend. For backend tests.

Every position of a sequence has one q, k and v, so a position computed in different batches,
chunks or modes must give the same rows; the pool slots are scattered, as a real allocator's are.
Row 0 of req_to_token is left unused (CUDA-graph padding rows read it).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from engine.kv.pool import KVPool, ReqToTokenPool
from engine.forward_batch import ForwardBatch, ForwardMode

Item = tuple[int, int, int]  # (sequence, start, n): positions [start, start + n) are new


class AttentionScene:
    def __init__(self, lens: Sequence[int], heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.lens, self.heads, self.kv_heads, self.head_dim = list(lens), heads, kv_heads, head_dim
        self.device = torch.device(device)
        total = sum(lens)
        self.pool = KVPool(total + 8, 1, kv_heads, head_dim, dtype, device)
        self.r2t = ReqToTokenPool(len(lens) + 2, max(lens) + 1, device)
        perm = torch.randperm(total, generator=gen) + 1  # slot 0 is the padding slot
        self.slots, self.q, self.k, self.v, offset = [], [], [], [], 0
        rand = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
        for i, n in enumerate(lens):
            slots = perm[offset:offset + n].to(device)
            offset += n
            self.r2t.write(i + 1, 0, slots)
            self.slots.append(slots)
            self.q.append(rand(n, heads, head_dim))
            self.k.append(rand(n, kv_heads, head_dim))
            self.v.append(rand(n, kv_heads, head_dim))

    def share_prefix(self, leader: int, members: Sequence[int], length: int) -> None:
        """Sequences `members` take the leader's first `length` slots and K/V, as samples of one
        prompt do from the radix cache (their own slots for those positions go unused)."""
        for s in members:
            self.slots[s] = torch.cat([self.slots[leader][:length], self.slots[s][length:]])
            self.k[s][:length] = self.k[leader][:length]
            self.v[s][:length] = self.v[leader][:length]
            self.r2t.write(s + 1, 0, self.slots[s])

    def batch(self, backend, items: Sequence[Item], decode: bool = False) -> ForwardBatch:
        """The batch for items; the cached part [0, start) of each is written to the pool first."""
        for s, start, _ in items:
            self.pool.set_kv_buffer(0, self.slots[s][:start], self.k[s][:start], self.v[s][:start])
        dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=torch.zeros(sum(n for *_, n in items), dtype=torch.int64, device=self.device),
            positions=torch.cat([torch.arange(a, a + n, device=self.device) for _, a, n in items]),
            out_cache_loc=torch.cat([self.slots[s][a:a + n] for s, a, n in items]),
            req_pool_indices=dev([s + 1 for s, *_ in items]),
            seq_lens=dev([a + n for _, a, n in items]),
            seq_lens_cpu=[a + n for _, a, n in items],
            extend_prefix_lens_cpu=[a for _, a, _ in items],
            extend_seq_lens_cpu=[n for *_, n in items],
            req_to_token=self.r2t.req_to_token, kv_pool=self.pool, attn_backend=backend,
        )

    def run(self, backend, items: Sequence[Item], decode: bool = False) -> list[torch.Tensor]:
        """Per item, the attention output rows [n, heads, head_dim]."""
        fb = self.batch(backend, items, decode)
        backend.init_forward_metadata(fb)
        return self.forward(backend, items, fb)

    def forward(self, backend, items: Sequence[Item], fb: ForwardBatch) -> list[torch.Tensor]:
        """The layer call alone, for a batch whose metadata the caller prepared."""
        q = torch.cat([self.q[s][a:a + n] for s, a, n in items])
        k = torch.cat([self.k[s][a:a + n] for s, a, n in items])
        v = torch.cat([self.v[s][a:a + n] for s, a, n in items])
        out = backend.forward(q, k, v, 0, self.head_dim**-0.5, fb)
        return list(out.split([n for *_, n in items]))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def worst_vs_torch(scene: AttentionScene, backend, items, decode: bool = False) -> float:
    """Largest relative error of `backend` against the torch backend over the scene's items."""
    from engine.attention.torch_native import TorchNativeAttentionBackend

    got = scene.run(backend, items, decode)
    ref = scene.run(TorchNativeAttentionBackend(), items, decode)
    assert all(torch.isfinite(g).all() for g in got)
    return max(rel_err(g, r) for g, r in zip(got, ref))


class cuda_timer:
    """`with cuda_timer("label"):` prints the block's wall time, device work included."""

    def __init__(self, label: str) -> None:
        self.label = label

    def __enter__(self) -> "cuda_timer":
        torch.cuda.synchronize()
        self.t = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize()
        print(f"[{self.label}] {time.perf_counter() - self.t:.2f} s")


# The GPU backend tests' scene: Qwen3-8B attention heads, prompts that cross 256-key splits and
# chunk boundaries, then STEPS decode steps each.
STEPS = 64
PROMPTS = [300, 1100, 2100, 64, 777, 4100]
LENS = [n + STEPS for n in PROMPTS]
# (sequence, cached prefix, new tokens): cached prefixes (1, 2, 4, 5), a chunk over a prefix (2),
# one extend of a single token
MIXED = [(0, 0, 300), (1, 512, 588), (2, 700, 1400), (3, 0, 64), (4, 776, 1), (5, 4000, 100)]
PREFILL = [(s, 0, n) for s, n in enumerate(PROMPTS)]


def qwen3_8b_scene() -> AttentionScene:
    return AttentionScene(LENS, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")


def worst_mixed_then_decode(scene: AttentionScene, backend) -> tuple[float, float]:
    """-> (error on the MIXED batch, worst error over STEPS decode steps after a full PREFILL),
    both relative to the torch backend."""
    mixed = worst_vs_torch(scene, backend, MIXED)
    scene.run(backend, PREFILL)
    decode = 0.0
    for step in range(STEPS):
        items = [(s, n + step, 1) for s, n in enumerate(PROMPTS)]
        decode = max(decode, worst_vs_torch(scene, backend, items, decode=True))
    print(f"  worst decode rel err over {STEPS} steps: {decode:.2e}")
    return mixed, decode
