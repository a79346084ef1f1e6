"""Discrete-event replay of an Assignment: a timeline of compute and transfer events per
resource, the step time, and per-tier memory over time with its peaks.

It applies the window rules of `ops.py` to concrete decisions, independently of the MILP's
linearisation; a test checks that the two agree on random problems.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..costmodel import NVME_ACT_STAGING_LAYERS, NVME_STATE_SETS, JobCosts
from ..spec import HardwareSpec
from .assignment import RECOMPUTE, STORE, Assignment
from .ops import (BWD, FWD, HEAD, after, bwd_window, ends_long_segment, fetched_early, first_block_held,
                  fwd_window, grad_d2h_bytes, grads_in_flight, head_peak_bytes, held_into_next_cycle, op_sequence,
                  refetch_last_kept, streaming_reserve, update_window, weight_parts)

RESOURCES = ("compute", "h2d", "d2h", "nvme_read", "nvme_write", "optimizer")


@dataclass(frozen=True)
class Event:
    resource: str      # one of RESOURCES
    kind: str          # compute_fwd | compute_bwd | recompute | h2d | d2h | nvme_read | nvme_write | optimizer
    layer: str
    micro_batch: int
    start_s: float
    end_s: float
    bytes: int = 0
    what: str = ""     # params | activation | grads | optimizer_state


@dataclass(frozen=True)
class Timeline:
    step_time_s: float
    compute_s: float
    recompute_s: float
    peak_bytes: dict[str, int]
    serial_optimizer_s: float = 0.0   # optimizer time on the compute resource (not overlapped)
    # an overlapped (host) optimizer's time beyond the compute it runs beside: the windows it lengthens
    exposed_optimizer_s: float = 0.0
    events: tuple[Event, ...] = field(repr=False, default=())
    device_curve: tuple[tuple[float, int], ...] = field(repr=False, default=())  # (time_s, bytes)

    @property
    def exposed_transfer_s(self) -> float:
        """Step time not explained by compute, recompute or the optimizer (sharing the compute
        resource on a CPU device, or overlapped and not hidden): the transfers that could not hide."""
        return max(0.0, self.step_time_s - self.compute_s - self.recompute_s - self.serial_optimizer_s
                   - self.exposed_optimizer_s)


def _window_items(costs: JobCosts, a: Assignment, hw: HardwareSpec, final: bool,
                  depth: int = 2, after_held: bool = False) -> list[list[tuple[str, str, str, str, float]]]:
    """Per window: (resource, kind, layer, what, amount) with amount in bytes or seconds.
    `after_held`: see ops.micro_batch_kinds."""
    L = costs.num_blocks
    ops = op_sequence(L)
    K = len(ops)
    layers = costs.layers
    items: list[list[tuple]] = [[] for _ in range(K)]
    rec = a.recompute_flags(L)
    not_last = [False] * (L + 2)   # fetched for recompute and again for backward
    long_last = False              # the last block ends a recompute segment of several blocks
    for seg in a.segments:
        if seg.mode == RECOMPUTE:
            for j in range(seg.s + 1, seg.e + 1 - refetch_last_kept(depth)):
                not_last[j] = True
            long_last = long_last or ends_long_segment(L, seg.s, seg.e)
    reuse = depth >= 2
    overlap = hw.optimizer_overlaps_compute
    cpu = hw.copies_share_compute   # no copy after an NVMe read; copies run on the compute lane
    held = held_into_next_cycle(final, costs.trains_base)

    for k, op in enumerate(ops):
        c = layers[op.layer]
        if op.kind == FWD:
            items[k].append(("compute", "compute_fwd", c.name, "", c.fwd_s))
        elif op.kind == HEAD:
            items[k].append(("compute", "compute_fwd", c.name, "", c.fwd_s))
            items[k].append(("compute", "compute_bwd", c.name, "", c.bwd_s))
        else:
            if rec[op.layer]:
                items[k].append(("compute", "recompute", c.name, "", c.fwd_s))
            items[k].append(("compute", "compute_bwd", c.name, "", c.bwd_s))
        # prefetch of the next op's parameters (cyclic); a tied head's parts come from their
        # owners' tiers (the embedding's matrix is fetched for it only when the embedding streams)
        nxt = ops[(k + 1) % K]
        times = 2 if (nxt.kind == BWD and not_last[nxt.layer]) else 1
        if ((reuse and nxt.kind == BWD and nxt.layer == L and not long_last)
                or (k == K - 1 and held)               # fetched before B_0 (ops.py)
                or (nxt.kind == BWD and nxt.layer == 0 and not held)     # B_0 reads no weights
                or (k == 0 and first_block_held(after_held, depth))):
            times = 0
        for owner, nbytes in weight_parts(costs, nxt.layer):
            tier = a.param_tier[owner]
            if tier == "device":
                continue
            name = layers[owner].name
            for _ in range(times):
                if tier == "nvme":
                    items[k].append(("nvme_read", "nvme_read", name, "params", nbytes))
                if not (cpu and tier == "nvme"):
                    items[k].append(("h2d", "h2d", name, "params", nbytes))

    for seg in a.segments:
        if seg.tier == "device":
            continue
        nbytes = seg.kept_bytes(costs)
        name = layers[seg.s + 1].name
        k_out = fwd_window(L, seg.s + 1) + (1 if seg.mode == STORE else 0)
        items[k_out].append(("d2h", "d2h", name, "activation", nbytes))
        if seg.tier == "nvme":
            items[k_out].append(("nvme_write", "nvme_write", name, "activation", nbytes))
        k_in = bwd_window(L, seg.e) - 1
        if seg.tier == "nvme":
            items[k_in].append(("nvme_read", "nvme_read", name, "activation", nbytes))
        if not (cpu and seg.tier == "nvme"):
            items[k_in].append(("h2d", "h2d", name, "activation", nbytes))

    if costs.trains_base:
        for j, c in enumerate(layers):  # the head's grads leave after the head op
            k_b = bwd_window(L, j) if c.kind != "head" else fwd_window(L, L + 1)
            k_g = after(L, k_b)
            if grad_d2h_bytes(costs, j):
                items[k_g].append(("d2h", "d2h", c.name, "grads", grad_d2h_bytes(costs, j)))
            if costs.grad_accum > 1 and a.grad_tier[j] == "nvme":
                items[k_g].append(("nvme_read", "nvme_read", c.name, "grads", c.grad_store_bytes))
                items[k_g].append(("nvme_write", "nvme_write", c.name, "grads", c.grad_store_bytes))
            if final:
                k_u = update_window(L, j, k_b, costs.clip_grad)
                res = "optimizer" if overlap else "compute"
                items[k_u].append((res, "optimizer", c.name, "", c.optimizer_s))
                if a.optimizer_tier[j] == "nvme":
                    items[k_u].append(("nvme_read", "nvme_read", c.name, "optimizer_state", c.optimizer_bytes))
                    items[k_u].append(("nvme_write", "nvme_write", c.name, "optimizer_state", c.optimizer_bytes))
                if a.param_tier[j] == "nvme":
                    items[k_u].append(("nvme_write", "nvme_write", c.name, "params", c.param_store_bytes))
                elif a.param_tier[j] == "device" and not cpu:   # (on a CPU device the update
                    # writes the resident weights itself, counted in its traffic: no copy)
                    items[k_u].append(("h2d", "h2d", c.name, "params", c.param_store_bytes))
    return items


def _rate(hw: HardwareSpec, resource: str) -> float | None:
    return {"h2d": hw.h2d_bytes_per_s, "d2h": hw.d2h_bytes_per_s,
            "nvme_read": hw.nvme_read_bytes_per_s, "nvme_write": hw.nvme_write_bytes_per_s}.get(resource)


def _lane(hw: HardwareSpec, resource: str) -> str:
    """The queue an item waits in: a half-duplex drive's reads and writes share one; on a CPU
    device copies are memcpys by the cores that compute."""
    if resource.startswith("nvme") and not hw.nvme_full_duplex:
        return "nvme"
    if hw.copies_share_compute and resource in ("h2d", "d2h"):
        return "compute"
    return resource


def memory_peaks(costs: JobCosts, a: Assignment, depth: int) -> tuple[dict[str, int], list[tuple[int, int]]]:
    """Per-tier peak bytes and the device bytes at each op of a micro-batch."""
    layers = costs.layers
    L = costs.num_blocks
    # per use of each layer: bytes brought to the device / read from NVMe (a tied head's matrix
    # counts with the embedding when resident, and in the head's streaming buffer when not)
    parts = [weight_parts(costs, j) for j in range(L + 2)]
    streamed = [sum(b for owner, b in ps if a.param_tier[owner] != "device") for ps in parts]
    from_nvme = [sum(b for owner, b in ps if a.param_tier[owner] == "nvme") for ps in parts]
    # Offloaded activations come back in backward one item ahead (runtime.executor.ACT_ITEMS_AHEAD):
    # a segment's own item (a stored layer's activations, a recompute segment's input boundary)
    # and one more, at most the largest. The forward brings none back; the head's window and
    # B_0's hold at most the one brought back ahead.
    offloaded = [s.kept_bytes(costs) for s in a.segments if s.tier != "device"]
    ahead = max(offloaded, default=0)
    static = (costs.device_static_bytes
              + sum(c.param_store_bytes for c, t in zip(layers, a.param_tier) if t == "device")
              + streaming_reserve(streamed, L, depth, costs.caches_stream_buffers))
    curve: list[tuple[int, int]] = [(0, static)]  # (window index, device bytes)
    held = 0
    for seg in a.segments:  # forward
        kept = seg.kept_bytes(costs) if seg.tier == "device" else 0
        held += kept
        for j in range(seg.s + 1, seg.e + 1):
            # a recomputed layer's forward, and an offloaded one's, has its activations on the
            # device while it computes (never above its segment's backward window: no MILP row)
            transient = layers[j].act_bytes if seg.mode == RECOMPUTE or seg.tier != "device" else 0
            transient += layers[j].fwd_transient_bytes
            curve.append((fwd_window(L, j), static + held + transient))
    curve.append((fwd_window(L, L + 1), static + ahead + held + head_peak_bytes(costs)))
    for seg in reversed(a.segments):  # backward
        own = seg.kept_bytes(costs) if seg.tier != "device" else 0
        curve.append((bwd_window(L, seg.e), static + ahead + own + held + seg.working_bytes(costs)
                      + grads_in_flight(costs, seg.s + 1, seg.e)))
        held -= seg.kept_bytes(costs) if seg.tier == "device" else 0
    curve.append((bwd_window(L, 0), static + ahead + held + grads_in_flight(costs, 0, 0)))

    host = (sum(c.param_store_bytes for c, t in zip(layers, a.param_tier) if t == "host")
            + depth * max(from_nvme, default=0) + costs.host_static_bytes
            + sum(s.kept_bytes(costs) for s in a.segments if s.tier == "host")
            # activations on their way to NVMe (host staging, NVME_ACT_STAGING_LAYERS layers' at most)
            + NVME_ACT_STAGING_LAYERS * max((s.kept_bytes(costs) for s in a.segments if s.tier == "nvme"),
                                            default=0))
    nvme = (sum(c.param_store_bytes for c, t in zip(layers, a.param_tier) if t == "nvme")
            + sum(s.kept_bytes(costs) for s in a.segments if s.tier == "nvme"))
    if costs.trains_base:
        host += sum(c.optimizer_bytes for c, t in zip(layers, a.optimizer_tier) if t == "host")
        nvme += sum(c.optimizer_bytes for c, t in zip(layers, a.optimizer_tier) if t == "nvme")
        # NVMe-tier state is updated through host staging sets (read ahead, written back async)
        host += NVME_STATE_SETS * max((c.optimizer_bytes for c, t in zip(layers, a.optimizer_tier)
                                       if t == "nvme"), default=0)
        if costs.grad_accum > 1:
            host += sum(c.grad_store_bytes for c, t in zip(layers, a.grad_tier) if t == "host")
            nvme += sum(c.grad_store_bytes for c, t in zip(layers, a.grad_tier) if t == "nvme")
        else:  # every layer's accumulator on the host (with clipping all of them are held
            # until the global norm is known; the executor allocates them all either way)
            host += sum(c.grad_store_bytes for c in layers)
    return {"device": max(b for _, b in curve), "host": int(host), "nvme": int(nvme)}, curve


def simulate(costs: JobCosts, a: Assignment, hw: HardwareSpec, depth: int = 2) -> Timeline:
    a.validate(costs.num_blocks)
    G = costs.grad_accum
    events: list[Event] = []
    t = 0.0
    peaks, curve = memory_peaks(costs, a, depth)
    compute_s = recompute_s = serial_opt_s = exposed_opt_s = 0.0
    window_start: dict[tuple[int, int], float] = {}
    for m in range(G):
        final = m == G - 1
        windows = _window_items(costs, a, hw, final, depth, fetched_early(m, costs.trains_base))
        for k, items in enumerate(windows):
            cursor: dict[str, float] = defaultdict(lambda: t)
            for res, kind, layer, what, amount in items:
                rate = _rate(hw, res)
                dur = amount / rate if rate else amount
                lane = _lane(hw, res)
                start = cursor[lane]
                cursor[lane] = start + dur
                events.append(Event(res, kind, layer, m, start, start + dur,
                                    int(amount) if rate else 0, what))
                if kind in ("compute_fwd", "compute_bwd"):
                    compute_s += dur
                elif kind == "recompute":
                    recompute_s += dur
                elif kind == "optimizer" and res == "compute":
                    serial_opt_s += dur
            window_start[m, k] = t
            end = max([t] + list(cursor.values()))
            if "optimizer" in cursor and cursor["optimizer"] == end:   # the optimizer set this window's length
                exposed_opt_s += end - max(t, cursor.get("compute", t))
            t = end
    device_curve = [(window_start[m, k], nbytes) for m in range(G) for k, nbytes in curve]
    return Timeline(step_time_s=t, compute_s=compute_s, recompute_s=recompute_s, peak_bytes=peaks,
                    serial_optimizer_s=serial_opt_s, exposed_optimizer_s=exposed_opt_s,
                    events=tuple(events), device_curve=tuple(device_curve))
