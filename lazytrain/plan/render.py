"""Human-readable views of a Plan: a per-layer table (identical neighbours collapsed) and a
summary."""

from __future__ import annotations

from ..spec import GiB
from .plan import Plan


def _groups(plan: Plan) -> list[tuple[str, int, tuple]]:
    rows: list[tuple[str, int, tuple]] = []
    segs = {s: e for s, e in plan.segments()}
    for d in plan.layers:
        seg = ""
        if d.recompute:   # named as the rows are (block.0 is layer 1)
            e = segs.get(d.segment_start)
            first = plan.layers[d.segment_start].name
            seg = f"{first}..{plan.layers[e].name}" if e is not None and e != d.segment_start else first
        key = (d.kind, "yes" if d.recompute else "no", d.activation_tier, d.param_tier, d.grad_tier,
               d.optimizer_tier, seg if d.recompute and d.activation_tier != "none" else "")
        if rows and rows[-1][2] == key and d.kind == "block" and not key[6]:
            name, n, _ = rows[-1]
            rows[-1] = (name, n + 1, key)
        else:
            rows.append((d.name, 1, key))
    return rows


def optimizer_state_label(job) -> str:
    """What the optimizer keeps per trained parameter, in words."""
    if job.mode == "lora":   # adapters (a few MiB) take fused fp32 AdamW whatever the bits say
        return "LoRA adapters: fp32 AdamW" + (" (optimizer_state_bits=8 applies to full fine-tuning only)"
                                              if job.optimizer_state_bits == 8 else "")
    if job.optimizer_state_bits == 8:
        return "fp32 master + 8-bit moments"
    if job.master_dtype == "bf16":   # ("pure bf16" for fp32 compute too, before: a review)
        return ("bf16 moments, no master: pure bf16" if job.compute_dtype == "bf16"
                else f"bf16 weights + moments, no fp32 master, {job.compute_dtype} compute")
    return "fp32 master + moments"


def gib_text(nbytes: float) -> str:
    """GiB with 2 decimals, or 4 significant digits below 1 GiB (a 0.0461 GiB peak read '0.05
    GiB (budget 0.0462)': over the budget it fits; review)."""
    x = nbytes / GiB
    return f"{x:.2f}" if x >= 1 or x == 0 else f"{x:.4g}"


def peak_text(nbytes: float, budget_gib: float) -> str:
    """`gib_text`, with more decimals where its rounding would put a peak that fits above its
    budget ('7.66 GiB (budget 7.6553)' for 7.6553 GiB; review)."""
    text = gib_text(nbytes)
    x = nbytes / GiB
    for d in range(3, 8):
        if x > budget_gib or float(text) <= budget_gib:
            break
        text = f"{x:.{d}f}"
    return text


def rate_text(r: float) -> str:
    return f"{r:,.0f}" if r >= 10 else f"{r:.3g}"   # (a 405B step printed '0 tokens/s')


def summary_lines(plan: Plan) -> list[str]:
    p = plan.predicted
    pk = p.peak_bytes
    j = plan.job
    gap = "-" if plan.solver.gap is None else f"{plan.solver.gap:.2%}"
    lines = [
        f"plan {plan.input_hash}  model {plan.model_name}  hardware {plan.hardware.name}  method {plan.method}",
        f"job {j.mode}  batch {j.batch_size} x seq {j.seq_len}  accum {j.grad_accum}  {j.compute_dtype}  "
        f"optimizer state {optimizer_state_label(j)}",
        f"status {plan.status}  solver {plan.solver.name}  gap {gap}  solve {plan.solver.wall_s:.2f} s",
        f"predicted step {p.step_time_s:.4g} s  ({rate_text(p.tokens_per_s)} tokens/s)  compute {p.compute_s:.4g} s  "
        f"recompute {p.recompute_s:.4g} s  "
        + (f"optimizer (not overlapped) {p.serial_optimizer_s:.4g} s  " if p.serial_optimizer_s else "")
        + (f"optimizer (not hidden) {p.exposed_optimizer_s:.4g} s  " if p.exposed_optimizer_s else "")
        + f"exposed transfers {p.exposed_transfer_s:.4g} s",
        f"peaks  device {peak_text(pk['device'], plan.hardware.device_memory_gib)} GiB "
        f"(budget {plan.hardware.device_memory_gib:g})  "
        f"host {gib_text(pk['host'])} GiB  nvme {gib_text(pk['nvme'])} GiB",
    ]
    if plan.solver.fell_back:   # the MILP timed out and a heuristic's plan is returned
        lines.insert(3, f"note   {plan.solver.status_detail}")
    return lines


def render(plan: Plan, console=None) -> str:
    """Print the full view to `console` (a rich Console), or return it as text when none is given."""
    from rich.console import Console
    from rich.table import Table

    header = ("layers", "n", "recompute", "activations", "params", "grads", "optimizer", "segment")
    table = Table(title=f"plan {plan.input_hash}", show_lines=False)
    for h in header:
        table.add_column(h)
    for name, n, key in _groups(plan):
        table.add_row(name if n == 1 else f"{name} ..", str(n), *key[1:])
    con = console or Console(record=True, width=120)
    for line in summary_lines(plan):
        con.print(line, highlight=False)
    if plan.layers:
        con.print(table)
    for x in plan.explanation:
        con.print(f"- {x}", highlight=False)
    return con.export_text() if console is None else ""
