"""Seeds and counter-based sampling noise.

The noise for (seed, position, vocab id) is a pure function of those three integers, computed
with int64 tensor ops (no generator state), so a row's sample never depends on which other rows
share its batch, on their order, or on the device's RNG stream.
"""

from __future__ import annotations


import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_KEY_A = 0x9E3779B9  # distinct constants so the two 32-bit halves are independent streams
_KEY_B = 0x85EBCA6B


def derive_seed(base_seed: int, index: int) -> int:
    """Seed of sample `index` of an n>1 group: a 63-bit non-negative splitmix64 hash."""
    x = (base_seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def to_int64(seed: int) -> int:
    """Any 64-bit pattern as the signed int64 a tensor can hold."""
    seed &= _MASK64
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 for x < 2^32, split in 16-bit halves of c so int64 never overflows
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 avalanche hash on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent 32-bit keys per row, chaining seed-hi, seed-lo, position-hi, position-lo."""
    h = lowbias32((seeds >> 32) & _MASK32)
    h = lowbias32(h ^ (seeds & _MASK32))
    h = lowbias32(h ^ ((positions >> 32) & _MASK32))
    h = lowbias32(h ^ (positions & _MASK32))
    return lowbias32(h ^ _KEY_A), lowbias32(h ^ _KEY_B)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float64 uniforms in (0, 1) with 52 random bits; never exactly 0 or 1."""
    key_a, key_b = _row_keys(seeds.long(), positions.long())
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64).unsqueeze(0)
    a = lowbias32(key_a.unsqueeze(1) ^ vocab)
    b = lowbias32(key_b.unsqueeze(1) ^ vocab)
    bits = (a << 20) | (b >> 12)  # 52 bits: (bits + 0.5) is exact in float64
    return (bits.double() + 0.5) * (2.0**-52)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float64 standard Gumbel noise keyed by (seed, position, vocab id)."""
    u = uniform_noise(seeds, positions, vocab_size)
    return -torch.log(-torch.log(u))


def gumbel_argmax(
    logprobs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """[B] int64: argmax(logprobs + Gumbel noise), i.e. one seeded sample per row."""
    noise = gumbel_noise(seeds, positions, logprobs.shape[-1])
    return torch.argmax(logprobs.double() + noise, dim=-1)
