"""Plan: the frozen, versioned, hashed decision record that the executor, simulator and CLI share.

Per layer (execution order: embed, block.0 .. block.{L-1}, head):
- `recompute`: the layer's forward is re-run in backward from its segment's kept input;
- `segment_start`: index of the first layer of its checkpoint segment; consecutive recomputed
  layers with the same `segment_start` form one segment (kept input = the output of layer
  `segment_start - 1`, i.e. the segment's input boundary);
- `activation_tier`: where what the layer keeps for backward lives: for the first layer of a
  recompute segment, the segment's input boundary; for a stored (not recomputed) layer, all the
  activations it saves (via saved-tensor hooks); "none" for the other layers of a segment;
- `param_tier`: where the compute-dtype weights live between uses (device = resident);
- `grad_tier`, `optimizer_tier`: where fp32 gradients and master weights + optimizer states live.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..spec import HardwareSpec, JobSpec

SCHEMA_VERSION = 1
STATUSES = ("optimal", "feasible", "infeasible")


@dataclass(frozen=True)
class PlannerOptions:
    max_segment_len: int = 4          # longest checkpoint segment considered (8: same optimum on the
                                      # jobs measured, 2-4x slower solves)
    time_limit_s: float = 30.0
    solver: str = "auto"              # "auto" (HiGHS if installed, else CBC) | "highs" | "cbc"
    prefetch_depth: int = 2           # parameter buffers on the device for streaming
    mip_gap: float = 0.01
    allow_nvme: bool = True

    SOLVERS = ("auto", "highs", "cbc")

    def __post_init__(self) -> None:
        """Refuse settings the solver would silently replace or misread (an unknown solver name
        fell back to CBC; a negative gap or limit, zero segments or buffers, 'maybe' for a bool)."""
        def whole(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        bad = []
        if self.solver not in self.SOLVERS:
            bad.append(f"solver={self.solver!r} (valid: {', '.join(self.SOLVERS)})")
        if not (whole(self.max_segment_len) and self.max_segment_len >= 1):
            bad.append(f"max_segment_len={self.max_segment_len!r} (an int >= 1)")
        if not (whole(self.prefetch_depth) and self.prefetch_depth >= 1):
            bad.append(f"prefetch_depth={self.prefetch_depth!r} (an int >= 1)")
        if not (number(self.time_limit_s) and self.time_limit_s > 0):
            bad.append(f"time_limit_s={self.time_limit_s!r} (seconds > 0)")
        if not (number(self.mip_gap) and 0 <= self.mip_gap < 1):
            bad.append(f"mip_gap={self.mip_gap!r} (a fraction in [0, 1))")
        if not isinstance(self.allow_nvme, bool):
            bad.append(f"allow_nvme={self.allow_nvme!r} (true or false)")
        if bad:
            raise ValueError("invalid " + "; ".join(bad))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PlannerOptions":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class LayerDecision:
    name: str
    kind: str
    index: int
    recompute: bool
    segment_start: int
    activation_tier: str
    param_tier: str
    grad_tier: str
    optimizer_tier: str


# status_detail of a plan returned by the MILP's timeout fallback starts so (solve._fallback)
FALLBACK_DETAIL = "time limit "


@dataclass(frozen=True)
class SolverInfo:
    name: str
    wall_s: float
    gap: float | None
    status_detail: str = ""

    def damage(self) -> str:
        """What is wrong with the values ('' if nothing): a hand-edited plan file's."""
        num = lambda v: isinstance(v, int | float) and not isinstance(v, bool)  # noqa: E731
        if not (self.gap is None or num(self.gap)) or not num(self.wall_s):
            return f"solver gap {self.gap!r} / wall_s {self.wall_s!r} are not numbers"
        if not isinstance(self.status_detail, str) or not isinstance(self.name, str):
            return "solver name / status_detail are not text"
        return ""

    @property
    def fell_back(self) -> bool:
        """The MILP ran out of time and a heuristic's plan was returned (status_detail says so)."""
        return self.status_detail.startswith(FALLBACK_DETAIL)


@dataclass(frozen=True)
class Predicted:
    step_time_s: float
    tokens_per_s: float
    peak_bytes: Mapping[str, int]       # {"device", "host", "nvme"}
    compute_s: float = 0.0               # forward + backward compute, no recompute
    recompute_s: float = 0.0
    exposed_transfer_s: float = 0.0      # step time beyond compute + recompute + the optimizer's share
    serial_optimizer_s: float = 0.0      # host optimizer not overlapped with compute (a CPU device)
    exposed_optimizer_s: float = 0.0     # an overlapped host optimizer's time beyond the compute beside it


@dataclass(frozen=True)
class Plan:
    schema_version: int
    input_hash: str
    status: str                          # optimal | feasible | infeasible
    method: str                          # "milp" or "heuristic:<name>"
    solver: SolverInfo
    predicted: Predicted
    layers: tuple[LayerDecision, ...]
    model_name: str
    model_config: Mapping[str, Any]
    hardware: HardwareSpec
    job: JobSpec
    options: PlannerOptions
    lazytrain_version: str
    explanation: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return self.status in ("optimal", "feasible")

    def layer(self, name: str) -> LayerDecision:
        for d in self.layers:
            if d.name == name:
                return d
        raise KeyError(name)

    def segments(self) -> list[tuple[int, int]]:
        """Recompute segments as (first_index, last_index) inclusive, in execution order."""
        out: list[tuple[int, int]] = []
        for d in self.layers:
            if not d.recompute:
                continue
            if out and out[-1][0] == d.segment_start and out[-1][1] == d.index - 1:
                out[-1] = (out[-1][0], d.index)
            else:
                out.append((d.index, d.index))
        return out

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = [asdict(x) for x in self.layers]
        d["explanation"] = list(self.explanation)
        return d

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        d = dict(d)
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"plan schema_version {d.get('schema_version')} != {SCHEMA_VERSION}")
        if d.get("status") not in STATUSES:
            raise ValueError(f"plan status {d.get('status')!r} not in {STATUSES}")
        return cls(
            schema_version=d["schema_version"], input_hash=d["input_hash"], status=d["status"],
            method=d["method"], solver=SolverInfo(**d["solver"]),
            predicted=Predicted(**d["predicted"]),
            layers=tuple(LayerDecision(**x) for x in d["layers"]),
            model_name=d["model_name"], model_config=d["model_config"],
            hardware=HardwareSpec.from_dict(d["hardware"]), job=JobSpec.from_dict(d["job"]),
            options=PlannerOptions.from_dict(d["options"]),
            lazytrain_version=d["lazytrain_version"], explanation=tuple(d.get("explanation", ())),
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path) -> "Plan":
        """A plan file; ValueError naming the file when it is missing or not a plan."""
        p = Path(path)
        if p.is_dir() and (p / "plan.json").is_file():   # a run's output_dir: the plan it ran
            p = p / "plan.json"
        if not p.is_file():
            raise ValueError(f"{p}: no such plan file" + (" (a directory without plan.json: give a plan file "
                                                          "or a run's output_dir)" if p.is_dir() else ""))
        try:
            return cls.parse(p.read_text())
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None

    @classmethod
    def parse(cls, text: str) -> "Plan":
        """A plan file's text; ValueError when it is not a plan, or one whose structure (what
        `plan show`, `trace` and the executor index) is broken (cache.malformed)."""
        try:
            plan = cls.from_json(text)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a lazytrain plan ({type(e).__name__}: {e})") from None
        from .cache import malformed   # (cache imports this module)
        if why := malformed(plan):
            raise ValueError(f"not a lazytrain plan ({why})")
        return plan


def input_hash(model_config: Mapping[str, Any], hardware: HardwareSpec, job: JobSpec,
               options: PlannerOptions, method: str, versions: Mapping[str, str]) -> str:
    """Content hash over every input that can change a plan. Whole numbers of the hardware, job and
    options are hashed as floats: `device_memory_gib=24` and `=24.0` are one plan (they were two
    cache entries and a re-solve: review). Job settings no plan depends on are left out: LoRA's
    alpha (a scale inside the adapter) and the order of its targets; a plan served for another value
    of them carries the asked job (`plan_job`). (A full job keeps its LoRA rank and targets: an
    infeasible one's advice plans job.mode=lora with them.)"""
    def num(d: dict) -> dict:
        return {k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in d.items()}

    j = asdict(job)
    j.pop("lora_alpha")
    j["lora_targets"] = sorted(j["lora_targets"])
    blob = json.dumps({
        "schema_version": SCHEMA_VERSION, "model": model_config, "hardware": num(asdict(hardware)),
        "job": num(j), "options": num(asdict(options)), "method": method, "versions": dict(versions),
    }, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]
