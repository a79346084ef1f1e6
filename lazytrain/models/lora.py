"""LoRA through PEFT: adapters on the linears whose names end with one of `targets`."""

from __future__ import annotations

from typing import Sequence

from torch import nn


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
