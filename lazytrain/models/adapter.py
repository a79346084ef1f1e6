"""Find the parts of a Hugging Face causal LM by module structure, and run them one layer at a time.

No list of class names: the decoder blocks are the `nn.ModuleList` with `config.num_hidden_layers`
entries, the embedding is `get_input_embeddings()`, the head is `get_output_embeddings()`, the
final norm is the one other child with parameters of the module that owns the blocks. The
keyword arguments a block receives (masks, rotary embeddings, position ids) are captured from the
model's own forward, so whatever the family computes before its first block is reproduced exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class ModelStructureError(ValueError):
    """The model does not have the embed / blocks / norm / head shape a decoder LM should have."""


@dataclass
class DecoderParts:
    lm: nn.Module                 # the *ForCausalLM (unwrapped from PEFT)
    base: nn.Module               # the module that owns the blocks (e.g. LlamaModel)
    embed: nn.Module
    blocks: nn.ModuleList
    norm: nn.Module
    head: nn.Module
    vocab_size: int
    tied: bool

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def layer_modules(self) -> list[list[nn.Module]]:
        """Modules per execution-order layer: embed, block.0 .. block.{L-1}, head (norm + lm_head)."""
        return [[self.embed], *[[b] for b in self.blocks], [self.norm, self.head]]

    def layer_names(self) -> list[str]:
        return ["embed", *[f"block.{i}" for i in range(self.num_layers)], "head"]


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The HF causal LM inside a PEFT wrapper (or the model itself)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def find_parts(model: nn.Module) -> DecoderParts:
    """Locate embed / blocks / final norm / head of an HF decoder LM by structure."""
    lm = unwrap_causal_lm(model)
    cfg = getattr(lm, "config", None)
    if cfg is None or not hasattr(lm, "get_input_embeddings") or not hasattr(lm, "get_output_embeddings"):
        raise ModelStructureError(f"{type(lm).__name__} is not a Hugging Face causal LM (no config / embeddings)")
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n_layers = int(getattr(text_cfg, "num_hidden_layers"))
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if embed is None or head is None:
        raise ModelStructureError(f"{type(lm).__name__}: no input or output embeddings")
    candidates = [(name, m) for name, m in lm.named_modules()
                  if isinstance(m, nn.ModuleList) and len(m) == n_layers
                  and all(sum(1 for _ in b.parameters()) for b in m)]
    if not candidates:
        raise ModelStructureError(f"{type(lm).__name__}: no ModuleList of {n_layers} decoder blocks found")
    # The decoder blocks are the outermost such list (MoE experts lists live inside blocks).
    blocks_name, blocks = min(candidates, key=lambda nm: nm[0].count("."))
    base = lm.get_submodule(blocks_name.rpartition(".")[0]) if "." in blocks_name else lm
    others = [m for name, m in base.named_children()
              if m is not blocks and m is not embed and any(True for _ in m.parameters())]
    if len(others) != 1:
        raise ModelStructureError(f"{type(base).__name__}: expected exactly one final norm next to the "
                                  f"blocks, found {len(others)} other modules with parameters")
    tied = head.weight is embed.weight
    return DecoderParts(lm=lm, base=base, embed=embed, blocks=blocks, norm=others[0], head=head,
                        vocab_size=int(text_cfg.vocab_size), tied=tied)


class _Captured(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("captured")
        self.args_, self.kwargs_ = args, kwargs


def block_kwargs(parts: DecoderParts, batch: int, seq: int, dtype: torch.dtype,
                 device: torch.device, attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """The keyword arguments the model's own forward passes to every block for this input shape.

    Runs the base model with a zero `inputs_embeds` and stops at the first block's pre-hook,
    so masks and rotary embeddings come from the family's own code (nothing re-implemented).
    """
    def grab(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _Captured(args, kwargs)

    handle = parts.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    dummy = torch.zeros(batch, seq, parts.embed.embedding_dim, dtype=dtype, device=device)
    try:
        with torch.no_grad():
            parts.base(inputs_embeds=dummy, attention_mask=attention_mask, use_cache=False)
    except _Captured as c:
        kwargs = dict(c.kwargs_)
    else:
        raise ModelStructureError(f"{type(parts.base).__name__}.forward never called its first block")
    finally:
        handle.remove()
    return kwargs


def run_block(block: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    out = block(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out  # older transformers return tuples


def head_loss(parts: DecoderParts, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Final norm + lm_head + the model's own causal-LM loss (mean over non-ignored tokens)."""
    logits = parts.head(parts.norm(hidden))
    return parts.lm.loss_function(logits=logits, labels=labels, vocab_size=parts.vocab_size)
