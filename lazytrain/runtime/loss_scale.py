"""Dynamic loss scaling for fp16 compute (torch.amp.GradScaler's rule, kept by the executor).

fp16 holds magnitudes down to ~6e-8 only: a language model's gradients (a 32k-vocab head's logit
gradients are ~1/(tokens x vocab)) flush to 0 without a scale. The loss is multiplied by `scale`
(a power of two) before backward; a step whose gradients overflowed (a non-finite global norm) is
skipped and the scale halves; after `growth_interval` good steps in a row it doubles. The
executor folds 1/scale into the clip coefficient, the one multiply its update already makes (no
unscaling pass; a power of two, so the result equals GradScaler's unscale_ then
clip_grad_norm_ bit for bit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


MIN_SCALE = 2.0 ** -126   # float32's smallest normal number


@dataclass
class DynamicLossScale:
    """torch.amp.GradScaler's defaults and update rule (``torch._amp_update_scale_``)."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0   # good steps in a row since the last change

    def __post_init__(self) -> None:
        for name, ok in (("scale", isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool)),
                         ("growth_factor", math.isfinite(self.growth_factor) and self.growth_factor > 1),
                         ("backoff_factor", 0 < self.backoff_factor < 1),
                         ("growth_interval", isinstance(self.growth_interval, int)
                          and not isinstance(self.growth_interval, bool) and self.growth_interval >= 1)):
            if not ok:
                want = {"scale": "a number", "growth_factor": "> 1", "backoff_factor": "in (0, 1)",
                        "growth_interval": "a whole number >= 1"}[name]
                raise ValueError(f"loss scale: {name} must be {want}, got {getattr(self, name)!r}")
        self.scale = _checked(self.scale)
        self.growth_tracker = min(int(self.growth_tracker), self.growth_interval - 1)

    def update(self, found_inf: bool) -> None:
        """After a step: back off on overflow, grow after `growth_interval` good steps."""
        if found_inf:
            # (not below float32's smallest normal number, where 1/scale overflows; GradScaler goes
            # on halving: this differs from it only after ~140 overflowed steps in a row)
            self.scale = max(_f32(self.scale * self.backoff_factor), MIN_SCALE)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = _f32(self.scale * self.growth_factor)
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, sd: dict) -> None:
        """Restore a saved scale and count; a count at or past this `growth_interval` (a resume
        with a smaller one) grows at the next good step (with ==, never again: review)."""
        scale, tracker = float(sd["scale"]), int(sd["growth_tracker"])
        if tracker < 0:
            raise ValueError(f"loss scale state: growth_tracker {tracker!r} is negative")
        self.scale = _checked(scale)
        self.growth_tracker = min(tracker, self.growth_interval - 1)


def _checked(x: float) -> float:
    """`x` as float32, refused unless a normal float32 > 0: a scale of inf skipped every step, a
    subnormal one made 1/scale overflow and the weights NaN (review)."""
    f = _f32(x)
    if not (math.isfinite(f) and f >= 2.0 ** -126):
        raise ValueError(f"loss scale: scale must be a normal float32 number > 0 (2**-126 to 2**127), got {x!r}")
    return f


def _f32(x: float) -> float:
    """`x` rounded to float32, as GradScaler keeps its scale (inf past float32's range)."""
    import struct

    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf
