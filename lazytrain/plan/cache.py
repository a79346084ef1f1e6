"""solver_cache/<input_hash>.json: a hit skips the solver; a corrupt entry is ignored (and
replaced by the re-solved plan)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from dataclasses import fields
from pathlib import Path

from ..spec.tier import Tier
from ..storage.filemode import replace_text
from .plan import Plan
from .plan import input_hash as hash_of_inputs

log = logging.getLogger(__name__)


TIERS = tuple(t.value for t in Tier)


# a cache entry's checksum of everything else in it (Plan.from_dict ignores the key): any edit or
# bit flip, of fields the replay below cannot re-derive too (status, tokens/s, solver, explanation)
CHECKSUM_KEY = "entry_sha256"


def _checksum(d: dict) -> str:
    return hashlib.sha256(json.dumps({k: v for k, v in d.items() if k != CHECKSUM_KEY},
                                     sort_keys=True).encode()).hexdigest()


def _checksum_damage(d: dict) -> str:
    if CHECKSUM_KEY not in d:
        return "no checksum (written before 2026-12-01, or by hand)"
    if d[CHECKSUM_KEY] != _checksum(d):
        return "its contents do not match its checksum (edited or damaged)"
    return ""


def _damage(plan: Plan, asked_hash: str | None = None) -> str:
    """What makes a parsed cache entry unusable ('' if nothing): valid JSON whose contents a bit
    flip or a hand edit broke would otherwise be served as the plan. `asked_hash`: the input hash
    the entry is served for, which its own inputs (model config, hardware, job, options, method)
    must hash to: its stored `input_hash` alone does not vouch for them (another job's settings
    edited in kept it)."""
    if asked_hash is not None:
        from .solve import versions   # (solve imports this module)
        own = hash_of_inputs(plan.model_config, plan.hardware, plan.job, plan.options, plan.method, versions())
        if own != asked_hash:
            return "its model, hardware, job or options are not the ones asked for"
    why = malformed(plan)
    if why or not plan.fits:
        return why
    peaks, t = plan.predicted.peak_bytes, plan.predicted.step_time_s
    hw = plan.hardware
    # capacities as job_costs has them; the slack covers the solver's feasibility tolerance
    # (memory rows are in GiB: ~1e-7 GiB)
    for tier, cap in (("device", hw.device_memory_bytes), ("host", hw.host_capacity_bytes),
                      ("nvme", hw.nvme_capacity_bytes)):
        if peaks[tier] > cap * (1 + 1e-6) + 4096:
            return f"predicted {tier} peak {peaks[tier]} bytes above its capacity ({max(cap, 0)} bytes)"
    n = plan.model_config.get("num_hidden_layers")
    if isinstance(n, int) and len(plan.layers) != n + 2:
        return f"{len(plan.layers)} layers for a model of {n} blocks"
    # The entry must say what its own decisions give: replayed, tiers edited by hand (every
    # layer's weights on a 24 GiB card) or a step time written over were served as they read.
    from .solve import simulate_plan   # (solve imports this module)
    try:
        with _quiet("lazytrain.costmodel.layers"):   # (said when planning: an unmatched LoRA target)
            tl = simulate_plan(plan)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        return f"its decisions do not replay ({e})"
    if not math.isclose(tl.step_time_s, t, rel_tol=1e-6):
        return f"its decisions give a {tl.step_time_s:.6g} s step, it says {t:.6g} s"
    for tier in ("device", "host", "nvme"):
        if abs(tl.peak_bytes[tier] - peaks[tier]) > 1e-6 * max(peaks[tier], 1) + 4096:
            return f"its decisions give a {tier} peak of {tl.peak_bytes[tier]} bytes, it says {peaks[tier]}"
    return ""


def malformed(plan: Plan) -> str:
    """What makes a parsed plan unusable as a plan, whatever planner wrote it ('' if nothing): the
    structure `plan show`, `trace` and the executor index (peaks per tier, the layers' segments and
    tiers, numbers where numbers belong). A plan file from an older cost model passes; only a
    cache entry must also replay to its own figures (_damage)."""
    peaks = plan.predicted.peak_bytes
    if not isinstance(peaks, dict) or set(peaks) != {"device", "host", "nvme"}:
        return "predicted peaks are not device/host/nvme"
    if not all(isinstance(b, int | float) and not isinstance(b, bool) and math.isfinite(b) and b >= 0
               for b in peaks.values()):
        return f"predicted peaks {dict(peaks)} are not byte counts >= 0"
    why = plan.solver.damage()
    if why or not plan.fits:
        return why
    t = plan.predicted.step_time_s
    if not (isinstance(t, int | float) and math.isfinite(t) and t > 0):
        return f"predicted step time {t!r} s"
    # every other figure `plan show` prints (a hand-edited "fast" was a TypeError there: review)
    for f in fields(plan.predicted):
        v = getattr(plan.predicted, f.name)
        if f.name != "peak_bytes" and not (isinstance(v, int | float) and not isinstance(v, bool)
                                           and math.isfinite(v) and v >= 0):
            return f"predicted {f.name} {v!r} is not a number >= 0"
    if len(plan.layers) < 3:
        return f"{len(plan.layers)} layers"
    for i, d in enumerate(plan.layers):
        if not isinstance(d.name, str) or not isinstance(d.kind, str):   # (a rich traceback: review)
            return f"layer {i}: name {d.name!r} / kind {d.kind!r} are not text"
        if not isinstance(d.recompute, bool):
            return f"{d.name}: recompute {d.recompute!r} is not true/false"
        if not isinstance(d.segment_start, int) or not 0 <= d.segment_start < len(plan.layers):
            return f"{d.name}: segment start {d.segment_start!r} outside the plan's layers"
        if d.recompute and not (d.segment_start <= i and plan.layers[d.segment_start].recompute):
            return f"{d.name}: recompute segment start {d.segment_start}"
        if any(t not in TIERS for t in (d.param_tier, d.grad_tier, d.optimizer_tier)):
            return f"{d.name}: a tier outside {TIERS}"
        if d.activation_tier not in (*TIERS, "none"):
            return f"{d.name}: activation tier {d.activation_tier!r}"
    from .solve import assignment_of   # (solve imports this module)
    try:
        assignment_of(plan, replay=False).validate(len(plan.layers) - 2)
    except (ValueError, AssertionError) as e:
        return str(e)
    return ""


@contextlib.contextmanager
def _quiet(logger: str):
    """Records of `logger` (this logger only) dropped while the block runs."""
    lg = logging.getLogger(logger)
    was = lg.disabled
    lg.disabled = True
    try:
        yield
    finally:
        lg.disabled = was


class PlanCache:
    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)

    def path(self, input_hash: str) -> Path:
        return self.dir / f"{input_hash}.json"

    def get(self, input_hash: str) -> Plan | None:
        p = self.path(input_hash)
        if not p.is_file():
            return None
        try:
            d = json.loads(p.read_text())
            plan = Plan.from_dict(d)
        except OSError as e:   # e.g. another user's entry this one may not read: the cache only saves time
            log.warning("ignoring unreadable plan cache entry %s (%s); re-solving", p, e.strerror or e)
            return None
        except (ValueError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            log.warning("ignoring corrupt plan cache entry %s (%s); re-solving", p, e)
            return None
        if plan.input_hash != input_hash:
            log.warning("ignoring plan cache entry %s: hash mismatch; re-solving", p)
            return None
        why = _damage(plan, input_hash) or _checksum_damage(d)
        if why:
            log.warning("ignoring damaged plan cache entry %s (%s); re-solving", p, why)
            return None
        return plan

    def put(self, plan: Plan) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        p = self.path(plan.input_hash)
        d = plan.to_dict()
        d[CHECKSUM_KEY] = _checksum(d)
        return replace_text(p, json.dumps(d, indent=1))   # (umask's mode: 0600 would hide a team's shared cache)
