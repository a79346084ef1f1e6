"""AdamW with blockwise 8-bit states, fp32 master weights for bf16 params and folded-in clipping.

Scheme: Dettmers et al. 2022 ("8-bit Optimizers via Block-wise Quantization", bitsandbytes): m and
v quantised per block of ``block_size`` elements by their absmax onto non-linear 8-bit code maps
(signed for m, unsigned for v), the update computed from the dequantised states and the new states
requantised with the new block absmax; tensors below ``min_8bit_numel`` keep fp32 states.
Deviations from bitsandbytes (details in qmap.py):
  * the code maps are base-2 "exponent maps" (same shape of precision as bitsandbytes' base-10
    dynamic map, 32/64 codes in the top binade for m/v) so quantising is integer work on float bits
    instead of a binary search; worst-case error 2**-7 / 2**-8 of absmax vs 0.0070 / 0.0035;
  * v never rounds to 0 (zero-point exclusion, Li et al. 2023), avoiding m/eps blow-ups;
  * default block 256 as bitsandbytes' blockwise optimizers: the two absmax cost 2 x 4 / 256
    bytes per parameter, total state 2.031 bytes/param (block 4096: 2.002, but a 300-step
    fine-tune then ends 1.7% off the fp32 loss, block 256 0.3%; and the kernel is no faster);
  * bf16 params get an fp32 master copy held here (bitsandbytes updates bf16 params in place).
    The master is authoritative: a bf16 param written from outside (weights restored into the
    model) is overwritten from it at the next step; restore the optimizer's state_dict with it,
    or build a new optimizer;
  * gradient clipping is folded into the fused pass as a scale on the gradient (the gradient is
    never rewritten) and non-finite global norms skip the step and are counted;
  * no stochastic rounding, no percentile clipping, no paged states.

Without ``max_grad_norm`` no norm is computed and non-finite gradients propagate, as in
``torch.optim.AdamW``; ``max_grad_norm=math.inf`` checks finiteness without clipping.

Entry points: ``step()`` (one norm pass if ``max_grad_norm`` + one fused pass), and for the
layer-streaming executor ``grad_sq_sum(params)`` per layer as its gradients land,
``clip_scale(total_sq)`` once, then ``step_params(params, clip_scale=...)`` per layer.
Kernels: C++ (csrc/adam8bit.cpp, AVX-512 when the CPU has it, built on first use) for CPU tensors;
for CUDA tensors the same arithmetic through torch.compile (kernel_compiled.py: inductor/Triton,
one graph per gradient dtype for all steps and sizes); and a bit-identical eager pure-torch fallback (kernel_torch.py)
for CPUs without a compiler and CUDA setups where compiling fails. Bit-identical means: the same
update for the same clip scale. The global norm behind that scale is summed in another order by each
(C++: fp32 sums of 16K-element chunks, FMA lanes, added in double; torch: per-tensor dot products
added in fp32), so a clipped step's scale, and then the weights, can differ in the last bit.
A NaN gradient element without ``max_grad_norm`` makes that weight NaN in every kernel (as
torch's AdamW does), and only that one: the block maxima skip NaN everywhere (until 2026-12-01
torch's propagated it, NaN-ing the whole 256-element block), and a NaN moment is stored as the
smallest code in every kernel (qmap.NAN_BIAS), as is an overflowed v's (a gradient above ~1e19,
unclipped) once its block's maximum is infinite: codes and weights stay bit-identical.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch

from lazytrain.optim import kernel_compiled, kernel_cpp, kernel_torch
from lazytrain.optim.kernel_torch import HYPER_FIELDS

STATE_FORMAT = "lazytrain-adamw8bit-v1"
GROUP_TAG = "lazytrain_adamw8bit"   # state_dict(): the format tag, in every saved param group too
SHAPE = "shape"                     # state key: the shape of the parameter the state was made for
_SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16)
PRESCALE_CLIP_BELOW = 1e-12   # clip**2 * (1 - b2) stays a normal fp32 number above it
# torch.optim.AdamW group options this optimizer does not implement; a group asking for them is
# an error rather than silently plain AdamW.
_UNSUPPORTED_GROUP_OPTIONS = ("amsgrad", "maximize", "capturable", "differentiable")
# Settings of the whole optimizer: as group keys they would be silently ignored (a group with its
# own max_grad_norm was not clipped by it), so they are refused there.
_OPTIMIZER_WIDE = ("max_grad_norm", "block_size", "min_8bit_numel", "backend")
# Attributes beyond torch's defaults/state/param_groups that a pickled or deep-copied optimizer
# needs; the per-device tables and the param -> group cache are rebuilt on demand instead.
_PICKLED_SETTINGS = ("max_grad_norm", "block_size", "min_8bit_numel", "backend", "skipped_steps")
_CACHES = ("_tables", "_compiled_tables", "_owner")


_f32 = kernel_torch.f32
MEMORY_ORDER = "memory_order"   # state key: dims of a non-contiguous parameter, largest stride first


def _check_devices(p: torch.Tensor, state: dict) -> None:
    """The gradient and every state tensor on the parameter's device: the C++ kernel reads raw
    pointers (a CUDA state read on the host crashes the process) and torch.optim.AdamW refuses
    this too (a model moved with .to() after steps leaves its optimizer state behind)."""
    where = {"grad": p.grad.device, **{k: v.device for k, v in state.items() if torch.is_tensor(v) and v.dim()}}
    off = sorted(k for k, d in where.items() if d != p.device)
    if off:
        raise RuntimeError(
            f"AdamW8bit: a parameter of shape {tuple(p.shape)} is on {p.device} but its "
            f"{', '.join(f'{k} is on {where[k]}' for k in off)}. Move the model before building the optimizer, "
            "or move the state with optimizer.load_state_dict(optimizer.state_dict()) after moving it"
        )


def _memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """Dims of `t` from the largest stride to the smallest when that order is dense (contiguous
    after the permute: channels-last weights, transposed views); None when `t` overlaps or has gaps."""
    if t.is_contiguous():
        return tuple(range(t.dim()))
    perm = tuple(sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)), reverse=True))
    return perm if t.permute(perm).is_contiguous() else None


def _once(pairs: list[tuple[torch.Tensor, dict]]) -> list[tuple[torch.Tensor, dict]]:
    """(param, group) pairs with each parameter once, first listing kept: one listed twice is
    updated and counted in the clipping norm once (torch warns, then updates it twice; the kernels
    would run both copies at once on the same buffers)."""
    first: dict[int, tuple[torch.Tensor, dict]] = {}
    for p, g in pairs:
        first.setdefault(id(p), (p, g))
    return list(first.values())


def _flat(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """`t` as one flat tensor in the memory order of `like` (default: its own): a view of the
    parameter (the kernels update its storage in place), a copy only for a gradient laid out
    differently from its parameter. The update is elementwise, so any order serves, as long as
    parameter, gradient and states agree on it."""
    if t.is_contiguous() and (like is None or like is t or like.is_contiguous()):
        return t.view(-1)   # the common case, without the permute below (it runs per tensor per step)
    ref = t if like is None else like
    perm = _memory_order(ref)
    if perm is None:
        raise ValueError(
            f"AdamW8bit: parameter of shape {tuple(ref.shape)} and strides {ref.stride()} is not "
            "dense (it overlaps or has gaps); the fused kernel updates flat storage"
        )
    x = t.permute(perm)
    return x.view(-1) if x.is_contiguous() else x.reshape(-1)


def _check_shape(p: torch.Tensor, s: dict, who: str) -> None:
    """A state made for another shape of the same size (an MLP's up [I, H] and down [H, I] after a
    change of parameter order) would be taken element for element: refused, as torch's AdamW
    refuses it at its first step (it was loaded and stepped without a word: a review). States
    saved before 2026-12-02 carry no shape and are not checked."""
    want = _saved_shape(s)
    if want is not None and want != tuple(p.shape):
        raise ValueError(f"{who}: the state was made for a parameter of shape {want}, this one is "
                         f"{tuple(p.shape)} (are the parameters in the order they were saved in?)")


def _saved_shape(s: dict) -> tuple[int, ...] | None:
    """The recorded shape (a list, or a tensor after a round trip through safetensors), or None."""
    v = s.get(SHAPE)
    return None if v is None else tuple(int(x) for x in (v.tolist() if torch.is_tensor(v) else v))


def _refuse_shared_memory(params: list[torch.Tensor]) -> None:
    """Two distinct parameters over overlapping memory (Parameter(t) twice, slices of one buffer):
    the C++ kernel updates every tensor of a step in one parallel pass, so their updates would race
    (run-to-run different weights), and each bf16 one would keep its own master. Refused by name; a
    tied weight is one Parameter, listed once or twice, and is fine. ~0.5 us a parameter (address
    ranges sorted per device: distinct allocations never overlap)."""
    spans = []
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        start = p.data_ptr()
        extent = n if p.is_contiguous() else 1 + sum((k - 1) * st for k, st in zip(p.shape, p.stride()))
        spans.append((p.get_device(), start, start + extent * p.element_size(), i))
    spans.sort()
    for (d0, _, e0, i0), (d1, s1, e1, i1) in zip(spans, spans[1:]):
        if d0 == d1 and s1 < e0:
            raise ValueError(
                f"AdamW8bit: parameters {i0} and {i1} of this step (shapes {tuple(params[i0].shape)}, "
                f"{tuple(params[i1].shape)}) share memory; the fused update would race on it. Give "
                f"each its own tensor, or tie them as one Parameter")


class AdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with blockwise 8-bit m and v.

    Args:
        params: parameters or param-group dicts (fp32 or bf16; bf16 ones get an fp32 master).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (same defaults, weight_decay 1e-2);
            per group.
        max_grad_norm: clip the global L2 norm of all gradients to this value (scale folded into the
            update pass); a non-finite norm skips the step and increments ``skipped_steps``. Pass
            ``math.inf`` to get the skip-on-non-finite check without clipping.
        block_size: elements per absmax block.
        min_8bit_numel: tensors with fewer elements keep fp32 m and v.
        backend: "auto" (CPU: the C++ kernel when it builds, else pure torch; CUDA: the
            torch.compile'd kernel, falling back to pure torch if it does not compile), "cpp",
            "torch" (eager, every device) or "compile" (compiled, every device).
        amsgrad, maximize, foreach, capturable, differentiable, fused: ``torch.optim.AdamW``'s,
            accepted so its calls run unchanged; ``foreach``/``fused`` are ignored (one fused
            kernel either way), the others must be False.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        max_grad_norm: float | None = None,
        block_size: int = 256,
        min_8bit_numel: int = 4096,
        backend: str = "auto",
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        # torch.optim.AdamW's own arguments, so a call written for it runs: its implementation
        # choices (foreach, fused) mean nothing here (one fused kernel either way); what would
        # change the update is refused by name
        for name, value in (("amsgrad", amsgrad), ("maximize", maximize), ("capturable", capturable),
                            ("differentiable", differentiable)):
            if value:
                raise TypeError(f"AdamW8bit: {name}=True is not supported (torch.optim.AdamW's "
                                f"{name}); leave it False")
        if not lr >= 0.0:
            raise ValueError(f"AdamW8bit: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW8bit: betas must be in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"AdamW8bit: eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"AdamW8bit: weight_decay must be >= 0, got {weight_decay}")
        if max_grad_norm is not None and not max_grad_norm > 0.0:
            raise ValueError(f"AdamW8bit: max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if not (isinstance(block_size, int) and block_size >= 16):
            raise ValueError(f"AdamW8bit: block_size must be an int >= 16, got {block_size!r}")
        if not (isinstance(min_8bit_numel, int) and not isinstance(min_8bit_numel, bool) and min_8bit_numel >= 0):
            raise ValueError(f"AdamW8bit: min_8bit_numel must be an int >= 0, got {min_8bit_numel!r}")
        if backend not in ("auto", "cpp", "torch", "compile"):
            raise ValueError(
                f"AdamW8bit: backend must be 'auto', 'cpp', 'torch' or 'compile', got {backend!r}"
            )
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.block_size = block_size
        self.min_8bit_numel = min_8bit_numel
        self.backend = backend
        self.skipped_steps = 0
        self._tables: dict[torch.device, kernel_torch.Tables] = {}
        self._compiled_tables: dict[torch.device, kernel_compiled.DeviceTables] = {}
        self._owner: dict[int, tuple[int, int]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """torch's keeps only defaults, state and param_groups: a deep copy or unpickled optimizer
        would lack the settings that ``step`` reads."""
        state = super().__getstate__()
        state.update((k, getattr(self, k)) for k in _PICKLED_SETTINGS)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling: caches start empty. torch's ``load_state_dict`` also calls this (with only
        state and param_groups); the settings and caches already there then stay."""
        super().__setstate__(state)
        for k in _CACHES:
            self.__dict__.setdefault(k, {})

    # ------------------------------------------------------------------ kernels
    def _cpp(self, device: torch.device) -> Any | None:
        """The C++ module when it should be used for tensors on ``device``."""
        if self.backend in ("torch", "compile") or device.type != "cpu":
            return None
        mod = kernel_cpp.load()
        if mod is None and self.backend == "cpp":
            raise RuntimeError(f"AdamW8bit(backend='cpp'): {kernel_cpp.unavailable_reason()}")
        return mod

    def _compiled_on(self, device: torch.device) -> kernel_compiled.DeviceTables | None:
        """Tables for the compiled kernel when it serves ``device`` (None: use the eager one)."""
        if not (self.backend == "compile" or (self.backend == "auto" and device.type == "cuda")):
            return None
        if device not in self._compiled_tables:
            self._compiled_tables[device] = kernel_compiled.DeviceTables(self._tables_on(device), device)
        return self._compiled_tables[device]

    def _tables_on(self, device: torch.device) -> kernel_torch.Tables:
        if device not in self._tables:
            self._tables[device] = kernel_torch.Tables.on(device)
        return self._tables[device]

    @property
    def kernel_backend(self) -> str:
        """"cpp" or "torch": what CPU tensors are updated with (builds the extension if needed)."""
        return "cpp" if self._cpp(torch.device("cpu")) is not None else "torch"

    # ------------------------------------------------------------------ clipping
    @torch.no_grad()
    def grad_sq_sum(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """fp32 0-d tensor: sum of squared gradients of ``params`` (params without grad ignored)."""
        # in each parameter's memory order, the order its update reads (a transposed view's norm
        # was summed in logical order: another rounding, so another clip scale than its
        # contiguous twin's; an equality the tests assert held on one CPU's random data only)
        grads = [_flat(p.grad, like=p) if _memory_order(p) is not None else p.grad.reshape(-1)
                 for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        devices = {g.device for g in grads}
        if len(devices) > 1:   # one sum per device (the C++ kernel reads CPU memory only)
            return sum((self._grad_sq_sum_on(d, [g for g in grads if g.device == d]).cpu()
                        for d in sorted(devices, key=str)), torch.zeros((), dtype=torch.float32))
        return self._grad_sq_sum_on(grads[0].device, grads)

    def _grad_sq_sum_on(self, device: torch.device, grads: list[torch.Tensor]) -> torch.Tensor:
        """`grad_sq_sum` of flat gradients that all live on `device`."""
        mod = self._cpp(device)
        if mod is not None and all(g.dtype in _SUPPORTED_PARAM_DTYPES for g in grads):
            return mod.grad_sq_sum([g.contiguous() for g in grads])
        return kernel_torch.grad_sq_sum(grads)

    def clip_scale(self, total_sq: torch.Tensor | float) -> float | None:
        """Clip coefficient ``min(1, max_grad_norm / (norm + 1e-6))`` for a global squared norm.

        Returns None (and counts the skip in ``skipped_steps``) when the norm is not finite; 1.0
        when ``max_grad_norm`` is None. Computed in fp32 like ``clip_grad_norm_``.
        """
        sq = torch.as_tensor(total_sq, dtype=torch.float32).detach().cpu()
        norm = torch.sqrt(sq)
        if not bool(torch.isfinite(norm)):
            self.skipped_steps += 1
            return None
        if self.max_grad_norm is None:
            return 1.0
        coef = torch.tensor(self.max_grad_norm, dtype=torch.float32) / (norm + 1e-6)
        return float(torch.clamp(coef, max=1.0))

    # ------------------------------------------------------------------ update
    def _group_of(self, p: torch.Tensor) -> dict:
        """The group of ``p`` for :meth:`step_params`, through an id -> (group index, position)
        cache that is checked on every use: param_groups may be reordered, popped or edited
        between steps (schedulers and freezing code do), and a stale index would apply another
        group's lr or fail. The check (the param really is at that position) also makes a
        recycled id harmless."""
        groups = self.param_groups
        entry = self._owner.get(id(p))
        if entry is not None:
            gi, pi = entry
            if gi < len(groups) and pi < len(groups[gi]["params"]) and groups[gi]["params"][pi] is p:
                return groups[gi]
        self._owner = {id(q): (gi, pi) for gi, g in enumerate(groups) for pi, q in enumerate(g["params"])}
        entry = self._owner.get(id(p))
        if entry is None:
            raise ValueError(
                f"AdamW8bit.step_params: a parameter of shape {tuple(p.shape)} does not belong "
                "to this optimizer"
            )
        return groups[entry[0]]

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state.get(p)
        if state:
            self._check_state(p, state)
            return state
        # Built aside and stored whole: an error half-way (a parameter with gaps) left {'step': 0},
        # and every later step of the parameter, made valid, raised KeyError: 'exp_avg'.
        state = {}
        numel = p.numel()
        state["step"] = 0
        state[SHAPE] = list(p.shape)   # (a list: what a state_dict round trip through JSON-like formats keeps)
        order = _memory_order(p)
        if order is not None and order != tuple(range(p.dim())):
            state[MEMORY_ORDER] = order   # the states' element order (see _check_layout)
        if p.dtype != torch.float32:
            state["master"] = _flat(p.detach()).float().clone()
        if numel >= self.min_8bit_numel:
            nblocks = (numel + self.block_size - 1) // self.block_size
            state["qm"] = torch.zeros(numel, dtype=torch.uint8, device=p.device)  # code 0 is 0.0
            state["qv"] = torch.zeros(numel, dtype=torch.uint8, device=p.device)
            state["absmax_m"] = torch.zeros(nblocks, dtype=torch.float32, device=p.device)
            state["absmax_v"] = torch.zeros(nblocks, dtype=torch.float32, device=p.device)
        else:
            state["exp_avg"] = torch.zeros(numel, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(numel, dtype=torch.float32, device=p.device)
        self.state[p] = state
        return state

    def _check_state(self, p: torch.Tensor, s: dict) -> None:
        """The state still fits the parameter: the kernels take its tensors as they are, so a
        parameter resized or recast since its state was made (its .data replaced) was written out
        of bounds (heap corruption), or half-updated, or stepped without its fp32 master."""
        numel = p.numel()
        if "qm" in s:
            nblocks = (numel + self.block_size - 1) // self.block_size
            sizes = dict(qm=numel, qv=numel, absmax_m=nblocks, absmax_v=nblocks)
        else:
            sizes = dict(exp_avg=numel, exp_avg_sq=numel)
        if "master" in s:
            sizes["master"] = numel
        bad = [f"{k!r} has {s[k].numel() if torch.is_tensor(s.get(k)) else 'no'} elements (needs {n})"
               for k, n in sizes.items() if not (torch.is_tensor(s.get(k)) and s[k].numel() == n)]
        if p.dtype not in _SUPPORTED_PARAM_DTYPES or (p.dtype == torch.float32) == ("master" in s):
            made = "bfloat16" if "master" in s else "float32"
            bad.append(f"it was made for a {made} parameter")
        made_for = _saved_shape(s)
        if made_for not in (None, tuple(p.shape)):
            bad.append(f"it was made for a parameter of shape {made_for}")
        if bad:
            raise ValueError(
                f"AdamW8bit: a parameter of shape {tuple(p.shape)} ({p.dtype}) no longer fits its optimizer "
                f"state: {'; '.join(bad)} (was its .data replaced?). Restore the parameter, or start its "
                "state afresh with `del optimizer.state[param]`"
            )

    @staticmethod
    def _hyper(group: dict, step: int, memo: dict | None = None) -> list[float]:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        key = (lr, beta1, beta2, group["eps"], group["weight_decay"], step)
        if memo is not None and key in memo:
            return memo[key]
        values = dict(
            b1=beta1,
            omb1=1.0 - beta1,
            b2=beta2,
            omb2=1.0 - beta2,
            eps=group["eps"],
            decay=1.0 - lr * group["weight_decay"],
            step_size=lr / (1.0 - beta1**step),
            inv_bc2_sqrt=1.0 / math.sqrt(1.0 - beta2**step),
        )
        row = [_f32(values[k]) for k in HYPER_FIELDS]
        if memo is not None:
            memo[key] = row
        return row

    @torch.compiler.disable   # eager: Dynamo recursed without end tracing the float32 rounding
    @torch.no_grad()
    def step_params(self, params: Iterable[torch.Tensor], clip_scale: float | None = 1.0) -> None:
        """Update only ``params`` (all must belong to this optimizer; those without grad are skipped).

        ``clip_scale`` multiplies every gradient inside the fused pass (from :meth:`clip_scale`);
        None means the step is skipped (non-finite norm) and nothing is touched.
        """
        self._step_pairs(_once([(p, self._group_of(p)) for p in params]), clip_scale)

    def _step_pairs(self, pairs: list[tuple[torch.Tensor, dict]], clip_scale: float | None) -> None:
        """Update each param with the settings of the group paired with it (see step_params)."""
        if clip_scale is None:
            return
        clip = float(clip_scale)
        if not math.isfinite(clip):
            raise ValueError(f"AdamW8bit.step_params: clip_scale must be finite, got {clip_scale}")
        # The kernels fold the factor into fp32 coefficients, clip * (1 - b1) and clip**2 * (1 - b2);
        # below PRESCALE_CLIP_BELOW the second would underflow (a finite norm ~1e12+ x max_grad_norm,
        # a gradient spike; fp16's 1/loss scale) and v would lose the step's gradient: then the
        # gradients are scaled by 2**-k first, in a temporary, and clip by 2**k (rare: only such
        # steps pay the extra pass). Powers of two: every product the kernel forms is the one it
        # forms without the shift, so the step is the same bit for bit (until 2026-12-01 the
        # gradients were multiplied by clip itself, which rounded differently: a review found an
        # fp16 step with 1/2**44 folded in off in the last bits).
        shift = math.ceil(math.log2(PRESCALE_CLIP_BELOW / clip)) if 0.0 < clip < PRESCALE_CLIP_BELOW else 0
        prescale = shift > 0
        _refuse_shared_memory([p for p, _ in pairs if p.grad is not None])
        work: dict[tuple[torch.device, bool], list] = defaultdict(list)
        checked: set[int] = set()
        # Everything is checked before any step count moves: an error leaves the optimizer as it
        # was (a retried step would otherwise bias-correct for a step its moments never saw).
        for p, group in pairs:   # (each parameter once: step and step_params pass them through _once)
            if p.grad is None:
                continue
            if id(group) not in checked:   # options set on a group after it was added (maximize, ...)
                self._check_group(group)
                checked.add(id(group))
            if p.grad.is_sparse:
                raise RuntimeError("AdamW8bit does not support sparse gradients; consider torch.optim.SparseAdam")
            if p.grad.shape != p.shape:
                raise ValueError(f"AdamW8bit: grad shape {tuple(p.grad.shape)} != param {tuple(p.shape)}")
            state = self._init_state(p)   # (a non-dense parameter raises a clear error here)
            self._check_layout(p, state, "AdamW8bit")
            _check_devices(p, state)
            grad = _flat(p.grad, like=p)
            if grad.dtype not in _SUPPORTED_PARAM_DTYPES or prescale:
                grad = grad.float()
            if prescale:
                grad = grad * 2.0 ** -shift   # (a new tensor: p.grad is left as it was)
            work[(p.device, "qm" in state)].append((p, grad.contiguous(), state, group))
        for items in work.values():
            for _, _, state, _ in items:
                state["step"] += 1
        errors = [self._update(device, is8bit, items, clip * 2.0 ** shift) for (device, is8bit), items in work.items()]
        errors = [e for e in errors if e]
        if errors:   # backend="compile": every parameter was stepped, the failed ones eagerly
            raise RuntimeError(f"AdamW8bit(backend='compile'): the compiled kernel failed ({errors[0]}); this "
                               "step was completed by the eager kernel (backend='auto' falls back without raising)")

    def _update(self, device: torch.device, is8bit: bool, items: list, clip: float) -> str | None:
        """One device's parameters of one kind; the compiled kernel's error under backend="compile"."""
        weights = [s["master"] if "master" in s else _flat(p) for p, _, s, _ in items]
        none = torch.empty(0)
        bf16_out = [_flat(p) if "master" in s else none for p, _, s, _ in items]
        grads = [g for _, g, _, _ in items]
        memo: dict = {}  # most parameters share their group's settings and step count
        hyper = [self._hyper(group, s["step"], memo) for _, _, s, group in items]
        mod = self._cpp(device)
        if mod is not None:
            h = torch.tensor(hyper, dtype=torch.float32).reshape(len(items), len(HYPER_FIELDS))
            if is8bit:
                t = self._tables_on(device)
                mod.adam8bit_step(
                    weights, bf16_out, grads,
                    [s["qm"] for _, _, s, _ in items], [s["qv"] for _, _, s, _ in items],
                    [s["absmax_m"] for _, _, s, _ in items], [s["absmax_v"] for _, _, s, _ in items],
                    h, clip, self.block_size, t.code_s, t.code_u,
                    t.qtab,
                    t.m.exp_lo, t.v.exp_lo, True,
                )  # fmt: skip
            else:
                mod.adam32_step(
                    weights, bf16_out, grads,
                    [s["exp_avg"] for _, _, s, _ in items], [s["exp_avg_sq"] for _, _, s, _ in items],
                    h, clip,
                )  # fmt: skip
            # The kernel wrote through data pointers: tell autograd, as an in-place op would, so a
            # backward through a graph that saved these parameters before the step raises instead
            # of silently using the new weights (the torch kernels' in-place ops do this themselves).
            torch.autograd.graph.increment_version([p for p, _, _, _ in items])
            return None
        tables = self._tables_on(device)
        compiled = self._compiled_on(device) if is8bit else None
        error = None
        for w, out, g, (_, _, s, _), hv in zip(weights, bf16_out, grads, items, hyper):
            h = dict(zip(HYPER_FIELDS, hv))
            if is8bit:
                args = (w, g, s["qm"], s["qv"], s["absmax_m"], s["absmax_v"], h, clip, self.block_size)
            if compiled is not None and error is None:
                error = kernel_compiled.adam8bit_update_(*args, compiled, tables, strict=self.backend == "compile")
            elif is8bit:
                kernel_torch.adam8bit_update_(*args, tables)
            else:
                kernel_torch.adam32_update_(w, g, s["exp_avg"], s["exp_avg_sq"], h, clip)
            if out.numel():
                out.copy_(w)
        return error

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then a check of the group as torch appended it (params normalised from a
        tensor, an iterator or (name, tensor) pairs); a rejected group is removed again, leaving
        the optimizer as it was."""
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    @staticmethod
    def _check_group(group: dict) -> None:
        for k in _UNSUPPORTED_GROUP_OPTIONS:
            if group.get(k):
                raise TypeError(f"AdamW8bit: param group option {k}={group[k]!r} is not supported")
        wide = [k for k in _OPTIMIZER_WIDE if k in group]
        if wide:
            raise TypeError(f"AdamW8bit: {', '.join(wide)} is a setting of the whole optimizer, not of a param "
                            "group (one clip norm over all parameters, one block layout); pass it to AdamW8bit(...)")
        # (values a scheduler or the user may set after construction; a beta of 1 divided by zero
        # in the bias correction)
        b1, b2 = (float(b) for b in group["betas"])
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"AdamW8bit: betas must be in [0, 1), got {group['betas']}")
        for k in ("lr", "eps", "weight_decay"):
            if not float(group[k]) >= 0.0:
                raise ValueError(f"AdamW8bit: {k} must be >= 0, got {group[k]}")
        for p in group["params"]:
            if p.dtype not in _SUPPORTED_PARAM_DTYPES:
                raise TypeError(
                    f"AdamW8bit: parameter of dtype {p.dtype} is not supported; use float32 or "
                    "bfloat16 parameters (bf16 ones get an fp32 master copy)"
                )

    @torch.compiler.disable   # eager: Dynamo recursed without end tracing the float32 rounding
    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim.Optimizer API
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pairs = _once([(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None])
        if any(p.grad.is_sparse for p, _ in pairs):   # (before the norm pass, which cannot take them)
            raise RuntimeError("AdamW8bit does not support sparse gradients; consider torch.optim.SparseAdam")
        scale: float | None = 1.0
        if self.max_grad_norm is not None:
            scale = self.clip_scale(self.grad_sq_sum(p for p, _ in pairs))
        self._step_pairs(pairs, scale)
        return loss

    # ------------------------------------------------------------------ state
    def state_bytes(self) -> int:
        """Bytes held in optimizer state (m, v, absmax, fp32 states), master weights excluded."""
        keys = ("qm", "qv", "absmax_m", "absmax_v", "exp_avg", "exp_avg_sq")
        return sum(
            t.numel() * t.element_size() for s in self.state.values() for k, t in s.items() if k in keys
        )

    def master_bytes(self) -> int:
        """Bytes of fp32 master weights held for bf16 parameters."""
        return sum(s["master"].numel() * 4 for s in self.state.values() if "master" in s)

    def state_dict(self) -> dict[str, Any]:  # noqa: D102 - torch.optim.Optimizer API
        sd = super().state_dict()
        sd["lazytrain"] = dict(
            format=STATE_FORMAT,
            skipped_steps=self.skipped_steps,
            block_size=self.block_size,
            min_8bit_numel=self.min_8bit_numel,
        )
        # The same tag in every saved group as well: torch.distributed.checkpoint's
        # get/set_optimizer_state_dict (what dcp.save/dcp.load go through) rebuild the dict from
        # 'state' and 'param_groups' alone, and the top-level tag was lost there (a review).
        sd["param_groups"] = [dict(g, **{GROUP_TAG: dict(sd["lazytrain"])}) for g in sd["param_groups"]]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore states bit-exactly (torch's default would cast uint8 codes and masters to the
        param dtype, hence this override), with torch's load_state_dict pre and post hooks run as
        torch runs them.

        A state saved for a parameter of the other dtype is adapted rather than trusted: a bf16
        parameter without a saved master gets one from its own (loaded) value, and an fp32
        parameter drops a saved master, the parameter itself being authoritative as it would be for
        ``torch.optim.AdamW``. Any other mismatch is an error naming the parameter.
        """
        state_dict = state_dict.copy()  # shallow, as torch: a pre hook may edit it in place
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            replaced = pre_hook(self, state_dict)
            if replaced is not None:
                state_dict = replaced
        extra = state_dict.get("lazytrain")
        if not extra and state_dict.get("param_groups"):   # (a dict rebuilt by DCP: see state_dict)
            extra = state_dict["param_groups"][0].get(GROUP_TAG)
        if not extra or extra.get("format") != STATE_FORMAT:
            raise ValueError("AdamW8bit.load_state_dict: not an AdamW8bit state dict (missing 'lazytrain' format tag)")
        if extra["block_size"] != self.block_size:
            raise ValueError(
                f"AdamW8bit.load_state_dict: saved block_size {extra['block_size']} != {self.block_size}; "
                "construct the optimizer with the saved block_size"
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(saved_groups, self.param_groups)
        ):
            raise ValueError("AdamW8bit.load_state_dict: parameter groups differ in number or size from the saved ones")
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(
                    ((p, self._param_name(g, gi, pi, p)) for pi, p in enumerate(g["params"]))
                    for gi, g in enumerate(self.param_groups)
                ),
            )
        )
        state: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        for pid, saved in state_dict["state"].items():
            p, name = id_map[pid]
            restored = {k: v.detach().clone().to(p.device) if torch.is_tensor(v) else v for k, v in saved.items()}
            self._fit_loaded_state(p, restored, name)
            state[p] = restored
        groups = [{k: v for k, v in dict(saved, params=cur["params"]).items() if k != GROUP_TAG}
                  for saved, cur in zip(saved_groups, self.param_groups)]
        self.__setstate__({"state": state, "param_groups": groups})
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    @staticmethod
    def _param_name(group: dict, gi: int, pi: int, p: torch.Tensor) -> str:
        """How errors name a parameter: by its name when the group has names (named_parameters)."""
        where = repr(group["param_names"][pi]) if "param_names" in group else f"{pi} of group {gi}"
        return f"parameter {where} (shape {tuple(p.shape)}, {p.dtype})"

    @staticmethod
    def _check_layout(p: torch.Tensor, s: dict, who: str) -> None:
        """States are flat in the memory order of the parameter they were made for (channels-last,
        a transposed view): with another layout the same flat index is another element, and 8-bit
        blocks cannot be permuted, so a different layout is refused, not scrambled."""
        if MEMORY_ORDER not in s and p.is_contiguous():
            return   # made for a contiguous parameter, which it still is
        want = s.get(MEMORY_ORDER, tuple(range(p.dim())))
        have = _memory_order(p)
        if have is not None and tuple(want) != have:
            raise ValueError(
                f"{who}: the optimizer state of a parameter of shape {tuple(p.shape)} was made with its "
                f"dims in memory order {tuple(want)}, the parameter now has {have}; give it the layout "
                "it had (e.g. .to(memory_format=...)) before stepping or loading"
            )

    def _fit_loaded_state(self, p: torch.Tensor, s: dict, name: str) -> None:
        """Check (and adapt across param dtypes, in place) a loaded state for ``p``: the kernels
        take its tensors as they are, so a wrong dtype or size would fail or corrupt there."""
        if not s:
            return  # never stepped; _init_state fills it
        numel, f32, u8 = p.numel(), torch.float32, torch.uint8
        nblocks = (numel + self.block_size - 1) // self.block_size
        if "qm" in s:
            expected = dict(qm=(u8, numel), qv=(u8, numel), absmax_m=(f32, nblocks), absmax_v=(f32, nblocks))
        elif "exp_avg" in s:
            expected = dict(exp_avg=(f32, numel), exp_avg_sq=(f32, numel))
        else:
            raise ValueError(f"AdamW8bit.load_state_dict: {name}: state has neither 8-bit nor fp32 moments")
        if "step" not in s:
            raise ValueError(f"AdamW8bit.load_state_dict: {name}: state has no step count")
        if p.dtype == torch.float32:
            s.pop("master", None)
        elif "master" in s:
            expected["master"] = (f32, numel)
        else:
            s["master"] = _flat(p.detach()).float().clone()
        for k, (dtype, size) in expected.items():
            t = s.get(k)
            if not (torch.is_tensor(t) and t.dtype == dtype and t.numel() == size):
                got = f"{t.dtype} with {t.numel()} elements" if torch.is_tensor(t) else repr(t)
                raise ValueError(
                    f"AdamW8bit.load_state_dict: {name}: state {k!r} is {got}, expected {dtype} "
                    f"with {size} elements"
                )
        # (after the sizes: a state of another size is that, whatever its memory order)
        self._check_layout(p, s, f"AdamW8bit.load_state_dict: {name}")
        _check_shape(p, s, f"AdamW8bit.load_state_dict: {name}")
