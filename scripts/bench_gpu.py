"""Short GPU benchmark for a lent CUDA machine (scripts/gpu_check.sh runs it); `--device cpu` is a
smoke run of the same code.

    .venv/bin/python scripts/bench_gpu.py               # CUDA, ~2 min
    .venv/bin/python scripts/bench_gpu.py --device cpu --small

(1) Optimizer step on the device, ~50M params in Llama-like shapes, median of interleaved rounds:
    lazytrain AdamW8bit (compiled kernel) with its folded-in clipping vs torch AdamW(fused=True)
    + clip_grad_norm_, and state bytes per parameter.
(2) Streamed training on the device: a ~220M Llama with parameters streamed from pinned host
    memory (lazytrain executor, fp32 master, bf16 compute, host optimizer fp32 or 8-bit) vs plain
    PyTorch AMP (fp32 weights, bf16 autocast, fused AdamW on the device, clip_grad_norm_) on the
    same batch, at batch 1 x 256 and 8 x 1024 tokens: tokens/s ratio, and the executor's device
    peak (torch.cuda.max_memory_allocated less the plain model's bytes, cross-checked with its
    accountant).
The table is printed last.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lazytrain.optim import AdamW8bit  # noqa: E402
from lazytrain.runtime import StreamingExecutor  # noqa: E402
from lazytrain.runtime.testing import hand_plan  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def optimizer_rows(device: torch.device, layers: int, rounds: int) -> list[tuple[str, str, str]]:
    hidden, inter = 1024, 2816
    shapes = [s for _ in range(layers) for s in
              [(3 * hidden, hidden), (hidden, hidden), (inter, hidden), (inter, hidden), (hidden, inter), (hidden,)]]
    g = torch.Generator().manual_seed(0)
    base = [(torch.randn(s, generator=g) * 0.02, torch.randn(s, generator=g) * 1e-3) for s in shapes]

    def make(kind):
        params = [torch.nn.Parameter(w.clone().to(device)) for w, _ in base]
        grads = [gr.to(device) for _, gr in base]
        if kind == "lt":
            opt = AdamW8bit(params, lr=1e-3, max_grad_norm=1.0)

            def step():
                opt.step()
        else:
            opt = torch.optim.AdamW(params, lr=1e-3, fused=True)

            def step():
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()

        def reset():
            for p, gr in zip(params, grads):
                p.grad = gr.clone()
        return opt, step, reset

    variants = {"lazytrain AdamW8bit (+clip)": make("lt"), "torch AdamW fused + clip_grad_norm_": make("torch")}
    times = {k: [] for k in variants}
    for _, step, reset in variants.values():   # warm-up: states, compilation
        for _ in range(2):
            reset()
            step()
    sync(device)
    for _ in range(rounds):
        for k, (_, step, reset) in variants.items():
            reset()
            sync(device)
            t = time.perf_counter()
            step()
            sync(device)
            times[k].append(time.perf_counter() - t)
    numel = sum(w.numel() for w, _ in base)
    rows = []
    ref = statistics.median(times["torch AdamW fused + clip_grad_norm_"])
    for k, (opt, _, _) in variants.items():
        state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                    if torch.is_tensor(v) and v.numel() > 1)
        med = statistics.median(times[k])
        rows.append((f"(1) {k}, {numel / 1e6:.0f}M params", f"{med * 1e3:.2f} ms",
                     f"{med / ref:.2f}x torch; {state / numel:.2f} B/param state"))
    return rows


def build_model(layers: int, hidden: int, inter: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=16, vocab_size=vocab,
                      max_position_embeddings=1024, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def streaming_rows(device: torch.device, layers: int, hidden: int, inter: int, vocab: int, batch: int, seq: int,
                   rounds: int) -> list[tuple[str, str, str]]:
    """Plain AMP vs the executor streaming every layer from pinned host memory, with the host
    optimizer in fp32 (torch's fused CPU AdamW) and 8-bit (lazytrain's CPU kernel), interleaved."""
    model = build_model(layers, hidden, inter, vocab)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mbs = [(ids, ids.clone())]
    plain = copy.deepcopy(model).to(device)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.0, fused=True)   # (as the executor's)

    def plain_step():
        x, y = ids.to(device), ids.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = plain(input_ids=x, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        popt.step()
        popt.zero_grad(set_to_none=True)

    # one plain step first, so its optimizer state exists before the executors are made: each
    # executor counts only what it allocates itself (what the process held before is not its own)
    plain_step()
    steps = {"plain": plain_step}
    variants = (("host fp32 AdamW", "adamw"), ("host 8-bit AdamW", "adamw8bit"))

    def make(opt):
        return StreamingExecutor(copy.deepcopy(model), hand_plan(layers, param_tier="host"), device=str(device),
                                 optimizer=opt, lr=1e-4, max_grad_norm=1.0,
                                 compute_dtype=torch.bfloat16)   # AMP's numerics
    execs = {name: make(opt) for name, opt in variants}
    for name, ex in execs.items():
        def ex_step(ex=ex):
            ex.train_step(mbs)
            ex.wait()
        steps[name] = ex_step
    for _ in range(2):   # warm-up
        for f in steps.values():
            f()
    times = {k: [] for k in steps}
    for _ in range(rounds):
        for k, f in steps.items():
            sync(device)
            t = time.perf_counter()
            f()
            sync(device)
            times[k].append(time.perf_counter() - t)
    for ex in execs.values():
        ex.close()
    del execs
    # Device peaks from one executor at a time (an executor counts as its own whatever the process
    # allocates after it was made, so two alive at once would count each other's buffers).
    last = {}
    for name, opt in variants:
        ex = make(opt)
        for _ in range(2):
            last[name] = ex.train_step(mbs)
            ex.wait()
        ex.close()
        del ex
    med = {k: statistics.median(v) for k, v in times.items()}
    tok = batch * seq
    n = sum(p.numel() for p in model.parameters())
    rows = [(f"(2) plain PyTorch AMP, {n / 1e6:.0f}M Llama, batch {batch} x seq {seq}",
             f"{tok / med['plain']:,.0f} tok/s", f"1.00x ({med['plain'] * 1e3:.0f} ms/step)")]
    for k, _ in variants:
        r = last[k]
        rows.append((f"(2)   lazytrain streamed from pinned host, {k}", f"{tok / med[k]:,.0f} tok/s",
                     f"{med['plain'] / med[k]:.2f}x plain AMP; device peak {r.device_peak_bytes / 2**20:.0f} MiB "
                     f"(accountant {r.accounted_peak_bytes / 2**20:.0f})"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="small shapes (a smoke run)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here; run with --device cpu for a smoke run")
        sys.exit(2)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}", flush=True)
    if args.small:
        rows = optimizer_rows(device, 1, 3) + streaming_rows(device, 2, 256, 512, 1024, 1, 64, 2)
    else:
        rows = optimizer_rows(device, 4, args.rounds)
        for batch, seq in ((1, 256), (8, 1024)):   # a small step (transfer/optimizer-bound), a real one
            rows += streaming_rows(device, 12, 1024, 2816, 32000, batch, seq, args.rounds)
    w = max(len(r[0]) for r in rows) + 2
    print()
    print(f"{'measure':<{w}}{'value':>14}  note")
    print("-" * (w + 60))
    for a, b, c in rows:
        print(f"{a:<{w}}{b:>14}  {c}")


if __name__ == "__main__":
    main()
