"""Adapters that find embed / blocks / norm / head in HF causal LMs, and LoRA via PEFT."""

from .adapter import DecoderParts, ModelStructureError, block_kwargs, find_parts, head_loss, run_block
from .lora import apply_lora

__all__ = ["DecoderParts", "ModelStructureError", "apply_lora", "block_kwargs", "find_parts",
           "head_loss", "run_block"]
