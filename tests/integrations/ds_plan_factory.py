"""Hand-made Plans for the DeepSpeed tests (the planner is not needed to test the export)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import yaml

from lazytrain.plan.plan import SCHEMA_VERSION, LayerDecision, Plan, PlannerOptions, Predicted, SolverInfo
from lazytrain.spec import HardwareSpec, JobSpec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

TINY_LLAMA: dict[str, Any] = dict(
    model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
    tie_word_embeddings=False, rms_norm_eps=1e-5)


def cpu_hardware() -> HardwareSpec:
    return HardwareSpec.from_dict(yaml.safe_load((CONFIGS / "hardware" / "cpu.yaml").read_text()))


def make_plan(model_config: Mapping[str, Any] = TINY_LLAMA, *, job: JobSpec | None = None,
              param_tier: str = "host", optimizer_tier: str = "host",
              recompute: frozenset[int] = frozenset(), segment_starts: Mapping[int, int] | None = None,
              activation_tiers: Mapping[int, str] | None = None,
              overrides: Mapping[int, Mapping[str, str]] | None = None, status: str = "optimal") -> Plan:
    """Plan over embed, block.0..L-1, head; `recompute`/`segment_starts`/`activation_tiers`/
    `overrides` are keyed by execution index (0 = embed)."""
    n_blocks = int(model_config["num_hidden_layers"])
    names = ["embed"] + [f"block.{i}" for i in range(n_blocks)] + ["head"]
    layers = []
    for idx, name in enumerate(names):
        kind = name.split(".")[0]
        rec = idx in recompute
        d = dict(name=name, kind=kind, index=idx, recompute=rec,
                 segment_start=(segment_starts or {}).get(idx, idx),
                 activation_tier=(activation_tiers or {}).get(idx, "device"),
                 param_tier=param_tier, grad_tier="host", optimizer_tier=optimizer_tier)
        d.update((overrides or {}).get(idx, {}))
        layers.append(LayerDecision(**d))
    return Plan(
        schema_version=SCHEMA_VERSION, input_hash="test", status=status, method="heuristic:test",
        solver=SolverInfo(name="none", wall_s=0.0, gap=None),
        predicted=Predicted(step_time_s=1.0, tokens_per_s=1.0, peak_bytes={"device": 0, "host": 0, "nvme": 0}),
        layers=tuple(layers), model_name="tiny-llama", model_config=dict(model_config),
        hardware=cpu_hardware(), job=job or JobSpec(batch_size=2, seq_len=32),
        options=PlannerOptions(), lazytrain_version="test",
        explanation=() if status != "infeasible" else ("needs 3 GiB more device memory",))
