"""Optimizers: fused blockwise 8-bit AdamW with folded-in gradient clipping, and its fp32 reference."""

from lazytrain.optim.adamw8bit import AdamW8bit
from lazytrain.optim.reference import AdamWRef

__all__ = ["AdamW8bit", "AdamWRef"]
