"""Optimizer-step benchmark on the CPU: lazytrain AdamW8bit against fp32 and 8-bit peers.

    .venv/bin/python scripts/bench_optim.py            # ~51M params, 11 rounds (several minutes)
    .venv/bin/python scripts/bench_optim.py --quick    # ~13M params, 3 rounds (smoke run)

Every optimizer updates its own copy of the same fp32 parameters (Llama-like shapes: fused qkv,
o, gate, up, down matrices and RMSNorm weights per layer) with the same gradients. Rounds are
interleaved (one step of each variant per round, each round starting one variant later) so
machine-load drift and a variant's neighbours hit all alike, and before
every timed step (untimed) each variant's gradients are restored to the originals; the table
shows the median step time per variant, with clipping (``clip_grad_norm_`` before the step, or
lazytrain's folded-in ``max_grad_norm``) and without. Peers: torch AdamW(fused=True), bitsandbytes
AdamW8bit, torchao AdamW8bit, DeepSpeedCPUAdam (adamw_mode=True); a peer that fails to import or
build is listed as unavailable with its reason. State bytes/param counts optimizer states only
(m, v and their scales), not parameters or gradients. The table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lazytrain.optim import AdamW8bit  # noqa: E402
from lazytrain.optim import kernel_cpp  # noqa: E402

LR = 1e-3
WD = 0.01   # weight decay, the same for every optimizer (DeepSpeedCPUAdam's default is 0, the others' 0.01)
MAX_GRAD_NORM = 1.0
HIDDEN = 1024
INTERMEDIATE = 2816


def layer_shapes(hidden: int = HIDDEN, inter: int = INTERMEDIATE) -> list[tuple[int, ...]]:
    """One Llama-like decoder layer: fused qkv, o, gate, up, down, two RMSNorm weights."""
    return [(3 * hidden, hidden), (hidden, hidden), (inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]


@dataclass
class Variant:
    name: str
    clip: bool
    step: Callable[[], None] | None = None
    reset: Callable[[], None] | None = None  # untimed: restore the original gradients
    state_bytes: Callable[[], int] | None = None
    times_s: list[float] = field(default_factory=list)
    error: str | None = None


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor, looking inside tensor subclasses (torchao's quantised states)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for s in opt.state.values():
        for k, v in s.items():
            if torch.is_tensor(v) and k != "step" and v.numel() > 1:
                total += tensor_bytes(v)
    return total


def make_params(shapes: list[tuple[int, ...]], seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for i, s in enumerate(shapes):
        p = torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
        p.grad = torch.randn(s, generator=g) * (1e-3 * (1 + i % 5))
        params.append(p)
    return params


def build_variants(shapes: list[tuple[int, ...]]) -> list[Variant]:
    variants: list[Variant] = []

    def add(name: str, factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], clip: str) -> None:
        """clip: 'none' | 'torch' (clip_grad_norm_ then step) | 'internal' (the optimizer clips)."""
        v = Variant(name=name, clip=clip != "none")
        try:
            params = make_params(shapes, seed=0)
            opt = factory(params)
            if clip == "torch":
                def step(opt=opt, params=params):
                    torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
                    opt.step()
            else:
                step = opt.step
            grads0 = [p.grad.clone() for p in params]

            def reset(params=params, grads0=grads0):
                # clip_grad_norm_ rescales gradients in place: without this they would shrink
                # round after round (towards denormals) for the peers that clip that way.
                for p, g0 in zip(params, grads0):
                    p.grad.copy_(g0)

            step()  # warm-up: allocates states, compiles/builds kernels
            reset()
            step()
            v.step, v.reset = step, reset
            v.state_bytes = lambda opt=opt: optimizer_state_bytes(opt)
        except Exception as exc:  # noqa: BLE001 - a failing peer is reported, not fatal
            v.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ''}"
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()
        variants.append(v)
        gc.collect()

    print(f"lazytrain kernel: {'C++' if kernel_cpp.load() is not None else 'pure torch (' + str(kernel_cpp.unavailable_reason()) + ')'}", flush=True)
    add("lazytrain AdamW8bit", lambda p: AdamW8bit(p, lr=LR, weight_decay=WD, max_grad_norm=MAX_GRAD_NORM), "internal")
    add("lazytrain AdamW8bit", lambda p: AdamW8bit(p, lr=LR, weight_decay=WD), "none")
    add("torch AdamW(fused=True)", lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WD, fused=True), "torch")
    add("torch AdamW(fused=True)", lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WD, fused=True), "none")

    def deepspeed_cpu_adam(p):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/lazytrain/torch_extensions"))
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(p, lr=LR, weight_decay=WD, adamw_mode=True)

    add("DeepSpeedCPUAdam", deepspeed_cpu_adam, "torch")
    add("DeepSpeedCPUAdam", deepspeed_cpu_adam, "none")

    def bnb_adamw8bit(p):
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(p, lr=LR, weight_decay=WD)

    add("bitsandbytes AdamW8bit", bnb_adamw8bit, "torch")
    add("bitsandbytes AdamW8bit", bnb_adamw8bit, "none")

    def torchao_adamw8bit(p):
        from torchao.optim import AdamW8bit as AoAdamW8bit

        return AoAdamW8bit(p, lr=LR, weight_decay=WD)

    add("torchao AdamW8bit", torchao_adamw8bit, "torch")
    add("torchao AdamW8bit", torchao_adamw8bit, "none")
    return variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 layer (~13M params), 3 rounds")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of parameters (4 -> ~51M)")
    ap.add_argument("--rounds", type=int, default=11, help="timed rounds (median reported)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.rounds = 1, 3
    torch.set_num_threads(args.threads)
    shapes = [s for _ in range(args.layers) for s in layer_shapes()] + [(HIDDEN,)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    load0 = os.getloadavg()[0]
    print(f"params: {numel / 1e6:.1f}M in {len(shapes)} tensors; threads {args.threads}; load avg {load0:.1f}", flush=True)
    variants = build_variants(shapes)
    live = [v for v in variants if v.step is not None]
    for r in range(args.rounds):
        # each round starts one variant later: none always runs first, right after the slowest
        # (the 8-bit peers allocate and free GBs per step) or always after the same neighbour
        for v in live[r % len(live):] + live[:r % len(live)]:
            v.reset()
            t0 = time.perf_counter()
            v.step()
            v.times_s.append(time.perf_counter() - t0)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    load1 = os.getloadavg()[0]

    def med_ms(name: str, clip: bool) -> float | None:
        for v in live:
            if v.name == name and v.clip == clip:
                return statistics.median(v.times_s) * 1e3
        return None

    ds_ref = med_ms("DeepSpeedCPUAdam", False)
    bnb_ref = med_ms("bitsandbytes AdamW8bit", False)
    bnb_ref_clip = med_ms("bitsandbytes AdamW8bit", True)
    header = f"{'optimizer':<26} {'clip':<5} {'median ms':>10} {'min ms':>8} {'ns/param':>9} {'vs DS no-clip':>14} {'bnb / this':>11} {'state B/param':>14}"
    lines = [
        "",
        f"Optimizer step, {numel / 1e6:.1f}M fp32 params, {args.threads} threads, median of {args.rounds} interleaved rounds "
        f"(load avg {load0:.1f} -> {load1:.1f}); clip = global-norm clipping to {MAX_GRAD_NORM}",
        header,
        "-" * len(header),
    ]
    for v in variants:
        if v.step is None:
            lines.append(f"{v.name:<26} {'yes' if v.clip else 'no':<5} unavailable: {v.error}")
            continue
        ms = statistics.median(v.times_s) * 1e3
        vs_ds = f"{ms / ds_ref:.2f}x" if ds_ref else "-"
        ref = bnb_ref_clip if v.clip else bnb_ref
        vs_bnb = f"{ref / ms:.1f}x" if ref else "-"
        sb = v.state_bytes() / numel if v.state_bytes else float("nan")
        lines.append(
            f"{v.name:<26} {'yes' if v.clip else 'no':<5} {ms:>10.1f} {min(v.times_s) * 1e3:>8.1f} {ms * 1e6 / numel:>9.2f} {vs_ds:>14} {vs_bnb:>11} {sb:>14.3f}"
        )
    lines.append("vs DS no-clip: this step time / DeepSpeedCPUAdam without clipping (goal for lazytrain with clip: <= 1.00x)")
    lines.append("bnb / this: bitsandbytes AdamW8bit time (same clip setting) / this time (goal for lazytrain: >= 20x)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
