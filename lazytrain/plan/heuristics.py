"""Hand-written checkpoint policies, scored with the planner's own cost model (their checkpoint
decisions pinned, the rest solved by the same MILP), so comparisons are like for like.

- no-checkpoint: every block keeps all its activations on the device (plain PyTorch).
- checkpoint-all: every block is its own recompute segment, input kept on the device
  (Hugging Face `gradient_checkpointing_enable()`).
- every-k: recompute segments of k blocks, inputs kept on the device (MegaTrain-style, k=4).
- offload-all: every block recomputed, its input offloaded to host, parameters and optimizer
  state on NVMe (ZeRO-Infinity-like).
"""

from __future__ import annotations

from .assignment import RECOMPUTE, STORE, Segment
from .milp import Pins

HEURISTICS = ("no-checkpoint", "checkpoint-all", "every-k", "offload-all")


def heuristic_pins(name: str, num_blocks: int, k: int = 4) -> Pins:
    L = num_blocks
    N = L + 2
    if name == "no-checkpoint":
        return Pins(segments=tuple(Segment(b, b + 1, STORE, "device") for b in range(L)))
    if name == "checkpoint-all":
        return Pins(segments=tuple(Segment(b, b + 1, RECOMPUTE, "device") for b in range(L)))
    if name == "every-k":
        return Pins(segments=tuple(Segment(b, min(L, b + k), RECOMPUTE, "device") for b in range(0, L, k)))
    if name == "offload-all":
        return Pins(segments=tuple(Segment(b, b + 1, RECOMPUTE, "host") for b in range(L)),
                    param_tier=("nvme",) * N, grad_tier=("host",) * N, optimizer_tier=("nvme",) * N)
    raise ValueError(f"unknown heuristic {name!r}; valid: {', '.join(HEURISTICS)}")
