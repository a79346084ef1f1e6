"""8-bit code maps for optimizer states and blockwise absmax quantisation, as pure functions.

Scheme: blockwise dynamic quantisation after Dettmers et al. 2022 ("8-bit Optimizers via
Block-wise Quantization", bitsandbytes): each block is divided by its absmax and every element is
rounded to one of 256 non-linearly spaced codes (signed map for m, unsigned map for v), with many
codes near the absmax and few, exponentially spaced ones near zero.

Deviation (the "exponent map"): bitsandbytes' dynamic map is base-10 (7 decades, linear inside each
decade), so quantising takes a binary search. Ours is base-2: binade d below the absmax ([2**-(d+1),
2**-d)) gets ``2**nb[d]`` linearly spaced codes, ``nb`` falling from 5 (m) / 6 (v) bits near the
absmax to 0 far below it, as in bitsandbytes' map where each decade halves the codes (top binade:
32 codes for m, 64 for v; bitsandbytes has ~35 and ~71 there). Every code is a float32 with a short
mantissa, so quantising is integer work on the float bits: pick the binade's (shift, bias) from a
32-entry table, add half a unit of the kept mantissa, shift. Rounding is to the nearest code (ties
away from zero), except below the smallest code (~1e-8 of absmax) where values under 3/4 of it
flush to 0 for m. v never rounds to 0 (zero-point exclusion, Li et al. 2023, "Memory Efficient
Optimizers with 4-bit States"): a v flushed to 0 next to a non-zero m gives an update of m/eps, a
blow-up seen in tests with gradients spread over 4 decades inside a block; v below the smallest
code (~4e-9 of absmax) is stored as that code instead, which can only shrink the update. An
all-zero block still decodes to 0 (absmax 0). The sign is bit 7 of the signed code. Max error relative to the block absmax: 2**-7 (m),
2**-8 (v); bitsandbytes: 0.0070 and 0.0035. ``bnb_dynamic_map`` rebuilds bitsandbytes' map for
comparison in tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Mantissa bits per binade below the absmax, top binade first; codes = 1 (zero) + sum(2**nb) + 1 (1.0).
SIGNED_NB = (5, 4, 4, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 1) + (0,) * 12  # 126 codes in 27 binades
UNSIGNED_NB = (6, 5, 5, 4, 4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 2) + (1,) * 13  # 254 codes in 28 binades
TABLE_SIZE = 32  # per-binade table entries (one AVX-512 two-register permute)


@dataclass(frozen=True)
class ExpMap:
    """One exponent map: the per-binade quantisation tables and the 256 code values."""

    signed: bool
    top_code: int  # magnitude index of the code 1.0 (127 signed, 255 unsigned)
    min_code: int  # smallest magnitude index produced: 0 (m), 1 (v: no zero, see module doc)
    exp_lo: int  # float32 exponent field of table entry 0 (the underflow binade)
    shift: torch.Tensor  # int32 [32]: 23 - mantissa bits kept
    half: torch.Tensor  # int32 [32]: 1 << (shift - 1), the rounding bias
    bias: torch.Tensor  # int32 [32]: code of the binade start minus (binade start bits >> shift)
    code: torch.Tensor  # float32 [256]: value of each code byte


NAN_BIAS = -8192   # see exp_map


@functools.lru_cache(maxsize=None)
def exp_map(signed: bool) -> ExpMap:
    """Build the signed (m) or unsigned (v) exponent map."""
    nb = SIGNED_NB if signed else UNSIGNED_NB
    depth = len(nb)
    top = 127 if signed else 255
    if 1 + sum(2**b for b in nb) != top:
        raise AssertionError("exponent map: code count does not fill the byte")
    exp_lo = 126 - depth  # exponent field of the underflow binade [2**-(depth+1), 2**-depth)
    shift = [23] * TABLE_SIZE
    bias = [0] * TABLE_SIZE
    values = [0.0] * (top + 1)
    # Entry 0: underflow binade, 0 mantissa bits, base code 0 (rounds up to the smallest code).
    bias[0] = 0 - ((exp_lo << 23) >> 23)
    base = 1
    for t in range(1, depth + 1):  # t = depth - d, d = binade index below the absmax
        d = depth - t
        bits = nb[d]
        e_field = 126 - d
        shift[t] = 23 - bits
        bias[t] = base - ((e_field << 23) >> shift[t])
        for j in range(2**bits):
            values[base + j] = 2.0 ** (e_field - 127) * (1 + j / 2**bits)
        base += 2**bits
    assert base == top
    values[top] = 1.0
    shift[depth + 1] = 23
    bias[depth + 1] = top - ((127 << 23) >> 23)
    # Exponents above 1's binade: no normalised finite value reaches them (the block maxima skip NaN,
    # so |x| <= absmax), only NaN (and inf): they give the smallest code (0 for m, 1 for v; its sign
    # kept for m), in every kernel, so a NaN moment (a NaN gradient, unclipped, or an overflowed v)
    # is stored as ~0 the same way everywhere and does not inflate its block's next maximum.
    # (-8192: the VBMI kernel's 16-bit bias offset, csrc kOff, takes no lower one.)
    for t in range(depth + 2, TABLE_SIZE):
        shift[t], bias[t] = 23, NAN_BIAS
    code = torch.zeros(256, dtype=torch.float32)
    mags = torch.tensor(values, dtype=torch.float32)
    code[: top + 1] = mags
    if signed:
        code[128:] = -mags
    shift_t = torch.tensor(shift, dtype=torch.int32)
    return ExpMap(
        signed=signed,
        top_code=top,
        min_code=0 if signed else 1,
        exp_lo=exp_lo,
        shift=shift_t,
        half=(torch.ones(TABLE_SIZE, dtype=torch.int32) << (shift_t - 1)),
        bias=torch.tensor(bias, dtype=torch.int32),
        code=code,
    )


def quantize_normalized(x: torch.Tensor, emap: ExpMap) -> torch.Tensor:
    """Code byte (uint8) of each float32 element of ``x`` (already divided by its block absmax).

    Integer arithmetic on the float bits, the same steps as the C++ kernel (bit-identical).
    """
    shift, half, bias = (tab.to(x.device) for tab in (emap.shift, emap.half, emap.bias))
    return quantize_bits(x, shift, half, bias, emap.exp_lo, emap.min_code, emap.top_code, emap.signed)


def quantize_bits(x: torch.Tensor, shift: torch.Tensor, half: torch.Tensor, bias: torch.Tensor,
                  exp_lo: int, min_code: int, top_code: int, signed: bool) -> torch.Tensor:
    """`quantize_normalized` with the map's tables given as tensors on ``x``'s device (the form the
    compiled kernel traces)."""
    bits = x.contiguous().view(torch.int32)
    mag = bits & 0x7FFFFFFF
    t = ((mag >> 23) - exp_lo).clamp(0, TABLE_SIZE - 1).long()
    k = ((mag + half[t]) >> shift[t]) + bias[t]
    k = k.clamp(min_code, top_code)
    if signed:
        k = k | ((bits >> 24) & 0x80)
    return k.to(torch.uint8)


def quantize_blockwise(
    x: torch.Tensor, emap: ExpMap, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ``x``, scale each block by 1/absmax and round to the map's codes.

    Returns ``(codes uint8 [numel], absmax float32 [ceil(numel / block_size)])``; an all-zero block
    gets absmax 0.
    """
    flat = x.detach().reshape(-1).float()
    numel = flat.numel()
    nblocks = (numel + block_size - 1) // block_size
    padded = torch.zeros(nblocks * block_size, dtype=torch.float32, device=flat.device)
    padded[:numel] = flat
    blocks = padded.view(nblocks, block_size)
    absmax = blocks.abs().amax(dim=1)
    inv = 1.0 / absmax
    inv = torch.where((absmax > 0) & torch.isfinite(inv), inv, torch.zeros_like(absmax))
    q = quantize_normalized(blocks * inv[:, None], emap)
    return q.reshape(-1)[:numel].clone(), absmax


def dequantize_blockwise(
    q: torch.Tensor, absmax: torch.Tensor, emap: ExpMap, block_size: int
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: float32 [numel]."""
    scale = absmax.repeat_interleave(block_size)[: q.numel()]
    return emap.code.to(q.device)[q.long()] * scale


def bnb_dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed, 7, 8)`` (sorted float32 [256]), for comparison."""
    data: list[float] = []
    for i in range(7):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        boundaries = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)
