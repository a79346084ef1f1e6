"""Assignment: the raw decisions (segments and tiers) a plan is made of, before it is dressed as a
Plan. The MILP produces one; heuristics write one by hand; the simulator replays one."""

from __future__ import annotations

from dataclasses import dataclass

STORE, RECOMPUTE = "store", "recompute"


@dataclass(frozen=True)
class Segment:
    """Blocks s+1..e (execution indices) between kept boundaries s and e.

    mode "store": e == s+1, the block keeps all its saved activations on `tier`.
    mode "recompute": only boundary s (the segment's input) is kept, on `tier`; the blocks'
    forward is re-run in backward.
    """
    s: int
    e: int
    mode: str
    tier: str

    def kept_bytes(self, costs) -> int:
        if self.mode == STORE:
            return costs.layers[self.e].act_bytes
        return costs.layers[self.s + 1].boundary_in_bytes

    def working_bytes(self, costs) -> int:
        """Transient device bytes while this segment's backward runs (beyond what it keeps)."""
        last = costs.layers[self.e]
        # (a block's forward, the first time or recomputed, holds at most what its segment's backward
        # holds with this: the forward windows need no bound of their own)
        fwd = max(costs.layers[j].fwd_transient_bytes for j in range(self.s + 1, self.e + 1))
        if self.mode == STORE:
            bwd = last.bwd_transient_bytes
            if self.tier != "device" and last.bwd_offloaded_transient_bytes is not None:
                bwd = last.bwd_offloaded_transient_bytes   # (brought back: held to its backward's end)
            return max(bwd, fwd)
        return sum(costs.layers[j].act_bytes for j in range(self.s + 1, self.e + 1)) + \
            max(last.bwd_transient_bytes, fwd)


@dataclass(frozen=True)
class Assignment:
    segments: tuple[Segment, ...]          # a path over boundaries 0..L (execution order)
    param_tier: tuple[str, ...]            # per layer (embed, blocks, head)
    grad_tier: tuple[str, ...]
    optimizer_tier: tuple[str, ...]

    def validate(self, num_blocks: int) -> None:
        pos = 0
        for seg in self.segments:
            if seg.s != pos or seg.e <= seg.s or (seg.mode == STORE and seg.e != seg.s + 1):
                raise ValueError(f"segments must form a path over boundaries 0..{num_blocks}: {seg}")
            pos = seg.e
        if pos != num_blocks:
            raise ValueError(f"segments end at boundary {pos}, expected {num_blocks}")
        n = num_blocks + 2
        for name in ("param_tier", "grad_tier", "optimizer_tier"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} needs {n} entries")

    def recompute_flags(self, num_blocks: int) -> list[bool]:
        """Per execution index 0..L+1: is the layer's forward re-run in backward."""
        flags = [False] * (num_blocks + 2)
        for seg in self.segments:
            if seg.mode == RECOMPUTE:
                for j in range(seg.s + 1, seg.e + 1):
                    flags[j] = True
        return flags
