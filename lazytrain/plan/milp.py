"""The planner's MILP (PuLP): checkpoint segments, tiers, and the transfer windows of ops.py.

Variables
- x[s,e,m,t]  binary: segment (s,e) in mode m (store | recompute) keeps its item on tier t;
              the chosen segments form a path over boundaries 0..L (flow conservation).
- p[j,t]      binary: layer j's compute-dtype weights live on t (device = resident).
- g[j,t], o[j,t]  binary: fp32 grads / master + moments on host or NVMe (full fine-tuning).
- zh[j], zn[j]  reload products: block j recomputed-not-last AND streamed (from NVMe).
- Bmax, Bblk, Bnvme, Smax  largest streamed layer, largest streamed block, largest NVMe layer,
              largest offloaded item (size the device's streaming buffers, ops.streaming_reserve;
              the host's bounce buffers; the offloaded activation brought back ahead in backward).
              A tied head's use streams its own weights and/or the embedding's matrix, each as its
              owner's tier says (`ops.weight_parts`): linear in p, no product needed.
- D[b]        device bytes kept by segments ending at or before boundary b.
- P           device peak; U[k] (last micro-batch) and W[k] (others; W1[k] too where the first of them
              fetches what the later ones find held, ops.micro_batch_kinds) window lengths.
Objective: sum U + (number of each kind) * sum W (= predicted step time) + a tiny tie-breaker on the
device peak.
Pinning (`pins`) fixes any subset of decisions, so the same model *evaluates* hand-written plans.
"""

from __future__ import annotations

import functools

import contextlib
import os
import sys
import time
from dataclasses import dataclass

import pulp

from ..costmodel import NVME_ACT_STAGING_LAYERS, NVME_STATE_SETS, JobCosts
from ..spec import GiB, HardwareSpec
from .assignment import RECOMPUTE, STORE, Assignment, Segment
from .ops import (BWD, FWD, HEAD, after, bwd_window, ends_long_segment, first_block_held, fwd_window,
                  grad_d2h_bytes, grads_in_flight, head_peak_bytes, held_into_next_cycle, micro_batch_kinds,
                  op_sequence, refetch_last_kept, streaming_reserve, update_window, weight_parts)

# The free re-solve after a solve with symmetry-breaking rows (solve_milp). Measured 2026-12-01 on
# the 2-core CPU machine, warm-started: qwen3-14b full fine-tuning on an RTX 3090 96.07 -> 94.76 s
# per step and 97.58 -> 95.48 s with the chunked loss, llama3.1-405b LoRA on an H200 28.81 ->
# 28.77 s, each within 3 s; 8B plans were optimal already (their re-solves take 0.1-0.3 s).
FREE_RESOLVE_S = 3.0
FREE_RESOLVE_NODES = 50
POLISH_MIN_S = 5.0   # the final LP's time allowance at least (it solves in well under 1 s)


@dataclass(frozen=True)
class Pins:
    """Decisions fixed before solving. None = free."""
    segments: tuple[Segment, ...] | None = None       # the whole checkpoint path
    activation_tiers: tuple[str, ...] | None = None   # allowed tiers for kept activations
    param_tier: tuple[str | None, ...] | None = None
    grad_tier: tuple[str | None, ...] | None = None
    optimizer_tier: tuple[str | None, ...] | None = None


@dataclass(frozen=True)
class MilpResult:
    status: str               # optimal | feasible | infeasible | timeout (no plan found in time)
    assignment: Assignment | None
    objective_s: float | None  # predicted step time (tie-breaker removed)
    peak_bytes: dict[str, int] | None
    solver_name: str
    wall_s: float
    gap: float | None
    detail: str


class _HiGHSWithStart(pulp.HiGHS):
    """PuLP's HiGHS API solver, plus a (partial) starting solution handed to HiGHS by name:
    HiGHS completes it and starts branch-and-bound with an incumbent."""

    def __init__(self, start: dict[str, float] | None = None, **kw) -> None:
        super().__init__(**kw)
        self.start = start or {}

    def findSolutionValues(self, lp):
        # A node limit (mip_max_nodes, the free re-solve's) ends with HiGHS' kSolutionLimit,
        # which this PuLP does not map: the incumbent is a feasible solution.
        try:
            return super().findSolutionValues(lp)
        except KeyError:
            if lp.solverModel.getInfo().objective_function_value < float("inf"):
                return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound

    def callSolver(self, lp):
        if self.start:
            import numpy as np
            idx = [v.index for v in lp.variables() if v.name in self.start]
            val = [float(self.start[v.name]) for v in lp.variables() if v.name in self.start]
            try:
                lp.solverModel.setSolution(len(idx), np.asarray(idx, dtype=np.int32),
                                           np.asarray(val, dtype=np.float64))
            except Exception:  # older highspy: no partial solutions; solve cold
                pass
        lp.solverModel.run()


@functools.lru_cache(maxsize=1)
def _available_solvers() -> tuple[str, ...]:
    """PuLP probes every solver class it knows: once per process is enough."""
    return tuple(pulp.listSolvers(onlyAvailable=True))


def make_solver(name: str, time_limit_s: float, mip_gap: float, presolve: bool = True,
                start: dict[str, float] | None = None):
    available = _available_solvers()
    if name in ("auto", "highs") and "HiGHS" in available:
        extra = {} if presolve else {"presolve": "off"}
        return _HiGHSWithStart(start=start, msg=False, timeLimit=time_limit_s, gapRel=mip_gap, threads=2,
                               mip_feasibility_tolerance=1e-7, **extra), "highs"
    if name == "highs":
        raise RuntimeError("planner.solver=highs but highspy is not installed (pip install highspy)")
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=mip_gap, threads=2), "cbc"


def solve_milp(costs: JobCosts, hw: HardwareSpec, *, max_segment_len: int = 8, depth: int = 2,
               allow_nvme: bool = True, pins: Pins | None = None, solver: str = "auto",
               time_limit_s: float = 30.0, mip_gap: float = 1e-3,
               minimize: str = "time", device_capacity_bytes: int | None = None,
               symmetry_breaking: bool = True, start: Assignment | None = None,
               presolve: bool = True, free_resolve_s: float = FREE_RESOLVE_S) -> MilpResult:
    """Solve (or, with everything pinned, evaluate) one job. `minimize="device_peak"` finds the
    smallest device memory any plan needs (capacity unconstrained unless `device_capacity_bytes` is
    given: then any plan under it, the question `solve.fits` asks) for infeasibility reports;
    "host_peak" / "nvme_peak" the least host memory / NVMe any plan needs within the other tiers'
    capacities (the advice for a job the host or drive cannot hold).

    The symmetry-breaking rows (below) make large models solve in seconds but can exclude the
    fastest plan; for `minimize="time"` the solution is then re-solved without them, warm-started
    from it, for at most `free_resolve_s` seconds and FREE_RESOLVE_NODES branch-and-bound nodes
    (HiGHS only; 0: off), and the faster of the two is kept."""
    pins = pins or Pins()
    L, G = costs.num_blocks, costs.grad_accum
    N = L + 2
    layers = costs.layers
    ops = op_sequence(L)
    K = len(ops)
    act_tiers = list(pins.activation_tiers or (("device", "host", "nvme") if allow_nvme else ("device", "host")))
    param_tiers = ["device", "host"] + (["nvme"] if allow_nvme else [])
    state_tiers = ["host"] + (["nvme"] if allow_nvme else [])
    prob = pulp.LpProblem("lazytrain_plan", pulp.LpMinimize)
    B = pulp.LpBinary

    # ---- segments -------------------------------------------------------------------------
    cand: list[tuple[int, int, str]] = []
    if pins.segments is not None:
        cand = sorted({(s.s, s.e, s.mode) for s in pins.segments})
    else:
        for s in range(L):
            cand.append((s, s + 1, STORE))
            for e in range(s + 1, min(L, s + max_segment_len) + 1):
                cand.append((s, e, RECOMPUTE))
    seg_tiers = {c: act_tiers for c in cand}
    if pins.segments is not None:
        seg_tiers = {(s.s, s.e, s.mode): [s.tier] for s in pins.segments}
    x = {(s, e, m, t): pulp.LpVariable(f"x_{s}_{e}_{m[0]}_{t}", cat=B)
         for (s, e, m) in cand for t in seg_tiers[(s, e, m)]}

    kept = {c: Segment(*c, "device").kept_bytes(costs) for c in cand}
    work = {(*c, t): Segment(*c, t).working_bytes(costs) for c in cand for t in seg_tiers[c]}
    # flow: one path 0 -> L
    for b in range(L + 1):
        out_ = pulp.lpSum(v for (s, e, m, t), v in x.items() if s == b)
        in_ = pulp.lpSum(v for (s, e, m, t), v in x.items() if e == b)
        if b == 0:
            prob += out_ == 1, "flow_0"
        elif b == L:
            prob += in_ == 1, "flow_L"
        else:
            prob += in_ == out_, f"flow_{b}"
    rec = {j: pulp.lpSum(v for (s, e, m, t), v in x.items() if m == RECOMPUTE and s < j <= e)
           for j in range(1, L + 1)}
    # fetched again for its backward after its recompute (ops.refetch_last_kept)
    kept_n = refetch_last_kept(depth)
    not_last = {j: pulp.lpSum(v for (s, e, m, t), v in x.items() if m == RECOMPUTE and s < j <= e - kept_n)
                for j in range(1, L + 1)}
    # the last block's backward needs a fetch only after a recompute segment of several blocks
    # (ops.py: otherwise, at depth >= 2, the streamer still holds it from its forward)
    long_last = pulp.lpSum(v for (s, e, m, t), v in x.items() if m == RECOMPUTE and ends_long_segment(L, s, e))

    # ---- tiers ----------------------------------------------------------------------------
    def tier_vars(prefix, tiers, pinned):
        vs = {}
        for j in range(N):
            allowed = tiers if (pinned is None or pinned[j] is None) else [pinned[j]]
            if not set(allowed) <= set(tiers):   # (NVMe off: solve.pins_for maps a heuristic's to host)
                raise ValueError(f"{prefix}: layer {j} pinned to {pinned[j]!r}, not one of {tiers}")
            for t in allowed:
                vs[j, t] = pulp.LpVariable(f"{prefix}_{j}_{t}", cat=B)
            prob.addConstraint(pulp.lpSum(vs[j, t] for t in allowed) == 1, f"{prefix}_one_{j}")
        return vs

    p = tier_vars("p", param_tiers, pins.param_tier)
    full = costs.trains_base
    o = tier_vars("o", state_tiers, pins.optimizer_tier) if full else {}
    g = tier_vars("g", state_tiers, pins.grad_tier) if (full and G > 1) else {}

    def pv(j, t):
        return p.get((j, t), 0)

    # Bytes one use of layer j brings to the device / reads from NVMe. A tied head's parts live on
    # two tiers: its own on its tier, the embedding's matrix on the embedding's (resident: counted
    # once, with the embedding; streamed: fetched for the head as the executor's streamer does).
    parts = [weight_parts(costs, j) for j in range(N)]

    def fetched_bytes(j):
        return sum(b * (1 - pv(owner, "device")) for owner, b in parts[j])

    def nvme_read_bytes(j):
        return sum(b * pv(owner, "nvme") for owner, b in parts[j])

    def host_fetched_bytes(j):
        return sum(b * pv(owner, "host") for owner, b in parts[j])

    # Symmetry breaking: order consecutive identical blocks' tiers (device-resident first, NVMe
    # last). This removes the permutations that otherwise keep branch-and-bound busy proving
    # optimality. Exact for the device peak, not for the step time: the windows around a block
    # differ with the recompute segments, and a plan that interleaves tiers can spread NVMe
    # traffic over more windows (qwen3-14b full at 2048 tokens on an RTX 3090: 94.76 vs 96.07 s
    # per step). Hence the free re-solve after the solve (_free_resolve).
    sym_rows: list[str] = []
    if symmetry_breaking:
        for j in range(1, L):
            if _same_block(layers[j], layers[j + 1]):
                for vname, vs in (("p", p), ("o", o), ("g", g)):
                    if (j, "device") in vs and (j + 1, "device") in vs:
                        sym_rows.append(f"sym_dev_{vname}_{j}")
                        prob += vs[j, "device"] >= vs[j + 1, "device"], sym_rows[-1]
                    if (j, "nvme") in vs and (j + 1, "nvme") in vs:
                        sym_rows.append(f"sym_nvme_{vname}_{j}")
                        prob += vs[j, "nvme"] <= vs[j + 1, "nvme"], sym_rows[-1]

    zh, zn = {}, {}
    for j in range(1, L + 1):
        zh[j] = pulp.LpVariable(f"zh_{j}", lowBound=0)
        prob += zh[j] >= not_last[j] - pv(j, "device"), f"zh_{j}"
        if allow_nvme:
            zn[j] = pulp.LpVariable(f"zn_{j}", lowBound=0)
            prob += zn[j] >= not_last[j] + pv(j, "nvme") - 1, f"zn_{j}"
    # the last block's backward fetch (reuse: only after a long recompute segment): long_last AND streamed
    wh = wn = None
    if depth >= 2 and L >= 1:
        wh = pulp.LpVariable("wh_last", lowBound=0)
        prob += wh >= long_last - pv(L, "device"), "wh_last"
        if allow_nvme:
            wn = pulp.LpVariable("wn_last", lowBound=0)
            prob += wn >= long_last + pv(L, "nvme") - 1, "wn_last"
    # CPU as the device (HardwareSpec.copies_share_compute): only host-tier weights are copied (an
    # NVMe read lands in device memory), so those reloads need their host-tier products
    cpu = hw.copies_share_compute
    zhh, whh = (dict(zh), wh) if not allow_nvme else ({}, None)
    if cpu and allow_nvme:
        for j in range(1, L + 1):
            zhh[j] = pulp.LpVariable(f"zhh_{j}", lowBound=0)
            prob += zhh[j] >= not_last[j] + pv(j, "host") - 1, f"zhh_{j}"
        if wh is not None:
            whh = pulp.LpVariable("whh_last", lowBound=0)
            prob += whh >= long_last + pv(L, "host") - 1, "whh_last"

    Bmax = pulp.LpVariable("Bmax", lowBound=0)
    Bblk = pulp.LpVariable("Bblk", lowBound=0)   # largest streamed block (ops.streaming_reserve)
    Bnvme = pulp.LpVariable("Bnvme", lowBound=0)
    Smax = pulp.LpVariable("Smax", lowBound=0)
    # Memory rows are written in GiB: byte-sized coefficients sit below solver tolerances.
    for j in range(N):
        prob += Bmax >= fetched_bytes(j) / GiB, f"bmax_{j}"
        if 1 <= j <= L:
            prob += Bblk >= fetched_bytes(j) / GiB, f"bblk_{j}"
        if allow_nvme:
            prob += Bnvme >= nvme_read_bytes(j) / GiB, f"bnvme_{j}"
    for c in cand:
        off = [x[(*c, t)] for t in seg_tiers[c] if t != "device"]
        if off:
            prob += Smax >= kept[c] / GiB * pulp.lpSum(off), f"smax_{c[0]}_{c[1]}_{c[2][0]}"

    # Streaming buffers (ops.streaming_reserve): depth of the largest slot (binary `wide` = 1), or
    # where at least depth - 1 blocks stream the largest slot + depth - 1 (+ 1 cached, on a CPU
    # device) of the largest block's; the solver takes the smaller.
    R = pulp.LpVariable("stream_reserve", lowBound=0)
    wide = pulp.LpVariable("stream_reserve_wide", cat=B)
    big = (depth + 1) * max((sum(b for _, b in parts[j]) for j in range(N)), default=0) / GiB
    prob += R >= depth * Bmax - big * (1 - wide), "reserve_wide"
    prob += R >= Bmax + (depth - 1 + int(costs.caches_stream_buffers)) * Bblk - big * wide, "reserve"
    prob += (pulp.lpSum(1 - pv(j, "device") for j in range(1, L + 1)) >= (depth - 1) * (1 - wide),
             "reserve_blocks")

    # ---- device memory --------------------------------------------------------------------
    # Offloaded activations (simulate.memory_peaks): one item brought back ahead (at most Smax) in
    # the head's and the backward windows, plus the segment's own item in its backward.
    base = (costs.device_static_bytes / GiB
            + pulp.lpSum(c.param_store_bytes / GiB * pv(j, "device") for j, c in enumerate(layers))
            + R + Smax)
    D = [pulp.LpVariable(f"D_{b}", lowBound=0) for b in range(L + 1)]
    prob += D[0] == 0, "D_0"
    for b in range(1, L + 1):
        prob += D[b] == D[b - 1] + pulp.lpSum(kept[(s, e, m)] / GiB * v for (s, e, m, t), v in x.items()
                                              if e == b and t == "device"), f"D_{b}"
    P = pulp.LpVariable("P", lowBound=0)
    prob += P >= base + D[L] + head_peak_bytes(costs) / GiB, "peak_head"
    prob += P >= base + grads_in_flight(costs, 0, 0) / GiB, "peak_embed_bwd"
    for b in range(L):
        # its kept item is on the device in its backward whatever its tier (kept there, or back)
        starting = pulp.lpSum((kept[(s, e, m)] + work[(s, e, m, t)]
                               + grads_in_flight(costs, s + 1, e)) / GiB * v
                              for (s, e, m, t), v in x.items() if s == b)
        prob += P >= base + D[b] + starting, f"peak_{b}"
    cap = costs.device_capacity_bytes if device_capacity_bytes is None else device_capacity_bytes
    if minimize != "device_peak" or device_capacity_bytes is not None:
        prob += P <= cap / GiB, "device_capacity"

    # ---- host and NVMe capacity -----------------------------------------------------------
    host = (costs.host_static_bytes / GiB + depth * Bnvme
            + pulp.lpSum(c.param_store_bytes / GiB * pv(j, "host") for j, c in enumerate(layers))
            + pulp.lpSum(kept[(s, e, m)] / GiB * v for (s, e, m, t), v in x.items() if t == "host"))
    nvme = (pulp.lpSum(c.param_store_bytes / GiB * pv(j, "nvme") for j, c in enumerate(layers))
            + pulp.lpSum(kept[(s, e, m)] / GiB * v for (s, e, m, t), v in x.items() if t == "nvme"))
    act_nvme = [(k, v) for k, v in x.items() if k[3] == "nvme"]
    if act_nvme:   # activations on their way to NVMe: the largest item's, NVME_ACT_STAGING_LAYERS times
        Astage = pulp.LpVariable("nvme_act_staging", lowBound=0)
        for (s, e, m, t), v in act_nvme:
            prob += Astage >= kept[(s, e, m)] / GiB * v, f"astage_{s}_{e}_{m[0]}"
        host += NVME_ACT_STAGING_LAYERS * Astage
    if full:
        host += pulp.lpSum(c.optimizer_bytes / GiB * o[j, "host"] for j, c in enumerate(layers) if (j, "host") in o)
        nvme += pulp.lpSum(c.optimizer_bytes / GiB * o[j, "nvme"] for j, c in enumerate(layers) if (j, "nvme") in o)
        if any(t == "nvme" for (_, t) in o):
            Ostage = pulp.LpVariable("nvme_state_staging", lowBound=0)  # largest NVMe-tier layer
            for j, c in enumerate(layers):
                if (j, "nvme") in o:
                    prob += Ostage >= c.optimizer_bytes / GiB * o[j, "nvme"], f"ostage_{j}"
            host += NVME_STATE_SETS * Ostage
        if G > 1:
            host += pulp.lpSum(c.grad_store_bytes / GiB * g[j, "host"] for j, c in enumerate(layers) if (j, "host") in g)
            nvme += pulp.lpSum(c.grad_store_bytes / GiB * g[j, "nvme"] for j, c in enumerate(layers) if (j, "nvme") in g)
        else:
            host += sum(c.grad_store_bytes for c in layers) / GiB   # (simulate.memory_peaks)
    Hpk = pulp.LpVariable("host_peak", lowBound=0)
    Npk = pulp.LpVariable("nvme_peak", lowBound=0)
    prob += Hpk == host, "host_peak_def"
    prob += Npk == nvme, "nvme_peak_def"
    # (minimize="host_peak" / "nvme_peak": that tier's least need, its capacity row dropped)
    if minimize != "host_peak":
        prob += Hpk <= costs.host_capacity_bytes / GiB, "host_capacity"
    if minimize != "nvme_peak":
        prob += Npk <= costs.nvme_capacity_bytes / GiB, "nvme_capacity"

    # ---- windows --------------------------------------------------------------------------
    def loads(final: bool, after_held: bool) -> list[dict[str, object]]:
        held = held_into_next_cycle(final, full)
        # h2d_host: the part of h2d that is a copy on a CPU device (not what NVMe reads bring)
        res = [{r: 0 for r in ("compute", "h2d", "h2d_host", "d2h", "nvme_read", "nvme_write", "optimizer")}
               for _ in range(K)]
        for k, op in enumerate(ops):
            c = layers[op.layer]
            if op.kind == FWD:
                res[k]["compute"] += c.fwd_s
            elif op.kind == HEAD:
                res[k]["compute"] += c.fwd_s + c.bwd_s
            else:
                res[k]["compute"] += c.bwd_s + (c.fwd_s * rec[op.layer] if op.layer in rec else 0)
            nxt = ops[(k + 1) % K]
            n = layers[nxt.layer]
            if nxt.kind == BWD and nxt.layer == L and wh is not None:
                res[k]["h2d"] += n.param_bytes * wh
                res[k]["h2d_host"] += n.param_bytes * whh if cpu else 0
                if wn is not None:
                    res[k]["nvme_read"] += n.param_bytes * wn
            elif not (k == K - 1 and held   # fetched before B_0 (ops.py)
                      or nxt.kind == BWD and nxt.layer == 0 and not held
                      or k == 0 and first_block_held(after_held, depth)):
                res[k]["h2d"] += fetched_bytes(nxt.layer)
                res[k]["h2d_host"] += host_fetched_bytes(nxt.layer) if cpu else 0
                res[k]["nvme_read"] += nvme_read_bytes(nxt.layer)
            if nxt.kind == BWD and nxt.layer in zh:
                res[k]["h2d"] += n.param_bytes * zh[nxt.layer]
                res[k]["h2d_host"] += n.param_bytes * zhh[nxt.layer] if cpu else 0
                if nxt.layer in zn:
                    res[k]["nvme_read"] += n.param_bytes * zn[nxt.layer]
        for (s, e, m, t), v in x.items():
            if t == "device":
                continue
            nb = kept[(s, e, m)]
            k_out = fwd_window(L, s + 1) + (1 if m == STORE else 0)
            k_in = bwd_window(L, e) - 1
            res[k_out]["d2h"] += nb * v
            res[k_in]["h2d"] += nb * v
            res[k_in]["h2d_host"] += nb * v if t == "host" else 0
            if t == "nvme":
                res[k_out]["nvme_write"] += nb * v
                res[k_in]["nvme_read"] += nb * v
        if full:
            for j, c in enumerate(layers):
                k_b = bwd_window(L, j) if c.kind != "head" else fwd_window(L, L + 1)
                k_g = after(L, k_b)
                res[k_g]["d2h"] += grad_d2h_bytes(costs, j)
                if G > 1 and (j, "nvme") in g:
                    res[k_g]["nvme_read"] += c.grad_store_bytes * g[j, "nvme"]
                    res[k_g]["nvme_write"] += c.grad_store_bytes * g[j, "nvme"]
                if final:
                    k_u = update_window(L, j, k_b, costs.clip_grad)
                    key = "optimizer" if hw.optimizer_overlaps_compute else "compute"
                    res[k_u][key] += c.optimizer_s
                    if (j, "nvme") in o:
                        res[k_u]["nvme_read"] += c.optimizer_bytes * o[j, "nvme"]
                        res[k_u]["nvme_write"] += c.optimizer_bytes * o[j, "nvme"]
                    res[k_u]["nvme_write"] += c.param_store_bytes * pv(j, "nvme")
                    # (on a CPU device the update writes the resident weights itself: no copy)
                    res[k_u]["h2d"] += c.param_store_bytes * pv(j, "device")
        if cpu:   # the copies take the compute lane's time (the simulator does the same)
            for ld in res:
                ld["compute"] += (1.0 / hw.h2d_bytes_per_s) * ld["h2d_host"] + (1.0 / hw.d2h_bytes_per_s) * ld["d2h"]
                ld["h2d"] = ld["d2h"] = 0
        return res

    rates = {"h2d": hw.h2d_bytes_per_s, "d2h": hw.d2h_bytes_per_s,
             "nvme_read": hw.nvme_read_bytes_per_s, "nvme_write": hw.nvme_write_bytes_per_s}

    def window_vars(prefix: str, window_loads: list[dict[str, object]]) -> list[pulp.LpVariable]:
        ts = []
        for k, ld in enumerate(window_loads):
            T = pulp.LpVariable(f"{prefix}_{k}", lowBound=0)
            prob.addConstraint(T >= ld["compute"], f"{prefix}_c_{k}")
            prob.addConstraint(T >= ld["optimizer"], f"{prefix}_o_{k}")
            for r, rate in rates.items():
                if not (isinstance(ld[r], (int, float)) and ld[r] == 0):
                    prob.addConstraint(T >= (1.0 / rate) * ld[r], f"{prefix}_{r}_{k}")
            busy = [r for r in ("nvme_read", "nvme_write")
                    if not (isinstance(ld[r], (int, float)) and ld[r] == 0)]
            if not hw.nvme_full_duplex and len(busy) == 2:   # one drive: reads and writes take turns
                prob.addConstraint(T >= (1.0 / rates["nvme_read"]) * ld["nvme_read"]
                                   + (1.0 / rates["nvme_write"]) * ld["nvme_write"], f"{prefix}_nvme_{k}")
            ts.append(T)
        return ts

    # one set of window variables per kind of micro-batch (ops.micro_batch_kinds)
    kinds = micro_batch_kinds(G, full)
    final_loads = loads(True, next(h for f, h, _ in kinds if f))
    step_time = pulp.lpSum(window_vars("U", final_loads))
    for i, (_, held, n) in enumerate(k for k in kinds if not k[0]):
        step_time += n * pulp.lpSum(window_vars("W" if i == 0 else f"W{i}", loads(False, held)))
    # Tie-breakers, scaled to the step so they never outweigh a real difference: among equally
    # fast plans prefer less link traffic and recompute (robust to bandwidth drift), then small peaks
    # (which also pins the max-variables at their true value).
    t_ref = max(1e-6, G * sum(c.fwd_s + c.bwd_s for c in layers))
    traffic_s = pulp.lpSum(ld[r] * (1.0 / rate) for ld in final_loads for r, rate in rates.items())
    # The objective is normalised by the compute time so that every term is O(1) and the
    # tie-breakers stay above the solver's tolerances whatever the model size.
    peaks = (P / max(cap / GiB, 1e-3) + 0.1 * Hpk / max(costs.host_capacity_bytes / GiB, 1.0)
             + 0.01 * Npk / max(costs.nvme_capacity_bytes / GiB, 1.0)
             + 0.01 * (Bmax + Bnvme + Smax) / max(cap / GiB, 1e-3))
    if minimize in ("host_peak", "nvme_peak"):
        prob += Hpk if minimize == "host_peak" else Npk
    elif minimize == "device_peak":
        # P alone: a step-time tie-breaker (1e-4 * step / compute time) outweighed peak differences
        # of 0.1 MB and more on transfer-bound jobs, whose step is many times their compute, so the
        # minimum came out up to 2.3% high (review). Only this plan's peak is used.
        prob += P
    else:
        recompute_s = pulp.lpSum(layers[j].fwd_s * rec[j] for j in rec)
        prob += (step_time + 1e-3 * (traffic_s + recompute_s)) / t_ref + 1e-4 * peaks

    # ---- solve ----------------------------------------------------------------------------
    start_values = None
    if start is not None:  # warm start: every binary of a known-feasible plan
        start_values = {v.name: 0.0 for v in x.values()}
        for sg in start.segments:
            key = (sg.s, sg.e, sg.mode, sg.tier)
            if key in x:
                start_values[x[key].name] = 1.0
        for vs, tiers in ((p, start.param_tier), (o, start.optimizer_tier), (g, start.grad_tier)):
            for (j, t), v in vs.items():
                start_values[v.name] = 1.0 if tiers[j] == t else 0.0
    slv, slv_name = make_solver(solver, time_limit_s, mip_gap, presolve=presolve, start=start_values)
    t0 = time.perf_counter()
    with _quiet_stdout():
        prob.solve(slv)
    has_solution = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if not has_solution and slv_name == "highs" and prob.status == pulp.LpStatusInfeasible:
        # HiGHS' presolve has declared feasible models infeasible here (seen on pinned heuristic
        # models with near-binding capacity rows); believe "infeasible" only without presolve.
        slv, _ = make_solver(solver, time_limit_s, mip_gap, presolve=False)
        with _quiet_stdout():
            prob.solve(slv)
        has_solution = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if has_solution:
        # Polish: incumbents found by primal heuristics leave continuous variables (window
        # lengths, peaks, max-buffers) anywhere above their bounds. Fix the binaries and solve the
        # remaining LP so the predicted time and peaks are exactly those of the decisions.
        mip_status = prob.sol_status
        mip_gap_found = _gap(prob)
        budget = min(free_resolve_s, time_limit_s - (time.perf_counter() - t0))
        if sym_rows and minimize == "time" and slv_name == "highs" and budget >= 0.5:
            better, free_status, free_gap = _free_resolve(prob, sym_rows, solver, budget, mip_gap, presolve)
            # The rows are not exact for the step time: the model without them decides the status
            # and gap of whichever plan is returned (the re-solve's, or the first one it started
            # from and could not beat). Stopped by its node or time limit, that is "feasible" with
            # the gap against the free model's bound, even where the first solve said optimal
            # (review: an "optimal, gap 0.00%" plan 0.04% slower than a heuristic's).
            if better or free_status != pulp.LpSolutionOptimal:
                mip_status, mip_gap_found = free_status, free_gap
        for v in prob.variables():
            if v.cat == pulp.LpInteger and v.varValue is not None:
                v.bounds(round(v.varValue), round(v.varValue))
        # the streaming reserve's branch the decisions allow at its smallest (ops.streaming_reserve),
        # not whichever the incumbent took (it moves only a tie-breaker, below the solver's gap)
        slots = [int(round(pulp.value(fetched_bytes(j)) or 0)) for j in range(N)]
        narrow = streaming_reserve(slots, L, depth, costs.caches_stream_buffers) < depth * max(slots, default=0)
        wide.bounds(0 if narrow else 1, 0 if narrow else 1)
        # An LP now (every integer fixed): its own time allowance, and the MIP's values kept if it
        # does not solve (a tiny planner.time_limit_s cut it off, every value read back empty, and
        # the plan came out as "segments end at boundary 0": review)
        incumbent = {v.name: v.varValue for v in prob.variables()}
        mip_code = prob.status
        with _quiet_stdout():
            prob.solve(make_solver(solver, max(time_limit_s, POLISH_MIN_S), mip_gap, presolve=False)[0])
        if prob.status != pulp.LpStatusOptimal or any(v.varValue is None for v in prob.variables()):
            for v in prob.variables():
                v.varValue = incumbent[v.name]
            prob.status = mip_code
        prob.sol_status = mip_status  # report the MIP's status (optimal vs feasible), not the LP's
    wall = time.perf_counter() - t0
    status = pulp.LpStatus[prob.status]
    if not has_solution:
        # "timeout": the time limit ran out before any plan was found (not a proof of infeasibility)
        proven = prob.status == pulp.LpStatusInfeasible
        return MilpResult("infeasible" if proven else "timeout", None, None, None, slv_name, wall, None, status)
    gap = mip_gap_found
    st = "optimal" if prob.sol_status == pulp.LpSolutionOptimal and (gap is None or gap <= mip_gap + 1e-9) else "feasible"

    def chosen(vs, j, default):
        for (jj, t), v in vs.items():
            if jj == j and (v.value() or 0) > 0.5:
                return t
        return default

    segs = tuple(Segment(s, e, m, t) for (s, e, m, t), v in sorted(x.items(), key=lambda kv: kv[0][0])
                 if (v.value() or 0) > 0.5)
    a = Assignment(
        segments=segs,
        param_tier=tuple(chosen(p, j, "host") for j in range(N)),
        grad_tier=tuple(chosen(g, j, "host") if full else "device" for j in range(N)),
        optimizer_tier=tuple(chosen(o, j, "host") if full else "device" for j in range(N)),
    )
    return MilpResult(st, a, pulp.value(step_time), {"device": int(round(P.value() * GiB)),
                      "host": int(round(Hpk.value() * GiB)), "nvme": int(round(Npk.value() * GiB))},
                      slv_name, wall, gap, status)


def _free_resolve(prob: pulp.LpProblem, sym_rows: list[str], solver: str, time_limit_s: float,
                  mip_gap: float, presolve: bool) -> tuple[bool, int, float | None]:
    """Drop the symmetry-breaking rows and re-solve from the current solution (HiGHS starts with
    it as its incumbent, so it only returns a faster one); keep the faster of the two. Bounded by
    FREE_RESOLVE_NODES nodes, where the result is the same on every run (small models finish
    before either limit), and by time, where a large model's may depend on the machine's speed.
    Returns (whether the re-solve's solution was kept, the re-solve's solution status and MIP gap:
    the free model's verdict on the plan kept; a failed re-solve says IntegerFeasible, no gap)."""
    variables = prob.variables()
    before = {v.name: v.varValue for v in variables}
    obj = pulp.value(prob.objective)
    status, sol_status = prob.status, prob.sol_status
    ints = {v.name: v.varValue for v in variables if v.cat == pulp.LpInteger and v.varValue is not None}
    for name in sym_rows:
        del prob.constraints[name]
    slv, _ = make_solver(solver, time_limit_s, mip_gap, presolve=presolve,
                         start={n: float(round(val)) for n, val in ints.items()})
    slv.optionsDict["mip_max_nodes"] = FREE_RESOLVE_NODES
    free_status, free_gap = pulp.LpSolutionIntegerFeasible, None
    try:
        with _quiet_stdout():
            prob.solve(slv)
        found = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        better = found and pulp.value(prob.objective) < obj * (1 - 1e-9)
        if found:   # (its incumbent is at least as fast as the start: the gap holds for the plan kept)
            free_status, free_gap = prob.sol_status, _gap(prob)
    except pulp.PulpSolverError:
        better = False
    if not better:   # (HiGHS keeps the start as incumbent; this also covers a failed solve)
        for v in variables:
            v.varValue = before[v.name]
        prob.status, prob.sol_status = status, sol_status
    return better, free_status, free_gap


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS prints a banner from C++ on stdout even with output off; keep CLI output clean."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no real fd (e.g. captured in-process)
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _same_block(a, b) -> bool:
    return (a.kind == b.kind == "block" and a.param_bytes == b.param_bytes and a.act_bytes == b.act_bytes
            and a.fwd_s == b.fwd_s and a.optimizer_bytes == b.optimizer_bytes)


def _gap(prob: pulp.LpProblem) -> float | None:
    model = getattr(prob, "solverModel", None)
    if model is not None and hasattr(model, "getInfo"):  # HiGHS python API reports the MIP gap
        try:
            gap = float(model.getInfo().mip_gap)
            return gap if gap == gap and gap < 1e30 else None
        except Exception:
            return None
    # CBC (through PuLP) reports no gap: "optimal" is within the gapRel it was given, and a time
    # limit's incumbent comes back as LpStatusOptimal too; unknown ("-"), not 0.00%
    return None
