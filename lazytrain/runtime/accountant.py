"""Memory accountant: every byte the executor places on the device tier is counted here.

On CPU (the CPU is the compute device) this count *is* the device budget's truth and going over
`budget_bytes` raises. On CUDA the count is cross-checked against torch.cuda.max_memory_allocated.

What the executor places itself (weight buffers, saved activations, gradients, the boundary) it
counts by hand (`alloc`). What autograd and the ops make inside a layer's forward or backward (the fp32
logits and their gradient, an MLP's intermediate gradients) only an allocator sees; on a CPU device
`OpTemporaries` is that allocator's view: a dispatch mode over one layer's compute that counts every
storage an op creates until it is freed or the executor takes it over (`adopt`).
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from contextlib import contextmanager
from functools import partial
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

OP_TEMPORARIES = "op_temporaries"


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
        self._window: OpTemporaries | None = None   # the layer compute being watched, if any

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

    def adopt(self, t: torch.Tensor) -> None:
        """`t` is counted by hand (alloc) from now on: inside a watched window its storage is no
        longer an op temporary."""
        if self._window is not None:
            self._window.adopt(t)

    def op_window(self, device: torch.device) -> "OpTemporaries":
        """A context counting the storages ops create inside it on `device` (see OpTemporaries)."""
        return OpTemporaries(self, device)

    @contextmanager
    def host_side(self) -> Iterator[None]:
        """Inside a watched window: what is allocated here is host memory, not an op temporary."""
        w = self._window
        if w is None:
            yield
            return
        w.paused += 1
        try:
            yield
        finally:
            w.paused -= 1


class OpTemporaries(TorchDispatchMode):
    """Counts in the accountant (as `op_temporaries`) every storage an op creates on `device`
    while the window is open, from the op that makes it until it is freed, the executor counts
    it by hand (`MemoryAccountant.adopt`: a saved activation, a fetched one), or the
    window closes (what survives is then the executor's to count: the layer's output, gradients).

    This is what a device allocator's peak sees and the executor's own counting does not: the
    temporaries of autograd and of the ops inside one layer (the head's fp32 logits and their
    gradients, an MLP's intermediate gradients), which the planner reserves as a layer's transient
    bytes. A new storage is an output whose storage is none of the op's inputs' (views and in-place
    results are not new memory). Scratch an op frees before it returns stays invisible. Over the
    budget it raises DeviceBudgetExceeded like any other placement. Cost: one Python call per op
    (~1-3% of a step of a 200M model here), so it is an executor option."""

    def __init__(self, acct: MemoryAccountant, device: torch.device) -> None:
        super().__init__()
        self.acct, self.device_type = acct, torch.device(device).type
        self.live: dict[int, int] = {}   # storage data_ptr -> bytes counted
        self.refs: dict[int, weakref.ref] = {}
        self.open = False
        self.paused = 0
        self._lock = threading.Lock()

    def __enter__(self):
        if self.acct._window is not None:
            raise RuntimeError("OpTemporaries windows do not nest")
        self.open = True
        self.acct._window = self
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.acct._window = None
            with self._lock:
                self.open = False
                nb = sum(self.live.values())
                self.live.clear()
                self.refs.clear()
            self.acct.free(nb, OP_TEMPORARIES)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        inputs = None
        for t in _tensors(out):
            if t.device.type != self.device_type:
                continue
            st = t.untyped_storage()
            p = st.data_ptr()
            if not p or p in self.live:
                continue
            if inputs is None:
                inputs = {a.untyped_storage().data_ptr() for a in _tensors(args)}
                inputs.update(a.untyped_storage().data_ptr() for a in _tensors(kwargs.values()))
            if p in inputs:
                continue
            nb = st.nbytes()
            with self._lock:
                self.live[p] = nb
                # fires when the storage is freed (storages keep their Python object while alive)
                self.refs[p] = weakref.ref(st, partial(self._freed, p))
            self.acct.alloc(nb, OP_TEMPORARIES)
        return out

    def _freed(self, ptr: int, _ref) -> None:
        self._drop(ptr)

    def adopt(self, t: torch.Tensor) -> None:
        """The executor counts `t` from now on: stop counting its storage here."""
        self._drop(t.untyped_storage().data_ptr())

    def _drop(self, ptr: int) -> None:
        with self._lock:
            if not self.open:
                return
            nb = self.live.pop(ptr, None)
            self.refs.pop(ptr, None)
        if nb is not None:
            self.acct.free(nb, OP_TEMPORARIES)


def _tensors(x) -> Iterator[torch.Tensor]:
    """The tensors in an op's outputs or arguments (a tensor, or tuples/lists of them and of
    other values: what aten ops take and return; cheaper than a general pytree walk)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)) or type(x).__name__ == "dict_values":
        for y in x:
            if isinstance(y, torch.Tensor):
                yield y
            elif isinstance(y, (tuple, list)):
                yield from _tensors(y)
