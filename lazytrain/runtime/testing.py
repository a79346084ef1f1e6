"""Hand-made Plans for tests and benchmarks: per-layer decisions without the planner.

    plan = hand_plan(num_blocks=4, param_tier="host", segments=[(1, 3)], activation_tier="nvme")

Layer indices are execution order: 0 = embed, 1..L = blocks, L+1 = head. `segments` are
inclusive (first, last) recompute ranges; their first layer's `activation_tier` says where the
segment input lives, the others get "none". `overrides` sets fields of single layers by name.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..plan.plan import LayerDecision, Plan, PlannerOptions, Predicted, SolverInfo
from ..spec import HardwareSpec, JobSpec

def hardware_for_tests(device_memory_gib: float = 64.0, device_type: str = "cpu") -> HardwareSpec:
    return HardwareSpec(name="test", device_type=device_type, device_memory_gib=device_memory_gib,
                        host_memory_gib=23.5, nvme_capacity_gib=40, h2d_gbps=26, d2h_gbps=26,
                        nvme_read_gbps=1.8, nvme_write_gbps=1.45, device_tflops=0.21, workspace_gib=0.0)


def hand_plan(num_blocks: int, *, param_tier: str = "device", activation_tier: str = "device",
              grad_tier: str = "host", optimizer_tier: str = "host",
              segments: Sequence[tuple[int, int]] = (),
              overrides: Mapping[str, Mapping[str, Any]] | None = None,
              hardware: HardwareSpec | None = None, job: JobSpec | None = None,
              prefetch_depth: int = 2, predicted_step_time_s: float = 0.0,
              predicted_device_bytes: int = 0) -> Plan:
    """A feasible Plan for a model with `num_blocks` decoder blocks and the given decisions."""
    n = num_blocks + 2
    names = ["embed", *[f"block.{i}" for i in range(num_blocks)], "head"]
    seg_of: dict[int, int] = {}
    for a, b in segments:
        if not (0 <= a <= b < n):
            raise ValueError(f"segment {(a, b)} out of range for {n} layers")
        for i in range(a, b + 1):
            if i in seg_of:
                raise ValueError(f"layer {i} is in two segments")
            seg_of[i] = a
    layers = []
    for i, name in enumerate(names):
        kind = "embed" if i == 0 else "head" if i == n - 1 else "block"
        rec = i in seg_of
        start = seg_of.get(i, i)
        d = dict(name=name, kind=kind, index=i, recompute=rec, segment_start=start,
                 activation_tier=activation_tier if (not rec or start == i) else "none",
                 param_tier=param_tier, grad_tier=grad_tier, optimizer_tier=optimizer_tier)
        d.update((overrides or {}).get(name, {}))
        layers.append(LayerDecision(**d))
    return Plan(
        schema_version=1, input_hash="hand", status="feasible", method="hand",
        solver=SolverInfo(name="hand", wall_s=0.0, gap=None),
        predicted=Predicted(step_time_s=predicted_step_time_s, tokens_per_s=0.0,
                            peak_bytes={"device": predicted_device_bytes, "host": 0, "nvme": 0}),
        layers=tuple(layers), model_name="hand", model_config={},
        hardware=hardware or hardware_for_tests(), job=job or JobSpec(),
        options=PlannerOptions(prefetch_depth=prefetch_depth), lazytrain_version="test",
    )


# The plan families of issue 3's exactness suite, for a model with L blocks.
def plan_families(num_blocks: int) -> dict[str, dict[str, Any]]:
    L = num_blocks
    return {
        "all_resident": {},
        "recompute_all": {"segments": [(0, L + 1)]},
        "mixed_segments": {"segments": [(1, 2), (L, L + 1)] if L >= 3 else [(1, 1)],
                           "overrides": {"embed": {"activation_tier": "host"}}},
        "acts_host": {"activation_tier": "host"},
        "acts_nvme": {"activation_tier": "nvme", "segments": [(2, L)] if L >= 3 else []},
        "params_host": {"param_tier": "host", "prefetch_depth": 3},
        "params_nvme": {"param_tier": "nvme", "grad_tier": "nvme", "optimizer_tier": "nvme",
                        "segments": [(1, 2)] if L >= 3 else []},
    }


TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64),
    "qwen2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64),
    # sliding-window attention (window 16): sequences longer than it run with an explicit mask
    "mistral": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, sliding_window=16),
    "mixtral": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                    num_local_experts=4, num_experts_per_tok=2),
    # block 1 is dense (mlp_only_layers): a model whose blocks do not all have a router
    "qwen3_moe": dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128,
                      max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                      shared_expert_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, num_experts=4,
                      num_experts_per_tok=2),
    "olmoe": dict(hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, num_experts=4,
                  num_experts_per_tok=2, eos_token_id=2),
}


def tiny_model(family: str, seed: int = 0, dtype: str = "float32", **overrides: Any):
    """A randomly initialised tiny HF causal LM of `family` (a key of TINY_CONFIGS); a "-tied"
    suffix (e.g. "qwen2-tied") ties the input and output embeddings, as small Qwen/Llama models do."""
    import torch
    import transformers

    family, tied = (family[:-len("-tied")], True) if family.endswith("-tied") else (family, False)
    cfg = transformers.AutoConfig.for_model(family, **{"tie_word_embeddings": tied,
                                                       **TINY_CONFIGS[family], **overrides})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))


def random_batches(n_micro: int, seed: int, batch: int = 2, seq: int = 12, vocab: int = 128):
    """`n_micro` (input_ids, labels) pairs of random tokens; a few labels are -100 (ignored)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_micro):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100
        out.append((ids, labels))
    return out


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (the exactness suite's measure)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


class GradCapture:
    """Reads the executor's fp32 gradient accumulators right before each layer's update."""

    def __init__(self, ex) -> None:   # a StreamingExecutor
        self.grads = {}
        for st, lay in zip(ex.states, ex.layers):
            if st is None:
                continue
            orig = st.update

            def update(hp, scale, write, opt8=None, st=st, lay=lay, orig=orig):
                g = st._load("grad", st.grad_tier)
                for p, v in zip(lay.params, lay.layout.views(g)):
                    self.grads[ex.param_names[id(p)]] = v.clone()
                if st.grad_tier == "nvme":
                    st._staging.pop("grad", None)
                return orig(hp, scale, write, opt8)

            st.update = update


def reference_training(model, steps: int, lr: float, wd: float, max_norm: float | None, seed: int,
                       fused: bool = True, device: str = "cpu", n_micro: int = 2, grad_noise: float = 0.0):
    """Plain PyTorch: `steps` AdamW steps (betas 0.9/0.95) on a copy of `model`, each over the same
    `random_batches(n_micro, seed)` averaged over micro-batches, clipping when `max_norm`; returns
    (the trained copy, the per-step losses). `grad_noise` > 0 multiplies every gradient element by
    (1 + grad_noise * N(0, 1)) before each update: a rounding-sized perturbation, to measure how
    much the 20-step weights move from last-bit differences alone (their noise floor)."""
    import copy

    import torch

    m = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd, betas=(0.9, 0.95), eps=1e-8,
                            fused=fused or None)
    losses = []
    for _ in range(steps):
        mbs = random_batches(n_micro, seed=seed)
        tot = 0.0
        for ids, labels in mbs:
            loss = m(input_ids=ids.to(device), labels=labels.to(device)).loss
            tot += loss.item()
            (loss / len(mbs)).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
        if grad_noise:
            gen = torch.Generator().manual_seed(len(losses))
            for p in m.parameters():
                noise = torch.randn(p.grad.shape, generator=gen).to(p.grad.device)
                p.grad.mul_(1 + grad_noise * noise)
        opt.step()
        opt.zero_grad()
        losses.append(tot / len(mbs))
    return m, losses


def planned_device_peak(model, plan: Plan) -> int:
    """The planner's device peak for `plan` (a hand plan) on the HF model `model`: what
    `plan.simulate.memory_peaks` gives and the MILP constrains."""
    from ..costmodel import job_costs
    from ..plan.simulate import memory_peaks
    from ..plan.solve import assignment_of
    from ..spec import ModelSpec

    # (the attention the model runs: to_dict() leaves out one given when it was built)
    cfg = {**model.config.to_dict(), "attn_implementation": model.config._attn_implementation}
    spec = ModelSpec.from_hf_config(cfg, name="tiny")
    costs = job_costs(spec, plan.hardware, plan.job)
    return memory_peaks(costs, assignment_of(plan), plan.options.prefetch_depth)[0]["device"]


def steps_counting_op_temporaries(model, plan: Plan, batches, steps: int = 2, **executor_kw) -> list:
    """`steps` training steps of `model` under `plan` on a CPU device with op temporaries counted
    (their `device_peak_bytes` is what a device allocator's peak would see); the StepResults."""
    from .executor import StreamingExecutor

    ex = StreamingExecutor(model, plan, device="cpu", count_op_temporaries=True, **executor_kw)
    try:
        return [ex.train_step(batches) for _ in range(steps)]
    finally:
        ex.close()
