"""torch.compile'd fused step: the CUDA path (inductor generates Triton), also runs on the CPU.

The same arithmetic as kernel_torch.py, written so that one compiled graph serves every step and
every tensor of a gradient dtype: the hyper-parameters and clip coefficients arrive as device
tensors (Python floats would be baked in and recompile every step), shapes are dynamic (one graph
for all block counts) and the tensors arrive as non-view aliases (a view's base shape was guarded
on too); a tensor's short tail block runs eagerly. Inductor fuses the dequantise, the AdamW update, the per-block absmax and the requantise
into a few kernels, so each block's parameter, gradient and states are read once and written once.
Not bit-identical to the eager kernel: the compiler may reorder or contract the float arithmetic;
tests hold it to the eager kernel within float32 rounding (and to identical codes almost
everywhere). On the CPU the C++ kernel is faster; ``AdamW8bit(backend="compile")`` forces this
path there for tests.
"""

from __future__ import annotations

import logging
import threading

import torch

from lazytrain.optim import kernel_torch, qmap
from lazytrain.optim.kernel_torch import HYPER_FIELDS, Tables, grad_coefs

_LOG = logging.getLogger(__name__)
_lock = threading.Lock()
_compiled = None


def _segment(
    w: torch.Tensor,  # fp32 [k, b], updated in place
    g: torch.Tensor,  # [k, b], fp32 or bf16
    qm: torch.Tensor,  # uint8 [k, b]
    qv: torch.Tensor,
    am: torch.Tensor,  # fp32 [k]
    av: torch.Tensor,
    hv: torch.Tensor,  # fp32 [8] in HYPER_FIELDS order
    coef: torch.Tensor,  # fp32 [2]: c1, c2 (kernel_torch.grad_coefs)
    code_s: torch.Tensor,
    code_u: torch.Tensor,
    tab_m: torch.Tensor,  # int32 [3, 32]
    tab_v: torch.Tensor,
    exp_lo_m: int,
    exp_lo_v: int,
) -> None:
    b1, b2, eps, decay, step_size, ibc2 = hv[0], hv[2], hv[4], hv[5], hv[6], hv[7]
    gf = g.float()
    m = code_s[qm.long()] * (am * b1)[:, None] + gf * coef[0]
    v = code_u[qv.long()] * (av * b2)[:, None] + (gf * gf) * coef[1]
    wi = w * decay
    denom = kernel_torch._sqrt(v) * ibc2 + eps
    w.copy_(wi - (m / denom) * step_size)
    # block maxima skipping NaN (a NaN gradient without clipping), as the C++ kernel's do: one
    # element's NaN must not turn its whole block's moments into NaN
    am_new = m.abs().nan_to_num(0.0, torch.inf).amax(dim=1)
    av_new = v.nan_to_num(0.0, torch.inf).amax(dim=1)
    qm.copy_(qmap.quantize_bits(m * kernel_torch._inv_or_zero(am_new)[:, None], *tab_m, exp_lo_m, 0, 127, True))
    qv.copy_(qmap.quantize_bits(v * kernel_torch._inv_or_zero(av_new)[:, None], *tab_v, exp_lo_v, 1, 255, False))
    am.copy_(am_new)
    av.copy_(av_new)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a tensor that is not a view: dynamo guards on a view's base too, and
    duck-sized a 64 x 64 parameter's two dims into one symbol, so every parameter shape made a
    graph of its own. (Writes through it do not bump the base's version counter: callers do.)"""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def compiled_segment():
    """The compiled ``_segment`` (compiled lazily, once per process)."""
    global _compiled
    with _lock:
        if _compiled is None:
            _compiled = torch.compile(_segment, dynamic=True, fullgraph=True)
        return _compiled


class DeviceTables:
    """The code tables and per-binade tables of both maps on one device, built once."""

    def __init__(self, tables: Tables, device: torch.device) -> None:
        self.code_s = tables.code_s.to(device)
        self.code_u = tables.code_u.to(device)
        self.tab_m = torch.stack([tables.m.shift, tables.m.half, tables.m.bias]).to(device)
        self.tab_v = torch.stack([tables.v.shift, tables.v.half, tables.v.bias]).to(device)
        self.exp_lo_m = int(tables.m.exp_lo)
        self.exp_lo_v = int(tables.v.exp_lo)


def failed() -> str | None:
    """Why compiling failed in this process (then every update runs eagerly), or None."""
    return _failed


_failed: str | None = None


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
    tables: DeviceTables,
    eager_tables: Tables,
    strict: bool = False,
) -> str | None:
    """kernel_torch.adam8bit_update_ with the full blocks through the compiled segment and the
    short tail block eagerly.

    A segment whose graph fails to compile runs eagerly instead, as do the rest of this tensor's
    (a compile error happens before the graph touches any tensor, so nothing is applied twice);
    later calls skip compiling. ``strict`` (backend="compile") returns the error instead of
    recording it, after the same eager completion, so the caller can finish the step and then
    raise: no parameter is left half-stepped. Out-of-memory errors are raised as they are.
    """
    global _failed
    device = weight.device
    hv = torch.tensor([h[k] for k in HYPER_FIELDS], dtype=torch.float32).to(device, non_blocking=True)
    coef = torch.tensor(grad_coefs(clip, h), dtype=torch.float32).to(device, non_blocking=True)
    fixed = (hv, coef, tables.code_s, tables.code_u, tables.tab_m, tables.tab_v, tables.exp_lo_m, tables.exp_lo_v)
    error = None
    for seg in kernel_torch.block_segments(weight, grad, qm, qv, am, av, block_size):
        # the full blocks [k, block_size] through the graph; a short tail block [1, n] eagerly (a
        # graph of its own per tail length class: five bf16 tensors of ordinary sizes made five
        # graphs, and fp32 plus bf16 ones hit dynamo's recompile limit of 8 mid-step)
        if error is None and (_failed is None or strict) and seg[0].shape[1] == block_size:
            try:
                compiled_segment()(*map(_alias, seg), *fixed)
                continue
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - inductor / Triton missing or failing
                error = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
                if not strict:
                    _failed = error
                    _LOG.warning("lazytrain.optim: the compiled 8-bit kernel failed (%s); using the eager one", error)
        kernel_torch._segment(*seg, h, clip, eager_tables)
    torch.autograd.graph.increment_version([weight, qm, qv, am, av])
    return error if strict else None
