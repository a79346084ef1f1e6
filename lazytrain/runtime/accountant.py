"""Memory accountant: every byte the executor places on the device tier is counted here.

On CPU (the CPU is the compute device) this count *is* the device budget's truth and going over
`budget_bytes` raises. On CUDA the count is cross-checked against torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import threading
from collections import defaultdict


class DeviceBudgetExceeded(MemoryError):
    """The executor would place more bytes on the device tier than the plan's budget."""


class MemoryAccountant:
    def __init__(self, budget_bytes: int, enforce: bool) -> None:
        self.budget_bytes = int(budget_bytes)
        self.enforce = enforce
        self.live_bytes = 0
        self.peak_bytes = 0
        self.by_kind: dict[str, int] = defaultdict(int)
        self.peak_by_kind: dict[str, int] = {}
        self._lock = threading.Lock()

    def alloc(self, nbytes: int, kind: str) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            self.live_bytes += nbytes
            self.by_kind[kind] += nbytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
                self.peak_by_kind = dict(self.by_kind)
            over = self.enforce and self.live_bytes > self.budget_bytes
            live = self.live_bytes
        if over:
            detail = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(self.by_kind.items()) if v)
            raise DeviceBudgetExceeded(
                f"device budget exceeded: {live / 2**20:.1f} MiB placed > budget "
                f"{self.budget_bytes / 2**20:.1f} MiB (while placing {kind}; live: {detail}); "
                f"plan with a smaller batch or more offload/recompute")

    def free(self, nbytes: int, kind: str) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            self.live_bytes -= nbytes
            self.by_kind[kind] -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes
            self.peak_by_kind = dict(self.by_kind)
