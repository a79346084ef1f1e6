"""Find the parts of a Hugging Face causal LM by module structure, and run them one layer at a time.

No list of class names: the decoder blocks are the `nn.ModuleList` with `config.num_hidden_layers`
entries, the embedding is `get_input_embeddings()`, the head is `get_output_embeddings()`, the
final norm is the one other norm-like child of the module that owns the blocks. The arguments a
block receives (masks, rotary embeddings, position ids) are captured from the model's own forward.
What the model does to the hidden state outside its blocks (before block 0, between blocks, after
the final norm) is not reproduced: `probe_forward` checks on a few tokens that there is nothing.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn


_LOG = logging.getLogger(__name__)

# The key under which `block_kwargs` keeps the positional arguments after the hidden state (not a
# valid keyword, so no block argument can have this name).
POSITIONAL = "*args"


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
    # set by probe_forward: the blocks get different arguments though config.layer_types does not
    # say so (e.g. a mask per block type), so block_kwargs captures them per block
    per_block_args: bool = False
    # set by probe_forward: what a block returns its hidden state in, which the model's own loop
    # unpacks (`hidden = outputs[0]`, RWKV's `hidden, state, attentions = block(...)`) and recorders
    # mimic: None (the tensor itself) or (container type, length; the rest None)
    block_returns: tuple[type, int] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def hidden_size(self) -> int:
        """The embedding width, also through PEFT's wrappers of the embedding (LoRA's
        lora.Embedding, trainable_token_indices' TrainableTokensWrapper), which lack
        ``embedding_dim`` (a raw AttributeError in the structure probe: review)."""
        m = self.embed
        for _ in range(4):
            if hasattr(m, "embedding_dim"):
                return int(m.embedding_dim)
            inner = m.get_base_layer() if hasattr(m, "get_base_layer") else getattr(m, "original_module", None)
            if inner is None or inner is m:
                break
            m = inner
        weight = getattr(self.embed, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return int(weight.shape[1])
        raise ModelStructureError(f"{type(self.embed).__name__}: cannot tell the embedding width")

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
    lists = {name for name, m in lm.named_modules() if isinstance(m, nn.ModuleList) and m is not blocks}
    outer = [n for n in lists if blocks_name.startswith(n + ".")]
    if outer:
        # a list inside another list's element (LongCat-Flash counts two sub-layers per block in
        # num_hidden_layers: its 2-entry self_attn was taken for the blocks and the block's own
        # MLP blamed as "weights next to the blocks": review)
        held = len(lm.get_submodule(min(outer, key=len)))
        raise ModelStructureError(f"{type(lm).__name__}: no ModuleList of {n_layers} decoder blocks (the config's "
                                  f"num_hidden_layers) found; the outermost list of blocks, "
                                  f"{min(outer, key=len)}, holds {held}")
    base = lm.get_submodule(blocks_name.rpartition(".")[0]) if "." in blocks_name else lm
    norm = _final_norm(base, blocks, embed)
    tied = head.weight is embed.weight
    return DecoderParts(lm=lm, base=base, embed=embed, blocks=blocks, norm=norm, head=head,
                        vocab_size=int(text_cfg.vocab_size), tied=tied)


def _norm_like(m: nn.Module) -> bool:
    """A module that can be a final norm: no embedding table, no weight matrix (a position
    embedding next to the blocks was taken for the final norm: openai-gpt)."""
    return not isinstance(m, nn.Embedding) and all(p.dim() <= 1 for p in m.parameters())


def _final_norm(base: nn.Module, blocks: nn.Module, embed: nn.Module) -> nn.Module:
    """The one norm-like child of `base` with parameters next to the blocks; failing that, the one
    parameter-less child that calls itself a norm (OLMo's LayerNorm has no weights): the probe
    (`probe_forward`) then checks that the model's forward ends in it as the executor's head does."""
    others = [(n, m) for n, m in base.named_children() if m is not blocks and m is not embed]
    weighted = [(n, m) for n, m in others if any(True for _ in m.parameters())]
    foreign = [f"{n} ({type(m).__name__})" for n, m in weighted if not _norm_like(m)]
    if foreign:
        verb = "hold" if len(foreign) > 1 else "holds"
        raise ModelStructureError(f"{type(base).__name__}: {', '.join(foreign)} {verb} weights next to the "
                                  f"blocks that are not a final norm (e.g. a position embedding); only "
                                  f"embedding -> blocks -> final norm -> head is supported")
    if len(weighted) == 1:
        return weighted[0][1]
    if not weighted:
        bare = [m for _, m in others if isinstance(m, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm))
                or "norm" in type(m).__name__.lower()]
        if len(bare) == 1:
            return bare[0]
    names = ", ".join(f"{n} ({type(m).__name__})" for n, m in weighted) or "none"
    raise ModelStructureError(f"{type(base).__name__}: expected exactly one final norm next to the "
                              f"blocks, found {len(weighted)} modules with parameters there: {names} (a norm "
                              f"on the embedding's output, as Bloom's, is not supported: only embedding -> "
                              f"blocks -> final norm -> head)")


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


def _split_hidden(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """(hidden state, the other positional arguments, keyword arguments) of a block call; the
    hidden state may come as the keyword `hidden_states`."""
    if args:
        return args[0], tuple(args[1:]), dict(kwargs)
    kwargs = dict(kwargs)
    return kwargs.pop("hidden_states", None), (), kwargs


def _call_args(args: tuple, kwargs: dict) -> dict[str, Any]:
    """A block's captured arguments as one dict: the keywords, and the positional arguments after
    the hidden state under POSITIONAL (XGLM passes its causal mask positionally: dropped, attention
    was not causal)."""
    return {**kwargs, POSITIONAL: args} if args else kwargs


def rng_states(devices: list[torch.device]) -> tuple[torch.Tensor, ...]:
    """The CPU generator's state and each CUDA device's in `devices` (restored by set_rng_states)."""
    return (torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices))


def set_rng_states(states: tuple[torch.Tensor, ...], devices: list[torch.device]) -> None:
    torch.set_rng_state(states[0])
    for st, d in zip(states[1:], devices):
        torch.cuda.set_rng_state(st, d)


class _Recorder(nn.Module):
    """Stands in for a block while the model's own forward runs: records what the block gets and
    passes the hidden state on unchanged, in the container the block returns it in (`wrap`: the
    model's loop unpacks it). Attributes it does not have are read from the block it replaces
    (Nemotron-H's forward picks each block's mask by `layer.block_type`)."""

    def __init__(self, block: nn.Module, last: bool = False, wrap: tuple[type, int] | None = None,
                 calls: list[int] | None = None, index: int = 0,
                 rng_devices: list[torch.device] | None = None) -> None:
        super().__init__()
        self.__dict__["_block"] = block   # (not a submodule: the recorder holds no parameters)
        self.kwargs: dict[str, Any] | None = None
        self.hidden: Any = None
        self.rng: tuple[torch.Tensor, ...] | None = None
        self.last, self.wrap, self.calls, self.index = last, wrap, calls, index
        self.rng_devices = rng_devices

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self.__dict__.get("_block")
            if block is None:
                raise
            return getattr(block, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden, rest, kw = _split_hidden(args, kwargs)
        self.hidden, self.kwargs = hidden, _call_args(rest, kw)
        if self.calls is not None:
            self.calls.append(self.index)
        if self.rng_devices is not None:
            self.rng = rng_states(self.rng_devices)
        if self.last:   # stop before the final norm (whose weights may be streamed, not resident)
            raise _Captured(args, kwargs)
        if self.wrap is None:
            return hidden
        container, n = self.wrap
        return container((hidden, *(None,) * (n - 1)))


def micro_batch_parts(mb: Sequence[torch.Tensor], where: str = "micro-batch"
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input_ids, labels, position_ids or None) of a micro-batch given as (input_ids, labels) or
    (input_ids, labels, position_ids), all [B, S] (position_ids: packed rows, see `block_kwargs`)."""
    if len(mb) not in (2, 3):
        raise ValueError(f"{where}: expected (input_ids, labels[, position_ids]), got {len(mb)} items")
    ids, labels, pos = (*mb, None) if len(mb) == 2 else mb
    if ids.dim() != 2 or ids.shape != labels.shape or (pos is not None and pos.shape != ids.shape):
        got = " and ".join(str(tuple(t.shape)) for t in (ids, labels, pos) if t is not None)
        names = "input_ids and labels must both" if pos is None else "input_ids, labels and position_ids must all"
        raise ValueError(f"{where}: {names} be [B, S], got {got}")
    return ids, labels, pos


def model_inputs(input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None,
                 device: torch.device | str | None = None) -> dict[str, Any]:
    """The keyword arguments of a HF causal LM's forward for one training micro-batch. With
    `position_ids` (packed rows), transformers builds the mask that keeps each row to itself only
    without a KV cache (masking_utils: a cache turns its packed-sequence detection off, and a
    model's config asks for one by default): hence use_cache=False, which training never uses."""
    kw: dict[str, Any] = {"input_ids": input_ids.to(device), "labels": labels.to(device), "use_cache": False}
    if position_ids is not None:
        kw["position_ids"] = position_ids.to(device)
    return kw


def mixed_layer_types(parts: DecoderParts) -> bool:
    """Whether blocks get different arguments by type (config.layer_types: sliding-window and full
    attention layers, each with its own mask, and in some families its own rotary embedding)."""
    types = getattr(parts.base.config, "layer_types", None) or ()
    return len(set(types[:len(parts.blocks)])) > 1


def block_kwargs(parts: DecoderParts, batch: int, seq: int, dtype: torch.dtype,
                 device: torch.device, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> list[dict[str, Any]]:
    """The arguments the model's own forward passes to each block for this input shape, one dict
    per block (the same dict for all of them when every block gets the same ones): the keyword
    arguments, and the positional ones after the hidden state under POSITIONAL (`run_block`).

    Runs the base model with a zero `inputs_embeds`, so masks and rotary embeddings come from the
    family's own code (nothing re-implemented): it stops at the first block's pre-hook, or, where
    blocks differ by layer type (`mixed_layer_types`, or the probe found them to differ:
    `parts.per_block_args`), runs with each block replaced by a recorder for the duration (gave
    block 0's sliding or full mask to every block before: wrong gradients).

    `position_ids` [batch, seq]: packed rows, each restarting at 0 (data.dataset._pack_rows):
    transformers then gives the blocks a mask that keeps each row's attention to itself, and rotary
    tables of the rows' own positions (None: 0..seq-1, one causal sequence).
    """
    pos = {} if position_ids is None else {"position_ids": position_ids}
    if mixed_layer_types(parts) or parts.per_block_args:
        return _per_block_kwargs(parts, batch, seq, dtype, device, attention_mask, pos)

    def grab(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _Captured(args, kwargs)

    handle = parts.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    dummy = torch.zeros(batch, seq, parts.hidden_size, dtype=dtype, device=device)
    try:
        with torch.no_grad():
            parts.base(inputs_embeds=dummy, attention_mask=attention_mask, use_cache=False, **pos)
    except _Captured as c:
        _, rest, kw = _split_hidden(c.args_, c.kwargs_)
        kwargs = _call_args(rest, kw)
    else:
        raise ModelStructureError(f"{type(parts.base).__name__}.forward never called its first block")
    finally:
        handle.remove()
    return [kwargs] * len(parts.blocks)


def context_tensors(kw: list[dict[str, Any]]) -> list[torch.Tensor]:
    """The distinct tensors (by storage) the blocks' arguments hold: masks, rotary tables, shared
    by the blocks; what the executor counts as the step's context."""
    return list({t.untyped_storage().data_ptr(): t for d in {id(d): d for d in kw}.values()
                 for v in d.values() for t in (v if isinstance(v, (tuple, list)) else (v,))
                 if isinstance(t, torch.Tensor)}.values())


def _per_block_kwargs(parts: DecoderParts, batch: int, seq: int, dtype: torch.dtype,
                      device: torch.device, attention_mask: torch.Tensor | None,
                      pos: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    blocks = list(parts.blocks)
    recorders = [_Recorder(b, last=i == len(blocks) - 1, wrap=parts.block_returns) for i, b in enumerate(blocks)]
    dummy = torch.zeros(batch, seq, parts.hidden_size, dtype=dtype, device=device)
    try:
        for i, r in enumerate(recorders):
            parts.blocks[i] = r
        with torch.no_grad():
            parts.base(inputs_embeds=dummy, attention_mask=attention_mask, use_cache=False, **pos)
    except _Captured:
        pass
    finally:
        for i, b in enumerate(blocks):
            parts.blocks[i] = b
    if any(r.kwargs is None for r in recorders):
        raise ModelStructureError(f"{type(parts.base).__name__}.forward did not call every block")
    return [r.kwargs for r in recorders]


def run_block(block: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """The block on `hidden` with the arguments `block_kwargs` captured; its hidden state out."""
    if POSITIONAL in kwargs:
        kwargs = dict(kwargs)
        out = block(hidden, *kwargs.pop(POSITIONAL), **kwargs)
    else:
        out = block(hidden, **kwargs)
    # older transformers return tuples, some families lists (openai-gpt)
    return out[0] if isinstance(out, (tuple, list)) else out


def head_loss(parts: DecoderParts, hidden: torch.Tensor, labels: torch.Tensor,
              chunk_tokens: int = 0) -> torch.Tensor:
    """Final norm + lm_head + the model's own causal-LM loss (mean over non-ignored tokens); with
    `chunk_tokens` > 0 the same loss over chunks of tokens (models/chunked_loss.py). The norm's
    output goes to lm_head in lm_head's dtype, as the models' own forward does where they differ
    (Mamba's blocks keep an fp32 residual in a bf16 model: the matmul refused the mix; review)."""
    normed = parts.norm(hidden)
    w = getattr(parts.head, "weight", None)
    if isinstance(w, torch.Tensor) and normed.dtype != w.dtype:
        normed = normed.to(w.dtype)
    if chunk_tokens > 0:
        from .chunked_loss import chunked_causal_lm_loss

        return chunked_causal_lm_loss(normed, parts.head, labels, chunk_tokens)
    logits = parts.head(normed)
    return parts.lm.loss_function(logits=logits, labels=labels, vocab_size=parts.vocab_size)


def check_chunked_loss(parts: DecoderParts) -> None:
    """A chunked loss computes lm_head itself: it needs a plain linear head."""
    if type(parts.head) is not nn.Linear:
        raise ValueError(f"job.loss_chunk_tokens needs a plain nn.Linear lm_head; this model's is "
                         f"{type(parts.head).__module__}.{type(parts.head).__qualname__} "
                         f"(use job.loss_chunk_tokens=0)")
    loss_type = getattr(parts.lm, "loss_type", None)
    if loss_type not in (None, "ForCausalLM"):
        raise ValueError(f"job.loss_chunk_tokens computes the causal-LM cross-entropy; this model's "
                         f"loss is {loss_type!r} (use job.loss_chunk_tokens=0)")


# The probe's input length: enough tokens that a dropout before block 0 shows (some of 8 x hidden
# values dropped) and the loss has targets, few enough that the probe costs next to nothing.
PROBE_TOKENS = 8
# Config flags that would make the probe's forward collect outputs (and have HF install its
# output-capturing hooks on the recorders rather than on the blocks): off while it runs.
_OUTPUT_FLAGS = ("output_router_logits", "output_hidden_states", "output_attentions")


def _same(a: Any, b: Any) -> bool:
    """Whether two values the probe compares are the same: tensors bit for bit (shape, dtype and
    device too), containers element-wise, plain values by ==, other objects (a cache) by type."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    if isinstance(a, dict) or isinstance(b, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if a is None or b is None or isinstance(a, (bool, int, float, str)):
        return type(a) is type(b) and a == b
    return type(a) is type(b)


def _arg_differs(a: dict[str, Any], b: dict[str, Any], key: str) -> bool:
    """Whether block argument `key` differs between two captures. An option only one of them has
    (None, a bool, a number, a string) does not count: the causal LM's forward passes some of its
    own down through **kwargs (output_router_logits=False, a multimodal model's logits_to_keep)
    that the base model's alone does not, and blocks take them in **kwargs unused."""
    if key in a and key in b:
        return not _same(a[key], b[key])
    v = a[key] if key in a else b[key]
    return not (v is None or isinstance(v, (bool, int, float, str)))


def _probe_pass(parts: DecoderParts, ids: torch.Tensor, labels: torch.Tensor, wrap: tuple[type, int] | None,
                devices: list[torch.device]) -> tuple[list[_Recorder], list[int], Any, str | None]:
    """The model's own forward with a recorder standing in for every block: (recorders, the order
    they were called in, the model's loss, why the recorders' hidden states do not line up)."""
    blocks, calls = list(parts.blocks), []
    recorders = [_Recorder(b, wrap=wrap, calls=calls, index=i, rng_devices=devices) for i, b in enumerate(blocks)]
    try:
        for i, r in enumerate(recorders):
            parts.blocks[i] = r
        out = parts.lm(input_ids=ids, labels=labels, use_cache=False)
    except Exception as e:   # noqa: BLE001 - reported (with the other container tried first)
        return recorders, calls, None, f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        for i, b in enumerate(blocks):
            parts.blocks[i] = b
    loss = out.loss if hasattr(out, "loss") else out[0]
    called = [r for r in recorders if r.hidden is not None]
    h0 = recorders[0].hidden
    if not isinstance(h0, torch.Tensor) or any(not isinstance(r.hidden, torch.Tensor) or r.hidden.shape != h0.shape
                                               for r in called):
        return recorders, calls, loss, "the blocks' hidden states do not line up"
    return recorders, calls, loss, None


def probe_forward(parts: DecoderParts, chunk_tokens: int = 0, tokens: int = PROBE_TOKENS) -> str | None:
    """Check that the model's own forward computes embed -> blocks -> final norm -> head -> loss
    and nothing else, as the executor does: run it on `tokens` tokens (batch 1) with a recorder
    standing in for every block (passing the hidden state on unchanged), once in eval mode and once
    in train mode, and compare, bit for bit and from the same RNG state,
      - the hidden state it feeds block 0 with `parts.embed(ids)` (an embedding multiplier or scale,
        position embeddings added outside the embedding, an embedding dropout),
      - what each block gets with what the previous one returned (changes between blocks,
        layerdrop), and that each block is called once, in order,
      - the arguments each block gets with what `block_kwargs` captures for the shape (sets
        `parts.per_block_args` where they differ by block, `parts.block_returns`),
      - its loss with `head_loss` on the hidden state the last block returned (logit soft-capping,
        logit scales or divisors after the head).
    Raises ModelStructureError naming what differs: the executor would give other loss and
    gradients. Cost: the embedding, final norm and lm_head on `tokens` tokens, four times (six with
    a chunked loss; more where the first container the blocks return in is not the model's), and
    the base model's mask/rotary set-up; no block runs (except block 0, once, where the model's loop
    unpacks more than the hidden state from its blocks: to see what they return), and the weights
    are used where they are (never moved). Leaves no trace: RNG states, training flags and config
    flags are restored. Returns a note (also logged) when it was skipped: a weight outside the
    blocks is not readable (meta)."""
    lm, base = parts.lm, parts.base
    what = type(lm).__name__
    in_blocks = {id(t) for b in parts.blocks for t in (*b.parameters(), *b.buffers())}
    outside = [(n, t) for n, t in (*lm.named_parameters(), *lm.named_buffers()) if id(t) not in in_blocks]
    meta = [n for n, t in outside if t.is_meta]
    if meta:
        note = (f"{what}: the structure probe was skipped ({meta[0]} is on the meta device); the executor "
                f"cannot check that the model computes nothing outside embed -> blocks -> norm -> head")
        _LOG.warning(note)
        return note
    device = next(parts.embed.parameters()).device
    devices = sorted({t.device for _, t in outside if t.device.type == "cuda"} | (
        {device} if device.type == "cuda" else set()), key=str)
    text_cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    special: set[int] = set()
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = getattr(text_cfg, key, None)
        special |= set(v) if isinstance(v, (list, tuple)) else ({v} if isinstance(v, int) else set())
    pool = torch.tensor([i for i in range(min(parts.vocab_size, 1024)) if i not in special] or [0])
    g = torch.Generator().manual_seed(0)   # (not the global RNG)
    ids = pool[torch.randint(len(pool), (1, tokens), generator=g)].to(device)
    labels = ids.clone()
    cfgs = list({id(c): c for c in (lm.config, text_cfg, getattr(base, "config", lm.config))}.values())
    flags = [(c, f, getattr(c, f)) for c in cfgs for f in _OUTPUT_FLAGS if getattr(c, f, None)]
    modes = [(m, m.training) for m in lm.modules()]
    try:
        for c, f, _ in flags:
            setattr(c, f, False)
        # Train mode is probed only for a model handed over in it (the executor runs the model in
        # the mode it is given): an eval-mode model with an embedding dropout computes exactly what
        # the executor does, and telling its user to "train in eval mode" would be no help.
        probe_modes = (False, True) if any(t for _, t in modes) else (False,)
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for training in probe_modes:
                lm.train(training)
                _probe_mode(parts, ids, labels, chunk_tokens, training, devices, what)
    finally:
        for c, f, v in flags:
            setattr(c, f, v)
        for m, t in modes:
            m.training = t
    return None


def _block_returns(parts: DecoderParts, rec: _Recorder, what: str) -> tuple[type, int] | None:
    """What block 0 returns, run on what the model gave the recorder standing in for it: a tuple
    whose values after the hidden state are all None is mimicked (RWKV's (hidden, None, None)
    without a cache); one with more (a state the model hands to the next block) is refused, as
    the executor passes on the hidden state only."""
    block = parts.blocks[0]
    if any(t.is_meta for t in (*block.parameters(), *block.buffers())):
        return None
    try:
        out = block(rec.hidden, *rec.kwargs.get(POSITIONAL, ()),
                    **{k: v for k, v in rec.kwargs.items() if k != POSITIONAL})
    except Exception:   # noqa: BLE001 - the first error is reported
        return None
    if not isinstance(out, (tuple, list)) or len(out) < 2:
        return None
    if any(v is not None for v in out[1:]):
        kinds = ", ".join(type(v).__name__ for v in out[1:])
        raise ModelStructureError(f"{what}: its blocks return more than the hidden state ({kinds}), which the "
                                  f"model's forward unpacks (e.g. a state handed to the next block); the executor "
                                  f"passes on the hidden state only, so its loss and gradients would differ from "
                                  f"the model's own forward: not supported")
    return type(out), len(out)


def _probe_mode(parts: DecoderParts, ids: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                training: bool, devices: list[torch.device], what: str) -> None:
    mode = " in training" if training else ""
    differ = "so the executor's loss and gradients would differ from the model's own forward"
    start = rng_states(devices)
    # what blocks return: the tensor itself, or a tuple the model's loop unpacks (a tensor there
    # gives `outputs[0]` the first sequence of the batch); failing both, block 0 runs once to show
    # it. Found in eval mode, kept for train mode.
    wraps: list[tuple[type, int] | None] = [parts.block_returns] if training else [None, (tuple, 1)]
    first_error, first_block0 = None, None
    k = 0
    while k < len(wraps):
        wrap, k = wraps[k], k + 1
        set_rng_states(start, devices)
        recorders, calls, loss, error = _probe_pass(parts, ids, labels, wrap, devices)
        if error is None:
            parts.block_returns = wrap
            break
        if first_error is None:
            first_error, first_block0 = error, recorders[0]
        if k == 2 and not training and first_block0.hidden is not None:
            found = _block_returns(parts, first_block0, what)
            if found is not None:
                wraps.append(found)
    else:
        raise ModelStructureError(f"{what}: the model's forward does not run with its blocks stood in for "
                                  f"({first_error}){mode}, so the executor cannot check that it computes "
                                  f"embed -> blocks -> final norm -> head only: not supported")
    n = len(recorders)
    if calls != list(range(n)):
        raise ModelStructureError(f"{what}: the model's forward calls its blocks in the order {calls[:12]}{mode}, "
                                  f"not each once in order as the executor does (e.g. layerdrop), {differ}")
    h0 = recorders[0].hidden
    set_rng_states(start, devices)
    embedded = parts.embed(ids)
    if not _same(embedded, h0):
        if training:
            raise ModelStructureError(
                f"{what}: the model's forward applies dropout (or other randomness) between the embedding and "
                f"block 0 in training (e.g. embd_pdrop, hidden_dropout, an embedding dropout), {differ}: set that "
                f"dropout to 0 in the config, or train in eval mode")
        raise ModelStructureError(
            f"{what}: the model's forward transforms the embedding output before block 0 (e.g. an "
            f"embedding_multiplier or scale, position embeddings or a norm applied outside the input "
            f"embedding), {differ}: not supported (where the config has such a multiplier, set it to 1)")
    if not _same(rng_states(devices), recorders[0].rng):
        raise ModelStructureError(f"{what}: the model's forward draws random numbers between the embedding and "
                                  f"block 0{mode}, {differ} (dropout in the blocks would draw other masks): "
                                  f"set its dropout to 0 in the config, or train in eval mode")
    for i in range(1, n):
        prev, cur = recorders[i - 1], recorders[i]
        if not _same(cur.hidden, prev.hidden):
            raise ModelStructureError(f"{what}: the model's forward changes the hidden state between block {i - 1} "
                                      f"and block {i}{mode}; the executor runs the blocks back to back, {differ}: "
                                      f"not supported")
        if not _same(cur.rng, prev.rng):
            raise ModelStructureError(f"{what}: the model's forward draws random numbers between block {i - 1} and "
                                      f"block {i}{mode} (e.g. layerdrop), {differ} (dropout in the blocks would draw "
                                      f"other masks): set layerdrop and dropout to 0 in the config, or train in "
                                      f"eval mode")
    if not mixed_layer_types(parts) and any(not _same(r.kwargs, recorders[0].kwargs) for r in recorders):
        parts.per_block_args = True   # e.g. a mask per block type without config.layer_types
    captured = block_kwargs(parts, *ids.shape, h0.dtype, h0.device)
    for i, (r, kw) in enumerate(zip(recorders, captured)):
        keys = sorted(k for k in {*r.kwargs, *kw} if _arg_differs(r.kwargs, kw, k))
        if keys:
            raise ModelStructureError(
                f"{what}: the arguments the model's forward gives block {i} ({', '.join(keys)}){mode} depend on "
                f"the input's values, not only on its shape; the executor captures them once per shape, "
                f"{differ}: not supported")
    if loss is None:
        _LOG.warning("%s: the model's forward returned no loss for labels; the structure probe could not "
                     "compare the executor's head with it", what)
        return
    set_rng_states(recorders[-1].rng, devices)
    mine = head_loss(parts, recorders[-1].hidden, labels)
    if not _same(mine, loss):
        raise ModelStructureError(
            f"{what}: the model's forward computes more than final norm -> lm_head -> loss after the last "
            f"block{mode} (e.g. final_logit_softcapping, logit_scale, logits_scaling, a logit divisor), "
            f"{differ}: not supported (where the config value disables it, set it: e.g. "
            f"final_logit_softcapping=None, logit_scale=1, logits_scaling=1)")
    if chunk_tokens > 0:
        set_rng_states(recorders[-1].rng, devices)
        chunked = head_loss(parts, recorders[-1].hidden, labels, chunk_tokens)
        if not torch.allclose(chunked.float(), loss.float(), rtol=1e-3, atol=0):
            raise ModelStructureError(f"{what}: job.loss_chunk_tokens: the chunked loss ({float(chunked):.6g}) is "
                                      f"not the model's ({float(loss):.6g}); use job.loss_chunk_tokens=0")


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
        if not _forward_mentions(lm, "aux_loss"):
            return None   # (GLM4-MoE, DeepSeek-V2/V3, dots1: their forward adds no aux loss)
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
                     coef=float(attr("router_aux_loss_coef", "aux_loss_coef")))   # (JetMoE's name)


def _forward_mentions(lm: nn.Module, word: str) -> bool:
    """Whether the source of ``lm``'s forward mentions ``word`` (True when it cannot be read):
    an MoE family whose config has output_router_logits but whose forward computes no aux loss
    was refused for lacking a load_balancing_loss_func it does not use (review)."""
    import inspect
    try:
        return word in inspect.getsource(type(lm).forward)
    except (OSError, TypeError):
        return True


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
