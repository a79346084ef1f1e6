"""Planner benchmark: cold solve and cached load times, MILP vs heuristics, max batch.

    .venv/bin/python scripts/bench_planner.py [--quick]

For 32-, 48-, 80- and 126-layer models on the rtx3090 profile: cold solve seconds (median of 3,
cache bypassed), cached load seconds (median of 20 `plan_job` calls that hit solver_cache/),
the MILP's predicted step time over the best heuristic's (all scored by the same cost model),
and, for the two goal jobs (8B full fine-tuning, 32B LoRA), the largest micro-batch per method.
The result table is printed last.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace

from lazytrain.cli.config import hardware_spec, job_spec, load_config, model_spec, planner_options
from lazytrain.plan import HEURISTICS, max_batch, plan_job

JOBS = [  # (label, overrides)
    ("llama3-8b full (32 L)", ["model=llama3-8b", "job.mode=full"]),
    ("qwen2.5-14b full (48 L)", ["model=qwen2.5-14b", "job.mode=full"]),
    ("llama3-70b lora (80 L)", ["model=llama3-70b", "job.mode=lora"]),
    ("llama3.1-405b lora (126 L)", ["model=llama3.1-405b", "job.mode=lora"]),
]
BATCH_JOBS = [
    ("llama3-8b full", ["model=llama3-8b", "job.mode=full"]),
    ("qwen2.5-32b lora", ["model=qwen2.5-32b", "job.mode=lora"]),
]


def specs(overrides, seq):
    cfg = load_config(overrides + ["hardware=rtx3090", f"job.seq_len={seq}", "job.batch_size=1"])
    return model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 repeat, skip the max-batch search")
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    reps = 1 if args.quick else 3
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for label, ov in JOBS:
            model, hw, job, opts = specs(ov, args.seq)
            cold = []
            for _ in range(reps):
                t = time.perf_counter()
                plan = plan_job(model, hw, job, opts, cache_dir=cache, use_cache=False)
                cold.append(time.perf_counter() - t)
            hits = []
            for _ in range(20):
                t = time.perf_counter()
                hit = plan_job(model, hw, job, opts, cache_dir=cache)
                hits.append(time.perf_counter() - t)
            assert hit.input_hash == plan.input_hash
            heur = {}
            for h in HEURISTICS:
                hp = plan_job(model, hw, job, opts, cache_dir=None, method=f"heuristic:{h}", explain=False)
                heur[h] = hp.predicted.step_time_s if hp.fits else None
            fitting = {h: v for h, v in heur.items() if v}
            best_h = min(fitting, key=fitting.get) if fitting else None
            ratio = plan.predicted.step_time_s / fitting[best_h] if best_h and plan.fits else float("nan")
            gap = "-" if plan.solver.gap is None else f"{plan.solver.gap:.2%}"
            rows.append((label, plan.status, gap, f"{statistics.median(cold):.2f}", f"{statistics.median(hits) * 1e3:.1f}",
                         f"{plan.predicted.step_time_s:.3g}", f"{ratio:.3f} ({best_h})"))
            print(f"{label}: cold {statistics.median(cold):.2f} s, cached {statistics.median(hits) * 1e3:.1f} ms, "
                  f"MILP/best heuristic {ratio:.3f}", flush=True)

    batch_rows = []
    if not args.quick:
        for label, ov in BATCH_JOBS:
            model, hw, job, opts = specs(ov, args.seq)
            res = {m: max_batch(model, hw, job, opts, m) for m in ["milp"] + [f"heuristic:{h}" for h in HEURISTICS]}
            batch_rows.append((label, *[str(res[m]) for m in res]))
            print(f"{label}: max batch {res}", flush=True)

    print()
    print(f"Planner on rtx3090 (24 GiB), seq {args.seq}, batch 1; HiGHS via PuLP on this machine (2 cores)")
    hdr = ("job", "status", "gap", "cold solve s", "cached ms", "MILP step s", "MILP / best heuristic")
    _print(hdr, rows)
    if batch_rows:
        print()
        print(f"Largest micro-batch that fits 24 GiB (seq {args.seq}); same cost model for every method")
        _print(("job", "milp", *HEURISTICS), batch_rows)


def _print(hdr, rows):
    widths = [max(len(str(r[i])) for r in [hdr, *rows]) for i in range(len(hdr))]
    for r in [hdr, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
