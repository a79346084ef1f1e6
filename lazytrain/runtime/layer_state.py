"""Per-layer host-side training state for full fine-tuning: fp32 gradient accumulator, fp32 master
weights and AdamW moments, each on the tier the plan says (host RAM or NVMe files), and the
per-layer optimizer update that writes fresh compute-dtype weights back to the parameter store.

Every method here runs on the optimizer thread, one job at a time in submission order, so a
layer's accumulate -> update -> write-back sequence needs no locks.

NVMe-tier optimizer state (master + moments) moves through a shared, bounded pool of staging sets
(`StagingSets`): `prefetch()` starts reading a layer's state ahead of its update, the update waits
only for what has not arrived yet, and the write-back is asynchronous (the set returns to the pool
when it lands). A later read of the same layer first waits for its write-back; a failed write is
raised (with file and operation) at that read, at `flush()` or at close.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future

import torch
from torch.optim.adamw import adamw as _adamw

from ..storage.aligned_io import DiskIOError, IOPool
from ..storage.flat import FlatLayout, typed
from ..storage.tiers import HostStore, NvmeStore, StagingSets, staging_buffer
from .trace import Trace

F32 = torch.float32
OPT_KEYS = ("master", "exp_avg", "exp_avg_sq")


class LayerTrainState:
    """fp32 grads / master / moments for one layer's streamed parameters."""

    def __init__(self, name: str, layout: FlatLayout, grad_tier: str, optimizer_tier: str,
                 host: HostStore, nvme: NvmeStore | None, trace: Trace,
                 master_alias: str | None = None, staging: StagingSets | None = None,
                 state_io: IOPool | None = None, moments: bool = True) -> None:
        """`layout.dtype` is the master dtype: fp32 (default), or bf16 for pure-bf16 training
        (master, moments and gradient accumulator all bf16, as torch's AdamW on bf16 params).
        `moments=False`: the moments live elsewhere (AdamW8bit's 8-bit states, on the host): none
        are allocated here (they were, zeroed and never used: 8 bytes per parameter of host memory
        no plan counted, more than the 8-bit states saved; review)."""
        if not moments and optimizer_tier != "host":
            raise ValueError(f"{name}: state kept outside the layer (moments=False) needs the host tier")
        self.moments = moments
        self.name, self.layout = name, layout
        self.numel = layout.numel
        self.dtype = layout.dtype
        self.grad_tier, self.optimizer_tier = grad_tier, optimizer_tier
        self.host, self.nvme, self.trace = host, nvme, trace
        # AdamW's step counters, one per tensor (the fused kernel takes one per parameter)
        self.steps = [torch.zeros((), dtype=F32) for _ in layout.names]
        self.norms: list[torch.Tensor] = []         # per-tensor L2 norms of this step's grads
        self.track_norms = True                     # False: no clipping, nobody needs them
        self.has_grad = False
        self._staging: dict[str, torch.Tensor] = {}   # NVMe-tier tensors read for this job
        self._direct: list[torch.Tensor] | None = None  # this step's grads, used where they are
        self.direct_bytes = 0   # their device bytes, counted by the executor until the update ran
        # NVMe-tier optimizer state through staging sets (None: synchronous, fresh buffers)
        self.staging = staging if optimizer_tier == "nvme" else None
        # Its own I/O workers: the streamer's fetch jobs block pool workers while they wait, and
        # the optimizer thread waiting behind them on this state could deadlock.
        self.state_io = state_io
        self._set: tuple[list[torch.Tensor], dict[str, Future]] | None = None  # read ahead
        self._writes: list[Future] = []   # write-backs of the last update still landing
        # NVMe-tier tensors whose last write-back failed (their files are part old, part new):
        # every later read raises until they are stored whole again (store_tensor: a resume)
        self._incomplete: dict[str, BaseException] = {}
        for key, tier in (("grad", grad_tier), ("master", optimizer_tier),
                          *((("exp_avg", optimizer_tier), ("exp_avg_sq", optimizer_tier)) if moments else ())):
            store = self._store(tier)
            if key == "master" and master_alias is not None and tier == "host":
                # the master *is* the layer's host parameter store (pure bf16: same dtype), so the
                # update writes the weights in place and nothing needs publishing
                store.bufs[self._key(key)] = store.get(master_alias)
                continue
            store.allocate(self._key(key), self.layout.nbytes)

    def _key(self, what: str) -> str:
        return f"{self.name}.{what}"

    def _store(self, tier: str):
        if tier == "host":
            return self.host
        if tier == "nvme":
            if self.nvme is None:
                raise ValueError(f"{self.name}: plan puts state on nvme but no nvme_dir was given")
            return self.nvme
        raise ValueError(f"{self.name}: grad/optimizer tier must be host or nvme, got {tier!r}")

    # ---- NVMe-tier optimizer state: read ahead, asynchronous write-back --------------------
    def prefetch(self) -> None:
        """Start reading this layer's master and moments into a staging set (NVMe tier only)."""
        if self.staging is None or self._set is not None:
            return
        self._wait_writes()
        bufs = self.staging.acquire(self.layout.nbytes)
        reads: dict[str, Future] = {}
        trace, nvme, name, nbytes = self.trace, self.nvme, self.name, self.layout.nbytes
        step = trace.current_step()   # read ahead: it may run while the next step has begun

        def read(key: str, buf: torch.Tensor) -> None:
            # traced where the I/O runs (the update's wait for it is not drive time)
            with trace.at_step(step), trace.span("nvme_read", name, nbytes, "nvme", "optimizer_state"):
                nvme.read_sync(key, buf)

        try:
            for w, b in zip(OPT_KEYS, bufs):
                reads[w] = (self.state_io or nvme.pool).submit(read, self._key(w), b)
        except BaseException:
            for f in reads.values():
                f.exception()
            self.staging.release(bufs)
            raise
        self._set = (bufs, reads)

    def cancel_prefetch(self) -> None:
        """Drop read-ahead state (a skipped step, or before the state is changed another way)."""
        if self._set is None:
            return
        bufs, reads = self._set
        self._set = None
        for f in reads.values():
            f.exception()   # wait: the buffers must be idle before they go back to the pool
        self.staging.release(bufs)

    def _wait_writes(self, strict: bool = True) -> None:
        """Wait for the last write-backs, raising a failed one (DiskIOError names the file and the
        operation), and, `strict`, raise while a file a failed write left incomplete is not stored
        whole again (review: the failure was raised once, and the next step trained on from the
        half-written master)."""
        writes, self._writes = self._writes, []
        failed: BaseException | None = None
        for what, f in zip(OPT_KEYS, writes):
            e = f.exception()   # (every write waited for before raising)
            if e is not None:
                self._incomplete[what] = e   # marked here, before any read: not by a callback
                failed = failed or e
        if failed is not None and strict:   # (not strict: the caller stores the state whole anew)
            raise failed
        if strict and self._incomplete:
            what, e = next(iter(self._incomplete.items()))
            raise DiskIOError(0, f"{self._key(what)} on NVMe is incomplete since its write-back failed ({e}); "
                                 f"restore the training state (resume from the last checkpoint)")

    def flush(self, strict: bool = True) -> None:
        """Wait for this layer's write-backs (raising a failed one) and drop read-ahead state."""
        self.cancel_prefetch()
        self._wait_writes(strict)

    def _staged(self, what: str) -> torch.Tensor:
        self.prefetch()   # no-op when already read ahead
        bufs, reads = self._set
        reads[what].result()   # (the read is traced by its job)
        return typed(bufs[OPT_KEYS.index(what)], self.dtype, self.numel)

    def _write_back_staged(self) -> None:
        """Write the staged set back asynchronously; it returns to the pool when all writes land."""
        bufs, _ = self._set
        s = self.trace.now()
        futs = [self.nvme.write_from(self._key(w), b, self.state_io) for w, b in zip(OPT_KEYS, bufs)]
        left, lock, staging, trace = [len(futs)], threading.Lock(), self.staging, self.trace
        step = trace.current_step()   # it lands later, on an I/O thread

        def landed(_f: Future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                with trace.at_step(step):
                    trace.add("nvme_write", self.name, s, trace.now(), 3 * self.layout.nbytes, "nvme",
                              "optimizer_state")
                staging.release(bufs)

        self._writes = futs    # before `_set` is cleared: a read of this layer must wait for them
        self._set = None
        for f in futs:
            f.add_done_callback(landed)

    # ---- tensors, materialised on host (read from NVMe when that is their tier) ---------
    def _load(self, what: str, tier: str, strict: bool = True) -> torch.Tensor:
        if tier == "host":
            return typed(self.host.get(self._key(what)), self.dtype, self.numel)
        if what in OPT_KEYS:
            self.flush(strict)   # read what the last write-back wrote; read-ahead copies may go stale
        buf = staging_buffer(self.layout.nbytes)
        self._staging[what] = buf
        s = self.trace.now()
        self.nvme.read_sync(self._key(what), buf)
        self.trace.add("nvme_read", self.name, s, self.trace.now(), self.layout.nbytes, "nvme",
                       "optimizer_state" if what in OPT_KEYS else "grads")
        return typed(buf, self.dtype, self.numel)

    def _save(self, what: str, tier: str, t: torch.Tensor) -> None:
        if tier == "host":
            return  # updated in place
        s = self.trace.now()
        buf = self._staging.pop(what)
        self.nvme.write_sync(self._key(what), buf)
        self.trace.add("nvme_write", self.name, s, self.trace.now(), self.layout.nbytes, "nvme",
                       "optimizer_state" if what in OPT_KEYS else "grads")

    def _fresh(self, what: str, tier: str) -> torch.Tensor:
        """A tensor to overwrite entirely (no read from NVMe needed)."""
        if tier == "host":
            return typed(self.host.get(self._key(what)), self.dtype, self.numel)
        if what in OPT_KEYS:
            self.flush()
        buf = staging_buffer(self.layout.nbytes)
        self._staging[what] = buf
        return typed(buf, self.dtype, self.numel)

    def init_master(self, values: list[torch.Tensor]) -> None:
        """Set fp32 master weights from the model's tensors; zero the moments."""
        for what in ("master", "exp_avg", "exp_avg_sq") if self.moments else ("master",):
            t = self._fresh(what, self.optimizer_tier)
            if what == "master":
                self.layout.gather(values, t)
            else:
                t.zero_()
            self._save(what, self.optimizer_tier, t)

    def _read(self, what: str) -> torch.Tensor:
        """Read-only load: an NVMe staging buffer is not kept for a later `_save`."""
        t = self._load(what, self.optimizer_tier)
        self._staging.pop(what, None)
        return t

    def master(self) -> torch.Tensor:
        return self._read("master")

    def load_tensor(self, what: str) -> torch.Tensor:
        return self._read(what).clone()

    def store_tensor(self, what: str, src: torch.Tensor) -> None:
        t = self._load(what, self.optimizer_tier, strict=False)   # (stored whole: complete again)
        t.copy_(src.reshape(-1))
        try:
            self._save(what, self.optimizer_tier, t)
        except BaseException as e:   # (a write that failed here leaves the file part old too)
            if self.optimizer_tier == "nvme" and what in OPT_KEYS:
                self._incomplete[what] = e
            raise
        self._incomplete.pop(what, None)

    # ---- gradient accumulation ----------------------------------------------------------
    def accumulate(self, grads: list[torch.Tensor | None], first: bool, last: bool,
                   shared: list[torch.Tensor | None] | None = None) -> None:
        """Add one micro-batch's gradients (any dtype/device, per tensor) into the fp32 accumulator.

        `shared`: the same micro-batch's other contribution to these tensors (a tied weight's, from
        the head). It is summed with `grads` first and the sum accumulated, as autograd sums a
        shared leaf's incoming gradients before adding them to `.grad`, so the result is the same
        bit for bit."""
        s = self.trace.now()
        self._direct = None
        if (first and last and shared is None and self.grad_tier == "host" and self.dtype != F32
                and not self.track_norms
                and all(g is not None and g.device.type == "cpu" and g.dtype == self.dtype and not g.is_pinned()
                        for g in grads)):
            # One micro-batch whose grads already are host tensors of the master dtype (pure bf16
            # on a CPU device), updated right after this backward (no clipping): the update reads
            # them where they are, no copy into the accumulator. (With clipping every layer's
            # would stay alive, uncounted, until the global norm is known: they are copied into
            # the host store instead; so are pinned ones copied off a GPU, which would keep the
            # pinned allocator's cache at every layer's size.)
            self._direct = [g.reshape(-1) for g in grads]
            self.has_grad = True
            self.norms = []
            return   # nothing moved (the plan counts no d2h either: plan.ops.grad_d2h_bytes)
        arrived = sum(g.nbytes for g in (*grads, *(shared or ())) if g is not None)   # what left the device
        acc = self._fresh("grad", self.grad_tier) if first else self._load("grad", self.grad_tier)
        if first and shared is None and all(g is not None for g in grads):
            # One call for the layer's tensors, not one per tensor: on a GPU this runs on the
            # optimizer thread, which must win the GIL back from the launching thread after every
            # torch call (the same copies, bit for bit)
            torch._foreach_copy_([acc[o:o + n] for o, n in zip(self.layout.offsets, self.layout.numels)],
                                 [g.reshape(-1) for g in grads])
            grads = []
        for k, (g, o, n) in enumerate(zip(grads, self.layout.offsets, self.layout.numels)):
            dst = acc[o:o + n]
            x = shared[k] if shared is not None else None
            if g is not None and x is not None:
                _add_pair(dst, g.reshape(-1), x.reshape(-1), first)
                continue
            g = x if g is None else g
            if g is None:
                if first:
                    dst.zero_()
            elif first:
                dst.copy_(g.reshape(-1))
            else:
                dst.add_(g.reshape(-1).to(self.dtype))
        self.has_grad = True
        if last and self.track_norms:
            # Per-tensor norms, combined later exactly as torch.nn.utils.clip_grad_norm_ does.
            # (_foreach_norm: one call; on host tensors it is vector_norm per tensor, bit for bit)
            self.norms = list(torch._foreach_norm([acc[o:o + n] for o, n in
                                                   zip(self.layout.offsets, self.layout.numels)]))
        self._save("grad", self.grad_tier, acc)
        self.trace.add("d2h", self.name, s, self.trace.now(), arrived, self.grad_tier, "grads")

    # ---- the update -----------------------------------------------------------------------
    @property
    def step(self) -> torch.Tensor:
        return self.steps[0] if self.steps else torch.zeros((), dtype=F32)

    def set_step(self, value: torch.Tensor) -> None:
        for t in self.steps:
            t.copy_(value)

    def update(self, hp: dict, clip_scale: torch.Tensor | None, write_params, opt8=None) -> None:
        """AdamW on this layer's fp32 master, then `write_params(master_fp32)` publishes weights."""
        s = self.trace.now()
        staged = self.staging is not None
        try:
            self._update(hp, clip_scale, write_params, opt8, staged, s)
        except BaseException:
            if staged:
                self.cancel_prefetch()   # its buffers may be half-updated: never write them back
            raise

    def _update(self, hp: dict, clip_scale, write_params, opt8, staged: bool, s: float) -> None:
        direct, self._direct = self._direct, None
        grad = self._load("grad", self.grad_tier) if direct is None else None
        if opt8 is None and clip_scale is not None and float(clip_scale) != 1.0:
            # torch's AdamW takes no clip factor: the gradients are scaled first, as
            # clip_grad_norm_ does (x * 1.0 == x: an unclipped step skips the pass, exactly; read-
            # in-place gradients come only without clipping). The 8-bit kernel folds the factor
            # into its one pass instead: the same fp32 product, no pass of its own.
            grad.mul_(clip_scale)
        master = self._staged("master") if staged else self._load("master", self.optimizer_tier)
        if opt8 is not None:
            p = opt8.param_groups[0]["params"][0]
            p.data = master
            p.grad = grad
            opt8.param_groups[0]["lr"] = hp["lr"]
            opt8.step_params([p], clip_scale=1.0 if clip_scale is None else clip_scale)
            p.grad = None
        else:
            m = self._staged("exp_avg") if staged else self._load("exp_avg", self.optimizer_tier)
            v = self._staged("exp_avg_sq") if staged else self._load("exp_avg_sq", self.optimizer_tier)
            # Per-tensor views, so every element sees exactly the arithmetic torch.optim.AdamW
            # applies to the model's own parameters (the fused kernel's vector/scalar split
            # depends on each tensor's length).
            lay = self.layout
            fused = bool(hp.get("fused", True))
            gviews = lay.views(grad) if direct is None else [g.view(sh) for g, sh in zip(direct, lay.shapes)]
            _adamw(lay.views(master), gviews, lay.views(m), lay.views(v), [], self.steps,
                   fused=fused, foreach=None if fused else False, amsgrad=False,
                   beta1=hp["betas"][0], beta2=hp["betas"][1], lr=hp["lr"],
                   weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=False)
            if not staged:
                self._save("exp_avg", self.optimizer_tier, m)
                self._save("exp_avg_sq", self.optimizer_tier, v)
        if not staged:
            self._save("master", self.optimizer_tier, master)
        self._staging.pop("grad", None)   # read-only here: an NVMe-tier grad buffer is done with
        write_params(master)
        if staged:
            self._write_back_staged()   # after the publish: it reads the master buffer too
        self.has_grad = False
        self.trace.add("optimizer", self.name, s, self.trace.now(), self.layout.nbytes * 4, "host")


def _add_pair(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool,
              chunk: int = 1 << 22) -> None:
    """dst = a + b (first) or dst += (a + b), a + b in dst's dtype as autograd sums a shared
    leaf's incoming gradients, in chunks (no full-size temporary)."""
    for s in range(0, dst.numel(), chunk):
        d, x, y = dst[s:s + chunk], a[s:s + chunk], b[s:s + chunk]
        if first:
            torch.add(x.to(d.dtype), y.to(d.dtype), out=d)
        else:
            d.add_(x.to(d.dtype) + y.to(d.dtype))


def total_norm(norms: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm from per-tensor norms (the same reduction clip_grad_norm_ uses)."""
    if not norms:
        return torch.zeros((), dtype=F32)
    return torch.linalg.vector_norm(torch.stack([n.cpu() for n in norms]))


def clip_scale_for(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """clip_grad_norm_'s clamped coefficient (0-d fp32); None when the norm is not finite (skip)."""
    if not math.isfinite(float(norm)):
        return None
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)
