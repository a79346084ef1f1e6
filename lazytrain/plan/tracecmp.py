"""Predicted vs measured, per resource: a run's trace.jsonl against the plan it ran (plan.json).

The executor's trace and the planner's simulator share one vocabulary (compute_fwd, compute_bwd,
recompute, h2d, d2h, nvme_read, nvme_write, optimizer; a transfer also says what it moves: params,
activation, grads, optimizer_state), so each kind's busy seconds and bytes per optimizer step can
be set side by side: where a prediction is off, this says which resource and which tensors. Pure
Python (no torch): `lazytrain plan trace RUN_DIR`.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from .plan import Plan

TRANSFERS = ("h2d", "d2h", "nvme_read", "nvme_write")
KINDS = ("compute_fwd", "compute_bwd", "recompute", *TRANSFERS, "optimizer")
WHATS = ("", "params", "activation", "grads", "optimizer_state")


@dataclass(frozen=True)
class KindRow:
    kind: str                     # an event kind, with what a transfer moves: "h2d params"
    predicted_s: float
    measured_s: float | None      # median over the steps compared; None: the trace has none
    predicted_bytes: int
    measured_bytes: int | None


@dataclass(frozen=True)
class TraceComparison:
    rows: tuple[KindRow, ...]
    steps: tuple[int, ...]                 # this process's steps compared (0-based, as traced)
    first_step: int                        # the run's number of this process's step 0 (metrics)
    predicted_step_s: float
    measured_step_s: float | None          # median step_time_s from metrics.jsonl, if present
    device_type: str
    notes: tuple[str, ...] = ()            # e.g. a cut-off last line that was ignored


def predicted_busy(plan: Plan, with_what: bool = True) -> tuple[dict[str, float], dict[str, int], float]:
    """Busy seconds and bytes per event kind in one optimizer step of `plan`, and its step time,
    from the simulator (the plan's own hardware, job and prefetch depth)."""
    from ..costmodel import job_costs
    from ..spec import ModelSpec
    from .simulate import simulate
    from .solve import assignment_of

    model = ModelSpec.from_hf_config(plan.model_config, name=plan.model_name)
    tl = simulate(job_costs(model, plan.hardware, plan.job), assignment_of(plan), plan.hardware,
                  plan.options.prefetch_depth)
    secs: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)
    for ev in tl.events:
        k = _key(ev.kind, ev.what if with_what else "")
        secs[k] += ev.end_s - ev.start_s
        nbytes[k] += ev.bytes
    return dict(secs), dict(nbytes), tl.step_time_s


def _key(kind: str, what: str) -> str:
    return f"{kind} {what}" if what and kind in TRANSFERS else kind


def measured_busy(events, skip_first: bool = True) -> tuple[dict[str, float], dict[str, int], tuple[int, ...]]:
    """Median busy seconds and bytes per kind over a trace's steps (the first of each process, a
    warm-up, left out when there are others: the run's first and each resume's, which a
    `resume` marker names)."""
    secs: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    nbytes: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for e in events:
        if e["step"] < 0:   # set-up, checkpoints: outside any step
            continue
        k = _key(e["kind"], e.get("what", ""))
        secs[e["step"]][k] += e["end_s"] - e["start_s"]
        nbytes[e["step"]][k] += int(e.get("bytes", 0))
    steps = sorted(secs)
    if skip_first and len(steps) > 1:
        # (runtime.trace.RESUME_KIND, spelt out: this module stays free of torch)
        warm = {steps[0]} | {e.get("first_step") for e in events if e["kind"] == "resume"}
        steps = [s for s in steps if s not in warm] or steps[1:]
    kinds = {k for s in steps for k in secs[s]}
    med_s = {k: statistics.median(secs[s].get(k, 0.0) for s in steps) for k in kinds}
    med_b = {k: int(statistics.median(nbytes[s].get(k, 0) for s in steps)) for k in kinds}
    return med_s, med_b, tuple(steps)


def step_ranges(nums) -> str:
    """Sorted step numbers as runs: 1, 2, 3, 5 -> '1..3, 5'."""
    runs: list[list[int]] = []
    for n in nums:
        if runs and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in runs)


def _read_jsonl(path: Path, notes: list[str]) -> list[dict]:
    """Rows of a JSONL file; a cut-off last line (a killed run) is skipped with a note, damage
    anywhere else is an error."""
    lines = path.read_bytes().splitlines()
    out = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            out.append(json.loads(raw.decode("utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if n == len(lines):
                notes.append(f"{path}: the last line is cut off (a killed run?) and was ignored")
                continue
            why = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise ValueError(f"{path}:{n}: not JSON ({why}); the file is damaged") from None
    return out


def compare_run(run_dir: str | Path) -> TraceComparison:
    """Compare RUN_DIR/trace.jsonl (and metrics.jsonl, if there) with RUN_DIR/plan.json."""
    d = Path(run_dir)
    plan_path, trace_path = d / "plan.json", d / "trace.jsonl"
    for p in (plan_path, trace_path):
        if not p.is_file():
            raise ValueError(f"{p} not found: give the output_dir of a `lazytrain train` run (engine=lazytrain)")
    plan = Plan.load(plan_path)
    notes: list[str] = []
    events = _read_jsonl(trace_path, notes)
    if not any(isinstance(e, dict) and isinstance(e.get("step", 0), int) and e.get("step", 0) >= 0
               for e in events):
        raise ValueError(f"{trace_path} has no step: the run traced none")
    if not all(isinstance(e, dict) and {"kind", "step", "start_s", "end_s"} <= e.keys()
               and isinstance(e["step"], int) for e in events):
        raise ValueError(f"{trace_path} is not a streaming-executor trace (engine=lazytrain writes one; "
                         "other engines log ops, not transfers)")
    with_what = any("what" in e for e in events)   # older traces: compare per kind only
    metrics = d / "metrics.jsonl"
    logged = [r for r in _read_jsonl(metrics, notes) if "step_time_s" in r] if metrics.is_file() else []
    if not metrics.is_file():
        notes.append("no metrics.jsonl: which steps completed is unknown (a step cut short would count "
                     "in the medians), and there is no measured step time")
    by_step = {r["step"]: r for r in logged if isinstance(r.get("step"), int)}
    done = None
    if by_step and len(by_step) == len(logged):
        # Trace step s is the run's step s + 1, across resumes too (Trace.continue_run), and a
        # step has its metrics row once it completed: a step cut short (Ctrl-C, a crash) has
        # events but no row, and is left out (its few events pulled every median down).
        done = {e["step"] for e in events if e["step"] >= 0 and e["step"] + 1 in by_step}
        cut = {e["step"] for e in events if e["step"] >= 0} - done
        if cut:
            notes.append(f"{len(cut)} step(s) traced but never completed (no row in metrics.jsonl; an "
                         f"interrupted run?) left out: {', '.join(str(s + 1) for s in sorted(cut))}")
            events = [e for e in events if e["step"] < 0 or e["step"] in done]
        if not done:
            raise ValueError(f"{trace_path} has no completed step (metrics.jsonl has none of its steps)")
        # A skipped step (a non-finite norm: fp16's overflows) ran no update: its optimizer lanes
        # counted 0 s in the medians (review); left out like an interrupted one, when any step updated
        skipped = {s for s in done if by_step[s + 1].get("skipped") is True}
        if skipped and skipped != done:
            done -= skipped
            events = [e for e in events if e["step"] < 0 or e["step"] in done]
            notes.append(f"{len(skipped)} skipped step(s) (non-finite gradients: fp16 loss-scale "
                         f"overflows, or clipping) left out: {', '.join(str(s + 1) for s in sorted(skipped))}")
        elif skipped:
            notes.append("every step was skipped (non-finite gradients): none ran the update the plan "
                         "times, so the optimizer and the step time are not comparable")
    if by_step:
        # A resume may re-plan (other settings: a budget, a batch) and overwrite plan.json: the
        # steps run under another plan log another predicted step time and are left out (they
        # were compared with this plan: a review)
        want = plan.predicted.step_time_s
        other = {e["step"] for e in events if e["step"] >= 0 and isinstance(
            p := by_step.get(e["step"] + 1, {}).get("predicted_step_time_s"), (int, float))
            and abs(p - want) > 1e-9 * max(abs(want), 1e-12)}
        if other:
            if other >= {e["step"] for e in events if e["step"] >= 0}:
                raise ValueError(f"no step of {trace_path} ran with {plan_path} (metrics.jsonl logs another "
                                 "predicted step time for each): it is not the plan this trace ran")
            events = [e for e in events if e["step"] < 0 or e["step"] not in other]
            notes.append(f"{len(other)} step(s) ran under another plan than plan.json (a resume that "
                         f"planned again) and were left out: {step_ranges(sorted(s + 1 for s in other))}")
    m_s, m_b, steps = measured_busy(events)
    p_s, p_b, p_step = predicted_busy(plan, with_what)
    keys = [_key(k, w) for k in KINDS for w in WHATS if w == "" or k in TRANSFERS]
    rows = tuple(KindRow(k, p_s.get(k, 0.0), m_s.get(k), p_b.get(k, 0), m_b.get(k))
                 for k in dict.fromkeys(keys) if k in p_s or k in m_s)
    measured_step, first_step = None, 1
    if done is not None:
        measured_step = statistics.median(by_step[s + 1]["step_time_s"] for s in steps)
    elif logged:
        # (rows without step numbers: the trace's steps are metrics.jsonl's last rows)
        n = max(e["step"] for e in events) + 1
        mine = logged[-n:] if len(logged) >= n else []
        chosen = [mine[s]["step_time_s"] for s in steps if s < len(mine)]
        if chosen:
            measured_step = statistics.median(chosen)
        if mine:
            first_step = int(mine[0].get("step", 1))
    return TraceComparison(rows, steps, first_step, p_step, measured_step, plan.hardware.device_type,
                           tuple(notes))
