"""Describing a training job's Plan in a few lines."""

from __future__ import annotations

from collections import Counter

from ..plan.plan import Plan
from ..plan.render import summary_lines


def plan_summary(plan: Plan) -> str:
    """A few lines: status, method, predicted step time / tokens/s / peaks, tiers and segments."""
    tiers = lambda attr: ", ".join(f"{k}:{v}" for k, v in sorted(Counter(
        getattr(d, attr) for d in plan.layers).items()))
    segs = plan.segments()
    seg_txt = ", ".join(f"{plan.layers[a].name}..{plan.layers[b].name}" for a, b in segs[:6])
    if len(segs) > 6:
        seg_txt += f", ... ({len(segs)} segments)"
    lines = summary_lines(plan) + [
        f"  params on [{tiers('param_tier')}]  activations on [{tiers('activation_tier')}]  "
        f"optimizer on [{tiers('optimizer_tier')}]",
        f"  recompute: {seg_txt or 'none'}",
    ]
    lines += [f"  {e}" for e in plan.explanation]
    return "\n".join(lines)
