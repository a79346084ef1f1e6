"""Getting a Plan for a training job and describing it in a few lines."""

from __future__ import annotations

from collections import Counter

from ..plan.plan import Plan, PlannerOptions
from ..spec import HardwareSpec, JobSpec, ModelSpec


class PlanInfeasible(RuntimeError):
    """The job does not fit the hardware; carries the planner's explanation."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        lines = list(plan.explanation) or ["the planner found no feasible plan"]
        super().__init__("the job does not fit: " + "\n  ".join(lines))


def make_plan(model: ModelSpec, hardware: HardwareSpec, job: JobSpec, options: PlannerOptions,
              cache_dir: str = "solver_cache", use_cache: bool = True) -> Plan:
    """plan_job (MILP, cached by input hash)."""
    from ..plan import plan_job

    return plan_job(model, hardware, job, options, cache_dir=cache_dir, use_cache=use_cache)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_summary(plan: Plan) -> str:
    """A few lines: status, method, predicted step time / tokens/s / peaks, tiers and segments."""
    p = plan.predicted
    tiers = lambda attr: ", ".join(f"{k}:{v}" for k, v in sorted(Counter(
        getattr(d, attr) for d in plan.layers).items()))
    segs = plan.segments()
    seg_txt = ", ".join(f"{plan.layers[a].name}..{plan.layers[b].name}" for a, b in segs[:6])
    if len(segs) > 6:
        seg_txt += f", ... ({len(segs)} segments)"
    lines = [
        f"plan {plan.input_hash[:12]}  {plan.model_name} on {plan.hardware.name}  "
        f"job {plan.job.mode} batch {plan.job.batch_size}x{plan.job.seq_len} accum {plan.job.grad_accum}",
        f"  status {plan.status} ({plan.method}, {plan.solver.name} {plan.solver.wall_s:.2f} s)",
        f"  predicted step {p.step_time_s * 1e3:.1f} ms, {p.tokens_per_s:,.0f} tokens/s; peaks "
        + ", ".join(f"{k} {_gib(v)}" for k, v in p.peak_bytes.items()),
        f"  params on [{tiers('param_tier')}]  activations on [{tiers('activation_tier')}]  "
        f"optimizer on [{tiers('optimizer_tier')}]",
        f"  recompute: {seg_txt or 'none'}",
    ]
    lines += [f"  {e}" for e in plan.explanation]
    return "\n".join(lines)
