"""Pure-torch fused step: the fallback (and the CUDA path) with the C++ kernel's exact arithmetic.

Vectorised over whole blocks (views ``[num_blocks, block_size]`` plus the tail block), one eager
torch op per line. Every product and sum is a separate op (no FMA, no ``alpha=``), in the same order
as csrc/adam8bit.cpp, so both give bit-identical weights, codes and absmax on the CPU.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from lazytrain.optim import qmap

HYPER_FIELDS = ("b1", "omb1", "b2", "omb2", "eps", "decay", "step_size", "inv_bc2_sqrt")


@dataclass(frozen=True)
class Tables:
    """The two exponent maps with their tables on one device."""

    m: qmap.ExpMap
    v: qmap.ExpMap
    code_s: torch.Tensor
    code_u: torch.Tensor
    qtab: torch.Tensor   # int32 [6, 32]: shift, half, bias of m then of v (the C++ kernel's table)

    @staticmethod
    def on(device: torch.device | str) -> "Tables":
        ms, mu = qmap.exp_map(True), qmap.exp_map(False)
        qtab = torch.stack([ms.shift, ms.half, ms.bias, mu.shift, mu.half, mu.bias]).contiguous()
        return Tables(ms, mu, ms.code.to(device), mu.code.to(device), qtab)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    # torch.sqrt on float32 CPU tensors is not correctly rounded in this build (~15% of results are
    # 1 ulp off); sqrt in float64 rounded to float32 is (double rounding is innocuous for sqrt).
    return torch.sqrt(x.double()).float()


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 (the kernels then use the same constant)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def grad_coefs(clip: float, h: dict[str, float]) -> tuple[float, float]:
    """float32 ``clip * (1 - b1)`` and ``clip * clip * (1 - b2)``, rounded as the C++ kernel does."""
    c = f32(clip)
    return f32(c * h["omb1"]), f32(f32(c * c) * h["omb2"])


def _inv_or_zero(absmax: torch.Tensor) -> torch.Tensor:
    """1 / absmax per block; 0 for an all-zero block and where the reciprocal overflows (absmax a
    denormal below 1 / FLT_MAX): inf would make the block's zeros NaN (0 * inf). As the C++ kernel."""
    inv = 1.0 / absmax
    return torch.where((absmax > 0) & torch.isfinite(inv), inv, torch.zeros_like(absmax))


def _segment(
    w: torch.Tensor,  # fp32 [k, b] weights (master or the param), updated in place
    g: torch.Tensor,  # [k, b] grad, fp32 or bf16
    qm: torch.Tensor,  # uint8 [k, b]
    qv: torch.Tensor,
    am: torch.Tensor,  # fp32 [k]
    av: torch.Tensor,
    h: dict[str, float],
    clip: float,
    t: Tables,
) -> None:
    # Constants folded per tensor (clip into the gradient coefficients) and per block (absmax into
    # the decay): three fewer products per element than the textbook order.
    c1, c2 = grad_coefs(clip, h)
    gf = g.float()
    m = t.code_s[qm.long()] * (am * h["b1"])[:, None] + gf * c1
    v = t.code_u[qv.long()] * (av * h["b2"])[:, None] + (gf * gf) * c2
    wi = w * h["decay"]
    denom = _sqrt(v) * h["inv_bc2_sqrt"] + h["eps"]
    w.copy_(wi - (m / denom) * h["step_size"])
    # block maxima skipping NaN (a NaN gradient without clipping), as the C++ kernel's do: one
    # element's NaN must not turn its whole block's moments into NaN
    am_new = m.abs().nan_to_num(0.0, torch.inf).amax(dim=1)
    av_new = v.nan_to_num(0.0, torch.inf).amax(dim=1)
    qm.copy_(qmap.quantize_normalized(m * _inv_or_zero(am_new)[:, None], t.m))
    qv.copy_(qmap.quantize_normalized(v * _inv_or_zero(av_new)[:, None], t.v))
    am.copy_(am_new)
    av.copy_(av_new)


def block_segments(weight, grad, qm, qv, am, av, block_size: int):
    """The full blocks as ``[k, block_size]`` views, then the short tail block as ``[1, n]``, each
    as (weight, grad, qm, qv, am, av). A generator: each segment's views are made only when it is
    reached (the compiled kernel needs views made after the previous segment's in-place update)."""
    numel = weight.numel()
    full = numel // block_size
    cut = full * block_size
    if full:
        yield (weight[:cut].view(full, block_size), grad[:cut].view(full, block_size),
               qm[:cut].view(full, block_size), qv[:cut].view(full, block_size), am[:full], av[:full])
    if cut < numel:
        yield (weight[cut:].view(1, -1), grad[cut:].view(1, -1), qm[cut:].view(1, -1),
               qv[cut:].view(1, -1), am[full:], av[full:])


def adam8bit_update_(
    weight: torch.Tensor,
    grad: torch.Tensor,
    qm: torch.Tensor,
    qv: torch.Tensor,
    am: torch.Tensor,
    av: torch.Tensor,
    h: dict[str, float],
    clip: float,
    block_size: int,
    tables: Tables,
) -> None:
    """Update one flat fp32 ``weight`` and its 8-bit states in place (all 1-D, same numel)."""
    for seg in block_segments(weight, grad, qm, qv, am, av, block_size):
        _segment(*seg, h, clip, tables)


def adam32_update_(
    weight: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    h: dict[str, float],
    clip: float,
) -> None:
    """fp32-state AdamW for small tensors, same arithmetic as the 8-bit path."""
    gi = grad.float() * clip
    m.copy_(m * h["b1"] + gi * h["omb1"])
    v.copy_(v * h["b2"] + (gi * gi) * h["omb2"])
    wi = weight * h["decay"]
    denom = _sqrt(v) * h["inv_bc2_sqrt"] + h["eps"]
    weight.copy_(wi - (m / denom) * h["step_size"])


def grad_sq_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    """fp32 0-d sum of squares of all ``grads`` (accumulated per tensor in fp32)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    if grads[0].device.type == "cuda":   # a few multi-tensor kernels instead of 2-3 launches per tensor
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        return torch.linalg.vector_norm(torch.stack(norms)).square()
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for g in grads:
        gf = g.float()
        total = total + torch.dot(gf.reshape(-1), gf.reshape(-1))
    return total
