"""fp32 AdamW reference: the yardstick the 8-bit optimizer is tested against.

Plain, readable, one tensor at a time, same semantics as ``torch.optim.AdamW`` (decoupled weight
decay, bias correction, ``denom = sqrt(v) / sqrt(1 - beta2**t) + eps``). Parameters of any float
dtype are updated through an fp32 master copy (kept here) so a bf16 model can be compared with the
8-bit optimizer's bf16/master path. Optional ``max_grad_norm`` clips exactly like
``torch.nn.utils.clip_grad_norm_`` (grads are scaled in place) before the step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class AdamWRef(torch.optim.Optimizer):
    """Reference fp32 AdamW (optionally with ``clip_grad_norm_`` semantics) — slow and simple."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,   # torch.optim.AdamW's (0.0 until 2026-12-02: a review)
        *,
        max_grad_norm: float | None = None,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.skipped_steps = 0

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim.Optimizer API
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if self.max_grad_norm is not None:
            total = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            if not torch.isfinite(total):
                self.skipped_steps += 1
                return loss
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    if p.dtype != torch.float32:
                        state["master"] = p.detach().float().clone()
                state["step"] += 1
                t = state["step"]
                master = state.get("master", p)
                g = p.grad.float()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                master.mul_(1 - lr * wd)
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                bc1 = 1 - beta1**t
                bc2_sqrt = math.sqrt(1 - beta2**t)
                denom = (v.sqrt() / bc2_sqrt).add_(eps)
                master.addcdiv_(m, denom, value=-lr / bc1)
                if master is not p:
                    p.copy_(master)
        return loss
