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
from collections import defaultdict, deque
from contextlib import contextmanager
from functools import partial
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

OP_TEMPORARIES = "op_temporaries"


class DeviceBudgetExceeded(MemoryError):
    """The executor would place more bytes on the device tier than the plan's budget."""


class Held:
    """Bytes counted for one storage by `MemoryAccountant.hold`: uncounted when the storage is
    freed or on `MemoryAccountant.release`, whichever comes first."""

    __slots__ = ("nbytes", "kind", "counted", "ref")

    def __init__(self, nbytes: int, kind: str) -> None:
        self.nbytes, self.kind, self.counted, self.ref = nbytes, kind, True, None


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
        # Storages freed since the last count, from weakref callbacks. Those may run inside a
        # garbage collection, i.e. while any lock is held (this one too): they only append here,
        # and the queue is drained before anything is counted (`_drain`).
        self._dead: deque = deque()
        # serialises draining with a window's own bookkeeping (its live table): any thread that
        # counts drains, the window's thread changes the table (callbacks only append, so a
        # collection while this is held cannot deadlock)
        self._drain_lock = threading.RLock()

    def _drain(self) -> None:
        if not self._dead:   # (the common case, without the lock: an append racing this check
            return           # is drained by the next count, as one landing after the drain is)
        with self._drain_lock:
            while self._dead:
                self._dead.popleft()()

    def alloc(self, nbytes: int, kind: str) -> None:
        self._drain()
        if nbytes <= 0:
            return
        with self._lock:
            # A placement over the budget is refused and not counted, as an allocator's
            # out-of-memory error allocates nothing: counted, it stayed so, since its callers do
            # not take back what raised (a whole layer's gradients or weights leaked into every
            # later step's count and peak: review)
            live = self.live_bytes + nbytes
            over = self.enforce and live > self.budget_bytes
            if not over:
                self.live_bytes = live
                self.by_kind[kind] += nbytes
                if live > self.peak_bytes:
                    self.peak_bytes = live
                    self.peak_by_kind = dict(self.by_kind)
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
        self._drain()
        with self._lock:
            self.peak_bytes = self.live_bytes
            self.peak_by_kind = dict(self.by_kind)

    def hold(self, t: torch.Tensor, kind: str) -> Held:
        """Count `t`'s storage as `kind` until it is freed or `release(held)` (a tensor autograd
        saved: it may drop it during the layer's backward, before the executor releases the
        layer). Inside a watched window the storage stops being an op temporary."""
        st = t.untyped_storage()
        h = Held(st.nbytes(), kind)
        self.adopt(t)
        h.ref = weakref.ref(st, lambda _r, h=h: self._dead.append(partial(self.release, h)))
        try:
            self.alloc(h.nbytes, kind)
        except DeviceBudgetExceeded:
            h.counted = False   # (alloc counts nothing it refuses: the storage's death must not uncount it)
            raise
        return h

    def release(self, h: Held) -> None:
        """Uncount a `hold` (once: the storage's death and the owner's release may both come)."""
        with self._lock:
            if not h.counted:
                return
            h.counted = False
            self.live_bytes -= h.nbytes
            self.by_kind[h.kind] -= h.nbytes

    def adopt(self, t: torch.Tensor) -> None:
        """`t` is counted by hand from now on (call before counting it): inside a watched window
        its storage is no longer an op temporary."""
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
    it by hand (`MemoryAccountant.adopt`/`hold`: a saved activation, a fetched one), or the
    window closes (what survives is then the executor's to count: the layer's output, gradients).

    This is what a device allocator's peak sees and the executor's own counting does not: the
    temporaries of autograd and of the ops inside one layer (the head's fp32 logits and their
    gradients, an MLP's intermediate gradients), which the planner reserves as a layer's transient
    bytes. A new storage is an output whose storage is none of the op's inputs' (views and in-place
    results are not new memory); an op that mutates its arguments (`out=`, `resize_`) is checked
    for storages it grew. Scratch an op frees before it returns stays invisible. Over the budget it
    raises DeviceBudgetExceeded like any other placement. Cost: one Python call per op, ~10% of a
    step of a 200M model here, so it is an executor option."""

    def __init__(self, acct: MemoryAccountant, device: torch.device) -> None:
        super().__init__()
        self.acct, self.device_type = acct, torch.device(device).type
        # id(storage) -> [bytes counted, weakref]; storages keep their Python object while alive
        self.live: dict[int, list] = {}
        self.open = False
        self.paused = 0

    def __enter__(self):
        if self.acct._window is not None:
            raise RuntimeError("OpTemporaries windows do not nest")
        self.acct._drain()
        self.open = True
        self.acct._window = self
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.acct._window = None
            with self.acct._drain_lock:
                try:
                    self.acct._drain()
                finally:   # closed and uncounted even if a drained action raised
                    self.open = False
                    nb = sum(e[0] for e in self.live.values())
                    self.live.clear()
            self.acct.free(nb, OP_TEMPORARIES)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        mutated = None
        if func._schema.is_mutable:   # out=, resize_, in-place: sizes before, to see growth
            mutated = [(st, st.nbytes()) for st in self._storages(args, kwargs)]
        out = func(*args, **kwargs)
        self.acct._drain()   # what the op freed, before what it made is counted
        inputs = None
        for t in _tensors(out):
            if t.device.type != self.device_type:
                continue
            st = t.untyped_storage()
            if not st.data_ptr() or id(st) in self.live:
                continue
            if inputs is None:
                inputs = {id(a) for a, _ in mutated} if mutated is not None else \
                    {id(a) for a in self._storages(args, kwargs)}
            if id(st) not in inputs:
                self._track(st, st.nbytes())
        for st, before in mutated or ():
            grown = st.nbytes() - before
            if grown > 0:
                with self.acct._drain_lock:
                    ent = self.live.get(id(st))
                if ent is not None:
                    self.acct.alloc(grown, OP_TEMPORARIES)   # (counted first: a refused growth is not)
                    with self.acct._drain_lock:
                        ent[0] += grown
                else:
                    self._track(st, grown)
        return out

    def _storages(self, args, kwargs) -> list:
        return [a.untyped_storage() for a in (*_tensors(args), *_tensors(kwargs.values()))
                if a.device.type == self.device_type]

    def _track(self, st, nbytes: int) -> None:
        key = id(st)
        ent = [nbytes, None]
        # counted first: alloc refuses (and does not count) a placement over the budget, and a
        # tracked entry would be uncounted again when the storage dies or the window closes
        self.acct.alloc(nbytes, OP_TEMPORARIES)
        ent[1] = weakref.ref(st, lambda r, key=key: self.acct._dead.append(partial(self._drop, key, r)))
        with self.acct._drain_lock:
            self.live[key] = ent

    def adopt(self, t: torch.Tensor) -> None:
        """The executor counts `t` from now on: stop counting its storage here."""
        self._drop(id(t.untyped_storage()), None)

    def _drop(self, key: int, ref) -> None:
        with self.acct._drain_lock:
            if not self.open:
                return
            ent = self.live.get(key)
            # `ref`: the weakref that fired; the id may since belong to a newer storage
            if ent is None or (ref is not None and ent[1] is not ref):
                return
            del self.live[key]
        self.acct.free(ent[0], OP_TEMPORARIES)


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
