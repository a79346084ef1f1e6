"""lazytrain vs DeepSpeed ZeRO-3 on this machine: same model, sequence, batch, dtype and optimizer.

    .venv/bin/python scripts/bench_vs_deepspeed.py                    # ~6-10 min on 2 cores
    .venv/bin/python scripts/bench_vs_deepspeed.py --engines ds-cpu,lt-host --steps 3

Engines (each in its own subprocess, so its peak RSS is its own):
  torch    plain in-memory PyTorch (bf16 autocast, fp32 weights, torch AdamW fused) - reference loss
  ds-cpu   DeepSpeed ZeRO-3, offload_param + offload_optimizer to cpu, DeepSpeedCPUAdam
  ds-nvme  DeepSpeed ZeRO-3, offload_param + offload_optimizer to nvme (async_io), DeepSpeedCPUAdam
  lt-host  lazytrain StreamingExecutor, the MILP plan with parameters/optimizer pinned to host
  lt-nvme  the same plan with parameters/optimizer pinned to nvme
DeepSpeed's config comes from the same Plan via ds_config_from_plan (so both recompute the same
blocks), every DeepSpeed setting is printed. Reported: median step time over --steps timed steps
after --warmup, DeepSpeed's step time over the engine's (>1: faster than DeepSpeed; against ZeRO-3
CPU offload and against the DeepSpeed row of the same tier), peak RSS, first-step loss minus plain PyTorch's, and the
largest batch whose peak RSS fits --mem-limit-gib. For that column every engine runs in its most
memory-frugal setting: each decoder block recomputed from its own kept input (DeepSpeed: the same
per-block Hugging Face checkpointing, and optimizer sub-groups no larger than the largest parameter
needs, `sub_group_size_for`: its default 1e9 is one group of this model, whose swap buffers alone
took 3.3 GiB with the state on NVMe; lazytrain: the kept inputs on the engine's tier, and freed
memory returned to the system, LAZYTRAIN_KEEP_FREED_MEMORY=0; plain torch keeps everything);
peak RSS is measured at --probe-batch and a quarter of it, the batch extrapolated linearly and run once to check that it fits (if it does not, the slope is refitted
through that run and the smaller batch run once more; "~" when not checked).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINES = ("torch", "ds-cpu", "ds-nvme", "lt-host", "lt-nvme")
GiB = 1 << 30
OPTIM = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "max_grad_norm": 1.0}


def model_config(a: argparse.Namespace) -> dict:
    return dict(model_type="llama", hidden_size=a.hidden, intermediate_size=a.intermediate,
                num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
                vocab_size=a.vocab, max_position_embeddings=max(2048, a.seq), rms_norm_eps=1e-5,
                tie_word_embeddings=False)


# ---- plans (parent process; the planner imports no torch) --------------------------------------

def plan_inputs(a: argparse.Namespace, batch: int, frugal: bool):
    """(model, hardware, job, planner options) of the plans below."""
    from lazytrain.cli.config import hardware_spec, load_config
    from lazytrain.plan import PlannerOptions
    from lazytrain.spec import JobSpec, ModelSpec
    hw = hardware_spec(load_config(["hardware=cpu"]))
    if frugal:  # the max-batch column: the device budget is the whole memory limit (same RAM here)
        hw = dataclasses.replace(hw, device_memory_gib=a.mem_limit_gib)
    model = ModelSpec.from_hf_config(model_config(a), name="bench-llama")
    job = JobSpec(batch_size=batch, seq_len=a.seq, mode="full", compute_dtype="bf16", clip_grad=True)
    return model, hw, job, PlannerOptions(time_limit_s=20)


def planned_max_batch(a: argparse.Namespace, limit: int) -> int:
    """The largest frugal batch (up to `limit`) the planner plans (0: none)."""
    from lazytrain.plan import max_batch
    model, hw, job, options = plan_inputs(a, 1, frugal=True)
    return max_batch(model, hw, job, options, limit=limit)


def make_plan(a: argparse.Namespace, batch: int, tier: str, frugal: bool = False):
    """The MILP plan for the cpu hardware profile with every layer's parameter and optimizer tier
    pinned to `tier` (the planner decides recompute and activation placement).

    frugal: the memory-frugal configuration used for the max-batch column instead: every decoder
    block recomputed from its own kept input (DeepSpeed gets the same per-block checkpointing),
    the kept inputs on `tier`."""
    from lazytrain.plan import plan_job
    model, hw, job, options = plan_inputs(a, batch, frugal)
    plan = plan_job(model, hw, job, options, cache_dir=str(ROOT / "solver_cache"))
    if not plan.fits:
        raise RuntimeError("; ".join(plan.explanation))
    # gradients stay in host memory: DeepSpeed cannot put them on NVMe, so neither does lazytrain here
    layers = tuple(dataclasses.replace(d, param_tier=tier, optimizer_tier=tier, grad_tier="host")
                   for d in plan.layers)
    method = plan.method + f"+pinned:{tier}"
    if frugal:
        layers = tuple(dataclasses.replace(d, recompute=True, segment_start=d.index, activation_tier=tier)
                       if d.kind == "block" else d for d in layers)
        method += "+recompute-all"
    return dataclasses.replace(plan, layers=layers, method=method)


# ---- worker (one engine, one process) ----------------------------------------------------------

def build_model(a: argparse.Namespace):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = {k: v for k, v in model_config(a).items() if k != "model_type"}
    return LlamaForCausalLM(LlamaConfig(**cfg))


def batch_data(a: argparse.Namespace, batch: int):
    import torch
    g = torch.Generator().manual_seed(1234)
    x = torch.randint(0, a.vocab, (batch, a.seq), generator=g)
    return [(x, x.clone())]


def worker(a: argparse.Namespace) -> dict:
    import torch
    engine, batch = a.worker, a.batch
    out: dict = {"engine": engine, "batch": batch}
    t0 = time.perf_counter()
    model = build_model(a)
    data = batch_data(a, batch)
    if engine == "torch":
        model.train()
        params = [p for p in model.parameters()]
        opt = torch.optim.AdamW(params, lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"],
                                weight_decay=OPTIM["weight_decay"], fused=True)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=data[0][0], labels=data[0][1]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, OPTIM["max_grad_norm"])
            opt.step()
            return float(loss)
        close = lambda: None  # noqa: E731
    elif engine.startswith("ds-"):
        from lazytrain.integrations.deepspeed import DeepSpeedTrainer
        from lazytrain.plan import Plan
        plan = Plan.from_json(Path(a.plan).read_text())
        cfg = json.loads(Path(a.ds_config).read_text())
        tr = DeepSpeedTrainer(model, ds_config=cfg, lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"],
                              weight_decay=OPTIM["weight_decay"], max_grad_norm=OPTIM["max_grad_norm"])
        out["plan_hash"] = plan.input_hash
        step = lambda: tr.train_step(data).loss  # noqa: E731
        close = tr.close
    else:
        from lazytrain.plan import Plan
        from lazytrain.runtime import StreamingExecutor
        plan = Plan.from_json(Path(a.plan).read_text())
        ex = StreamingExecutor(model.to(torch.bfloat16), plan, nvme_dir=a.nvme_dir, optimizer="adamw",
                               lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"],
                               weight_decay=OPTIM["weight_decay"], max_grad_norm=OPTIM["max_grad_norm"])
        results = []

        def step():
            r = ex.train_step(data)
            results.append(r)
            return r.loss
        close = ex.close
        out["predicted_step_time_s"] = plan.predicted.step_time_s
    out["init_s"] = time.perf_counter() - t0
    out["torch_threads"] = torch.get_num_threads()
    losses, times = [], []
    for i in range(a.warmup + a.steps):
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
    # bytes actually on the NVMe dir while the engine is alive (swap files, tier files)
    out["nvme_bytes"] = sum(f.stat().st_size for f in Path(a.nvme_dir).rglob("*") if f.is_file())
    close()
    out["losses"] = losses
    out["step_times_s"] = times[a.warmup:]
    out["median_step_s"] = statistics.median(times[a.warmup:])
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


# ---- parent ------------------------------------------------------------------------------------

def run_worker(a: argparse.Namespace, engine: str, batch: int, plan_path: Path | None,
               ds_path: Path | None, steps: int, warmup: int, frugal: bool = False) -> dict:
    """One engine run in its own process. `frugal` (the max-batch probes): lazytrain without its
    kept freed memory (LAZYTRAIN_KEEP_FREED_MEMORY=0, runtime/malloc.py), which holds the heap at
    its high-water mark for speed: 13.7 vs 10.0 GiB peak RSS at batch 64 here (2026-12-01)."""
    cmd = [sys.executable, __file__, "--worker", engine, "--batch", str(batch), "--steps", str(steps),
           "--warmup", str(warmup), "--nvme-dir", a.nvme_dir] + _model_args(a)
    if plan_path:
        cmd += ["--plan", str(plan_path)]
    if ds_path:
        cmd += ["--ds-config", str(ds_path)]
    t = time.perf_counter()
    try:
        env = {**os.environ, "LAZYTRAIN_KEEP_FREED_MEMORY": "0"} if frugal and engine.startswith("lt-") else None
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.worker_timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "batch": batch, "error": f"timed out after {a.worker_timeout_s:.0f} s"}
    finally:  # swap files of this run (GBs): only our own subdir (see main), never left behind
        shutil.rmtree(a.nvme_dir, ignore_errors=True)
        Path(a.nvme_dir).mkdir(parents=True, exist_ok=True)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return {"engine": engine, "batch": batch, "error": f"exit {p.returncode}: {tail[:160]}"}
    r = json.loads(lines[-1][len("RESULT "):])
    r["wall_s"] = time.perf_counter() - t
    return r


def _model_args(a: argparse.Namespace) -> list[str]:
    return ["--hidden", str(a.hidden), "--intermediate", str(a.intermediate), "--layers", str(a.layers),
            "--heads", str(a.heads), "--vocab", str(a.vocab), "--seq", str(a.seq)]


def prepare(a: argparse.Namespace, engine: str, batch: int, tmp: Path,
            frugal: bool = False) -> tuple[Path | None, Path | None, list[str], str | None]:
    """Plan and DeepSpeed config files for one engine run; (plan, ds_config, dropped, pending reason)."""
    if engine == "torch":
        return None, None, [], None
    tier = "nvme" if engine.endswith("nvme") else "host"
    try:
        plan = make_plan(a, batch, tier, frugal=frugal)
    except Exception as e:  # the planner is being built alongside this script
        return None, None, [], f"planner unavailable ({type(e).__name__}: {e})"
    plan_path = tmp / f"plan-{tier}-b{batch}{'-frugal' if frugal else ''}.json"
    plan_path.write_text(plan.to_json())
    if engine.startswith("lt-"):
        try:
            import importlib
            importlib.import_module("lazytrain.runtime").StreamingExecutor  # noqa: B018
        except Exception as e:
            return None, None, [], f"StreamingExecutor not importable ({type(e).__name__}: {e})"
        return plan_path, None, [], None
    from lazytrain.integrations.deepspeed import check_available
    from lazytrain.integrations.ds_config import ds_config_from_plan
    msg = check_available(nvme=tier == "nvme")
    if msg:
        return None, None, [], msg
    cfg, dropped = ds_config_from_plan(plan, nvme_dir=os.path.join(a.nvme_dir, f"ds-b{batch}"))
    if frugal:
        # optimizer sub-groups no larger than the largest parameter (DeepSpeed's 1e9 default is one
        # group of this model: with the state on NVMe, 3.3 GiB of swap buffers whatever the batch;
        # ds_config_from_plan sets this for NVMe itself, here for CPU offload too: review)
        from lazytrain.integrations.ds_config import sub_group_size_for
        cfg["zero_optimization"]["sub_group_size"] = sub_group_size_for(
            plan, cfg["zero_optimization"].get("sub_group_size", 1_000_000_000))
    ds_path = tmp / f"ds-{tier}-b{batch}{'-frugal' if frugal else ''}.json"
    ds_path.write_text(json.dumps(cfg, indent=1))
    return plan_path, ds_path, dropped, None


def fmt_gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--steps", type=int, default=3, help="timed steps per engine (after warm-up)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="engines run interleaved this many times")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--probe-batch", type=int, default=16,
                   help="RSS fit between this batch and a quarter of it (max-batch column); 0: skip")
    # (64 until 2026-12-01: on the Intel machine both host-tier engines fit 64 at 12 GiB, a tie at the
    # cap; measured at batch 83 DeepSpeed took 12.9 GiB, lazytrain 12.0)
    p.add_argument("--max-batch-cap", type=int, default=128, help="largest batch the max-batch column reports")
    p.add_argument("--no-verify-max-batch", dest="verify_max_batch", action="store_false",
                   help="do not run the extrapolated max batch once to check it fits")
    p.add_argument("--mem-limit-gib", type=float, default=12.0, help="peak-RSS limit for the max-batch column")
    p.add_argument("--nvme-dir", default=os.path.join(tempfile.gettempdir(), "lazytrain-bench-nvme"))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--worker-timeout-s", type=float, default=600)
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--ds-config", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        print("RESULT " + json.dumps(worker(a)), flush=True)
        return 0

    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        print(f"unknown engine(s) {bad}; valid: {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    a.nvme_dir = str(Path(a.nvme_dir) / "bench-vs-deepspeed")   # ours alone: emptied after each run
    Path(a.nvme_dir).mkdir(parents=True, exist_ok=True)
    n_params = sum(_param_counts(a))
    print(f"model: Llama hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, {n_params / 1e6:.0f}M params; "
          f"seq {a.seq}, batch {a.batch}, bf16 compute, AdamW lr {OPTIM['lr']} betas {OPTIM['betas']} "
          f"eps {OPTIM['eps']} wd {OPTIM['weight_decay']}, clip {OPTIM['max_grad_norm']}; "
          f"{a.rounds} interleaved round(s) x ({a.warmup} warm-up + {a.steps} timed steps); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    rows: dict[str, dict] = {}
    probes: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-vs-ds-") as tmpd:
        tmp = Path(tmpd)
        prepared = {e: prepare(a, e, a.batch, tmp) for e in engines}
        for e, (plan_path, ds_path, dropped, pending) in prepared.items():
            if pending:
                rows[e] = {"engine": e, "pending": pending}
                print(f"[{e}] pending: {pending}", flush=True)
                continue
            if ds_path:
                print(f"[{e}] DeepSpeed config (from the plan; dropped: {dropped or 'none'}):\n"
                      f"  {json.dumps(json.loads(ds_path.read_text()))}", flush=True)
            if plan_path:
                from lazytrain.plan import Plan
                pl = Plan.from_json(plan_path.read_text())
                rec = [d.name for d in pl.layers if d.recompute]
                print(f"[{e}] plan {pl.method} {pl.input_hash}: recompute {rec or 'none'}, activations on "
                      f"{sorted({d.activation_tier for d in pl.layers})}, predicted {pl.predicted.step_time_s:.2f} s/step",
                      flush=True)
        # Engines interleaved round by round, so a drift in machine load hits all of them alike.
        for rnd in range(a.rounds):
            for e, (plan_path, ds_path, _, pending) in prepared.items():
                if pending or "error" in rows.get(e, {}):
                    continue
                r = run_worker(a, e, a.batch, plan_path, ds_path, a.steps, a.warmup)
                print(f"[{e}] round {rnd + 1}: {json.dumps(r)}", flush=True)
                if "error" in r or e not in rows:
                    rows[e] = r
                else:
                    rows[e]["step_times_s"] += r["step_times_s"]
                    rows[e]["peak_rss_bytes"] = max(rows[e]["peak_rss_bytes"], r["peak_rss_bytes"])
                if "step_times_s" in rows[e]:
                    rows[e]["median_step_s"] = statistics.median(rows[e]["step_times_s"])
        # Largest batch under --mem-limit-gib: every engine in its most memory-frugal setting
        # (each block recomputed from its kept input; the plain torch reference keeps everything),
        # peak RSS measured at batch 1 and --probe-batch, the batch extrapolated linearly, then
        # run once to check that it really fits.
        for e, (_, _, _, pending) in prepared.items():
            if not a.probe_batch or pending or "error" in rows.get(e, {"error": 1}):
                continue
            probe: dict = {}
            lo = max(1, a.probe_batch // 4)
            for b in (lo, a.probe_batch):
                pp, dp, _, pend = prepare(a, e, b, tmp, frugal=True)
                if pend:
                    break
                probe[b] = run_worker(a, e, b, pp, dp, steps=1, warmup=0, frugal=True)
                print(f"[{e}] frugal probe batch {b}: {json.dumps(probe[b])}", flush=True)
            if len(probe) < 2 or any("peak_rss_bytes" not in r for r in probe.values()):
                continue
            r1, r2 = probe[lo]["peak_rss_bytes"], probe[a.probe_batch]["peak_rss_bytes"]
            slope = (r2 - r1) / (a.probe_batch - lo)
            limit = a.mem_limit_gib * GiB

            def extrapolate(b0: int, r0: float, k: float) -> int:
                if r0 > limit:   # (the larger probe is over: from the smaller one, not 0: review)
                    if b0 != lo and r1 <= limit and k > 0:
                        return lo + int((limit - r1) // k)
                    return 0
                return a.max_batch_cap if k <= 0 else min(a.max_batch_cap, b0 + int((limit - r0) // k))
            est = extrapolate(a.probe_batch, r2, slope)
            probes[e] = {"rss_b1": r1, "slope": slope, "estimate": est, "capped": est >= a.max_batch_cap}
            # run the estimate; if it does not fit, refit the slope through that run and retry once
            for attempt in range(2 if a.verify_max_batch else 0):
                if est < 1:
                    break
                pp, dp, _, pend = prepare(a, e, est, tmp, frugal=True)
                if pend and (fit := planned_max_batch(a, est - 1)):
                    # the planner's own device budget (the cpu profile's 12 GiB) is what stops it: the
                    # largest batch it plans is the one to run (a 2026-12-01 run reported ">= 128
                    # (run failed)" for the planner's refusal of 128, where it plans 122)
                    print(f"[{e}] batch {est} does not plan ({pend.splitlines()[0][:160]}...); "
                          f"verifying the planner's largest, {fit}", flush=True)
                    est = fit
                    pp, dp, _, pend = prepare(a, e, est, tmp, frugal=True)
                v = ({"error": pend} if pend else run_worker(a, e, est, pp, dp, steps=1, warmup=0, frugal=True))
                print(f"[{e}] verify batch {est}: {json.dumps(v)}", flush=True)
                probes[e].update(estimate=est, verified_rss=v.get("peak_rss_bytes"), verify_error=v.get("error"),
                                 capped=est >= a.max_batch_cap)
                rv = v.get("peak_rss_bytes")
                if v.get("error") or rv is None or rv <= limit or attempt == 1:
                    break
                # refit through the verified run and the nearer probe (below the larger probe: the smaller)
                b0, r0 = (a.probe_batch, r2) if est > a.probe_batch else (lo, r1)
                est = min(est - 1, extrapolate(b0, r0, (rv - r0) / max(1, est - b0)))
    print_table(a, rows, probes)
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (on {os.cpu_count()} CPUs; above that, "
          f"other processes shared the cores and absolute times are inflated)")
    return 0


def _param_counts(a: argparse.Namespace) -> list[int]:
    from lazytrain.spec import ModelSpec
    return [layer.param_count for layer in ModelSpec.from_hf_config(model_config(a)).layers]


def print_table(a: argparse.Namespace, rows: dict[str, dict], probes: dict[str, dict]) -> None:
    ref_loss = rows.get("torch", {}).get("losses", [None])[0]
    peer = {"host": rows.get("ds-cpu", {}), "nvme": rows.get("ds-nvme", {})}
    limit = a.mem_limit_gib * GiB
    header = (f"{'engine':<8} {'step s (median)':>15} {'tokens/s':>9} {'vs DS cpu':>9} {'vs DS same tier':>15} "
              f"{'peak RSS GiB':>12} "
              f"{'loss0 - torch':>13} {f'max batch @{a.mem_limit_gib:g} GiB':>26}")
    print("\n" + header)
    print("-" * len(header))
    for e, r in rows.items():
        if "pending" in r or "error" in r:
            print(f"{e:<8} {('pending: ' + r['pending']) if 'pending' in r else ('error: ' + r['error'])}")
            continue
        med = r["median_step_s"]
        tier = "nvme" if e.endswith("nvme") else "host"
        p = peer[tier]
        ratio = f"{p['median_step_s'] / med:.2f}x" if "median_step_s" in p and e != "torch" else "-"
        ratio_cpu = f"{peer['host']['median_step_s'] / med:.2f}x" if "median_step_s" in peer["host"] else "-"
        dloss = f"{r['losses'][0] - ref_loss:+.4f}" if ref_loss is not None else "-"
        mb = "-"
        q = probes.get(e)
        if q:
            # (the search's cap is a lower bound, not the largest batch: it was printed as one)
            mb = (">= " if q.get("capped") else "") + str(q["estimate"])
            if "verified_rss" in q:
                if q.get("verify_error"):
                    mb += " (run failed)"
                elif q["verified_rss"] is not None:
                    ok = q["verified_rss"] <= limit
                    mb += f" ({'fits' if ok else 'OVER'}: {q['verified_rss'] / GiB:.1f} GiB)"
            else:
                mb = "~" + mb
        print(f"{e:<8} {med:>15.2f} {a.batch * a.seq / med:>9.0f} {ratio_cpu:>9} {ratio:>15} "
              f"{fmt_gib(r['peak_rss_bytes']):>12} {dloss:>13} {mb:>26}")


if __name__ == "__main__":
    sys.exit(main())
