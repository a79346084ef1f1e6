"""--plot: device memory over a step (per tier) and a Gantt of compute and transfers."""

from __future__ import annotations

from pathlib import Path

from ..spec import GiB
from .plan import Plan
from .simulate import RESOURCES


def plot_plan(plan: Plan, path: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .solve import simulate_plan

    tl = simulate_plan(plan)
    fig, (ax_m, ax_g) = plt.subplots(2, 1, figsize=(12, 7), sharex=True,
                                     gridspec_kw={"height_ratios": [1, 1.3]})
    if tl.device_curve:
        t = [x for x, _ in tl.device_curve] + [tl.step_time_s]
        b = [y / GiB for _, y in tl.device_curve]
        ax_m.step(t, b + b[-1:], where="post", label="device")
    for tier, color in (("host", "tab:green"), ("nvme", "tab:brown")):
        ax_m.hlines(tl.peak_bytes[tier] / GiB, 0, tl.step_time_s, linestyles="dotted", colors=color,
                    label=f"{tier} (peak)")
    ax_m.axhline(plan.hardware.device_memory_gib, color="red", lw=0.8, label="device budget")
    ax_m.set_ylabel("GiB")
    ax_m.legend(loc="upper right", fontsize=8)
    ax_m.set_title(f"{plan.model_name} on {plan.hardware.name}: predicted step {tl.step_time_s:.3g} s")
    colors = {"compute_fwd": "tab:blue", "compute_bwd": "tab:green", "recompute": "tab:orange",
              "optimizer": "tab:purple"}
    for row, res in enumerate(RESOURCES):
        evs = [e for e in tl.events if e.resource == res and e.end_s > e.start_s]
        ax_g.broken_barh([(e.start_s, e.end_s - e.start_s) for e in evs], (row - 0.4, 0.8),
                         facecolors=[colors.get(e.kind, "tab:gray") for e in evs])
    ax_g.set_yticks(range(len(RESOURCES)), RESOURCES)
    ax_g.set_xlabel("seconds")
    fig.tight_layout()
    out = Path(path)
    if not out.suffix:   # (matplotlib writes a PNG and adds .png: the path said was another file)
        out = out.with_name(out.name + ".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
