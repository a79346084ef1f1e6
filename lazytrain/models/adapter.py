"""Find the parts of a Hugging Face causal LM by module structure, and run them one layer at a time.

No list of class names: the decoder blocks are the `nn.ModuleList` with `config.num_hidden_layers`
entries, the embedding is `get_input_embeddings()`, the head is `get_output_embeddings()`, the
final norm is the one other child with parameters of the module that owns the blocks. The
keyword arguments a block receives (masks, rotary embeddings, position ids) are captured from the
model's own forward, so whatever the family computes before its first block is reproduced exactly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable

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


def embedding_backward_reads_weights(parts: DecoderParts, weights: Iterable[torch.Tensor] | None = None) -> bool:
    """Whether the embedding's backward may read `weights` (default: all its parameters; the
    executor asks about the streamed ones, not resident LoRA adapters). An `nn.Embedding`'s does
    not (its gradient needs only the token ids and the output's gradient), so the streamer need
    not bring them back for it. Only `nn.Embedding` itself and the subclasses transformers ships
    (scaled embeddings) are trusted, and those only after a probe: the embedding runs once on one
    token with saved-tensor hooks, and any saved tensor sharing one of their storages means yes
    (so does a failed probe). Anything else (a wrapper, user code) counts as yes: a probe cannot see
    weights kept on an autograd.Function's ctx, saved under the module's own saved-tensor hooks
    (checkpointing inside it), or cast to another dtype before they are saved."""
    embed = parts.embed
    trusted = type(embed).forward is nn.Embedding.forward or (
        isinstance(embed, nn.Embedding) and type(embed).__module__.startswith("transformers."))
    if not trusted:
        return True
    weights = list(embed.parameters()) if weights is None else list(weights)
    ptrs = {p.untyped_storage().data_ptr() for p in weights if p.numel()}
    if not ptrs:
        return False
    saved: list[bool] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.untyped_storage().data_ptr() in ptrs)
        return t

    try:
        ids = torch.zeros(1, 1, dtype=torch.long, device=next(embed.parameters()).device)
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            embed(ids)
    except Exception:   # noqa: BLE001 - cannot tell: keep fetching the weights for the backward
        return True
    return any(saved)


class _Captured(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("captured")
        self.args_, self.kwargs_ = args, kwargs


class _Recorder(nn.Module):
    """Stands in for a block while its arguments are captured: keeps them, passes the hidden on."""

    def __init__(self, last: bool = False) -> None:
        super().__init__()
        self.kwargs: dict[str, Any] | None = None
        self.last = last

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.kwargs = dict(kwargs)
        if self.last:   # stop before the final norm (whose weights may be streamed, not resident)
            raise _Captured(args, kwargs)
        return hidden


def mixed_layer_types(parts: DecoderParts) -> bool:
    """Whether blocks get different arguments by type (config.layer_types: sliding-window and full
    attention layers, each with its own mask, and in some families its own rotary embedding)."""
    types = getattr(parts.base.config, "layer_types", None) or ()
    return len(set(types[:len(parts.blocks)])) > 1


def block_kwargs(parts: DecoderParts, batch: int, seq: int, dtype: torch.dtype,
                 device: torch.device, attention_mask: torch.Tensor | None = None) -> list[dict[str, Any]]:
    """The keyword arguments the model's own forward passes to each block for this input shape,
    one dict per block (the same dict for all of them when every block gets the same ones).

    Runs the base model with a zero `inputs_embeds`, so masks and rotary embeddings come from the
    family's own code (nothing re-implemented): it stops at the first block's pre-hook, or, where
    blocks differ by layer type (`mixed_layer_types`), runs with each block replaced by a recorder
    for the duration (gave block 0's sliding or full mask to every block before: wrong gradients).
    """
    if mixed_layer_types(parts):
        return _per_block_kwargs(parts, batch, seq, dtype, device, attention_mask)

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
    return [kwargs] * len(parts.blocks)


def _per_block_kwargs(parts: DecoderParts, batch: int, seq: int, dtype: torch.dtype,
                      device: torch.device, attention_mask: torch.Tensor | None) -> list[dict[str, Any]]:
    blocks = list(parts.blocks)
    recorders = [_Recorder(last=i == len(blocks) - 1) for i in range(len(blocks))]
    dummy = torch.zeros(batch, seq, parts.embed.embedding_dim, dtype=dtype, device=device)
    try:
        for i, r in enumerate(recorders):
            parts.blocks[i] = r
        with torch.no_grad():
            parts.base(inputs_embeds=dummy, attention_mask=attention_mask, use_cache=False)
    except _Captured:
        pass
    finally:
        for i, b in enumerate(blocks):
            parts.blocks[i] = b
    if any(r.kwargs is None for r in recorders):
        raise ModelStructureError(f"{type(parts.base).__name__}.forward did not call every block")
    return [r.kwargs for r in recorders]


def run_block(block: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    out = block(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out  # older transformers return tuples


def head_loss(parts: DecoderParts, hidden: torch.Tensor, labels: torch.Tensor,
              chunk_tokens: int = 0) -> torch.Tensor:
    """Final norm + lm_head + the model's own causal-LM loss (mean over non-ignored tokens); with
    `chunk_tokens` > 0 the same loss over chunks of tokens (models/chunked_loss.py)."""
    if chunk_tokens > 0:
        from .chunked_loss import chunked_causal_lm_loss

        return chunked_causal_lm_loss(parts.norm(hidden), parts.head, labels, chunk_tokens)
    logits = parts.head(parts.norm(hidden))
    return parts.lm.loss_function(logits=logits, labels=labels, vocab_size=parts.vocab_size)


def check_chunked_loss(parts: DecoderParts) -> None:
    """A chunked loss computes lm_head itself: it needs a plain linear head."""
    if type(parts.head) is not nn.Linear:
        raise ValueError(f"job.loss_chunk_tokens needs a plain nn.Linear lm_head; this model's is "
                         f"{type(parts.head).__name__} (use job.loss_chunk_tokens=0)")
    loss_type = getattr(parts.lm, "loss_type", None)
    if loss_type not in (None, "ForCausalLM"):
        raise ValueError(f"job.loss_chunk_tokens computes the causal-LM cross-entropy; this model's "
                         f"loss is {loss_type!r} (use job.loss_chunk_tokens=0)")


@dataclass
class RouterAux:
    """The MoE router load-balancing loss the *ForCausalLM's forward adds when
    `config.output_router_logits` is set: `loss + coef * loss_fn(router_logits, num_experts, top_k,
    attention_mask)`, where router_logits are every router's logits in execution order.

    `routers[b]`: per decoder block, the (module, output index) pairs whose outputs HF records as
    "router_logits" (the model's own `can_record_outputs`, resolved like its output-capture hooks
    do); empty for blocks without a router (Qwen3-MoE's `mlp_only_layers`, a dense block)."""
    routers: list[list[tuple[nn.Module, int]]]
    loss_fn: Callable[..., Any]
    num_experts: int
    top_k: int
    coef: float


def router_aux_enabled(parts: DecoderParts) -> bool:
    """Whether the model's own forward would add the router aux loss (its config says so)."""
    return bool(getattr(parts.lm.config, "output_router_logits", False))


def _recorder_specs(base: nn.Module, key: str) -> list[tuple[type | None, str | None, str | None, int]]:
    """(target_class, class_name, layer_name, index) of the recorders `base` declares for `key`."""
    rec = getattr(base, "can_record_outputs", None)
    if rec is None:
        rec = getattr(base, "_can_record_outputs", None) or {}
    specs = rec.get(key)
    if specs is None:
        return []
    out = []
    for sp in specs if isinstance(specs, (list, tuple)) else [specs]:
        if isinstance(sp, str):
            out.append((None, sp, None, 1))
        elif isinstance(sp, type):
            out.append((sp, None, None, 1))   # HF's default index for keys other than hidden_states
        else:   # OutputRecorder
            out.append((getattr(sp, "target_class", None), getattr(sp, "class_name", None),
                        getattr(sp, "layer_name", None), int(getattr(sp, "index", 0))))
    return out


def router_aux(parts: DecoderParts) -> RouterAux | None:
    """Find the router modules and HF's own load-balancing loss function of an MoE causal LM.

    None for a model that has neither (a dense model ignores `output_router_logits`, and so does
    its forward). Raises ModelStructureError when it has one but not the other, or no router is
    found in its blocks: training without the loss its own forward adds would silently differ."""
    lm, base = parts.lm, parts.base
    specs = _recorder_specs(base, "router_logits")
    fn = getattr(sys.modules.get(type(lm).__module__), "load_balancing_loss_func", None)
    if not specs and fn is None:
        return None
    if not specs:
        raise ModelStructureError(f"{type(lm).__name__}: output_router_logits is set but "
                                  f"{type(base).__name__} declares no router_logits recorder")
    blocks_name = next(n for n, m in base.named_modules() if m is parts.blocks)
    routers: list[list[tuple[nn.Module, int]]] = []
    for i, block in enumerate(parts.blocks):
        found = []
        for name, m in block.named_modules():
            # the name HF's hook installer sees: "." + path from the model that declares the spec
            full = f".{blocks_name}.{i}" + (f".{name}" if name else "")
            for cls, cls_name, layer_name, index in specs:
                if not ((cls is not None and isinstance(m, cls))
                        or (cls_name is not None and full.endswith(cls_name))):
                    continue
                if layer_name is not None and f".{layer_name.strip('.')}." not in full + ".":
                    continue
                found.append((m, index))
        routers.append(found)
    if not any(routers):
        raise ModelStructureError(f"{type(lm).__name__}: output_router_logits is set but no router "
                                  f"module was found in the decoder blocks")
    if fn is None:
        raise ModelStructureError(f"{type(lm).__name__}: output_router_logits is set but "
                                  f"{type(lm).__module__} has no load_balancing_loss_func")
    cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config

    def attr(*names: str) -> Any:
        for obj in (lm, cfg):
            for n in names:
                if getattr(obj, n, None) is not None:
                    return getattr(obj, n)
        raise ModelStructureError(f"{type(lm).__name__}: no {names[0]} for the router aux loss")

    return RouterAux(routers=routers, loss_fn=fn,
                     num_experts=int(attr("num_experts", "num_local_experts")),
                     top_k=int(attr("num_experts_per_tok")),
                     coef=float(attr("router_aux_loss_coef")))


def run_block_routed(block: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any],
                     routers: list[tuple[nn.Module, int]]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """run_block, also returning the router logits the block's routers produced (firing order)."""
    got: list[torch.Tensor] = []

    def grab(index: int):
        def hook(_m: nn.Module, _args: tuple, out: Any) -> None:
            t = out[index] if isinstance(out, (tuple, list)) else out
            if t is not None:
                got.append(t)
        return hook

    handles = [m.register_forward_hook(grab(index)) for m, index in routers]
    try:
        out = run_block(block, hidden, kwargs)
    finally:
        for h in handles:
            h.remove()
    return out, tuple(got)
