"""Parameter streaming: each layer's compute-dtype weights in one flat buffer on their planned tier,
brought to the device ahead of need (the plan's `prefetch_depth` buffers: the layer computing
and depth-1 on their way) and dropped when no use is near.

The executor tells the streamer the order of uses (forward, recompute, backward: a pure expansion
of the Plan, see `use_sequence`); `use(i)` waits only for layer i's own transfer and then starts
the transfers for the next depth-1 layers. A fetch first waits for that layer's pending optimizer
update, so the next step's forward waits only for the layer it needs, not for the whole update.
On a CUDA device transfers run on a copy stream from an I/O thread; on a CPU device a host-tier
copy is a memcpy by the computing cores and runs in place, in the same order (NVMe reads, which
need no core, stay on the I/O thread).

A layer may also compute with another layer's weights (`borrows`: a tied head uses the embedding's
matrix). Those have one buffer, owned by the lender and counted once; using the borrower brings the
lender's buffer to the device with its own (the two count as one prefetch slot, as the cost model
counts the tied head's streamed bytes as one layer's).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import nn

from ..plan.ops import streaming_reserve
from ..storage.aligned_io import InlinePool, IOPool, aligned_empty
from ..storage.fastcopy import copy_into
from ..storage.flat import FlatLayout, typed
from ..storage.tiers import HostStore, NvmeStore
from .accountant import MemoryAccountant
from .trace import Trace


@dataclass
class StreamedLayer:
    index: int
    name: str
    params: list[nn.Parameter]          # the layer's streamed (non-adapter) parameters
    layout: FlatLayout
    tier: str                           # param tier: device | host | nvme
    ready: Future | None = None         # pending optimizer update that rewrites the weights
    publish: Future | None = None       # NVMe tier: the write of its updated weights, maybe landing
    resident: torch.Tensor | None = None  # device buffer of a device-tier layer
    held: torch.Tensor | None = None    # typed flat device buffer while fetched
    fetch: Future | None = None
    event: object = None
    extra: dict = field(default_factory=dict)
    borrows: tuple[int, ...] = ()       # other layers whose weights this one computes with (tied head)


def use_sequence(n_layers: int, segments: list[tuple[int, int]], embed_backward: bool = False) -> list[int]:
    """Layer indices in the order their weights are used in one micro-batch: forward, then
    backward in reverse where a recompute segment (a..b) re-runs a..b forward before b..a backward.
    The embedding's backward (the last use) is left out unless `embed_backward`: an embedding's
    gradient needs only the token ids and its output's gradient, not its weights."""
    seq = list(range(n_layers))
    seg_by_end = {b: a for a, b in segments}
    seg_of = {i: (a, b) for a, b in segments for i in range(a, b + 1)}
    stop = -1 if embed_backward else 0   # backward uses down to (not) the embedding's
    i = n_layers - 1
    while i >= 0:
        if i in seg_by_end:
            a = seg_by_end[i]
            seq += list(range(a, i + 1)) + list(range(i, max(a, stop + 1) - 1, -1))
            i = a - 1
        else:
            assert i not in seg_of
            if i > stop:
                seq.append(i)
            i -= 1
    # merge consecutive repeats (head forward then head backward is one use)
    return [x for k, x in enumerate(seq) if k == 0 or seq[k - 1] != x]


class ParamStreamer:
    def __init__(self, layers: list[StreamedLayer], device: torch.device, depth: int,
                 host: HostStore, nvme: NvmeStore | None, pool: IOPool,
                 accountant: MemoryAccountant, trace: Trace, embed_recomputed: bool = False) -> None:
        self.layers = layers
        self.device = device
        self.cuda = device.type == "cuda"
        self.depth = max(1, int(depth))
        self.host, self.nvme, self.pool = host, nvme, pool
        self.acct, self.trace = accountant, trace
        self.h2d_stream = torch.cuda.Stream(device) if self.cuda else None
        self._inline = InlinePool()
        self.seq: list[int] = []
        self.pos = 0
        self.wrap = False
        self._free: dict[int, list[torch.Tensor]] = {}   # CPU: reuse device buffers by size
        # Streaming buffers held at once (in use + cached for reuse) stay within what the plan
        # reserves for them (a slot: a layer and what it borrows; plan.ops.streaming_reserve: the
        # largest slot + depth - 1 of the largest block's, one more on a CPU device, which keeps
        # freed ones for reuse). Cached free buffers are released first when a fetch would go over.
        slot = [sum(layers[j].layout.padded_nbytes for j in (lay.index, *lay.borrows)
                    if layers[j].tier != "device") for lay in layers]
        self._cap = streaming_reserve(slot, len(layers) - 2, self.depth, cached=not self.cuda,
                                      embed_recomputed=embed_recomputed)
        self._pool_bytes = 0
        for lay in layers:
            if lay.tier == "device" and lay.layout.numel:
                buf = torch.empty(lay.layout.numel, dtype=lay.layout.dtype, device=device) if self.cuda else \
                    typed(aligned_empty(lay.layout.padded_nbytes, huge=True), lay.layout.dtype, lay.layout.numel)
                self.acct.alloc(buf.nbytes, "params_resident")
                lay.resident = buf
                self._bind(lay, buf)

    # ---- storage -------------------------------------------------------------------------
    def key(self, lay: StreamedLayer) -> str:
        return f"{lay.name}.param"

    def device_buffer(self, index: int) -> torch.Tensor | None:
        """The typed flat device buffer currently holding layer `index`'s weights (or None)."""
        lay = self.layers[index]
        return lay.resident if lay.resident is not None else lay.held

    def group(self, index: int) -> list[int]:
        """Layer `index` and the layers whose weights it borrows: all on the device while it computes."""
        return [index, *self.layers[index].borrows]

    def _bind(self, lay: StreamedLayer, flat: torch.Tensor) -> None:
        for p, v in zip(lay.params, lay.layout.views(flat)):
            p.data = v

    def _unbind(self, lay: StreamedLayer) -> None:
        empty = torch.empty(0, dtype=lay.layout.dtype, device=self.device)
        for p in lay.params:
            p.data = empty
            p._lazytrain_moved = True   # (a new executor refuses it while empty; a real 0-element param is fine)

    # ---- schedule ------------------------------------------------------------------------
    def start(self, seq: list[int], wrap: bool) -> None:
        """Begin a micro-batch's use sequence; `wrap`: prefetch across its end (weights unchanged)."""
        self.seq, self.pos, self.wrap = seq, 0, wrap

    def _ahead(self, max_slots: int | None = None) -> list[int]:
        max_slots = self.depth - 1 if max_slots is None else max_slots
        out: list[int] = []
        slots = 0
        k = self.pos + 1
        n = len(self.seq)
        # `depth` buffers in all (the plan's prefetch_depth): the current layer + depth-1 ahead;
        # a layer with the weights it borrows takes one slot
        while slots < max_slots and (k < n or (self.wrap and k < self.pos + n)):
            new = [j for j in self.group(self.seq[k % n]) if j not in out and self.layers[j].resident is None]
            if new:
                out += new
                slots += 1
            k += 1
        return out

    def use(self, index: int) -> None:
        """Layer `index` is about to compute: its weights are bound and on the device on return."""
        while self.pos < len(self.seq) and self.seq[self.pos] != index:
            self.pos += 1
        if self.pos >= len(self.seq):
            raise RuntimeError(f"layer {self.layers[index].name} used out of the planned order")
        group = [self.layers[j] for j in self.group(index)]
        ahead = self._ahead()
        keep = set(ahead) | {lay.index for lay in group}
        for other in self.layers:
            if other.held is not None and other.index not in keep:
                self._evict(other)
        for lay in group:
            if lay.resident is None:
                self._fetch(lay)
        for idx in ahead:
            self._fetch(self.layers[idx])
        for lay in group:
            self._wait(lay)

    def prefetch_first(self, seq: list[int]) -> None:
        """After a step's updates were queued: start the next step's first fetches now."""
        self.start(seq, wrap=False)
        for idx in self.group(seq[0]) + self._ahead(max(1, self.depth - 1) - 1):
            if self.layers[idx].resident is None:
                self._fetch(self.layers[idx])

    def invalidate(self) -> None:
        """Weights are about to change (optimizer step): drop every fetched copy."""
        for lay in self.layers:
            if lay.held is not None or lay.fetch is not None:
                self._evict(lay)

    # ---- transfers -----------------------------------------------------------------------
    def _alloc(self, lay: StreamedLayer) -> torch.Tensor:
        """A buffer of at least the layer's padded size (the caller uses its first bytes)."""
        # CPU: buffers are reused (fresh allocations page-fault at ~9 GB/s) and stay counted
        # while cached, so the accountant's figure is what the process really holds. A cached one
        # up to 1/8 larger also serves (the head: the embedding's matrix plus the final norm).
        nb = lay.layout.padded_nbytes
        fit = min((k for k, bufs in self._free.items() if bufs and nb <= k <= nb + nb // 8), default=None)
        if fit is not None:
            return self._free[fit].pop()
        while self._pool_bytes + nb > self._cap and any(self._free.values()):
            bufs = next(b for b in self._free.values() if b)
            old = bufs.pop()
            self._pool_bytes -= old.numel()
            self.acct.free(old.numel(), "params_streamed")
            del old   # gone before the new buffer is allocated (it is no longer counted)
        # counted first (a placement over the budget raises before the memory is taken, and
        # leaves neither count behind: review), uncounted if the allocation itself fails
        self.acct.alloc(nb, "params_streamed")
        try:
            if self.cuda:
                buf = torch.empty(nb, dtype=torch.uint8, device=self.device)
            else:
                # aligned: NVMe reads land directly in it; kept for reuse, so huge pages (copies
                # into it and the matmuls reading it are faster: aligned_io.huge_empty)
                buf = aligned_empty(nb, huge=True)
        except BaseException:
            self.acct.free(nb, "params_streamed")
            raise
        self._pool_bytes += nb
        return buf

    def _fetch(self, lay: StreamedLayer) -> None:
        if lay.held is not None or lay.fetch is not None or not lay.layout.numel:
            return
        buf = self._alloc(lay)
        lay.extra["buf"] = buf
        buf = buf[:lay.layout.padded_nbytes]
        ready = lay.ready
        nb = lay.layout.padded_nbytes
        after = None
        if self.cuda:
            # The buffer may be memory the compute stream freed moments ago (still being read by
            # queued kernels): the copy stream must start only after what is queued now.
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))

        step = self.trace.current_step()   # traced under the step that asked (it may land in the next)

        def job():
            with self.trace.at_step(step):
                return fetch()

        def fetch():
            if ready is not None:
                ready.result()
            publish = lay.publish   # read after the update: it is what sets a new one
            if publish is not None:
                publish.result()
            s = self.trace.now()
            if not self.cuda:
                if lay.tier == "nvme":
                    self.nvme.read_sync(self.key(lay), buf)
                    self.trace.add("nvme_read", lay.name, s, self.trace.now(), nb, "nvme", "params")
                else:
                    copy_into(buf, self.host.get(self.key(lay)))   # streaming stores: buf is out of cache
                    self.trace.add("h2d", lay.name, s, self.trace.now(), lay.layout.nbytes, "host", "params")
                return None
            src = self.host.get(self.key(lay)) if lay.tier == "host" else None
            if src is None:
                src = aligned_empty(nb, pin=True)
                self.nvme.read_sync(self.key(lay), src)
                self.trace.add("nvme_read", lay.name, s, self.trace.now(), nb, "nvme", "params")
                s = self.trace.now()
            with torch.cuda.stream(self.h2d_stream):
                self.h2d_stream.wait_event(after)
                buf.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.h2d_stream)
            ev.synchronize()  # keeps `src` alive until the copy ran; only this I/O thread waits
            self.trace.add("h2d", lay.name, s, self.trace.now(), lay.layout.nbytes, lay.tier, "params")
            return ev

        # On a CPU device a host-tier copy is a memcpy by the cores that compute. Run on the I/O
        # thread it takes them from the running layer anyway (measured here: blocks 10-17% slower,
        # the same step time), so it runs here, at full speed, in the step's order; the planner
        # charges it to the compute lane (HardwareSpec.copies_share_compute).
        lay.fetch = (self._inline if not self.cuda and lay.tier == "host" else self.pool).submit(job)

    def _wait(self, lay: StreamedLayer) -> None:
        if lay.resident is not None:
            if lay.ready is not None:
                lay.ready.result()
                lay.ready = None
            return
        if lay.held is None:
            lay.fetch.result()
            lay.fetch = None
            lay.held = typed(lay.extra["buf"], lay.layout.dtype, lay.layout.numel)
            self._bind(lay, lay.held)

    def _evict(self, lay: StreamedLayer) -> None:
        if lay.fetch is not None:
            fetch, lay.fetch = lay.fetch, None
            try:
                fetch.result()   # the transfer must be over before its buffer is reused
            except Exception:    # noqa: BLE001 - a failed fill of a buffer being dropped: nothing
                pass             # used it (a use raises it; a failed update also raises in wait())
        buf = lay.extra.pop("buf", None)
        lay.held = None
        self._unbind(lay)
        if buf is None:
            return
        if not self.cuda:   # kept for reuse (within the cap _alloc enforces)
            self._free.setdefault(buf.numel(), []).append(buf)
        else:
            self._pool_bytes -= buf.numel()
            self.acct.free(buf.numel(), "params_streamed")

    def close(self) -> None:
        self.invalidate()
        for bufs in self._free.values():
            for b in bufs:
                self._pool_bytes -= b.numel()
                self.acct.free(b.numel(), "params_streamed")
        self._free.clear()
        # Device-tier layers: the executor lets go of their buffers (they stayed referenced and
        # counted after close(): a review). Parameters still bound to one (no sync_model() before)
        # keep it alive as the model's own memory.
        for lay in self.layers:
            if lay.resident is not None:
                self.acct.free(lay.resident.nbytes, "params_resident")
                lay.resident = None
