"""LoRA through PEFT: adapters on the linears whose names end with one of `targets`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

# What a PEFT model's state dict holds beside the base model's own weights (LoRA's matrices, DoRA's
# magnitudes, trainable-token deltas, modules_to_save's trained copies)
_ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.",
                  ".trainable_tokens_delta", ".modules_to_save.")
# PEFT's wrappers of a base layer, whose own weight sits under them (trainable tokens wrap the
# embedding, and a tied head, as `<name>.token_adapter.base_layer.weight`)
_WRAPPERS = (".token_adapter.base_layer.", ".base_layer.", ".original_module.")


def unmatched_targets(model: nn.Module, targets: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the targets that name no linear layer of `model`; the linear layers' names). `model` may
    live on the meta device: only module names are read."""
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    return [t for t in targets if t not in names], names


def apply_lora(model: nn.Module, rank: int, alpha: float, targets: Sequence[str],
               dropout: float = 0.0) -> nn.Module:
    """Wrap an HF causal LM with PEFT LoRA adapters (base weights frozen). Returns the PEFT model.

    Saved adapters (`model.save_pretrained(dir)`) load back with `PeftModel.from_pretrained`.
    """
    from peft import LoraConfig, get_peft_model

    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    missing, names = unmatched_targets(model, targets)
    if missing or not targets:
        raise ValueError(f"LoRA targets {missing or list(targets)} match no linear layer of this model; "
                         f"linear names: {names}")
    cfg = LoraConfig(r=int(rank), lora_alpha=float(alpha), target_modules=list(targets),
                     lora_dropout=float(dropout), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def base_state_dict(peft_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The frozen base model's weights in a PEFT model's `state_dict()`, under the base model's own
    names (what `AutoModelForCausalLM.from_pretrained` expects): adapter tensors left out, PEFT's
    `base_model.model.` prefix and its wrappers' levels (`_WRAPPERS`: `.base_layer`,
    `.token_adapter.base_layer`, `.original_module`) dropped."""
    out: dict[str, torch.Tensor] = {}
    for k, v in peft_state.items():
        if any(part in k for part in _ADAPTER_PARTS):
            continue
        name = k.removeprefix("base_model.model.")
        for w in _WRAPPERS:
            name = name.replace(w, ".")
        if name in out and out[name] is not v:
            raise ValueError(f"two base tensors map to {name!r} (PEFT's key layout changed?)")
        out[name] = v
    return out


def save_base_model(peft_model: nn.Module, directory, peft_state: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write the frozen base model under a PEFT model as an HF model dir (safetensors) that
    `AutoModelForCausalLM.from_pretrained` loads. `peft_state`: the PEFT model's state dict when
    the caller has gathered it (DeepSpeed ZeRO-3), else read from the model."""
    sd = base_state_dict(peft_model.state_dict() if peft_state is None else peft_state)
    inner = peft_model.get_base_model()
    # every weight the base class has (a PEFT key layout this does not map would otherwise leave
    # one out, and from_pretrained would fill it at random with only a log line)
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        want = AutoModelForCausalLM.from_config(inner.config).state_dict().keys()
    missing = sorted(set(want) - set(sd))
    if missing:
        raise ValueError(f"the base model's weights {missing[:3]}{' ...' if len(missing) > 3 else ''} are not "
                         f"found in the PEFT model's state dict (an unknown PEFT key layout): base not saved")
    inner.save_pretrained(str(directory), state_dict=sd, safe_serialization=True)


def point_adapter_at_base(adapter_dir, base_dir) -> None:
    """Record `base_dir` as the base model of the adapter saved in `adapter_dir` (its
    adapter_config.json's base_model_name_or_path, which `AutoPeftModelForCausalLM` loads)."""
    f = Path(adapter_dir) / "adapter_config.json"
    cfg = json.loads(f.read_text())
    cfg["base_model_name_or_path"] = str(base_dir)
    f.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
