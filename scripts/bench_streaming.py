#!/usr/bin/env python
"""Layer-streaming executor vs plain PyTorch on a ~220M-parameter Llama (bf16), on this machine.

    .venv/bin/python scripts/bench_streaming.py            # all three sections, ~5-10 min on 2 cores
    .venv/bin/python scripts/bench_streaming.py --sections a --repeats 7 --a-seqs 256

(a) tokens/s of streamed training (weights streamed from host; from NVMe) vs plain in-memory
    PyTorch on the same model, batch and sequence, two ways: "amp" has the streamed runs' numerics
    (fp32 master weights and fused fp32 AdamW, bf16 compute under autocast), the reference for the
    streamed runs with an fp32 master; "bf16" is pure bf16 training (bf16 weights with fused AdamW
    on them, no master copy), the reference for the streamed "pure bf16" runs (job.master_dtype=bf16,
    the same math bit for bit). Steps are interleaved round-robin (each round starting one runner
    later) and the medians compared (goal >= 0.95x from host), at each of `--a-seqs` (batch
    `--batch`): the weights cross to the "device" once per step whatever its tokens, so short steps
    show their cost most. On a CPU the
    copies are memcpys by the two cores that compute (no copy engine to hide them behind).
(b) at a fixed device budget, the largest batch lazytrain runs vs plain PyTorch with HF gradient
    checkpointing. Both are counted the same way: the bytes a run places on the device tier, i.e.
    weights + gradients + optimizer state held there + the saved-for-backward tensors (unique
    storages, tracked by saved-tensor hooks). Batches are extrapolated from batch 1 and 2 and then
    verified by running the largest one (it must fit) and one more (it must not).
(c) predicted (planner) vs measured step time and device peak, for the plan `plan_job` makes with
    the static `cpu` hardware profile and with this machine measured first (as `lazytrain profile`).
    The measured peak is the executor's accountant in one more step with `count_op_temporaries`
    (it then also counts what autograd and the ops allocate inside a layer, as a device allocator
    would; the note says what it counts by hand alone).
The results table is printed last.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lazytrain.runtime import DeviceBudgetExceeded, StreamingExecutor  # noqa: E402
from lazytrain.runtime.testing import hand_plan, hardware_for_tests  # noqa: E402

GiB = 1 << 30


def model_config(args) -> dict:
    return dict(model_type="llama", hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                num_key_value_heads=args.hidden // 64, vocab_size=args.vocab,
                max_position_embeddings=2048, tie_word_embeddings=False)


def build_model(args) -> torch.nn.Module:
    cfg = dict(model_config(args))
    cfg.pop("model_type")
    torch.manual_seed(0)
    conf = transformers.AutoConfig.for_model("llama", **cfg)
    return transformers.AutoModelForCausalLM.from_config(conf).to(torch.bfloat16)


def batch(b: int, seq: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, seq), generator=g)
    return [(ids, ids.clone())]


# ---- (a) throughput ---------------------------------------------------------------------------
class Plain:
    name = "plain PyTorch, pure bf16 (bf16 weights and AdamW states)"
    short = "bf16"

    def __init__(self, model) -> None:
        self.model = model
        # weight decay 0, as the streamed runs' (the executor's default; torch's is 0.01)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)

    def step(self, mbs) -> float:
        t = time.perf_counter()
        for ids, labels in mbs:
            (self.model(input_ids=ids, labels=labels).loss / len(mbs)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t


class PlainAmp(Plain):
    """Plain PyTorch with the streamed runs' numerics: fp32 weights (the master copy) and fused
    fp32 AdamW, bf16 compute under autocast (torch's standard mixed precision)."""
    name = "plain PyTorch, fp32 master + bf16 autocast (amp)"
    short = "amp"

    def __init__(self, model) -> None:
        super().__init__(model.float())

    def step(self, mbs) -> float:
        t = time.perf_counter()
        for ids, labels in mbs:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = self.model(input_ids=ids, labels=labels).loss / len(mbs)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t


class Streamed:
    def __init__(self, name: str, model, plan, nvme_dir, master_dtype=torch.float32) -> None:
        self.name = name
        self.short = name
        self.ex = StreamingExecutor(model, plan, device="cpu", nvme_dir=nvme_dir, lr=1e-4,
                                    master_dtype=master_dtype)
        self.last = None

    def step(self, mbs) -> float:
        # Timed until every queued optimizer update and the next step's first weight fetch (an
        # NVMe read the step starts at its end) have landed: with steps interleaved across runners,
        # work left running would otherwise overlap (and slow) the next runner's step, and go
        # untimed (the NVMe runners' embedding read, ~34 ms of a 1.5 s step: review).
        t = time.perf_counter()
        self.last = self.ex.train_step(mbs)
        self.ex.wait(fetches=True)
        return time.perf_counter() - t


def section_a(args, model, nvme_dir) -> list[tuple]:
    L = args.layers
    make = {"plain": lambda: Plain(copy.deepcopy(model)),
            "amp": lambda: PlainAmp(copy.deepcopy(model)),
            "host": lambda: Streamed("streamed from host", copy.deepcopy(model),
                                     hand_plan(L, param_tier="host", prefetch_depth=2), nvme_dir),
            "nvme": lambda: Streamed("streamed from NVMe", copy.deepcopy(model),
                                     hand_plan(L, param_tier="nvme", prefetch_depth=2), nvme_dir),
            "host-bf16": lambda: Streamed("streamed from host, pure bf16 (bf16 master + moments)",
                                          copy.deepcopy(model), hand_plan(L, param_tier="host", prefetch_depth=2),
                                          nvme_dir, master_dtype=torch.bfloat16),
            "nvme-bf16": lambda: Streamed("streamed from NVMe, pure bf16 (bf16 master + moments)",
                                          copy.deepcopy(model), hand_plan(L, param_tier="nvme", prefetch_depth=2),
                                          nvme_dir, master_dtype=torch.bfloat16)}
    runners = [make[k]() for k in args.a_runners.split(",")]
    mbs = batch(args.batch, args.seq, args.vocab)
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    for r in runners:
        r.step(mbs)   # warm-up: allocations, first-touch
    for rep in range(args.repeats):
        # each round starts one runner later, so no runner always follows the same one (review)
        k = rep % len(runners)
        for r in runners[k:] + runners[:k]:
            times[r.name].append(r.step(mbs))
        print(f"(a) round {rep + 1}/{args.repeats}: " +
              ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    tokens = args.batch * args.seq
    base = tokens / statistics.median(times[runners[0].name])
    amp = [r for r in runners if isinstance(r, PlainAmp)]
    base_amp = tokens / statistics.median(times[amp[0].name]) if amp else None
    rows = []
    for r in runners:
        tps = tokens / statistics.median(times[r.name])
        note = ""
        if isinstance(r, Streamed):
            nv = r.ex.nvme
            note = f"device peak {r.last.device_peak_bytes / 2**20:.0f} MiB"
            if nv is not None:
                note += ", O_DIRECT" if nv.direct_io else ", buffered (no O_DIRECT)"
            r.ex.close()
            r.ex = None
        ratio = f"{tps / base:.3f}x vs {runners[0].short}"
        if base_amp and r is not runners[0]:
            ratio += f", {tps / base_amp:.3f}x vs amp"
        rows.append(("a", f"{r.name}, {args.batch}x{args.seq}: tokens/s", f"{tps:.1f}", ratio, note))
    del runners
    gc.collect()
    return rows


# ---- (b) largest batch at a fixed device budget -------------------------------------------------
class _Held:
    """What a pack hook returns: uncounts its storage when autograd drops it."""

    def __init__(self, counter: "SavedCounter", t: torch.Tensor, ptr: int) -> None:
        self.c, self.t, self.ptr = counter, t, ptr

    def __del__(self) -> None:
        self.c.drop(self.ptr)


class SavedCounter:
    """Peak bytes of unique storages held by autograd's saved tensors (excluding `skip` storages)."""

    def __init__(self, skip: set[int], fixed_bytes: int, budget_bytes: int) -> None:
        self.skip, self.fixed, self.budget = skip, fixed_bytes, budget_bytes
        self.live: dict[int, list[int]] = {}
        self.cur = self.peak = 0

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip:
            return t
        ent = self.live.get(ptr)
        if ent is None:
            nb = t.untyped_storage().nbytes()
            self.live[ptr] = [1, nb]
            self.cur += nb
            self.peak = max(self.peak, self.cur)
            if self.fixed + self.cur > self.budget:
                raise DeviceBudgetExceeded("baseline over budget")
        else:
            ent[0] += 1
        return _Held(self, t, ptr)

    def drop(self, ptr: int) -> None:
        ent = self.live.get(ptr)
        if ent is None:
            return
        ent[0] -= 1
        if ent[0] == 0:
            self.cur -= ent[1]
            del self.live[ptr]

    @staticmethod
    def unpack(obj):
        return obj.t if isinstance(obj, _Held) else obj


def baseline_bytes(model, b: int, args, budget: int) -> int:
    """Device bytes plain PyTorch + HF gradient checkpointing holds at batch b (raises over budget)."""
    params = sum(p.numel() for p in model.parameters())
    # weights + grads (bf16) + fused AdamW exp_avg/exp_avg_sq (bf16, as torch keeps them for bf16 params)
    fixed = params * 2 * 4
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    c = SavedCounter(skip, fixed, budget)
    ids, labels = batch(b, args.seq_b, args.vocab)[0]
    with torch.autograd.graph.saved_tensors_hooks(c.pack, c.unpack):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
    model.zero_grad(set_to_none=True)
    return fixed + c.peak


class LazytrainBytes:
    """Device peak of one lazytrain step at batch b; one executor reused until a step overflows."""

    def __init__(self, model, args, budget: int, nvme_dir) -> None:
        L = args.layers
        self.plan = hand_plan(L, param_tier="host", prefetch_depth=1, activation_tier="host",
                              segments=[(i, i) for i in range(1, L + 1)],
                              hardware=hardware_for_tests(device_memory_gib=budget / GiB))
        self.model, self.args, self.nvme_dir = model, args, nvme_dir
        self.ex = None

    def __call__(self, b: int) -> int:
        if self.ex is None:
            self.ex = StreamingExecutor(copy.deepcopy(self.model), self.plan, device="cpu",
                                        nvme_dir=self.nvme_dir, lr=1e-4)
        try:
            return self.ex.train_step(batch(b, self.args.seq_b, self.args.vocab)).device_peak_bytes
        except DeviceBudgetExceeded:
            self.close()   # a step cut short leaves the executor mid-step: start a fresh one
            raise

    def close(self) -> None:
        if self.ex is not None:
            self.ex.close()
            self.ex = None
            gc.collect()


def largest_batch(measure, budget: int, cap: int, who: str) -> tuple[int, int, bool]:
    """Extrapolate from batch 1 and 2, then verify: (largest batch that ran, its bytes, capped)."""
    b1, b2 = measure(1), measure(2)
    per = max(1, b2 - b1)
    guess = max(1, int((budget - (b1 - per)) // per))
    print(f"(b) {who}: batch 1 {b1 / 2**20:.0f} MiB, batch 2 {b2 / 2**20:.0f} MiB -> "
          f"extrapolated largest batch {guess}{f' (search capped at {cap})' if guess > cap else ''}",
          flush=True)
    capped = guess >= cap
    best = None
    for b in range(min(guess + 1, cap), 0, -1):   # walk down from one above the extrapolation
        try:
            used = measure(b)
        except DeviceBudgetExceeded:
            print(f"(b) {who}: batch {b} exceeds the budget", flush=True)
            continue
        print(f"(b) {who}: batch {b} ran, {used / 2**20:.0f} MiB", flush=True)
        if used <= budget:
            best = (b, used)
            break
    if best is None:
        return 0, 0, False
    if capped and best[0] == cap:
        return best[0], best[1], True
    try:                                # confirm the next batch really does not fit
        over = measure(best[0] + 1) > budget
    except DeviceBudgetExceeded:
        over = True
    if not over:
        print(f"(b) note: batch {best[0] + 1} also fits; extrapolation was conservative", flush=True)
    return best[0], best[1], False


def section_b(args, model, nvme_dir) -> list[tuple]:
    budget = int(args.budget_gib * GiB)
    gc_model = copy.deepcopy(model)
    gc_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    gc_model.train()
    base_b, base_used, base_capped = largest_batch(lambda b: baseline_bytes(gc_model, b, args, budget), budget,
                                                   args.max_batch_b, "plain+HF ckpt")
    print(f"(b) plain+HF checkpointing: batch {base_b} ({base_used / GiB:.2f} GiB)", flush=True)
    measure = LazytrainBytes(model, args, budget, nvme_dir)
    lt_b, lt_used, capped = largest_batch(measure, budget, args.max_batch_b, "lazytrain")
    measure.close()
    del gc_model
    gc.collect()
    print(f"(b) lazytrain: batch {lt_b} ({lt_used / GiB:.2f} GiB)", flush=True)
    # (a capped baseline is a lower bound: no ratio can be claimed from it; it was printed as one)
    ratio = ("n/a (the baseline's search hit --max-batch-b)" if base_capped
             else f"{'>= ' if capped else ''}{lt_b / base_b:.2f}x" if base_b else "baseline does not fit batch 1")
    return [("b", f"largest batch @ {args.budget_gib} GiB, seq {args.seq_b}: plain + HF ckpt",
             f"{'>=' if base_capped else ''}{base_b}", "",
             f"{base_used / GiB:.2f} GiB counted" + (" (search capped)" if base_capped else "")),
            ("b", f"largest batch @ {args.budget_gib} GiB, seq {args.seq_b}: lazytrain "
                  "(stream from host, recompute blocks, boundaries on host)",
             f"{'>=' if capped else ''}{lt_b}", ratio,
             f"{lt_used / GiB:.2f} GiB counted" + (" (search capped)" if capped else ""))]


# ---- (c) predicted vs measured -----------------------------------------------------------------
def measured_hardware(base, spec, job, nvme_dir):
    """`base` with this machine's measured figures, as `lazytrain profile` measures and writes them
    (lazytrain.profile.hardware.profile_machine) for `job` on `spec`: copy and O_DIRECT rates, the
    matmul peak, the efficiency of this model's blocks and the rate of the job's host update."""
    from lazytrain.profile.hardware import profile_machine

    return profile_machine(base, spec, job, torch.device("cpu"), nvme_dir, 128 * 2**20, repeats=4)[0]


def section_c(args, model, nvme_dir) -> list[tuple]:
    try:
        import yaml

        from lazytrain.plan import plan_job
        from lazytrain.plan.plan import PlannerOptions
        from lazytrain.spec import HardwareSpec, JobSpec, ModelSpec
    except ImportError as e:
        return [("c", "predicted vs measured", "PENDING", "", f"planner not available ({e})")]
    root = Path(__file__).resolve().parents[1]
    hw_dict = yaml.safe_load((root / "configs/hardware/cpu.yaml").read_text())
    hw_dict["device_memory_gib"] = args.budget_c_gib
    static = HardwareSpec.from_dict(hw_dict)
    job = JobSpec(batch_size=args.batch, seq_len=args.seq, compute_dtype="bf16")
    spec = ModelSpec.from_hf_config(model_config(args), name="bench-llama")
    measured = measured_hardware(static, spec, job, nvme_dir)
    print(f"(c) measured profile: matmul {measured.device_tflops * 1e3:.0f} GFLOP/s x efficiency "
          f"{measured.efficiency:.2f}, copies {measured.h2d_gbps:.1f} GB/s, NVMe read "
          f"{measured.nvme_read_gbps:.2f} / write {measured.nvme_write_gbps:.2f} GB/s, host update "
          f"{measured.host_memory_gbps:.1f} GB/s", flush=True)
    rows = []
    for label, hw in (("`cpu` profile", static), ("measured profile", measured)):
        plan = plan_job(spec, hw, job, PlannerOptions(), cache_dir=str(root / "solver_cache"))
        if not plan.fits:
            rows.append(("c", f"predicted vs measured ({label})", "n/a", "", "planner: " + " ".join(plan.explanation)))
            continue
        ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", nvme_dir=nvme_dir, lr=1e-4)
        mbs = batch(args.batch, args.seq, args.vocab)
        ex.train_step(mbs)
        res, times = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            res.append(ex.train_step(mbs))
            ex.wait()
            times.append(time.perf_counter() - t0)
        hand = max(r.device_peak_bytes for r in res)
        # One more step, untimed, with the ops' own allocations counted too (a Python call per op:
        # ~10% slower here), as a device allocator's peak would: the measured device peak.
        ex.count_op_temporaries = True
        peak = ex.train_step(mbs).device_peak_bytes
        ex.wait()
        kinds = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(ex.acct.peak_by_kind.items()) if v)
        ex.close()
        t = statistics.median(times)
        pt, pp = plan.predicted.step_time_s, plan.predicted.peak_bytes.get("device", 0)
        rows += [("c", f"step time, {plan.method} plan @ {args.budget_c_gib} GiB, {label}", f"{t:.2f} s",
                  f"pred {pt:.2f} s ({(t - pt) / pt * 100:+.0f}%)" if pt else "no prediction", ""),
                 ("c", f"device peak, {label}", f"{peak / 2**20:.0f} MiB",
                  f"pred {pp / 2**20:.0f} MiB ({(peak - pp) / pp * 100:+.0f}%)" if pp else "no prediction",
                  f"with op temporaries (what the executor counts by hand alone: {hand / 2**20:.0f}); "
                  f"MiB at peak: {kinds}")]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256, help="sequence length for (c)")
    ap.add_argument("--a-seqs", default="256,1024",
                    help="(a): sequence lengths, one interleaved comparison each")
    ap.add_argument("--batch", type=int, default=1, help="batch for (a) and (c)")
    ap.add_argument("--seq-b", type=int, default=128, help="sequence length for (b)")
    ap.add_argument("--budget-gib", type=float, default=2.0, help="device budget for (b)")
    ap.add_argument("--budget-c-gib", type=float, default=1.0, help="device budget for (c)")
    ap.add_argument("--max-batch-b", type=int, default=48, help="(b): largest batch tried")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--a-runners", default="plain,amp,host,nvme,host-bf16,nvme-bf16",
                    help="(a): which runs, interleaved; the first is the reference")
    ap.add_argument("--sections", default="abc")
    ap.add_argument("--nvme-dir", default=None, help="directory for NVMe-tier files (default: a temp dir)")
    args = ap.parse_args()
    model = build_model(args)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: Llama {n / 1e6:.0f}M params, bf16, {torch.get_num_threads()} threads", flush=True)
    rows: list[tuple] = []
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as nvme_dir:
        if "a" in args.sections:
            for seq in (int(x) for x in args.a_seqs.split(",")):
                rows += section_a(argparse.Namespace(**{**vars(args), "seq": seq}), model, nvme_dir)
        for sec, fn in (("b", section_b), ("c", section_c)):
            if sec in args.sections:
                rows += fn(args, model, nvme_dir)
    print()
    print(f"{'':2} {'measure':<78} {'value':>10}  {'ratio / prediction':<26} note")
    for sec, what, val, ratio, note in rows:
        print(f"{sec:2} {what:<78} {val:>10}  {ratio:<26} {note}")


if __name__ == "__main__":
    main()
