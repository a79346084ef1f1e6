"""Plan -> DeepSpeed ZeRO-3 config: the plan expressed as closely as DeepSpeed can, plus the list of
plan decisions DeepSpeed cannot express. Pure (no torch, no deepspeed import), so
`lazytrain plan export-deepspeed` runs anywhere.

What maps:
- `param_tier` (majority by parameter count) -> `zero_optimization.offload_param.device`
  (device: no offload; host: cpu; nvme: nvme). DeepSpeed has one device for all parameters, so
  layers whose tier differs from the majority are reported as dropped.
- `optimizer_tier` (majority) -> `zero_optimization.offload_optimizer.device` (cpu | nvme).
  `grad_tier` nvme has no DeepSpeed equivalent (offloaded gradients stay in host memory).
- `recompute` of decoder blocks -> `lazytrain.recompute_blocks`, applied by DeepSpeedTrainer as
  per-block Hugging Face activation checkpointing (DeepSpeed's own `activation_checkpointing` section
  only configures `deepspeed.checkpointing.checkpoint`, which HF layers do not call). Multi-layer
  segments become per-layer checkpoints (one kept input per layer instead of one per segment);
  recompute of embed/head and activations offloaded to host/NVMe are dropped.
- job: micro-batch size, gradient accumulation, compute dtype (bf16 / fp16 / fp32).

The extra top-level `lazytrain` key is ignored by DeepSpeed (checked by a test), so the exported file
is a valid DeepSpeed config as is.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections import Counter
from typing import Any, Mapping

from ..plan.plan import Plan

_TIER_TO_DS = {"device": "none", "host": "cpu", "nvme": "nvme"}

# Settings measured to work on this project's CPU machines (../shared/MACHINE.md): with NVMe param
# offload ZeRO-3 asserts in its swap buffers at step 1 unless these hold.
NVME_BUFFER_COUNT = 32
NVME_MAX_REUSE_DISTANCE = 0


def default_nvme_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "lazytrain_ds_nvme")


def _layer_param_counts(plan: Plan) -> dict[str, int]:
    """Parameters per plan layer from the model config; empty if the config cannot be described."""
    try:
        from ..spec import ModelSpec
        spec = ModelSpec.from_hf_config(dict(plan.model_config), name=plan.model_name)
    except Exception:  # a hand-made plan with a partial config: fall back to layer counts
        return {}
    return {layer.name: int(layer.param_count) for layer in spec.layers}


def largest_param_numel(model_config: Mapping[str, Any]) -> int:
    """Element count of the largest single parameter tensor (embedding, a linear, fused experts)."""
    from ..spec import ModelSpec
    spec = ModelSpec.from_hf_config(dict(model_config))
    best = spec.vocab_size * spec.hidden_size
    for layer in spec.layers:
        sizes = {lin.name: lin.in_features * lin.out_features * max(1, lin.count) for lin in layer.linears}
        # transformers >= 5 fuses routed experts' gate and up projections into one tensor
        # (experts.gate_up_proj, [E, 2I, H]): one DeepSpeed parameter of twice either's size
        if "experts.gate_proj" in sizes and "experts.up_proj" in sizes:
            sizes["experts.gate_up_proj"] = sizes.pop("experts.gate_proj") + sizes.pop("experts.up_proj")
        best = max([best, *sizes.values()])
    return best


def _majority(plan: Plan, attr: str, weights: Mapping[str, int]) -> str:
    votes: Counter[str] = Counter()
    for d in plan.layers:
        votes[getattr(d, attr)] += weights.get(d.name, 1)
    # Ties go to the slower tier: a config that fits is better than a faster one that does not.
    order = {"nvme": 0, "host": 1, "device": 2}
    return max(votes, key=lambda t: (votes[t], -order.get(t, 3)))


def _ranges(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 6 else ", ".join(names[:5]) + f", ... ({len(names)} layers)"


def whole(v):
    """A whole number written as a float (`2e8`, as YAML and JSON read it) as an int: DeepSpeed
    reads some sizes (aio.block_size) as they are; anything else unchanged."""
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) >= 1 else v


def deep_merge(base: dict, over: Mapping[str, Any]) -> dict:
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            deep_merge(base[k], v)
        else:
            base[k] = copy.deepcopy(v)
    return base


def ds_config_from_plan(plan: Plan, overrides: Mapping[str, Any] | None = None, *,
                        nvme_dir: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Return (DeepSpeed config dict, plan decisions DeepSpeed cannot express).

    `overrides` is deep-merged last (e.g. `{"zero_optimization": {"offload_param": {"device":
    "nvme"}}}`); `nvme_dir` is where NVMe-tier tensors go (default: $TMPDIR/lazytrain_ds_nvme).
    """
    if not plan.fits:
        raise ValueError(f"plan status is {plan.status!r}: nothing to export "
                         f"({'; '.join(plan.explanation) or 'the job does not fit'})")
    weights = _layer_param_counts(plan)
    dropped: list[str] = []
    job, hw = plan.job, plan.hardware
    nvme_path = nvme_dir or default_nvme_dir()
    pin = hw.device_type == "cuda"  # pinned host memory only means something with a CUDA device

    param_tier = _majority(plan, "param_tier", weights)
    opt_tier = _majority(plan, "optimizer_tier", weights)
    for attr, chosen in (("param_tier", param_tier), ("optimizer_tier", opt_tier)):
        odd = [d for d in plan.layers if getattr(d, attr) != chosen]
        for tier in sorted({getattr(d, attr) for d in odd}):
            names = [d.name for d in odd if getattr(d, attr) == tier]
            dropped.append(f"{attr}={tier} for {_ranges(names)}: DeepSpeed puts all layers on one "
                           f"tier, used {chosen}")
    nvme_grads = [d.name for d in plan.layers if d.grad_tier == "nvme"]
    if nvme_grads:
        dropped.append(f"grad_tier=nvme for {_ranges(nvme_grads)}: DeepSpeed keeps offloaded "
                       f"gradients in host memory")

    zero: dict[str, Any] = {
        "stage": 3,
        "overlap_comm": hw.device_type == "cuda",   # one CPU process: nothing to overlap with
        "contiguous_gradients": True,
        "reduce_bucket_size": 50_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "sub_group_size": 1_000_000_000,
    }
    if param_tier != "device":
        zero["offload_param"] = {"device": _TIER_TO_DS[param_tier], "pin_memory": pin}
    zero["offload_optimizer"] = {"device": _TIER_TO_DS[opt_tier], "pin_memory": pin}
    _complete_nvme(zero, {}, plan, nvme_path)

    # Activation checkpointing: per decoder block.
    blocks = [d for d in plan.layers if d.kind == "block"]
    recompute_blocks = sorted(d.index - blocks[0].index for d in blocks if d.recompute) if blocks else []
    other = [d.name for d in plan.layers if d.recompute and d.kind != "block"]
    if other:
        dropped.append(f"recompute of {_ranges(other)}: Hugging Face checkpoints decoder blocks only")
    for first, last in plan.segments():
        if last > first:
            dropped.append(f"segment {plan.layers[first].name}..{plan.layers[last].name} recomputed "
                           f"per layer (keeps {last - first + 1} inputs instead of 1)")
    offl = [d for d in plan.layers if d.activation_tier in ("host", "nvme")]
    for tier in ("host", "nvme"):
        names = [d.name for d in offl if d.activation_tier == tier]
        if names:
            dropped.append(f"activation_tier={tier} for {_ranges(names)}: DeepSpeed offloads "
                           f"activation checkpoints only with model-parallel partition_activations; "
                           f"kept in memory")

    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": job.batch_size,
        "gradient_accumulation_steps": job.grad_accum,
        "zero_optimization": zero,
        "steps_per_print": 1_000_000_000,     # the recipe logs; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
        "lazytrain": {"recompute_blocks": recompute_blocks, "plan_hash": plan.input_hash},
    }
    if job.compute_dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif job.compute_dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if job.optimizer_state_bits == 8:
        dropped.append("optimizer_state_bits=8: DeepSpeed's CPU/NVMe offload runs fp32 Adam states")
    if job.master_dtype == "bf16":
        dropped.append("master_dtype=bf16: DeepSpeed keeps fp32 master weights and Adam states "
                       "(about twice the optimizer memory the plan sized)")
    if job.loss_chunk_tokens:
        dropped.append(f"loss_chunk_tokens={job.loss_chunk_tokens}: DeepSpeed runs the model's own "
                       f"(unchunked) loss")
    if not job.clip_grad:
        # DeepSpeed 0.19 clips at 1.0 when the key is absent; the plan's job does not clip. (With
        # clipping, the threshold is the recipe's optim.max_grad_norm, which the plan does not hold:
        # lazytrain's trainer sets it.)
        cfg["gradient_clipping"] = 0.0
    if overrides:
        deep_merge(cfg, overrides)
        over = overrides.get("zero_optimization")
        if isinstance(cfg.get("zero_optimization"), dict):
            _complete_nvme(cfg["zero_optimization"], over if isinstance(over, Mapping) else {}, plan, nvme_path)
    return cfg, dropped


def _complete_nvme(zero: dict[str, Any], over: Mapping[str, Any], plan: Plan, nvme_path: str) -> None:
    """An offload on NVMe (the plan's, or one the overrides moved there) gets where to write, the
    swap buffers and, for parameters, the reuse distance that works here, unless the overrides
    (`over`: their zero_optimization section) set them."""
    for sec in ("offload_param", "offload_optimizer"):
        off = zero.get(sec)
        if not (isinstance(off, dict) and off.get("device") == "nvme"):
            continue
        off.setdefault("nvme_path", nvme_path)
        if sec == "offload_param":
            off.setdefault("buffer_count", NVME_BUFFER_COUNT)
            off.setdefault("buffer_size", _nvme_buffer_size(plan))
            if "stage3_max_reuse_distance" not in over:
                zero["stage3_max_reuse_distance"] = NVME_MAX_REUSE_DISTANCE
        else:
            off.setdefault("buffer_count", 4)
            off.setdefault("fast_init", False)
            if "sub_group_size" not in over:
                zero["sub_group_size"] = sub_group_size_for(plan, zero.get("sub_group_size", 1_000_000_000))


NVME_MIN_SUB_GROUP = 10_000_000   # elements: groups below it only add swaps (40 MB fp32 buffers)


def sub_group_size_for(plan: Plan, default: int) -> int:
    """ZeRO-3's optimizer sub-group size with its state on NVMe: each of `buffer_count` page-locked
    swap buffers holds the largest sub-group (fp32), so DeepSpeed's 1e9 made one group of a 220M
    model and 3.3 GiB of buffers that do not depend on the batch (a review: its NVMe peer fitted
    batch 24 where 38 fits). The size whose largest group is smallest, of a few around the largest
    trainable parameter (no group can be smaller), at least NVME_MIN_SUB_GROUP; `default` when the
    model cannot be described."""
    try:
        from ..spec import ModelSpec
        sizes = _trainable_sizes(plan, ModelSpec.from_hf_config(dict(plan.model_config)))
    except Exception:  # noqa: BLE001 - a hand-made plan with a partial config
        return default
    if not sizes:
        return default
    big = max(sizes)
    cands = sorted({max(NVME_MIN_SUB_GROUP, int(big * f)) for f in (0.25, 0.5, 1.0)}, reverse=True)
    return min(cands, key=lambda c: _largest_sub_group(sizes, c))   # (ties: the largest, fewest swaps)


def uses_nvme(cfg: Mapping[str, Any]) -> bool:
    """Whether a DeepSpeed config offloads anything to NVMe."""
    zero = cfg.get("zero_optimization")
    return isinstance(zero, Mapping) and any(
        isinstance(zero.get(sec), Mapping) and zero[sec].get("device") == "nvme"
        for sec in ("offload_param", "offload_optimizer"))


def _nvme_buffer_size(plan: Plan) -> int:
    try:
        return int(largest_param_numel(plan.model_config))
    except Exception:
        return 100_000_000   # DeepSpeed's default; works for hidden*vocab up to 1e8


def _trainable_sizes(plan: Plan, spec) -> list[int]:
    """Element counts of the trainable parameters in model order (full: embedding, each block's
    linears and the rest of its parameters, final norm, an untied head; LoRA: each targeted linear's
    A and B), as DeepSpeed walks them into optimizer sub-groups."""
    job = plan.job
    if job.mode == "lora":
        targets, r = tuple(job.lora_targets), job.lora_rank
        return [n for layer in spec.layers for lin in spec.lora_linears(layer) if lin.name.split(".")[-1] in targets
                for n in (lin.count * r * lin.in_features, lin.count * r * lin.out_features)]
    sizes: list[int] = []
    for layer in spec.layers:
        mats = [lin.in_features * lin.out_features * max(1, lin.count) for lin in layer.linears]
        if layer.kind != "block":   # (the head's param_count leaves out a tied lm_head: the embedding's)
            mats = [layer.param_count]
        sizes += mats + ([layer.param_count - sum(mats)] if layer.param_count > sum(mats) else [])
    return sizes


def _largest_sub_group(sizes: list[int], sub_group_size: int) -> int:
    """DeepSpeed ZeRO-3's split (stage3._create_fp16_sub_groups): parameters are added to a group
    until it holds sub_group_size elements or more."""
    best = cur = 0
    for n in sizes:
        cur += n
        if cur >= sub_group_size:
            best, cur = max(best, cur), 0
    return max(best, cur)


def pinned_swap_buffers(cfg: Mapping[str, Any], plan: Plan) -> list[tuple[str, int, str]]:
    """DeepSpeed's NVMe swap buffers in a config: (section, bytes, how), page-locked host memory
    ZeRO-Infinity allocates when it starts, on top of everything else the run holds in host memory.
    - offload_param on NVMe: `buffer_count` buffers of `buffer_size` elements in the compute dtype
      (partitioned_param_swapper; buffer_size must hold the largest parameter);
    - offload_optimizer on NVMe: `buffer_count` fp32 buffers of the largest optimizer sub-group
      (optimizer_utils.SwapBufferManager; trainable parameters gathered in model order until a group
      reaches `sub_group_size`; estimated from the model spec, its small tensors lumped per layer).
    Empty when the model config cannot be described or nothing goes to NVMe."""
    zero = cfg.get("zero_optimization")
    if not isinstance(zero, Mapping):
        return []
    try:
        from ..spec import ModelSpec
        spec = ModelSpec.from_hf_config(dict(plan.model_config))
    except Exception:  # noqa: BLE001 - a hand-made plan with a partial config: nothing to say
        return []
    out: list[tuple[str, int, str]] = []
    half = any(isinstance(cfg.get(k), Mapping) and cfg[k].get("enabled") for k in ("bf16", "fp16"))
    def count(v):   # what DeepSpeed's parser takes as a count: ints, whole floats, digit strings
        if isinstance(v, bool):
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        elif isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        return v if isinstance(v, int) and v > 0 else None
    par = zero.get("offload_param")
    if isinstance(par, Mapping) and par.get("device") == "nvme":
        n, size, e = count(par.get("buffer_count", 5)), count(par.get("buffer_size", 100_000_000)), 2 if half else 4
        if n and size:   # (other values are DeepSpeed's parser's to refuse, in one line)
            out.append(("offload_param", n * size * e, f"buffer_count {n} x buffer_size {size:,} x {e} B"))
    opt = zero.get("offload_optimizer")
    if isinstance(opt, Mapping) and opt.get("device") == "nvme":
        n, sub = count(opt.get("buffer_count", 4)), count(zero.get("sub_group_size", 1_000_000_000))
        if n and sub:
            numel = _largest_sub_group(_trainable_sizes(plan, spec), sub)
            out.append(("offload_optimizer", n * numel * 4,
                        f"buffer_count {n} x {numel:,} elements (the largest sub-group) x 4 B"))
    return out


def pinned_swap_note(cfg: Mapping[str, Any], plan: Plan) -> tuple[str, bool] | None:
    """(a line saying how much page-locked host memory DeepSpeed's NVMe swap buffers take, whether
    that is more than the host can spare: hardware.host_memory_gib less host_reserve_gib), or None."""
    bufs = pinned_swap_buffers(cfg, plan)
    if not bufs:
        return None
    total = sum(b for _, b, _ in bufs)
    hw = plan.hardware
    spare = (hw.host_memory_gib - hw.host_reserve_gib) * 2**30
    parts = "; ".join(f"{sec}: {b / 2**30:.2f} GiB ({how})" for sec, b, how in bufs)
    over = total > spare
    line = (f"DeepSpeed's NVMe swap buffers pin {total / 2**30:.2f} GiB of host memory ({parts})")
    if over:
        line += (f", more than this host's {spare / 2**30:.0f} GiB (hardware.host_memory_gib - host_reserve_gib): "
                 f"lower zero_optimization.offload_param.buffer_count (buffer_size must stay >= the "
                 f"largest parameter, {largest_param_numel(plan.model_config):,}), "
                 f"zero_optimization.sub_group_size or offload_optimizer.buffer_count")
    return line, over
