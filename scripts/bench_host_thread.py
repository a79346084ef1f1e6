"""Does the main thread's kernel launching slow the executor's host optimizer thread? (GPU lead)

On an H200 the executor's optimizer thread took ~4x longer per layer than the same work alone
(README, "On a GPU"). One candidate is the GIL: a main thread running Python between short
GIL-releasing torch calls (HF's forward launching kernels) takes the GIL straight back at every
release, and a waiting thread rarely gets in. This times the optimizer thread's per-layer host work
(the executor's: a bf16->fp32 gradient copy, per-tensor norms, fused fp32 AdamW over one Llama
block's tensors) on a worker thread while the main thread

  (1) waits (the work alone),
  (2) launches small ops with a little Python between them, as a model's forward does,
  (3) the same with sys.setswitchinterval(5e-6),

and prints the medians last.

    python scripts/bench_host_thread.py                 # CUDA if present, else the CPU
    python scripts/bench_host_thread.py --device cpu --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

SHAPES = [(3072, 1024), (1024, 1024), (2816, 1024), (2816, 1024), (1024, 2816), (1024,), (1024,)]


def layer_work(grads_pinned: list[torch.Tensor], acc: list[torch.Tensor], master: list[torch.Tensor],
               m: list[torch.Tensor], v: list[torch.Tensor], step: list[torch.Tensor]) -> None:
    """One layer's host work, as the executor does it (runtime/layer_state.py): the layer's first
    accumulation one _foreach_copy_, its norms one _foreach_norm (until 2026-12-01 this script made
    a call per tensor, which the executor no longer does: review), fused AdamW."""
    torch._foreach_copy_(acc, grads_pinned)
    torch._foreach_norm(acc)
    torch._fused_adamw_(master, acc, m, v, [], step, lr=1e-4, beta1=0.9, beta2=0.999,
                        weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    dev = torch.device(args.device)
    pin = dev.type == "cuda"
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g).bfloat16() for s in SHAPES]
    grads = [x.pin_memory() for x in grads] if pin else grads
    acc = [torch.zeros(s) for s in SHAPES]
    master = [torch.randn(s, generator=g) for s in SHAPES]
    m = [torch.zeros(s) for s in SHAPES]
    v = [torch.zeros(s) for s in SHAPES]
    step = [torch.zeros(()) for _ in SHAPES]
    x = torch.randn(64, 64, device=dev)
    w = torch.randn(64, 64, device=dev)

    stop = threading.Event()

    def launcher() -> None:   # a forward's pattern: Python, a short op, Python, ...
        y = x
        while not stop.is_set():
            for _ in range(40):
                y = torch.nn.functional.silu(y @ w) * 0.5 + x
                _ = [i * i for i in range(20)]   # a little Python between launches
            if pin:
                torch.cuda.synchronize(dev)
            y = x

    def timed(pool: ThreadPoolExecutor) -> list[float]:
        out = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            pool.submit(layer_work, grads, acc, master, m, v, step).result()
            out.append(time.perf_counter() - t)
        return out

    rows = []
    default_interval = sys.getswitchinterval()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(layer_work, grads, acc, master, m, v, step).result()   # warm-up
        rows.append(("(1) optimizer thread alone", timed(pool)))
        for label, interval in (("(2) while the main thread launches ops", default_interval),
                                ("(3) same, sys.setswitchinterval(5e-6)", 5e-6)):
            sys.setswitchinterval(interval)
            stop.clear()
            th = threading.Thread(target=launcher)
            th.start()
            time.sleep(0.05)
            try:
                rows.append((label, timed(pool)))
            finally:
                stop.set()
                th.join()
                sys.setswitchinterval(default_interval)
    n = sum(t.numel() for t in master)
    base = statistics.median(rows[0][1])
    print(f"\none Llama block's host optimizer work ({n / 1e6:.1f}M params), device {dev}, "
          f"{torch.get_num_threads()} intra-op threads, median of {args.rounds}")
    print(f"{'case':<44}{'median ms':>10}{'vs alone':>10}")
    for label, ts in rows:
        med = statistics.median(ts)
        print(f"{label:<44}{med * 1e3:>10.2f}{med / base:>9.2f}x")


if __name__ == "__main__":
    main()
