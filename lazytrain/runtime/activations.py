"""Where a layer's saved-for-backward tensors live: kept on the device, copied to host, or written
to NVMe files, via torch.autograd.graph.saved_tensors_hooks; fetched back ahead of need.

Two kinds of saved tensor are never moved: views of the layer's streamed parameter buffer, or of
one it borrows (a tied head's embedding matrix), saved as a placeholder and re-resolved against
wherever those parameters are when backward runs, because the buffer may be evicted and refetched
in between; and tensors that stay resident anyway (LoRA adapters, the step's rotary embeddings /
masks).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..costmodel import NVME_ACT_STAGING_LAYERS
from ..storage.aligned_io import DirectFile, IOPool, aligned_empty, round_up
from ..storage.flat import typed
from .accountant import Held, MemoryAccountant
from .trace import Trace


def _window(t: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(pad, span, 1-D view) of the storage window a tensor covers.

    Offloaded tensors come back with their exact strides and alignment (mod 64 bytes): CPU
    kernels pick vectorised or scalar loops from the layout, and e.g. SiLU's backward rounds
    differently in the two, so a `.contiguous()` copy would change the math.
    """
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    lo = t.storage_offset()
    pad = lo % max(1, 64 // t.element_size())
    return pad, span, t.as_strided((pad + span,), (1,), lo - pad)


def _view(flat: torch.Tensor, rec: "_Rec") -> torch.Tensor:
    return flat.as_strided(rec.size, rec.stride, flat.storage_offset() + rec.pad)


@dataclass
class _Rec:
    tier: str
    layer: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int                            # bytes moved: the storage window incl. pad
    pad: int = 0                           # elements before the tensor's first one in the window
    dev: torch.Tensor | None = None        # on the device (kept, or fetched back)
    host: torch.Tensor | None = None       # host copy (host tier) / staging (nvme)
    offset: int = 0                        # nvme file offset
    write: Future | None = None
    read: Future | None = None
    event: object = None                   # CUDA event guarding `dev` or `host`
    counted: int = 0                       # device bytes this record holds in the accountant
    base: "_Rec | None" = None             # a view of another record's copy (its whole storage):
                                           # `pad` is then the element offset into it


@dataclass
class _LayerActs:
    recs: list[_Rec] = field(default_factory=list)
    kept_storages: dict[int, Held] = field(default_factory=dict)  # ptr -> its count
    kept_recs: list[int] = field(default_factory=list)   # storage ptrs of device-tier save()s
    file: DirectFile | None = None
    file_bytes: int = 0
    pending_writes: bool = False   # NVMe writes not yet waited for (_bound_staging)


class ActivationStore:
    def __init__(self, device: torch.device, accountant: MemoryAccountant, trace: Trace,
                 nvme_root: Path | None, pool: IOPool | None, layer_names: list[str]) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.acct = accountant
        self.trace = trace
        self.nvme_root = nvme_root
        self.pool = pool
        self.names = layer_names
        self.layers: dict[int, _LayerActs] = {}
        # storage ptr -> how many device-tier saves of live layers reference it (protected())
        self._protected: Counter[int] = Counter()
        self.resident_ptrs: set[int] = set()
        self.d2h_stream = torch.cuda.Stream(device) if self.cuda else None
        self.h2d_stream = torch.cuda.Stream(device) if self.cuda else None
        self._dedup: dict[tuple, _Rec] = {}
        self._shared: dict[tuple, _Rec] = {}   # (layer, storage, dtype, version) -> its whole copy
        self._hold: list[torch.Tensor] = []

    # ---- forward side -------------------------------------------------------------------
    def hooks(self, layer: int, tier: str, param_buf: Callable[[int], torch.Tensor | None],
              kind: str = "activations", param_layers: Sequence[int] | None = None
              ) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks placing what `layer` saves on `tier` ("device" | "host" | "nvme").

        `param_layers`: the layers whose weight buffers `layer` computes with (default: its own;
        a tied head also uses the embedding's), whose views are saved as placeholders."""
        la = self.layers.setdefault(layer, _LayerActs())
        # storage ptr -> (layer, its typed flat buffer's data pointer and dtype). Not the buffer
        # itself: autograd keeps this closure as long as the layer's saved tensors, and a streamed
        # buffer the streamer dropped (and uncounted) stayed alive through it until the layer's
        # backward, memory over the budget that nothing counted (review, 2026-12-01: +22%).
        owns: dict[int, tuple[int, int, torch.dtype]] = {}
        for j in (layer,) if param_layers is None else param_layers:
            buf = param_buf(j)
            if buf is not None:
                owns[buf.untyped_storage().data_ptr()] = (j, buf.data_ptr(), buf.dtype)

        def pack(t: torch.Tensor):
            sp = t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
            hit = owns.get(sp)
            if hit is not None and t.dtype == hit[2]:
                # A view of streamed weights: remember whose and where, not what.
                j, own_ptr, _ = hit
                off = (t.data_ptr() - own_ptr) // t.element_size()
                return ("param", j, tuple(t.shape), tuple(t.stride()), off)
            if sp in self.resident_ptrs or t.numel() == 0:
                return ("keep", t)
            if tier == "device":
                held = la.kept_storages.get(sp)
                if held is None or held.ref() is None:
                    # counted until the layer is released, or until autograd frees it (also in
                    # this forward: a newer storage at the same address is counted anew)
                    la.kept_storages[sp] = self.acct.hold(t, kind)
                    if held is None:
                        self._protected[sp] += 1
                return ("keep", t.detach())
            return ("rec", self._save(layer, tier, t))

        def unpack(obj):
            if obj[0] == "keep":
                return obj[1]
            if obj[0] == "param":
                _, lay, size, stride, off = obj
                buf = param_buf(lay)
                return buf.as_strided(size, stride, buf.storage_offset() + off)
            return self._materialize(obj[1])

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def save(self, layer: int, tier: str, t: torch.Tensor, kind: str = "boundary") -> _Rec:
        """Explicitly keep one tensor (a recompute segment's input) on `tier`."""
        self.layers.setdefault(layer, _LayerActs())
        if tier == "device":
            rec = _Rec("device", layer, tuple(t.shape), tuple(t.stride()), t.dtype, t.nbytes, dev=t.detach())
            rec.counted = t.nbytes
            self.acct.alloc(rec.counted, kind)
            la, sp = self.layers[layer], t.untyped_storage().data_ptr()
            la.kept_recs.append(sp)
            self._protected[sp] += 1
            la.recs.append(rec)
            return rec
        return self._save(layer, tier, t)

    def protected(self) -> Counter[int]:
        """Storages that device-tier saves of live layers still reference (must not be freed
        early): `ptr in protected()`. Kept up to date as saves are made and layers released."""
        return self._protected

    def _unprotect(self, ptrs) -> None:
        for sp in ptrs:
            self._protected[sp] -= 1
            if self._protected[sp] <= 0:
                del self._protected[sp]

    def end_forward(self, layer: int) -> None:
        """The layer's forward is done: originals of offloaded tensors may now be freed."""
        self._dedup.clear()
        self._shared.clear()
        self._hold.clear()

    def _save(self, layer: int, tier: str, t: torch.Tensor) -> _Rec:
        with self.acct.host_side():   # the copy's destination is host memory, not a device temporary
            return self._save_off_device(layer, tier, t)

    def _save_off_device(self, layer: int, tier: str, t: torch.Tensor) -> _Rec:
        key = (layer, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
        if key in self._dedup:
            return self._dedup[key]
        # Keep the original alive until the layer's forward ends so its address is not reused by
        # another tensor that would then hit the dedup table (and, on CUDA, until the copy ran).
        self._hold.append(t)
        # Saved views of one storage cross once: the whole storage is copied when the first view
        # spans at least half of it, and every later view of it (same dtype and version) is a view
        # of that copy. Copied view by view, e.g. the gate and up halves of an MoE expert's fused
        # gate_up output (each spanning nearly all of it) made the storage cross twice and come
        # back twice: +15% of an MoE block's offloaded bytes, over what the planner counts.
        st = t.untyped_storage()
        skey = (layer, st.data_ptr(), st.nbytes(), t.dtype, t._version)
        base = self._shared.get(skey)
        if base is None and st.nbytes() % t.element_size() == 0 and 2 * _window(t)[2].nbytes >= st.nbytes():
            base = self._copy_off(layer, tier, t.as_strided((st.nbytes() // t.element_size(),), (1,), 0))
            self._shared[skey] = base
        if base is not None:
            rec = _Rec(tier, layer, tuple(t.shape), tuple(t.stride()), t.dtype, 0, pad=t.storage_offset(),
                       base=base)
        else:
            rec = self._copy_off(layer, tier, t)
        self._dedup[key] = rec
        return rec

    def _bound_staging(self, layer: int) -> None:
        """Before staging more of `layer`'s activations for NVMe, wait for the writes of layers
        NVME_ACT_STAGING_LAYERS or more before it: the host staging in flight stays within what
        the planner counts (unbounded before: a drive slower than compute let a step's NVMe
        activations pile up on the host, 45-110% over the planned host peak: review). A write
        that failed raises here, with its file and operation."""
        for j, la in self.layers.items():
            if j <= layer - NVME_ACT_STAGING_LAYERS and la.pending_writes:
                for rec in la.recs:
                    if rec.write is not None:
                        rec.write.result()
                la.pending_writes = False

    def _copy_off(self, layer: int, tier: str, t: torch.Tensor) -> _Rec:
        """Copy the storage window `t` covers to `tier`: a record that owns the copy."""
        la = self.layers[layer]
        pad, span, win = _window(t)
        rec = _Rec(tier, layer, tuple(t.shape), tuple(t.stride()), t.dtype, win.nbytes, pad=pad)
        name = self.names[layer]
        if tier == "host":
            start = self.trace.now()
            host = torch.empty(pad + span, dtype=t.dtype, pin_memory=self.cuda)
            if self.cuda:
                self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.d2h_stream):
                    host.copy_(win, non_blocking=True)
                    rec.event = torch.cuda.Event()
                    rec.event.record(self.d2h_stream)
                t.record_stream(self.d2h_stream)
            else:
                host.copy_(win)
            rec.host = host
            self.trace.add("d2h", name, start, self.trace.now(), rec.nbytes, "host", "activation")
        elif tier == "nvme":
            if la.file is None:
                if self.nvme_root is None or self.pool is None:
                    raise ValueError("activation tier nvme needs nvme_dir")
                la.file = DirectFile(self.nvme_root / f"act_{name}.bin", "w")
            nb = round_up(max(rec.nbytes, 1))
            self._bound_staging(layer)
            staging = aligned_empty(nb, pin=self.cuda)
            start = self.trace.now()
            typed(staging, t.dtype, pad + span).copy_(win)  # synchronous d2h on CUDA: the write needs it
            rec.offset = la.file_bytes
            la.file_bytes += nb
            f = la.file
            trace = self.trace

            def write() -> None:
                s = trace.now()
                f.write_from(staging, rec.offset)
                trace.add("nvme_write", name, s, trace.now(), nb, "nvme", "activation")

            rec.write = self.pool.submit(write)
            la.pending_writes = True
            self.trace.add("d2h", name, start, self.trace.now(), rec.nbytes, "nvme", "activation")
        else:
            raise ValueError(f"unknown activation tier {tier!r}")
        la.recs.append(rec)
        return rec

    # ---- backward side ------------------------------------------------------------------
    def prefetch(self, layer: int) -> None:
        """Start bringing `layer`'s offloaded tensors back to the device (non-blocking)."""
        la = self.layers.get(layer)
        if la is None:
            return
        for rec in la.recs:
            if rec.dev is not None or rec.read is not None:
                continue
            if rec.tier == "host":
                self._fetch_host(rec)
            elif rec.tier == "nvme":
                self._fetch_nvme(rec)

    def _fetch_host(self, rec: _Rec) -> None:
        name = self.names[rec.layer]
        start = self.trace.now()
        flat = torch.empty(rec.host.numel(), dtype=rec.dtype, device=self.device)
        self.acct.adopt(flat)
        self.acct.alloc(flat.nbytes, "activations_fetched")
        rec.counted = flat.nbytes   # (once counted: release() frees what is recorded)
        if self.cuda:
            if rec.event is not None:
                self.h2d_stream.wait_event(rec.event)
            # `flat` may reuse memory queued compute still reads: copy after what is queued now.
            self.h2d_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.h2d_stream):
                flat.copy_(rec.host, non_blocking=True)
                rec.event = torch.cuda.Event()
                rec.event.record(self.h2d_stream)
        else:
            flat.copy_(rec.host)
        rec.dev = _view(flat, rec)
        self.trace.add("h2d", name, start, self.trace.now(), rec.nbytes, "host", "activation")

    def _fetch_nvme(self, rec: _Rec) -> None:
        name = self.names[rec.layer]
        la = self.layers[rec.layer]
        nb = round_up(max(rec.nbytes, 1))
        # On CPU the device *is* host memory: read straight into the buffer autograd will use.
        # Counted at the tensor's own bytes, as the CUDA path's device copy is: the page rounding
        # O_DIRECT needs (< 4 KiB a saved tensor) is allocator slack, like a GPU allocator's block
        # rounding, which the plan does not model either (counted, it put toy MoE runs 1% above
        # their plans: 27 saved tensors a block; review)
        buf = aligned_empty(nb, pin=self.cuda)
        if not self.cuda:
            self.acct.adopt(buf)
            self.acct.alloc(rec.nbytes, "activations_fetched")
            rec.counted = rec.nbytes
        write, f, trace = rec.write, la.file, self.trace

        def read() -> torch.Tensor:
            if write is not None:
                write.result()
            s = trace.now()
            f.read_into(buf, rec.offset)
            trace.add("nvme_read", name, s, trace.now(), nb, "nvme", "activation")
            return buf

        rec.host = None
        rec.read = self.pool.submit(read)

    def _materialize(self, rec: _Rec) -> torch.Tensor:
        if rec.base is not None:   # a view of a whole-storage copy
            flat = self._materialize(rec.base)
            return flat.as_strided(rec.size, rec.stride, flat.storage_offset() + rec.pad)
        if rec.dev is None:
            if rec.tier == "host":
                self._fetch_host(rec)
            elif rec.tier == "nvme":
                if rec.read is None:
                    self._fetch_nvme(rec)
                buf = rec.read.result()
                flat = typed(buf, rec.dtype, rec.nbytes // rec.dtype.itemsize)
                if self.cuda:
                    start = self.trace.now()
                    dev = torch.empty(flat.numel(), dtype=rec.dtype, device=self.device)
                    self.acct.alloc(dev.nbytes, "activations_fetched")
                    rec.counted = dev.nbytes
                    dev.copy_(flat)
                    self.trace.add("h2d", self.names[rec.layer], start, self.trace.now(), rec.nbytes, "nvme",
                                   "activation")
                    flat = dev
                rec.dev = _view(flat, rec)
        if self.cuda and rec.event is not None:
            torch.cuda.current_stream(self.device).wait_event(rec.event)
            rec.event = None
        return rec.dev

    def load(self, rec: _Rec) -> torch.Tensor:
        if rec.tier == "device":
            return rec.dev
        return self._materialize(rec)

    def release(self, layer: int) -> None:
        """The layer's backward is done: forget its saved tensors and uncount them."""
        la = self.layers.pop(layer, None)
        if la is None:
            return
        err: BaseException | None = None
        for rec in la.recs:
            if rec.counted:
                self.acct.free(rec.counted, "boundary" if rec.tier == "device" else "activations_fetched")
            if rec.write is not None:
                try:
                    rec.write.result()  # surface write errors; the file is reused next micro-batch
                except BaseException as e:   # raised once the whole layer is released
                    err = err or e
            # uncounted now, so gone now: whoever still holds the record (the executor's segment
            # inputs, until the micro-batch ends) must not keep its memory alive (on CUDA the
            # allocator's peak would see it)
            rec.dev = rec.host = rec.read = None
        for held in la.kept_storages.values():
            self.acct.release(held)
        self._unprotect(la.kept_storages)
        self._unprotect(la.kept_recs)
        if la.file is not None:
            la.file.close()
        if err is not None:
            raise err

    def clear(self) -> None:
        """Forget every layer's saved tensors, as if each was released: what a micro-batch that
        raised left behind (its next one, or the next step's backward, must not find them)."""
        self.end_forward(-1)
        for layer in list(self.layers):
            try:
                self.release(layer)
            except Exception:   # noqa: BLE001 - a failed activation write: the step raises already
                pass

    def close(self) -> None:
        for layer in list(self.layers):
            self.release(layer)
