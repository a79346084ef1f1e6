"""plan_job: specs in, Plan out (cached by content hash). Also heuristic scoring, the smallest
device memory a job needs, the largest batch that fits, and the explanations users read."""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path

from .. import __version__
from ..costmodel import JobCosts, job_costs
from ..spec import GiB, HardwareSpec, JobSpec, ModelSpec
from ..spec.model import FAMILIES
from .assignment import RECOMPUTE, STORE, Assignment, Segment
from .cache import PlanCache
from .heuristics import HEURISTICS, heuristic_pins
from .milp import FREE_RESOLVE_S, MilpResult, Pins, solve_milp
from .render import optimizer_state_label, peak_text
from .plan import FALLBACK_DETAIL, SCHEMA_VERSION, LayerDecision, Plan, PlannerOptions, Predicted, SolverInfo, input_hash
from .ops import FWD, HEAD, head_peak_bytes, op_sequence
from .simulate import Timeline, memory_peaks, simulate
from .simplify import simplify

log = logging.getLogger(__name__)


TIMED_OUT = -1  # min_device_bytes: the solver ran out of time before an answer


class InfeasiblePlanError(RuntimeError):
    """No plan fits; `plan.explanation` says what would."""

    def __init__(self, plan: Plan) -> None:
        lines = list(plan.explanation) or ["the planner found no feasible plan"]
        super().__init__("the job does not fit: " + "\n  ".join(lines))
        self.plan = plan


@functools.lru_cache(maxsize=1)
def model_code_fingerprint() -> str:
    """Hash of the sources that turn inputs into a plan (specs, cost model, planner): a cached
    plan made by other code is not served, even without a version bump."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    # (models/adapter.py: the structure finder a measured spec is built with: review)
    for f in [*(f for sub in ("spec", "costmodel", "plan") for f in sorted((root / sub).glob("*.py"))),
              root / "models" / "adapter.py"]:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def versions() -> dict[str, str]:
    import pulp
    out = {"lazytrain": __version__, "pulp": pulp.__version__, "planner_code": model_code_fingerprint()}
    # (highspy has no __version__: a HiGHS upgrade, whose plans can differ, kept the cache's keys)
    # torch and transformers build the measured specs of model types without formulas
    # (spec/generic.py: what a block saves for backward): an upgrade may change them (review)
    return {**out, **installed_versions(("highspy", "torch", "transformers"))}


def installed_versions(packages) -> dict[str, str]:
    """Each package's installed version, "absent" where it is not installed."""
    from importlib import metadata

    out = {}
    for pkg in packages:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def _solve(costs: JobCosts, hw: HardwareSpec, options: PlannerOptions, pins: Pins | None,
           **kw) -> MilpResult:
    """solve_milp with the planner options (`kw` adds to or overrides them)."""
    args = dict(max_segment_len=options.max_segment_len, depth=options.prefetch_depth,
                allow_nvme=options.allow_nvme, pins=pins, solver=options.solver,
                time_limit_s=options.time_limit_s, mip_gap=options.mip_gap)
    return solve_milp(costs, hw, **{**args, **kw})



def pins_for(method: str, num_blocks: int, job: JobSpec | None = None,
             options: PlannerOptions | None = None) -> Pins | None:
    """The method's pins (none for the MILP, a heuristic's otherwise), plus what the job requires
    of every plan: the fused 8-bit AdamW updates in place in host memory, so its states stay there.
    With NVMe off (planner.allow_nvme=false) a heuristic's NVMe tiers are the host's (offload-all
    becomes ZeRO-Offload-like): a plan, minimum or fallback must not use a tier the user turned off;
    likewise every-k's segments are at most planner.max_segment_len blocks."""
    k = 4 if options is None else max(1, min(4, options.max_segment_len))
    pins = None if method == "milp" else heuristic_pins(method.removeprefix("heuristic:"), num_blocks, k)
    if pins is not None and options is not None and not options.allow_nvme:
        host = lambda tiers: None if tiers is None else tuple("host" if t == "nvme" else t for t in tiers)  # noqa: E731
        acts = host(pins.activation_tiers)
        pins = replace(pins, param_tier=host(pins.param_tier), grad_tier=host(pins.grad_tier),
                       optimizer_tier=host(pins.optimizer_tier),
                       activation_tiers=None if acts is None else tuple(dict.fromkeys(acts)),
                       segments=None if pins.segments is None else tuple(
                           replace(sg, tier="host") if sg.tier == "nvme" else sg for sg in pins.segments))
    if job is not None and job.mode == "full" and job.optimizer_state_bits == 8:
        pins = replace(pins or Pins(), optimizer_tier=("host",) * (num_blocks + 2))
    return pins


def plan_job(model: ModelSpec, hw: HardwareSpec, job: JobSpec,
             options: PlannerOptions = PlannerOptions(), *, cache_dir: str | Path | None = "solver_cache",
             use_cache: bool = True, method: str = "milp", explain: bool = True,
             free_resolve_s: float = FREE_RESOLVE_S) -> Plan:
    """Plan one job with the MILP (method="milp") or score a heuristic ("heuristic:<name>").
    `free_resolve_s`: milp.solve_milp's re-solve without symmetry-breaking rows (0: off; a plan
    asked for with it off is not cached, as it may be slower than the one the default finds)."""
    if method != "milp" and method.removeprefix("heuristic:") not in HEURISTICS:
        raise ValueError(f"unknown method {method!r}; valid: milp, " + ", ".join(f"heuristic:{h}" for h in HEURISTICS))
    if job.seq_len > model.max_position_embeddings:
        raise ValueError(f"job.seq_len={job.seq_len} exceeds the model's max_position_embeddings="
                         f"{model.max_position_embeddings}")
    if explain and hw.device_type == "cpu" and hw.device_memory_bytes > hw.host_usable_bytes > 0:   # (not for advice's checks)
        log.warning("hardware.device_memory_gib=%g exceeds the %.2f GiB of usable host RAM a CPU device "
                    "takes it from: planned within %.2f GiB", hw.device_memory_gib, hw.host_usable_bytes / GiB,
                    hw.host_usable_bytes / GiB)
    h = input_hash(model.hf_config, hw, job, options, method, versions())
    cache = PlanCache(cache_dir) if cache_dir is not None else None
    if cache is not None and use_cache:
        hit = cache.get(h)
        if hit is not None and hit.job != job:   # (solved for a job that differs in nothing it plans by)
            hit = replace(hit, job=job)
        if hit is not None:   # (the hash covers the config, not the name: another name, same plan)
            if hit.model_name == model.name:
                return hit
            # its explanation may name the model it was solved for (the host/NVMe floor does)
            old = hit.model_name
            return replace(hit, model_name=model.name, explanation=tuple(
                line.replace(f" of {old} (", f" of {model.name} (") if old else line for line in hit.explanation))
    costs = job_costs(model, hw, job)
    r = _solve(costs, hw, options, pins_for(method, model.num_layers, job, options),
               free_resolve_s=free_resolve_s)
    if r.status == "timeout" and method == "milp":
        r = _fallback(costs, hw, options, model.num_layers, job, r)
    timed_out = r.status == "timeout"
    if timed_out:   # no plan found in time is no proof that none fits: say so, not what would fit
        plan = _empty_plan(model, hw, job, options, method, h, r, (_timed_out_line(options),))
    elif r.status == "infeasible":
        lines, unknown = _explain_infeasible(model, hw, job, options, method) if explain else ((), False)
        if unknown:   # (a figure in it came from a search the time limit cut short)
            timed_out = True        # not cached: the next run, or a longer limit, may say more
            if not any("time_limit_s" in line for line in lines):
                lines = [*lines, f"(some of these figures come from searches that hit planner.time_limit_s="
                                 f"{options.time_limit_s}; raise it for exact ones)"]
        plan = _empty_plan(model, hw, job, options, method, h, r, tuple(lines))
    else:
        plan = build_plan(model, hw, job, options, method, h, costs, r)
    # A heuristic returned because the MILP ran out of time (a busy machine, a short limit) is
    # not cached: the next run tries the MILP again instead of being served the fallback for good.
    # Nor is a time limit's "no plan found": a wall-clock outcome, not a property of the inputs.
    # Nor an infeasible answer asked for without its explanation: cached, every later `lazytrain
    # plan` with these inputs printed "infeasible: " and no advice (review).
    unexplained = not explain and r.status == "infeasible"
    if (cache is not None and not plan.solver.fell_back and not timed_out and not unexplained
            and free_resolve_s == FREE_RESOLVE_S):
        try:
            cache.put(plan)
        except OSError as e:   # the cache only saves time: planning goes on without it
            log.warning("planner cache %s not written (%s); set planner.cache_dir=DIR or "
                         "planner.cache=false", cache.dir, e.strerror or e)
    return plan


def _fallback(costs: JobCosts, hw: HardwareSpec, options: PlannerOptions, num_blocks: int,
              job: JobSpec, timed_out: MilpResult) -> MilpResult:
    """The MILP found no plan within planner.time_limit_s: return the best heuristic plan (their
    checkpointing pinned, the rest solved), marked `feasible` and saying so; never fail silently."""
    best: MilpResult | None = None
    for name in HEURISTICS:
        r = _solve(costs, hw, options, pins_for(f"heuristic:{name}", num_blocks, job, options))
        if r.assignment is not None and (best is None or r.objective_s < best.objective_s):
            best = replace(r, detail=f"{FALLBACK_DETAIL}{options.time_limit_s} s hit before the MILP found a "
                                     f"plan; best heuristic ({name}) returned")
    if best is None:
        return timed_out
    return replace(best, status="feasible", gap=None, wall_s=best.wall_s + timed_out.wall_s)


def build_plan(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
               method: str, h: str, costs: JobCosts, r: MilpResult) -> Plan:
    a = r.assignment
    assert a is not None
    if method == "milp":  # equally fast but simpler: fewer transfers, faster tiers (simplify.py)
        a = simplify(costs, a, hw, depth=options.prefetch_depth)
        if r.detail.startswith(FALLBACK_DETAIL) and a != r.assignment:
            # (it read as the heuristic's own plan, which `plan compare` shows slower: a review)
            r = replace(r, detail=f"{r.detail}, its tiers then made faster by simplify")
    tl = simulate(costs, a, hw, depth=options.prefetch_depth)
    decisions: list[LayerDecision] = []
    seg_of: dict[int, tuple] = {}
    for seg in a.segments:
        for j in range(seg.s + 1, seg.e + 1):
            seg_of[j] = seg
    for j, spec in enumerate(model.layers):
        if spec.kind == "block":
            seg = seg_of[j]
            first = j == seg.s + 1
            if seg.mode == RECOMPUTE:
                rec, start, act = True, seg.s + 1, (seg.tier if first else "none")
            else:
                rec, start, act = False, j, seg.tier
        else:
            rec, start, act = False, j, "device"
        decisions.append(LayerDecision(
            name=spec.name, kind=spec.kind, index=j, recompute=rec, segment_start=start,
            activation_tier=act, param_tier=a.param_tier[j], grad_tier=a.grad_tier[j],
            optimizer_tier=a.optimizer_tier[j]))
    predicted = Predicted(
        step_time_s=tl.step_time_s, tokens_per_s=job.tokens_per_step / tl.step_time_s,
        peak_bytes=dict(tl.peak_bytes), compute_s=tl.compute_s, recompute_s=tl.recompute_s,
        exposed_transfer_s=tl.exposed_transfer_s, serial_optimizer_s=tl.serial_optimizer_s,
        exposed_optimizer_s=tl.exposed_optimizer_s)
    plan = Plan(
        schema_version=SCHEMA_VERSION, input_hash=h, status=r.status, method=method,
        solver=SolverInfo(name=r.solver_name, wall_s=round(r.wall_s, 4), gap=r.gap, status_detail=r.detail),
        predicted=predicted, layers=tuple(decisions), model_name=model.name,
        model_config=dict(model.hf_config), hardware=hw, job=job, options=options,
        lazytrain_version=__version__, explanation=())
    lines = explain_plan(plan, costs, tl)
    if model.family not in FAMILIES:
        lines.append(f"model costs measured, not from formulas (no formulas for {model.family}: "
                     f"spec/generic.py); measured device peaks have been 0.72-0.99 of such plans' "
                     f"(bf16; fp32 jobs and LoRA lower)")
    return replace(plan, explanation=tuple(lines))


def _empty_plan(model, hw, job, options, method, h, r: MilpResult, lines: tuple[str, ...]) -> Plan:
    return Plan(
        schema_version=SCHEMA_VERSION, input_hash=h, status="infeasible", method=method,
        solver=SolverInfo(name=r.solver_name, wall_s=round(r.wall_s, 4), gap=None, status_detail=r.detail),
        predicted=Predicted(step_time_s=0.0, tokens_per_s=0.0, peak_bytes={"device": 0, "host": 0, "nvme": 0}),
        layers=(), model_name=model.name, model_config=dict(model.hf_config), hardware=hw, job=job,
        options=options, lazytrain_version=__version__, explanation=lines)


def assignment_of(plan: Plan, replay: bool = True) -> Assignment:
    """Rebuild the raw decisions from a Plan (to replay it in the simulator). The cost model's
    recompute segments run over blocks: a (hand-made) plan that recomputes the embedding or the
    head, which the executor runs, is refused for a replay rather than replayed as another plan
    (its predicted peak came out 16-21% low; review); `replay=False` (a structure check) takes it."""
    from .assignment import STORE, Segment
    L = len(plan.layers) - 2
    for d in (plan.layers[0], plan.layers[-1]) if replay else ():
        if d.recompute:
            raise ValueError(f"{d.name}: a recompute segment over the {d.kind} has no term in the cost "
                             f"model (the planner recomputes blocks only); its step time and peaks "
                             f"cannot be predicted")
    segs: list[Segment] = []
    j = 1
    while j <= L:
        d = plan.layers[j]
        if d.recompute:
            e = j
            while e + 1 <= L and plan.layers[e + 1].recompute and plan.layers[e + 1].segment_start == d.segment_start:
                e += 1
            segs.append(Segment(j - 1, e, RECOMPUTE, d.activation_tier))
            j = e + 1
        else:
            segs.append(Segment(j - 1, j, STORE, d.activation_tier))
            j += 1
    return Assignment(segments=tuple(segs), param_tier=tuple(d.param_tier for d in plan.layers),
                      grad_tier=tuple(d.grad_tier for d in plan.layers),
                      optimizer_tier=tuple(d.optimizer_tier for d in plan.layers))


def simulate_plan(plan: Plan) -> Timeline:
    model = ModelSpec.from_hf_config(plan.model_config, name=plan.model_name)
    costs = job_costs(model, plan.hardware, plan.job)
    return simulate(costs, assignment_of(plan), plan.hardware, depth=plan.options.prefetch_depth)


# ---- explanations ---------------------------------------------------------------------------

def _up(n: float, unit: int = GiB) -> float:
    """`n` bytes in `unit`s, rounded up to 0.01: a floor the user may set as it reads."""
    return math.ceil(n / unit * 100) / 100


def _up_setting(n: float) -> tuple[float, str]:
    """`n` bytes as a GiB setting rounded up, to 0.01 GiB or 3 significant digits, whichever is
    finer (a toy job's 13.7 MiB minimum read "0.02 GiB", 1.5x what it needs), and its text."""
    gib = n / GiB
    if gib <= 0:
        return 0.0, "0.00"
    e = min(-2, math.floor(math.log10(gib)) - 2)   # the step is 10**e GiB
    v = math.ceil(round(gib * 10 ** -e, 6)) / 10 ** -e
    return v, f"{v:.{-e}f}"


def _host_grown(hw: HardwareSpec, dev_gib: float, dev_txt: str) -> str:
    """hardware.host_memory_gib grown by what a CPU device's setting `dev_gib` adds, to that
    setting's decimals (rounded to 1e-6 first: 4.2 + 0.26 - 0.1 is 4.36 plus float noise, not 4.37)."""
    d = max(2, len(dev_txt.partition(".")[2]))
    return f"{math.ceil(round((hw.host_memory_gib + dev_gib - hw.device_memory_gib) * 10**d, 6)) / 10**d:.{d}f}"


def _gib(n: float, up: bool = False) -> str:
    """GiB to 0.01 (rounded up with `up`); a non-zero amount below that in MiB (a toy model's
    "0.00 GiB" says nothing)."""
    unit, name = (2**20, "MiB") if 0 < abs(n) < 0.005 * GiB else (GiB, "GiB")
    return f"{_up(n, unit) if up else n / unit:.2f} {name}"


def _budget(hw: HardwareSpec) -> str:
    """The device budget as the user set it (`_gib` made 0.006 GiB "0.01 GiB", next to a need of
    0.00849 GiB: a review)."""
    return f"{hw.device_memory_gib:g} GiB"


def explain_plan(plan: Plan, costs: JobCosts, tl: Timeline) -> list[str]:
    lines: list[str] = []
    blocks = [d for d in plan.layers if d.kind == "block"]
    rec = [d for d in blocks if d.recompute]
    stored_act = sum(c.act_bytes for c in costs.blocks)
    if rec:
        segs = plan.segments()
        lines.append(f"{len(rec)}/{len(blocks)} blocks recomputed in {len(segs)} segment(s) (keeping every "
                     f"block's activations would take {_gib(stored_act)}); recompute costs "
                     f"{tl.recompute_s:.3f} s/step")
    else:
        lines.append(f"no recompute: all block activations ({_gib(stored_act)}) are kept")
    tiers = Counter(d.activation_tier for d in blocks if d.activation_tier != "none")
    if tiers.get("host") or tiers.get("nvme"):
        lines.append("kept activations offloaded: " + ", ".join(f"{n} to {t}" for t, n in tiers.items() if t != "device"))
    pt = Counter(d.param_tier for d in plan.layers)
    lines.append("parameters: " + ", ".join(f"{n} layer(s) {'resident on device' if t == 'device' else 'streamed from ' + t}"
                                           for t, n in sorted(pt.items())))
    if costs.trains_base:
        ot = Counter(d.optimizer_tier for d in plan.layers)
        lines.append(f"optimizer state ({optimizer_state_label(plan.job)}): "
                     + ", ".join(f"{n} on {t}" for t, n in sorted(ot.items())))
        serial = tl.serial_optimizer_s > 0   # hardware.optimizer_overlaps_compute false (a CPU device)
        lines.append(("updates wait for the global norm: they run after the backward, "
                      + ("on the cores that compute (not overlapped)" if serial else "overlapping the next forward")
                      + (" (clipping: job.clip_grad; `train` sets it from optim.max_grad_norm)" if plan.job.clip_grad
                         else " (fp16's overflow check)"))
                     if costs.clip_grad else
                     "updates follow each layer's backward (no clipping: job.clip_grad=false)"
                     + ("; they take the cores that compute (not overlapped)" if serial else ""))
    # what bounds the step: sum of time per resource over the step
    busy: Counter = Counter()
    for ev in tl.events:
        busy[ev.resource] += ev.end_s - ev.start_s
    top = ", ".join(f"{r} {s:.3f} s" + (f" (optimizer {tl.serial_optimizer_s:.3f} s of it)"
                                        if r == "compute" and tl.serial_optimizer_s > 0 else "")
                    for r, s in busy.most_common(4))
    hidden_not = (f"{tl.exposed_optimizer_s:.3f} s of optimizer and {tl.exposed_transfer_s:.3f} s of transfers"
                  if tl.exposed_optimizer_s > 0 else f"{tl.exposed_transfer_s:.3f} s")
    lines.append(f"busy time per resource: {top}; step {tl.step_time_s:.3f} s, of which "
                 f"{hidden_not} not hidden behind compute")
    if plan.hardware.copies_share_compute:
        lines.append("the device is the CPU: host<->device copies are memcpys by the computing cores "
                     "(they add to the step), NVMe reads land in device memory")
    dev = plan.predicted.peak_bytes["device"]
    lines.append(f"device peak {peak_text(dev, plan.hardware.device_memory_gib)} GiB of "
                 f"{_budget(plan.hardware)} budget"
                 + _peak_where(plan, costs))
    return lines


def _peak_where(plan: Plan, costs: JobCosts) -> str:
    """Which op of the micro-batch sets the device peak, and for the loss what it holds."""
    curve = memory_peaks(costs, assignment_of(plan), plan.options.prefetch_depth)[1]
    if not curve:
        return ""
    op = op_sequence(costs.num_blocks)[max(curve, key=lambda c: c[1])[0]]
    name = plan.layers[op.layer].name
    if op.kind == HEAD:
        tokens, vocab = costs.tokens_per_micro_batch, plan.model_config.get("vocab_size")
        own = f", at the loss: the head's own {_gib(head_peak_bytes(costs))}"
        chunk = plan.job.loss_chunk_tokens
        if chunk:
            return (own + f" (chunked: logits for {min(chunk, tokens)} of {tokens} tokens at a time"
                    + (", and the fp32 sum of its weight gradient)" if costs.trains_base else ")"))
        return own + (f" (what it saves, and in its backward two fp32 gradients over {tokens} tokens x "
                      f"{vocab} vocabulary; job.loss_chunk_tokens or fewer tokens per micro-batch shrink it)")
    return f", at the {'forward' if op.kind == FWD else 'backward'} of {name}"


def min_device_bytes(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
                     method: str = "milp") -> int | None:
    """Smallest device memory any plan (of this method) needs, found to `options.mip_gap` (the true
    minimum may be that fraction lower); None if host/NVMe cannot hold it.

    Never above what a second look finds: HiGHS has called a minimum 0.8% too high optimal at
    mip_gap 0 (tiny-llama, batch 41: 324.3 MB; 321.6 MB plans) on the small coefficients of a toy
    model's rows; without presolve, or with other tolerances, it found the lower one. So a HiGHS
    answer is solved again without presolve, started from its plan, and for the MILP each
    heuristic's minimum is taken too (any of their plans is one the MILP may choose). The
    symmetry-breaking rows are not the cause: that plan satisfies them (and P is the same for
    any order of identical blocks' tiers)."""
    costs = job_costs(model, hw, job)
    pins = pins_for(method, model.num_layers, job, options)
    r = _solve(costs, hw, options, pins, minimize="device_peak")
    if r.status == "timeout":
        return TIMED_OUT
    if r.status == "infeasible" or r.assignment is None:
        return None
    found = [r.assignment]
    if r.solver_name == "highs":
        again = _solve(costs, hw, options, pins, minimize="device_peak", presolve=False, start=r.assignment)
        found.append(again.assignment)
    if method == "milp":
        for name in HEURISTICS:
            hpins = pins_for(f"heuristic:{name}", model.num_layers, job, options)
            found.append(_solve(costs, hw, options, hpins, minimize="device_peak").assignment)
    return min(memory_peaks(costs, a, options.prefetch_depth)[0]["device"]   # = simulate()'s
               for a in found if a is not None)


def min_tier_bytes(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
                   method: str, tier: str) -> int | None:
    """Least host memory (`tier="host"`) or NVMe ("nvme") any plan of this method needs within the
    device's and the other tier's capacities (the MILP with that tier's capacity row dropped and
    its peak minimised); None where no plan fits those, TIMED_OUT where the solve ran out of time
    (at most SUGGESTION_TIME_LIMIT_S). What the advice for a job the host or the drive cannot hold
    is sized from: the few hand-built layouts it was sized from before put everything on one tier,
    asking a 64 GiB host with 60 GiB of NVMe for 135 GiB where 70 plans (review)."""
    costs = job_costs(model, hw, job)
    pins = pins_for(method, model.num_layers, job, options)
    quick = replace(options, time_limit_s=min(options.time_limit_s, SUGGESTION_TIME_LIMIT_S))
    r = _solve(costs, hw, quick, pins, minimize=f"{tier}_peak")
    if r.status == "timeout":
        return TIMED_OUT
    if r.status == "infeasible" or r.assignment is None:
        return None
    return memory_peaks(costs, r.assignment, options.prefetch_depth)[0][tier]


def fits(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
         method: str = "milp") -> bool | None:
    """Whether some plan fits the device budget: the model plan_job solves, with its device
    capacity row, asked for any plan (the first found ends the solve), so that a batch called too
    large is one plan_job cannot plan either. Deciding with the minimum (min_device_bytes) called
    tiny-llama's batch 41 too large at 0.3 GiB, which plan_job and offload-all plan: HiGHS had
    reported that minimum 0.8% high as optimal. A time limit hit first: for the MILP, a heuristic's
    plan that fits is a yes (plan_job would return it, as its fallback); else None, unknown (it was
    counted a no: `plan max-batch` gave the MILP a smaller batch than the heuristics, or 0)."""
    costs = job_costs(model, hw, job)

    def one(pins) -> bool | None:
        r = _solve(costs, hw, options, pins, minimize="device_peak",
                   device_capacity_bytes=costs.device_capacity_bytes, mip_gap=1.0)
        if r.status == "timeout":
            return None
        return r.assignment is not None and r.status in ("optimal", "feasible")

    got = one(pins_for(method, model.num_layers, job, options))
    if got is None and method == "milp":
        answers = [one(pins_for(f"heuristic:{name}", model.num_layers, job, options)) for name in HEURISTICS]
        got = True if any(answers) else None
    return got


def max_batch(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
              method: str = "milp", limit: int = 4096, report: dict | None = None) -> int:
    """Largest micro-batch whose plan fits (0 if even batch 1 does not). Feasibility is monotone
    in the batch, so exponential search then bisection. A probe the time limit left unknown counts
    as a no, and `report["timed_out"]` (when given) says the answer is then only a lower bound."""
    def ok(b: int) -> bool:
        got = fits(model, hw, replace(job, batch_size=b), options, method)
        if got is None and report is not None:
            report["timed_out"] = True
        return bool(got)
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def best_split(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
               global_batch: int, max_micro_batch: int) -> list[tuple[int, int, Plan]]:
    """(micro_batch, grad_accum, plan) for every split of `global_batch` that fits, fastest first."""
    out = []
    for b in range(1, min(global_batch, max_micro_batch) + 1):
        if global_batch % b:
            continue
        j = replace(job, batch_size=b, grad_accum=global_batch // b)
        p = plan_job(model, hw, j, options, cache_dir=None, explain=False)
        if p.fits:
            out.append((b, global_batch // b, p))
    return sorted(out, key=lambda t: -t[2].predicted.tokens_per_s)


def _off_device_layouts(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
                        method: str = "milp") -> list[dict[str, int]]:
    """Per-tier peaks (simulate.memory_peaks) of a few layouts that keep little on the host, what
    the method's pins fix kept as pinned (8-bit states on the host: `pins_for`). Off-device
    items go to NVMe (where planner.allow_nvme) or the host; parameters stay on the device, or
    the embedding's and head's do, or none (streamed: `depth` of the largest layer's weights
    staged on the host when from NVMe); kept activations on NVMe, or block boundaries on the
    device (recompute); gradients (with accumulation) on the off tier; optimizer state on the
    off tier, except that on NVMe the largest layers' may stay on the host where that costs less
    than staging them (NVME_STATE_SETS sets of the largest NVMe-tier layer's)."""
    costs = job_costs(model, hw, job)
    L = model.num_layers
    n = L + 2
    pins = pins_for(method, L, job, options) or Pins()

    def pinned(tiers: tuple[str, ...], pin) -> tuple[str, ...]:
        return tiers if pin is None else tuple(t if p is None else p for t, p in zip(tiers, pin))

    offs = ("nvme", "host") if options.allow_nvme else ("host",)
    if pins.segments is not None:
        seg_sets = [pins.segments]
    else:
        seg_sets = [tuple(Segment(j, j + 1, RECOMPUTE, "device") for j in range(L))]
        if options.allow_nvme:
            seg_sets.append(tuple(Segment(j, j + 1, STORE, "nvme") for j in range(L)))
    # optimizer state on NVMe: the k largest layers' on the host instead (k at each size change)
    order = sorted(range(n), key=lambda j: -costs.layers[j].optimizer_bytes)
    ks = [k for k in range(n + 1) if k in (0, n)
          or costs.layers[order[k - 1]].optimizer_bytes > costs.layers[order[k]].optimizer_bytes]
    out = []
    for off in offs:
        for params in ("device", "ends", "off"):
            pt = tuple("device" if params == "device" or (params == "ends" and j in (0, n - 1)) else off
                       for j in range(n))
            pt = pinned(pt, pins.param_tier)
            gt = pinned((off,) * n, pins.grad_tier)
            for k in (ks if off == "nvme" else [0]):
                host_set = set(order[:k])
                ot = pinned(tuple("host" if j in host_set else off for j in range(n)), pins.optimizer_tier)
                for segs in seg_sets:
                    a = Assignment(segments=tuple(segs), param_tier=pt, grad_tier=gt, optimizer_tier=ot)
                    out.append(memory_peaks(costs, a, options.prefetch_depth)[0])
    return out


def _least_host_and_nvme(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
                         method: str = "milp") -> tuple[int, int]:
    """Host and NVMe bytes of the layout (of `_off_device_layouts`, those the device holds where
    any does) that keeps the least on the host: a floor for plans like it; with that much host
    memory and the NVMe it needs, the job plans (device memory permitting). Parameters the device holds take no host memory
    (a 16-bit llama3-8b's on a 24 GiB GPU), streamed ones `depth` staging buffers."""
    layouts = _off_device_layouts(model, hw, job, options, method)
    # those the drive holds, where any does: with no NVMe the floor was a layout needing hundreds
    # of GiB of it, and more host memory, which plans, was never said (review)
    layouts = [p for p in layouts if p["nvme"] <= hw.nvme_capacity_bytes] or layouts
    held = [p for p in layouts if p["device"] <= hw.device_memory_bytes]
    if not held:
        # None fits the device: size host and NVMe for the layouts that need the least device
        # memory. (The least host of all keeps every parameter on the device: advice sized for it
        # sent llama3.1-405b full on a 3090 to a device of 770 GiB where ~26 GiB plans; review.)
        least = min(p["device"] for p in layouts)
        held = [p for p in layouts if p["device"] == least]
    best = min(held, key=lambda p: (p["host"], p["nvme"]))
    return best["host"], best["nvme"]


def _off_device_advice(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
                       method: str, host: int, nvme: int) -> str:
    """What would let the job fit off the device: the job settings (not already in effect) whose
    floor host and NVMe hold, each with its host floor, and the host memory (or NVMe) the job
    needs as it is."""
    changes: list[tuple[str, dict]] = []
    if job.mode == "full":
        if job.master_dtype != "bf16" and job.compute_dtype == "bf16":
            # pure bf16 keeps no fp32 master, which 8-bit states need (JobSpec)
            changes.append(("job.master_dtype=bf16" + (" job.optimizer_state_bits=32"
                                                       if job.optimizer_state_bits == 8 else ""),
                            dict(master_dtype="bf16", optimizer_state_bits=32)))
        if job.optimizer_state_bits != 8 and job.master_dtype == "fp32":
            changes.append(("job.optimizer_state_bits=8", dict(optimizer_state_bits=8)))
        if job.grad_accum == 1:
            # with accumulation the gradients may wait on NVMe between micro-batches (without it every
            # layer's fp32 gradients stay on the host until the update)
            b = job.batch_size
            changes.append((f"job.batch_size={b // 2} job.grad_accum=2 (the same tokens per step)"
                            if b >= 2 and b % 2 == 0 else "job.grad_accum=2 (twice the tokens per step)",
                            dict(grad_accum=2, batch_size=b // 2 if b >= 2 and b % 2 == 0 else b)))
    if job.mode != "lora":
        changes.append(("job.mode=lora", dict(mode="lora")))
    fixes, refuted = [], []
    for label, kw in changes:
        try:
            other = replace(job, **kw)
        except ValueError:
            continue
        # Each change is planned (only this path pays it), not judged by the layouts' floor: on a
        # small device a change can fit host and NVMe and still not plan, and without NVMe the
        # floor overstates what the planner needs (it keeps some blocks resident).
        p, cut = _check(model, hw, other, options, method)
        if p is not None:
            fixes.append(f"{label} (planned host peak {_gib(p.predicted.peak_bytes.get('host', 0), up=True)})")
        elif not cut:
            refuted.append(label)
    costs = job_costs(model, hw, job)
    # the host memory (and NVMe) with which the floor's layout fits, rounded up to 0.01 GiB
    # hardware.host_memory_gib also holds the reserve (and a CPU device's memory: job_costs); the
    # reserve in full: host_usable_bytes is floored at 0 where host_memory_gib is below it
    extra = int(hw.host_reserve_gib * GiB) + (hw.device_memory_bytes if hw.device_type == "cpu" else 0)
    more_hw = {}
    if host > costs.host_capacity_bytes:
        more_hw["host_memory_gib"] = _up(host + extra)
    if nvme > costs.nvme_capacity_bytes:
        more_hw["nvme_capacity_gib"] = _up(nvme)
    needs = [f"hardware.{k}={v:.2f}" for k, v in more_hw.items()]
    short = " and ".join(w for w, k in (("host memory", "host_memory_gib"), ("NVMe", "nvme_capacity_gib"))
                         if k in more_hw)
    if not more_hw:
        more = "add host memory or NVMe"
    elif (chk := _check(model, replace(hw, **more_hw), job, options, method))[0] is not None:
        more = f"add {short} ({', '.join(needs)})"
    elif chk[1]:
        more = f"add {short} (about {', '.join(needs)}; not checked within {_check_limit(options)})"
    else:
        more = (f"add {short} (with {' '.join(needs)} alone it still does not plan: the device needs "
                f"more memory too)")
    if "nvme_capacity_gib" not in more_hw and options.allow_nvme and "host_memory_gib" in more_hw:
        # or more NVMe with this host: the least any plan then needs (review: only host memory was
        # said where a larger drive plans the job with the host there is)
        drive = min_tier_bytes(model, hw, job, options, method, "nvme")
        if drive is not None and drive != TIMED_OUT and drive > costs.nvme_capacity_bytes:
            alt = replace(hw, nvme_capacity_gib=_up(drive))
            if _planned(model, alt, job, options, method) is not None:
                more += f", or add NVMe instead (hardware.nvme_capacity_gib={alt.nvme_capacity_gib:.2f})"
    if "nvme_capacity_gib" in more_hw and options.allow_nvme:
        # or no NVMe at all: the host-only layouts' floor, where more host memory plans it
        # (review: with NVMe capacity 0 only NVMe was suggested)
        # (the device-held layouts' floor: the least host of all keeps every parameter on a device
        # that cannot hold them, and that suggestion never planned: review)
        host_only = _least_host_and_nvme(model, hw, job, replace(options, allow_nvme=False), method)[0]
        alt = replace(hw, host_memory_gib=max(hw.host_memory_gib, _up(host_only + extra)))
        if alt.host_memory_gib > hw.host_memory_gib and _planned(model, alt, job, options, method) is not None:
            more += f", or add host memory instead (hardware.host_memory_gib={alt.host_memory_gib:.2f}, no NVMe)"
    if fixes:
        return f"{more}, or use {' or '.join(fixes)}"
    return more + (f" (with {_or(refuted)} it would not plan either)" if refuted else "")


SUGGESTION_TIME_LIMIT_S = 10.0
SHORTEST_SEQ = 16   # the sequence length below which shortening is not worth suggesting
CHUNK_SUGGESTED = 1024


def _other_device_fixes(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
                        method: str, need: int) -> str:
    """Changes besides batch, length and device memory that let the job plan at this device budget:
    the chunked loss (when the logits set the floor) and more host memory (when the host, not the
    device, is what runs short: the layouts that would fit the device need more host than there
    is). Each is planned before it is said."""
    out = []
    tokens = job.batch_size * job.seq_len
    if not job.loss_chunk_tokens and tokens > CHUNK_SUGGESTED:
        chunked = replace(job, loss_chunk_tokens=CHUNK_SUGGESTED)
        c = min_device_bytes(model, hw, chunked, options, method)
        # (worth saying only where it saves 1%: 0.485 -> 0.484 GiB read as noise, or as more: review)
        if isinstance(c, int) and c != TIMED_OUT and c < 0.99 * need:
            fits = c <= hw.device_memory_bytes
            dev_gib, dev_txt = _up_setting(c)   # (to the precision of the need said before it: review)
            then = "plans it" if fits else f"brings the need down to {dev_txt} GiB"
            if not fits and hw.device_type == "cpu":
                # a CPU device's budget comes out of host RAM: the host grows with it, where it must
                # (review: the lower device figure alone did not plan)
                more = replace(hw, device_memory_gib=dev_gib)
                if _planned(model, more, chunked, options, method) is None:
                    then += (f" (hardware.device_memory_gib={dev_txt} and hardware.host_memory_gib="
                             f"{_host_grown(hw, dev_gib, dev_txt)}: the host grows with a CPU device's memory)")
            out.append(f"job.loss_chunk_tokens={CHUNK_SUGGESTED} (the loss over chunks of tokens, never all "
                       f"logits at once) {then}")
    host = min_tier_bytes(model, hw, job, options, method, "host")
    if host is None or host == TIMED_OUT:
        host, _ = _least_host_and_nvme(model, hw, job, options, method)
    if host > hw.host_capacity_bytes:
        extra = int(hw.host_reserve_gib * GiB) + (hw.device_memory_bytes if hw.device_type == "cpu" else 0)
        more = replace(hw, host_memory_gib=_up(host + extra))
        if _planned(model, more, job, options, method) is not None:
            out.append(f"hardware.host_memory_gib={more.host_memory_gib:.2f} plans it at this device budget "
                       f"(the host, holding what the device does not, is what runs short)")
    return ("; or " + "; or ".join(out)) if out else ""


_checks = threading.local()   # .unknown: a suggestion's check in this explanation hit the time limit


def _check(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
           method: str) -> tuple[Plan | None, bool]:
    """(the plan of a suggested change if it fits, whether its check hit the time limit). Not
    cached, not explained; at most 10 s of solver time each, as up to four run on the infeasible
    path. A check cut short says nothing negative of its suggestion; cut by planner.time_limit_s
    itself it is noted for the explanation, which is then not cached (review: 'job.mode=lora would
    not plan either' at a 1 ms limit, cached, where LoRA plans)."""
    quick = replace(options, time_limit_s=min(options.time_limit_s, SUGGESTION_TIME_LIMIT_S))
    # (only whether it plans and its host peak matter here: no re-solve for a faster plan)
    p = plan_job(model, hw, job, quick, cache_dir=None, explain=False, method=method, free_resolve_s=0.0)
    if p.fits:
        return p, False
    cut = timed_out(p)
    if cut and _planners_limit_cuts_checks(options):
        # planner.time_limit_s itself cut it: raising it may change the answer (not cached, and
        # said so). Cut by the suggestions' own cap, the suggestion is just not made: the answer
        # does not depend on planner.time_limit_s, which the line would tell the user to raise
        # (the session-17 review's point, undone by the session-21 fix above until session 22)
        _checks.unknown = True
    return None, cut


def _planners_limit_cuts_checks(options: PlannerOptions) -> bool:
    """Whether planner.time_limit_s (not the checks' own cap, below it) is what limits a check."""
    return options.time_limit_s <= SUGGESTION_TIME_LIMIT_S


def _check_limit(options: PlannerOptions) -> str:
    """What cuts a suggestion's check short, in words."""
    if _planners_limit_cuts_checks(options):
        return "planner.time_limit_s"
    return f"the {SUGGESTION_TIME_LIMIT_S:g} s each suggestion's check is given"


def _planned(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
             method: str) -> Plan | None:
    """The plan of a suggested change, if it fits (`_check`)."""
    return _check(model, hw, job, options, method)[0]


def _or(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


TIMED_OUT_LINE = "the planner hit planner.time_limit_s="   # how a time-limited empty plan's explanation starts


def _timed_out_line(options: PlannerOptions) -> str:
    return (f"{TIMED_OUT_LINE}{options.time_limit_s} before finding any plan "
            f"or proving none fits; raise planner.time_limit_s")


def timed_out(plan: Plan) -> bool:
    """No plan because the time limit came first (no proof that none fits)."""
    return not plan.fits and bool(plan.explanation) and plan.explanation[0].startswith(TIMED_OUT_LINE)


def explain_infeasible(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
                       method: str = "milp") -> list[str]:
    return _explain_infeasible(model, hw, job, options, method)[0]


def _explain_infeasible(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
                        method: str) -> tuple[list[str], bool]:
    """_explain: its answer is unknown too where a suggestion's check hit the time limit."""
    _checks.unknown = False
    try:
        lines, unknown = _explain(model, hw, job, options, method)
        return lines, unknown or _checks.unknown
    finally:
        _checks.unknown = False


def _explain(model: ModelSpec, hw: HardwareSpec, job: JobSpec, options: PlannerOptions,
             method: str) -> tuple[list[str], bool]:
    """(the explanation, whether planner.time_limit_s left an answer it states unknown: the device
    memory the job needs, its largest batch; a suggestion a time limit kept from being checked is
    just not made, and does not count: review)."""
    what = "no plan fits" if method == "milp" else f"{method} does not fit"
    if hw.device_type == "cpu" and hw.device_memory_bytes > hw.host_usable_bytes:
        # a CPU device's memory is host RAM: the budget cannot be met (the advice below would send
        # the user to a device budget already set: review)
        base = hw.device_memory_bytes + hw.host_reserve_gib * GiB
        floor, _ = _least_host_and_nvme(model, hw, job, options, method)   # what the host tier needs besides
        more = replace(hw, host_memory_gib=_up(base + floor))
        raise_to = (f"hardware.host_memory_gib to {more.host_memory_gib:.2f} (plans it)"
                    if _planned(model, more, job, options, method) is not None
                    else f"hardware.host_memory_gib above {_up(base):.2f}")
        return [f"{what}: a CPU device's memory is host RAM, and {_budget(hw)} (hardware.device_memory_gib) "
                f"exceeds the {_gib(hw.host_usable_bytes)} usable (hardware.host_memory_gib {hw.host_memory_gib:g} "
                f"less hardware.host_reserve_gib {hw.host_reserve_gib:g}): lower the device budget or raise "
                f"{raise_to}"], False
    need = min_device_bytes(model, hw, job, options, method)
    if need == TIMED_OUT:   # (plan_job calls this for a proven infeasibility: only the advice is unknown)
        return [f"{what} hardware.device_memory_gib={hw.device_memory_gib} (proven); the search for the "
                f"device memory it needs hit planner.time_limit_s={options.time_limit_s}: raise it for "
                f"what would fit"], True
    if need is None:
        # the least host any plan needs with the NVMe there is and this device (the MILP), where
        # one plans so; the layouts' floor only where none does (then the drive is short too)
        floor = min_tier_bytes(model, hw, job, options, method, "host")
        solved = floor is not None and floor != TIMED_OUT
        host, nvme = (floor, 0) if solved else _least_host_and_nvme(model, hw, job, options, method)
        # what the planner gives the host: less the reserve and, for a CPU device, its budget
        cap = hw.host_capacity_bytes
        usable = f"{_gib(cap)} usable" + (f" after the CPU device's {_budget(hw)}"
                                          if hw.device_type == "cpu" else "")
        if host > cap:
            where = ("with NVMe off (planner.allow_nvme=false)" if not options.allow_nvme else
                     "with no NVMe capacity" if hw.nvme_capacity_bytes <= 0 else
                     f"with the {_gib(hw.nvme_capacity_bytes)} of NVMe there is" if solved else
                     "even with everything that may live on NVMe there")
            why = (f"the host needs about {_gib(host, up=True)} {where} ("
                   + ("the least any plan needs" if solved else "the least of the layouts checked")
                   + f"; it has {usable})")
        else:
            why = (f"host ({usable}) and NVMe ({_gib(hw.nvme_capacity_bytes)}) hold less than the "
                   f"layout that needs the least host memory: ~{_gib(host)} there and {_gib(nvme)} on NVMe")
        return [f"{what}: the parameters, gradients and optimizer state of {model.name} "
                f"({model.param_count / 1e9:.2f}B params, mode {job.mode}) do not fit off the device: "
                f"{why}; {_off_device_advice(model, hw, job, options, method, host, nvme)}"], False
    best, cut = 0, {}
    if job.batch_size > 1:
        best = max_batch(model, hw, replace(job, batch_size=1), options, method, limit=job.batch_size - 1,
                         report=cut)
    if best:
        tail = f"the largest batch that fits {_budget(hw)} is {best} (job.batch_size={best})"
        if cut:
            tail = (f"batch {best} fits {_budget(hw)} (job.batch_size={best}; larger ones "
                    f"were cut short by planner.time_limit_s)")
    elif cut:
        tail = (f"no batch was found to fit {_budget(hw)} before planner.time_limit_s ran "
                f"out (raise it to know)")
    else:
        # whether any sequence length would do: the weights' streaming buffers and the workspace
        # do not shrink with it (review: "shorten job.seq_len" at seq 16, which needed 4.28 GiB)
        shortest = replace(job, batch_size=1, seq_len=min(job.seq_len, SHORTEST_SEQ))
        floor = min_device_bytes(model, hw, shortest, options, method) if shortest != job else need
        if floor != TIMED_OUT and (floor is None or floor > hw.device_memory_bytes):   # (timed out: unknown)
            # (the shortest length checked is said: "nor would any sequence length" was not true
            # below it, review)
            tail = (f"even batch 1 does not fit {_budget(hw)}, nor would batch 1 at job.seq_len={shortest.seq_len} "
                    + (f"(it needs {_up_setting(floor)[1]} GiB: streaming buffers and workspace)"
                       if floor is not None else "(it does not fit off the device)")
                    + ": add device memory")
        else:
            tail = f"even batch 1 does not fit {_budget(hw)}: shorten job.seq_len or add device memory"
    tail += _other_device_fixes(model, hw, job, options, method, need)
    need_gib, need_txt = _up_setting(need)  # rounded up: the suggested setting must fit
    setting = f"hardware.device_memory_gib={need_txt}"
    if hw.device_type == "cpu" and need_gib > hw.device_memory_gib:
        # A CPU device's budget comes out of host RAM (job_costs): more of it leaves the host less.
        # Where the host then runs short, the same amount must be added to host_memory_gib too.
        more = replace(hw, device_memory_gib=need_gib)
        if _planned(model, more, job, options, method) is None:
            grow = _up_setting((need_gib - hw.device_memory_gib) * GiB)[1]
            setting += (f" and hardware.host_memory_gib={_host_grown(hw, need_gib, need_txt)}: a CPU device's memory comes out "
                        f"of host RAM, which must grow by the same {grow} GiB")
    return [f"{what} hardware.device_memory_gib={hw.device_memory_gib}: this job "
            f"(batch {job.batch_size} x seq {job.seq_len}, {job.mode}) needs at least {need_txt} GiB "
            f"of device memory ({setting}); {tail}"], bool(cut)
