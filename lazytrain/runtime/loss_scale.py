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


@dataclass
class DynamicLossScale:
    """torch.amp.GradScaler's defaults and update rule (``torch._amp_update_scale_``)."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0   # good steps in a row since the last change

    def __post_init__(self) -> None:
        for name, ok in (("scale", math.isfinite(self.scale) and self.scale > 0),
                         ("growth_factor", math.isfinite(self.growth_factor) and self.growth_factor > 1),
                         ("backoff_factor", 0 < self.backoff_factor < 1),
                         ("growth_interval", isinstance(self.growth_interval, int)
                          and not isinstance(self.growth_interval, bool) and self.growth_interval >= 1)):
            if not ok:
                want = {"scale": "a finite number > 0", "growth_factor": "> 1", "backoff_factor": "in (0, 1)",
                        "growth_interval": "a whole number >= 1"}[name]
                raise ValueError(f"loss scale: {name} must be {want}, got {getattr(self, name)!r}")
        self.scale = _f32(self.scale)

    def update(self, found_inf: bool) -> None:
        """After a step: back off on overflow, grow after `growth_interval` good steps."""
        if found_inf:
            self.scale = _f32(self.scale * self.backoff_factor)
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
        scale, tracker = float(sd["scale"]), int(sd["growth_tracker"])
        if not (math.isfinite(scale) and scale > 0 and tracker >= 0):
            raise ValueError(f"loss scale state: scale {scale!r} or growth_tracker {tracker!r} out of range")
        self.scale, self.growth_tracker = _f32(scale), tracker


def _f32(x: float) -> float:
    """`x` rounded to float32, as GradScaler keeps its scale (inf past float32's range)."""
    import struct

    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf
