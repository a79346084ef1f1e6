"""ModelSpec of a causal LM whose model_type the planner has no formulas for (spec/model.py knows
eight families): measured from the model itself, not modelled.

- transformers builds the model from its config on the meta device (no weights, no memory);
- the executor's structure finder (models/adapter.find_parts) names its embedding, blocks, final
  norm and head, or refuses it with the reason, as it would at training time;
- parameters are counted per layer; the linear layers (and 3-D expert weights) give the matmul
  FLOPs and the LoRA targets;
- what a block saves for backward is measured: one block of each kind (type and parameter shapes)
  is made for real once in bf16 on the CPU with zero weights and run forward at three sequence
  lengths (16, 32, 64 tokens, as if no sliding window reached them: past one the cost model adds
  SDPA's explicit mask itself, and an eager attention holds the whole square whatever its window)
  with saved-tensor hooks, counting every distinct storage that is neither a weight nor one of the
  step's shared arguments (rotary tables, masks; the step context holds those). The three lengths
  separate what is saved per sequence, per token and per token x sequence (an eager attention's
  probabilities). A Llama config measured this way comes within a few % of its family's formula
  (tests/spec/test_generic_spec.py);
- what a block holds beyond that, at the worst moment of its forward and of its backward (the ops'
  outputs, op by op, with a dispatch mode: an eager attention's fp32 scores and softmax, their
  gradients), is measured at the same lengths and kept as constant / per token / per token x
  sequence terms per moment, which give the same bytes at any longer length
  (tests/spec/test_measured_transients.py); so are the step's shared arguments (an eager model's
  [S, S] mask). A block whose scan runs over chunks (Mamba-2, Gated DeltaNet) pads the sequence
  to whole chunks, where its memory is polynomial: it is measured at two, three and four whole
  chunks (one chunk alone as a floor) and the cost model pads the length (`LayerSpec.scan_chunk`);
  a token loop or a convolution (Mamba-1, LFM2) is taken per token, its worst over the lengths;
- what the blocks return is looked at too: a bf16 Mamba keeps its residual in fp32, whose
  boundaries the cost model counts at 4 bytes (`ModelSpec.residual_bytes`);
- the head (final norm, lm_head, loss) is the families' (the structure finder has checked that the
  model's loss is exactly that), but for what the final norm saves, measured (a LayerNorm saves
  more than an RMSNorm).

Costs one block's weights in memory, three short forwards and three short forward+backward passes
per kind of block (~6 s for a 104B Cohere config, 4 s before the transients were measured; a
chunked scan's whole chunks cost more: MiniMax-Text-01's config ~1 min). Cached per config for the
process and on disk (`SPEC_CACHE_ENV`, by default ~/.cache/lazytrain/specs/): keyed by the config,
the name, every lazytrain source file and the versions of torch, transformers and the kernel
packages transformers would use instead of its torch code (KERNEL_PACKAGES), so other code or
versions measure anew; a file that does not hold what its checksum says is measured anew and
rewritten; a spec with an estimated block (its backward could not run here) is not kept.

Attention FLOPs: num_attention_heads x head_dim over the whole (causal) sequence for every block
the config's `layer_types` (transformers' names) does not mark as one without softmax attention
(`linear_attention`: Mamba, Gated DeltaNet, ...; `conv`; `mlp`/`moe`-only blocks of Nemotron-H),
which get none: a hybrid's linear blocks cost what their linears do. Sliding-window blocks are
counted over the whole sequence (what SDPA with an explicit mask computes).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import math
import os
from pathlib import Path

from .model import Linear, LayerSpec, ModelConfigError, ModelSpec, _count

# transformers' `layer_types` of blocks without softmax attention (no seq x seq term)
NO_SOFTMAX_ATTENTION = ("linear_attention", "mamba", "conv", "mlp", "moe")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "top_k", "moe_top_k", "experts_per_token",
              "moe_k", "moe_topk")   # (ERNIE-4.5-MoE's, Hunyuan-MoE's: refused before; review)
log = logging.getLogger(__name__)
# what a chunked-scan block's transients may still grow per token past the measured lengths (_measure)
CHUNKED_MARGIN = 1.05


def spec_from_structure(cfg: dict, name: str | None) -> ModelSpec:
    return _cached(json.dumps(cfg, sort_keys=True, default=str), name)


# where measured specs are kept between processes: unset, ~/.cache/lazytrain/specs; empty, "0" or
# "off": nowhere (the test suite's default: tests that stub the measurement must not be served
# another process's)
SPEC_CACHE_ENV = "LAZYTRAIN_SPEC_CACHE"
SPEC_CACHE_FORMAT = 1


def spec_cache_dir() -> Path | None:
    v = os.environ.get(SPEC_CACHE_ENV)
    if v is None:
        return Path("~/.cache/lazytrain/specs").expanduser()
    if v.strip().lower() in ("", "0", "off", "false", "no", "none"):
        return None
    return Path(v).expanduser()


# packages whose kernels transformers runs in place of its torch code where they are installed
# (Mamba-2, Falcon-H1, Qwen3-Next blocks): other blocks, other bytes
KERNEL_PACKAGES = ("flash-linear-attention", "fla-core", "mamba-ssm", "causal-conv1d", "kernels")


@functools.lru_cache(maxsize=1)
def _package_fingerprint() -> str:
    """Hash of every lazytrain source file: a measurement runs the structure finder, the
    accountant, the chunked loss... (`model_code_fingerprint` covers the planner's alone)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _cache_key(kind: str, args: tuple) -> str:
    from ..plan.solve import installed_versions

    blob = json.dumps({"format": SPEC_CACHE_FORMAT, "kind": kind, "args": list(args), "code": _package_fingerprint(),
                       **installed_versions(("torch", "transformers", *KERNEL_PACKAGES))}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


_MISS = object()


def _load_cached(path: Path, key: str, from_text):
    """What `path` keeps under `key` (`from_text` of its text), or _MISS (absent; or damaged:
    said, and measured anew)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return _MISS
    except OSError as e:
        log.warning("cannot read the measured-spec cache file %s (%s); measuring the model again", path, e.strerror)
        return _MISS
    try:
        d = json.loads(raw)
        text = d["value"]
        if d.get("key") != key or hashlib.sha256(text.encode()).hexdigest() != d.get("sha256"):
            raise ValueError("its key or checksum does not match its content")
        return from_text(text)
    except Exception as e:  # noqa: BLE001 - any damage: JSON, keys, types, the spec's own fields
        log.warning("the measured-spec cache file %s is damaged (%s: %s); measuring the model again",
                    path, type(e).__name__, str(e)[:120])
        return _MISS


def _store_cached(path: Path, key: str, text: str) -> None:
    from ..storage.atomic import atomic_write_text

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"key": key, "sha256": hashlib.sha256(text.encode()).hexdigest(),
                                            "value": text}))
    except OSError as e:   # (a read-only home: planning goes on, measuring again next time)
        log.warning("cannot keep the measured spec in %s (%s); set %s to a writable dir, or to off",
                    path.parent, getattr(e, "strerror", None) or e, SPEC_CACHE_ENV)


def _on_disk(kind: str, args: tuple, compute, to_text, from_text):
    """compute()'s value ((value, keep): `keep` False for a verdict that is not one, e.g. a probe
    that could not run), kept in the cache dir between processes."""
    folder = spec_cache_dir()
    if folder is None:
        return compute()[0]
    key = _cache_key(kind, args)
    path = folder / f"{kind}-{key}.json"
    hit = _load_cached(path, key, from_text)
    if hit is not _MISS:
        return hit
    value, keep = compute()
    if keep:
        _store_cached(path, key, to_text(value))
    return value


def _verdict(text: str) -> str | None:
    v = json.loads(text)
    if v is not None and not isinstance(v, str):
        raise ValueError(f"a verdict is a line or null, not {type(v).__name__}")
    return v


@functools.lru_cache(maxsize=16)
def _cached(cfg_json: str, name: str | None) -> ModelSpec:
    def measure():
        # a block whose backward could not be measured here (estimated terms, with a warning) is
        # not kept: served from disk, every later plan took the estimate without the warning (review)
        notes: dict = {}
        spec = _measure(json.loads(cfg_json), name, notes)
        return spec, not notes.get("estimated")
    return _on_disk("spec", (cfg_json, name), measure, ModelSpec.to_json, ModelSpec.from_json)


def _build_meta(cfg: dict):
    import torch
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    family = cfg["model_type"]
    if family not in CONFIG_MAPPING:
        raise ModelConfigError(f"model_type {family!r}: transformers does not know it")
    # what a real config.json holds, under the standard name or the family's own (GPT-J's n_layer):
    # transformers would fill a missing one with its default and plan another model
    cls = CONFIG_MAPPING[family]
    aliases = getattr(cls, "attribute_map", {}) or {}
    required = _required_keys(cls)
    missing = [k for k in required if k not in cfg and aliases.get(k) not in cfg]
    if missing:
        raise ModelConfigError(f"config is missing required keys: {', '.join(missing)}")
    for k in required:
        _count({k: cfg.get(k, cfg.get(aliases.get(k, k)))}, k)   # (a whole number >= 1, named)
    # a key the family derives from others: one of those must be given (transformers' default
    # layout otherwise: a Nemotron-H config naming none was planned as a 4-layer model; review)
    for k, sources in DERIVED_KEYS.get(family, {}).items():
        if not any(cfg.get(src) for src in sources):
            raise ModelConfigError(f"config is missing required keys: {' or '.join(sources)} ({family}'s {k})")
    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(family, **kw)
    except Exception as e:  # noqa: BLE001 - its own validation (hidden size not divisible by heads, ...)
        why = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise ModelConfigError(f"config ({family}): {why.removeprefix('ValueError: ')[:200]}") from None
    for k in DERIVED_KEYS.get(family, {}):
        given = cfg.get(k, cfg.get(aliases.get(k, k)))
        if given is not None and given != getattr(config, k, given):
            raise ModelConfigError(f"config: {k}={given} but {family}'s layout gives {getattr(config, k)}")
    # a multimodal family's language model takes its sizes from text_config: transformers keeps a
    # top-level hidden_size as an unread attribute (`{"model_type": "gemma3", "hidden_size": 64}`
    # was planned as its default 2304-wide, 26-layer model without a word; review)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        unread = [f"{k}={cfg[k]} (text_config: {getattr(text, k, None)})" for k in SIZE_KEYS
                  if k in cfg and getattr(text, k, None) != cfg[k]]
        if unread:
            raise ModelConfigError(f"config ({family}): {', '.join(unread)} at the top level: a {family} config "
                                   f"takes its language model's sizes from text_config, where transformers "
                                   f"reads them; move them there")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises for this config
        raise ModelConfigError(f"model_type {family!r}: transformers cannot build it as a causal LM "
                               f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from None
    return config, model


# Size keys a family derives from others (a property of its config), and the keys one of which a
# config must give for it
DERIVED_KEYS = {"nemotron_h": {"num_hidden_layers": ("layers_block_type", "layer_types", "hybrid_override_pattern")}}
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@functools.lru_cache(maxsize=64)
def _required_keys(cls) -> tuple[str, ...]:
    """The size keys a config of this class must give: those its family has as plain settings.
    Not a key the family lacks (Mamba's blocks have no attention heads: a real Mamba config names
    none, and was refused for it), nor one it derives (`DERIVED_KEYS`: Nemotron-H's layer count is
    its `layers_block_type`'s length, and a config transformers 5 saves has no num_hidden_layers)."""
    try:
        default = cls()
    except Exception:  # noqa: BLE001 - a family whose default cannot be built: ask for all of them
        default = None
    if default is None or not any(hasattr(default, k) for k in SIZE_KEYS):
        # (a multimodal family's sizes live in its text_config: all four, as before; review: none
        # was required and `{"model_type": "gemma3"}` planned transformers' default model)
        return SIZE_KEYS
    derived = DERIVED_KEYS.get(getattr(cls, "model_type", None), {})
    keys = []
    for k in SIZE_KEYS:
        if k in derived:   # (one of its sources is required instead: _build_meta)
            continue
        if not hasattr(default, k):
            continue
        keys.append(k)
    return tuple(keys)


def structure_problem(cfg: dict, chunk_tokens: int = 0) -> str | None:
    """Why the streaming executor would refuse this model's structure (its forward computes more
    than embed -> blocks -> final norm -> head: a logit soft-cap or scale, an embedding multiplier,
    ...), found before any weight is loaded: the executor's own probe (models.adapter.probe_forward)
    run on the model built from `cfg` with a vocabulary of at most 1024 tokens and random weights
    outside the blocks (the blocks stay on the meta device: the probe stands in for them). None when
    it passes, or when the probe cannot run so (the executor probes the loaded model anyway)."""
    return _structure_cached(json.dumps(cfg, sort_keys=True, default=str), int(chunk_tokens))


@functools.lru_cache(maxsize=16)
def _structure_cached(cfg_json: str, chunk_tokens: int) -> str | None:
    # (MiniMax-Text-01's 80 layers: ~20 s to build, their decay tables made for real)
    return _on_disk("structure", (cfg_json, chunk_tokens), lambda: _structure_probe(cfg_json, chunk_tokens),
                    json.dumps, _verdict)


def _structure_probe(cfg_json: str, chunk_tokens: int) -> tuple[str | None, bool]:
    import logging

    import torch
    from accelerate import init_empty_weights
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    from ..models.adapter import ModelStructureError, check_chunked_loss, find_parts, probe_forward

    cfg = json.loads(cfg_json)
    family = cfg.pop("model_type")
    vocab = 0
    try:
        vocab = _small_vocab(cfg, CONFIG_MAPPING[family]().to_dict())
        config = AutoConfig.for_model(family, **cfg)
        # parameters on the meta device, buffers (rotary tables, embedding scales) computed for real
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        parts = find_parts(model)
        g = torch.Generator().manual_seed(0)
        real: dict[int, tuple[torch.Tensor, torch.nn.Parameter]] = {}   # meta param -> its stand-in
        for mod in [c for c in parts.base.children() if c is not parts.blocks] + [parts.head]:
            for sub in mod.modules():
                for name, p in list(sub.named_parameters(recurse=False)):
                    if p.is_meta:
                        if id(p) not in real:   # (one stand-in per parameter: a tied head stays tied)
                            t = torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.dim() == 1 else 0.0)
                            real[id(p)] = (p, torch.nn.Parameter(t, requires_grad=p.requires_grad))
                        sub._parameters[name] = real[id(p)][1]
        if chunk_tokens:
            check_chunked_loss(parts)
        if probe_forward(parts, chunk_tokens) is not None:
            return None, True   # (skipped: a weight it needs stayed on the meta device)
    except ModelStructureError as e:
        if "does not run with its blocks stood in" in str(e):
            return None, True   # (the blocks' own returns unknown on the meta device: no verdict; review: Bamba)
        return str(e), True
    except Exception as e:  # noqa: BLE001 - the probe could not run on this stand-in: the executor's runs
        logging.getLogger(__name__).debug("plan-time structure probe not run (vocab %d): %s", vocab, e)
        return None, False   # (not kept: it may run next time, e.g. with more memory)
    return None, True


def packed_rows_problem(cfg: dict) -> str | None:
    """Why rows packed into one sequence would see each other in this model (None: each attends
    only to itself). Packed rows carry position ids restarting at 0 with each row, from which
    transformers builds a mask that keeps them apart, where the family builds its masks so: checked
    on the model built from `cfg` on the meta device, its blocks stood in for (their arguments for
    rows of 3 and 4 tokens: every block must get a [.., 7, 7] mask in which the second row's tokens
    cannot see the first's). A family that builds its mask otherwise (GPT-OSS, ALiBi models) or
    whose blocks carry a state along the sequence (Mamba, linear attention: no such mask) fails.
    The families with formulas (spec.model.FAMILIES) are known to pass (tests/runtime/test_packed_rows.py)."""
    from .model import FAMILIES

    if cfg.get("model_type") in FAMILIES:
        return None
    return _packed_cached(json.dumps(cfg, sort_keys=True, default=str))


@functools.lru_cache(maxsize=16)
def _packed_cached(cfg_json: str) -> str | None:
    return _on_disk("packed", (cfg_json,), lambda: (_packed_probe(cfg_json), True), json.dumps, _verdict)


def _packed_probe(cfg_json: str) -> str | None:
    import torch

    from ..models.adapter import _per_block_kwargs, find_parts

    cfg = json.loads(cfg_json)
    S = 7   # rows of 3 and 4 tokens (not 8: a rotary table's [1, 8, 8] was taken for the mask; review)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    try:
        _, model = _build_meta(cfg)
        parts = find_parts(model)
        _materialise_context(parts)
        kw = _per_block_kwargs(parts, 1, S, torch.bfloat16, torch.device("cpu"), None, {"position_ids": pos})
    except Exception as e:  # noqa: BLE001 - no verdict is a verdict: rows are not packed then
        return (f"its forward does not run with its blocks stood in on the meta device to show its masks "
                f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
    types = getattr(model.config, "layer_types", None) or ()
    for i, d in enumerate(kw):
        if i < len(types) and types[i] in NO_SOFTMAX_ATTENTION:
            return f"block {i} is a {types[i]} layer (a state carried along the sequence, from row to row)"
        conv = next((type(m).__name__ for m in parts.blocks[i].modules() if isinstance(m, torch.nn.Conv1d)), None)
        if conv:
            return f"block {i} holds a convolution over the sequence ({conv}: a state carried from row to row)"
        # the mask: a [.., S, S] argument named as one (or, unnamed, the first such tensor)
        cands = [(k, t) for k, v in d.items() for t in (v if isinstance(v, (tuple, list)) else (v,))
                 if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) == (S, S)]
        masks = [t for k, t in cands if "mask" in str(k)] or [t for _, t in cands]
        if not masks:
            return f"block {i} gets no mask from the rows' position ids (it attends, or carries state, across them)"
        m = masks[0].reshape(-1, S, S)[0]
        sees = (lambda q, k: bool(m[q, k])) if m.dtype == torch.bool else (lambda q, k: float(m[q, k]) > -1e4)
        if sees(3, 2) or not sees(3, 3):   # (the second row's first token: the first row's last, itself)
            return f"block {i}'s mask lets the second row's tokens see the first row (it ignores the position ids)"
    return None


def _small_vocab(cfg: dict, defaults: dict) -> int:
    """Shrink `cfg` (in place) to a vocabulary of at most 1024 tokens; special token ids past it
    (`cfg`'s or the family's `defaults`) are dropped (none is drawn by the probe). Returns the size."""
    key = "vocab_size" if "vocab_size" in cfg else next((k for k in ("n_vocab", "padded_vocab_size") if k in cfg),
                                                         "vocab_size")
    vocab = min(int(cfg.get(key) or 1024), 1024)
    cfg[key] = vocab
    for k in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id"):
        v = cfg.get(k, defaults.get(k))
        if isinstance(v, list):
            v = [i for i in v if isinstance(i, int) and i < vocab] or None
        elif isinstance(v, int) and v >= vocab:
            v = None
        if k in cfg or k in defaults:
            cfg[k] = v
    return vocab


def _materialise_context(parts) -> None:
    """Make real (CPU) what computes the blocks' arguments: the base model's children other than
    the embedding and the blocks (rotary tables, norms); a rotary module's frequencies are
    recomputed (to_empty leaves them unset). Values do not matter to what is measured, shapes do."""
    import torch

    for mod in parts.base.children():
        if mod is parts.blocks or mod is parts.embed:
            continue
        mod.to_empty(device="cpu")
        for sub in mod.modules():
            init = getattr(sub, "rope_init_fn", None)
            if init is not None and isinstance(getattr(sub, "inv_freq", None), torch.Tensor):
                try:
                    inv, _ = init(sub.config, "cpu")
                except TypeError:   # (PhiMoE's takes the config alone: a traceback from `plan`; review)
                    inv, _ = init(sub.config)
                sub.inv_freq = inv
                if hasattr(sub, "original_inv_freq"):
                    sub.original_inv_freq = inv


def _real_copy(block):
    """`block` made for real on the CPU (bf16) with zero weights and buffers. An expert stack (a
    3-D [experts, out, in] weight) is one zero expert repeated with stride 0: made in full,
    DeepSeek-V3's block (256 experts of 7168 x 2048 x 3) was ~22 GB to zero, and `lazytrain plan`
    on its config ran past the 4 minutes a review gave it (now 3.8 s, 1.9 GB). With zero weights the router sends every token to
    the same experts whatever the count, and what is saved is what a full copy saves (tests)."""
    import torch

    real = copy.deepcopy(block)
    for mod in real.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if p.dim() == 3 and not isinstance(mod, torch.nn.modules.conv._ConvNd):
                t = torch.zeros((1, *p.shape[1:]), dtype=p.dtype).expand(p.shape)
            else:
                t = torch.zeros(p.shape, dtype=p.dtype)
            mod._parameters[name] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = (torch.zeros if b.is_floating_point() else torch.empty)(b.shape, dtype=b.dtype)
    return real


def _saved_bytes(real, kwargs: dict, hidden: int, seq: int) -> int:
    """Bytes block `real` (a `_real_copy`) saves for backward on [1, seq] tokens."""
    import torch

    from ..models.adapter import run_block

    ctx = [t for v in kwargs.values() for t in (v if isinstance(v, (tuple, list)) else (v,))
           if isinstance(t, torch.Tensor)]
    return _saved_storage_bytes(lambda x: run_block(real, x, kwargs), real, hidden, seq, ctx)


def _scan_chunk(block) -> int:
    """The chunk a block's scan pads the sequence to (tokens; 0: none found): its modules'
    `chunk_size` (Mamba-2's, Falcon-H1's, Nemotron-H's mixers) or `block_size` (MiniMax's
    lightning attention: 256 tokens a block; taken per token at 16-64 tokens its plans were
    2.1-2.7x its device peak), or the `chunk_size` default of the chunked kernel a module holds
    (Qwen3-Next's Gated DeltaNet: 64). Only asked of blocks without softmax attention, a
    convolution or heads (`_measure`)."""
    import inspect

    found = []
    for mod in block.modules():
        for attr in ("chunk_size", "block_size"):
            c = getattr(mod, attr, None)
            if isinstance(c, int) and not isinstance(c, bool) and c > 0:
                found.append(c)
        # the functions its forward calls by name (transformers' torch_chunk_gated_delta_rule)
        code = getattr(getattr(inspect.unwrap(type(mod).forward), "__code__", None), "co_names", ())
        scope = getattr(inspect.getmodule(type(mod)), "__dict__", {})
        for name in code:
            fn = scope.get(name) if "chunk" in name else None
            if not inspect.isfunction(fn):
                continue
            p = inspect.signature(fn).parameters.get("chunk_size")
            if p is not None and isinstance(p.default, int) and not isinstance(p.default, bool) and p.default > 0:
                found.append(p.default)
    return max(found, default=0)


def _output_itemsize(real, kwargs: dict, hidden: int, seq: int) -> int:
    """Bytes per element of what block `real` (a `_real_copy`) returns for a bf16 input: 4 where
    it keeps its residual in fp32 (Mamba's `residual_in_fp32`)."""
    import torch

    from ..models.adapter import run_block

    with torch.no_grad():
        out = run_block(real, torch.zeros(1, seq, hidden, dtype=torch.bfloat16), kwargs)
    return out.element_size()


def _saved_storage_bytes(fn, module, hidden: int, seq: int, exclude=(), with_output: bool = False,
                         with_input: bool = True) -> int:
    """Bytes of the distinct storages `fn` saves for backward on a zero bf16 [1, seq, hidden]
    input, other than `module`'s weights and the tensors in `exclude` (the step's shared
    arguments); `with_output`: its output's too; `with_input`: the input's, where saved."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}
    alive: list[torch.Tensor] = []   # (a saved tensor the forward dropped again freed its address for
    # the next one: two counted as one, and the measure changed from run to run by a tensor's size)
    x = torch.zeros(1, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    if not with_input:
        skip.add(x.untyped_storage().data_ptr())

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
            alive.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    if with_output:
        seen[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    return sum(seen.values())


def _allocations_mode(events: list):
    """A dispatch mode writing down, in order, every storage an op makes (an output sharing no
    storage with the op's inputs) as (key, +bytes) and its death as (key, -bytes): what a device
    allocator's peak would see of the ops' own memory. Scratch an op frees before it returns
    stays invisible (as in runtime.accountant.OpTemporaries). `mode.live`: id(storage) -> key."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    from ..runtime.accountant import _tensors

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            inputs = None
            for t in _tensors(out):
                st = t.untyped_storage()
                if not st.data_ptr() or id(st) in self.live:
                    continue
                if inputs is None:
                    inputs = {id(a.untyped_storage()) for a in (*_tensors(args), *_tensors(kwargs.values()))}
                if id(st) not in inputs:
                    self.track(st)
            return out

        def track(self, st) -> None:
            key, nb, sid = len(events), st.nbytes(), id(st)

            def dead(_ref, key=key, nb=nb, sid=sid, live=self.live):
                events.append((key, -nb))
                if live.get(sid, (None,))[0] == key:
                    del live[sid]

            events.append((key, nb))
            self.live[sid] = (key, weakref.ref(st, dead))

    mode = Allocations()
    mode.live = {}
    return mode


def _excess_curves(real, kwargs: dict, hidden: int, seq: int) -> tuple[list[int], list[int], list[int]]:
    """What block `real` (a `_real_copy`) holds above its saved activations, op by op, on [1, seq]
    tokens: in its forward (the ops' outputs alive, less what the forward leaves saved); in its
    backward with its saved activations freed as autograd frees them (kept on the device, or
    recomputed); and in its backward with them alive to the end (brought back from the host or
    NVMe: the executor holds a layer's fetched activations for its whole backward). None counts
    the block's output, its input's gradient (the planner's boundaries) nor weight gradients (its
    gradients in flight). Only the input and the vectors (norms' weights, biases: their
    gradients' products per token are real temporaries) are differentiated: a weight matrix's
    gradient is one matmul's output, which is not counted, and made it cost the whole block's size
    again in memory (differentiating the matrices too, a 104B Cohere config took 9 s and 6.4 GB
    to plan; without, 6 s and 3.4 GB)."""
    import torch

    from ..models.adapter import run_block

    events: list = []
    mode = _allocations_mode(events)
    saved: set = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        ent = mode.live.get(id(t.untyped_storage()))
        if ent is not None:
            saved.add(ent[0])
        return t

    x = torch.zeros(1, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_block(real, x, kwargs)
    n_fwd = len(events)
    grad_out = torch.zeros_like(out)
    out_key = mode.live.get(id(out.untyped_storage()), (None,))[0]
    wrt = [x] + [p for p in real.parameters() if p.requires_grad and p.dim() < 2]
    with mode:
        grads = torch.autograd.grad(out, wrt, grad_out, allow_unused=True)
        del out
    skip = {out_key} | {mode.live[id(g.untyped_storage())][0] for g in grads
                        if g is not None and id(g.untyped_storage()) in mode.live}
    del grads
    fwd, bwd, held, live, kept = [], [], [], 0, 0
    for i, (key, nb) in enumerate(events):
        if key in skip:
            nb = 0
        live += nb
        if i < n_fwd:
            fwd.append(live)
        else:
            if nb < 0 and key in saved:
                kept -= nb
            bwd.append(live)
            held.append(live + kept)
    end = fwd[-1] if fwd else 0   # (what the forward left: the saved activations it made)
    return [v - end for v in fwd], [v - end for v in bwd], [v - end for v in held]


def _transient_terms(curves: list[list[int]], lengths: tuple[int, ...],
                     up: bool = False) -> tuple[tuple[int, int, int], ...]:
    """Each point of a curve measured at three sequence lengths as constant + per token x S +
    per token x S x S bytes (exact for what is made per token and per token pair), the points no
    other exceeds in every term. () where the runs made different numbers of allocations. `up`:
    each term rounded up (a chunked scan's bytes grow by a fraction of a byte per token x sequence:
    rounded to the nearest, its fit fell ~10 KB under at 1024 tokens, more with every chunk)."""
    if len({len(c) for c in curves}) != 1 or not curves[0]:
        return ()
    s0, s1, s2 = lengths
    pts = set()
    for e0, e1, e2 in zip(*curves):
        # e(S) = c + a S + b S^2 through the three points (divided differences)
        d01, d12 = (e1 - e0) / (s1 - s0), (e2 - e1) / (s2 - s1)
        b = (d12 - d01) / (s2 - s0)
        a = d01 - b * (s0 + s1)
        c = e0 - a * s0 - b * s0 * s0
        rnd = (lambda x: math.ceil(x - 1e-9)) if up else round  # noqa: E731 - (not float noise)
        pts.add((rnd(c), rnd(a), rnd(b)))
    return _pareto(pts)


def _pareto(pts) -> tuple[tuple[int, int, int], ...]:
    """The (constant, per token, per token x sequence) points no other exceeds in every term."""
    pts = set(pts)
    keep = [p for p in pts if not any(q != p and all(qi >= pi for qi, pi in zip(q, p)) for q in pts)]
    return tuple(sorted(keep))


def _norm_saved_per_token(norm, hidden: int, lengths: tuple[int, ...]) -> int:
    """Bytes per token the final norm (a `_real_copy`) saves for backward, with its output (what
    lm_head saves), not counting its input (the last hidden state: a boundary of the plan's)."""
    import math

    real = _real_copy(norm)
    return math.ceil(max(_saved_storage_bytes(real, real, hidden, s, with_output=True, with_input=False) / s
                         for s in lengths))


def _measure(cfg: dict, name: str | None, notes: dict | None = None) -> ModelSpec:
    import torch

    from ..models.adapter import ModelStructureError, block_kwargs, context_tensors, find_parts

    family = cfg["model_type"]
    config, model = _build_meta(cfg)
    try:
        parts = find_parts(model)
    except ModelStructureError as e:
        raise ModelConfigError(f"model_type {family!r}: {e}") from None
    H = parts.hidden_size
    L = len(parts.blocks)
    V = int(parts.vocab_size)
    # read from the config object: it maps each family's own key names (GPT-J's n_head, MPT's
    # n_heads) to the standard ones
    std = {k: getattr(config, k, None) for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                  "max_position_embeddings", "intermediate_size")}
    std = {k: v for k, v in std.items() if v is not None}
    # (none in a family without softmax attention: Mamba, Mamba-2, whose blocks then cost what
    # their linears do)
    nh = _count(std, "num_attention_heads") if "num_attention_heads" in std else 0
    nkv = _count(std, "num_key_value_heads", nh) if nh else 0
    # (multi-head latent attention: the query/key head is its rope and no-rope parts together)
    qk = getattr(config, "qk_head_dim", None) or (getattr(config, "qk_rope_head_dim", 0) or 0) + \
        (getattr(config, "qk_nope_head_dim", 0) or 0)
    hd = (int(qk) if qk else _count(std, "head_dim", H // nh)) if nh else 0
    types = getattr(config, "layer_types", None)
    types = list(types) if isinstance(types, (list, tuple)) and len(types) == L else [None] * L
    # the window as the built config holds it (after the family's own rules: a key the family
    # ignores, e.g. SmolLM3's sliding_window under all-full layer_types, slides nothing)
    window = getattr(config, "sliding_window", None) or None
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if any(types) else \
        tuple(range(L)) if window else ()
    window = int(window) if window and sliding else None
    # Three lengths, each block measured as if no window reached them: with SDPA a window the
    # sequence reaches brings an explicit mask the cost model adds itself; an eager attention holds
    # the whole [S, S] square whatever its window. (Measured below the window instead, a window of
    # 16 left 7 and 15 tokens to fit Gemma 2's probabilities from, 4 bytes per token x sequence
    # of 24, and one of 8 or less none: plans at 1.3-2.2x their device peak; review.)
    s0, s1, s2 = lengths = (16, 32, 64)
    if window:
        for c in {id(config): config, id(model.config): model.config}.values():
            c.sliding_window = 1 << 30
    _materialise_context(parts)
    try:
        kw = {s: block_kwargs(parts, 1, s, torch.bfloat16, torch.device("cpu")) for s in lengths}
    except (ModelStructureError, ValueError, TypeError, RuntimeError, NotImplementedError) as e:
        # (Bamba's loop unpacks two values from each block: a bare "not enough values to unpack"
        # from `plan`, a traceback from `train`: review)
        raise ModelConfigError(f"model_type {family!r}: the planner cannot measure it: its forward does not run "
                               f"with its blocks stood in on the meta device ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None

    def _kwargs_at(seq: int) -> list:
        """The blocks' arguments for one sequence of `seq` tokens (the three lengths' made above)."""
        if seq not in kw:
            kw[seq] = block_kwargs(parts, 1, seq, torch.bfloat16, torch.device("cpu"))
        return kw[seq]

    # the step's context (masks, rotary tables: the executor holds them for the whole step),
    # measured at each length: an eager attention's model builds its mask whatever the length
    ctx = {s: sum(t.untyped_storage().nbytes() for t in context_tensors(kw[s])) for s in kw}
    context_terms = _transient_terms([[ctx[s]] for s in lengths], lengths)
    numel = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    layers = [LayerSpec(name="embed", kind="embed", index=0, param_count=numel(parts.embed),
                        active_param_count=numel(parts.embed), matmul_flops_fwd_per_token=0,
                        attn_flops_fwd_per_token_per_seq=0, saved_bytes_per_token={"input_ids": 8})]
    measured: dict[tuple, tuple[int, int]] = {}
    residual = 2   # (bytes per element of what the blocks return, run in bf16)
    for i, block in enumerate(parts.blocks):
        linears, matmul, experts = [], 0, []
        for mname, mod in block.named_modules():
            w = getattr(mod, "weight", None)
            if isinstance(mod, torch.nn.Linear) or (
                    isinstance(w, torch.nn.Parameter) and w.dim() == 2 and not isinstance(mod, torch.nn.Embedding)):
                # (an MoE router holds its [experts, hidden] matrix as a bare weight)
                out_f, in_f = int(w.shape[0]), int(w.shape[1])
                linears.append(Linear(mname.split(".")[-1], in_f, out_f, lora=isinstance(mod, torch.nn.Linear)))
                matmul += in_f * out_f
        for pname, p in block.named_parameters():
            # one weight per expert: [experts, out, in] (or [experts, in, out]); a convolution's
            # [channels, 1, kernel] (Mamba, Gated DeltaNet, LFM2) is not (it made 128 "experts"
            # of a Qwen3-Next linear-attention block and refused Mamba2: review)
            owner = block.get_submodule(pname.rpartition(".")[0]) if "." in pname else block
            # (nor a [1, 1, hidden] mixing vector: RWKV's time-mix was taken for one expert; review)
            if p.dim() == 3 and p.shape[0] > 1 and not isinstance(owner, torch.nn.modules.conv._ConvNd):
                experts.append((pname, p))
        E = k = expert_params = 0
        params = numel(block)
        active = params
        if experts:
            E = int(experts[0][1].shape[0])
            # (a list: one per layer, Hunyuan-MoE's moe_topk; its first)
            ks = ((v[0] if isinstance(v, list) and v else v) for v in (cfg.get(key) for key in TOP_K_KEYS))
            k = next((int(v) for v in ks if isinstance(v, int) and not isinstance(v, bool)), 0)
            if not 1 <= k <= E:
                raise ModelConfigError(f"model_type {family!r}: block {i} holds {E} experts but the config "
                                       f"names no top-k in 1..{E} (looked for {', '.join(TOP_K_KEYS)})")
            all_expert = sum(p.numel() for _, p in experts)
            expert_params = all_expert // E
            active = params - all_expert + k * expert_params
            matmul += k * expert_params
            for pname, p in experts:
                linears.append(Linear("experts." + pname.split(".")[-1], int(p.shape[-1]), int(p.shape[-2]), E, k))
        # one measurement per kind of block: its class, parameter shapes and arguments' shapes
        kind = (type(block).__name__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters()),
                tuple(sorted((a, tuple(v.shape)) for a, v in kw[s2][i].items() if isinstance(v, torch.Tensor))))
        if kind not in measured:
            real = _real_copy(block)   # (one copy for every length)
            residual = max(residual, _output_itemsize(real, kw[s0][i], H, s0))
            # A recurrent or linear-attention block's scan pads the sequence to its chunk
            # (Mamba-2's 256 tokens) or loops token by token (Mamba-1's torch path: a different
            # number of allocations at each length): what it saves and holds is not a polynomial
            # of the length fitted point by point at 16-64 tokens.
            # (or a model without attention heads at all: RWKV's recurrence, a token loop on the CPU)
            chunked = types[i] in NO_SOFTMAX_ATTENTION or not nh or any(
                isinstance(m, torch.nn.modules.conv._ConvNd) for m in block.modules())
            chunk = _scan_chunk(block) if chunked else 0
            # A scan over chunks (Mamba-2, Falcon-H1, Nemotron-H, Gated DeltaNet) is measured at
            # two, three and four whole chunks, where what it saves and holds is polynomial in the
            # length (in its chunk count: the inter-chunk decay is [chunks, chunks]; one chunk
            # takes a path of its own, saving less: Falcon-H1's 216 MB where the trend of 2-4
            # chunks gives 283 MB, and a fit through it 1.6x too much at four), and the cost
            # model pads each sequence to whole chunks as the block does. Measured at 16-64 tokens
            # as if each were a whole chunk, Falcon-H1's plans were 7-9x its device peak and
            # Qwen3-Next's 3.3x (session 27).
            lens = (2 * chunk, 3 * chunk, 4 * chunk) if chunk else lengths
            args = [_kwargs_at(s)[i] for s in lens]
            saved = [_saved_bytes(real, a, H, s) for a, s in zip(args, lens)]
            if chunked and not chunk:
                # Otherwise (Mamba-1's token loop, convolutions) the saved bytes per token are
                # taken at the short lengths, and so are its transients: each moment's worst per
                # token over the lengths, with 5% for what still grows past them (Jamba's Mamba-1
                # loop: 0.4% from 64 to 512 tokens). The formulas' instead: Jamba's blocks hold
                # ~62 KB per token in their backward, 24x the formula: plans 1.35-1.39x under
                # their peak (review).
                quad = max(0, round((saved[2] / s2 - saved[1] / s1) / (s2 - s1)))
                const, per_tok = 0, round(saved[1] / s1 - quad * s1)
            else:
                # constant + per token + per token x sequence, exactly (two lengths took a
                # constant as a negative per token x sequence term: 20 of Gemma 2's 24 bytes; review)
                ((const, per_tok, quad),) = _transient_terms([[b] for b in saved], lens, up=bool(chunk))
            if chunk:
                # (a single chunk takes a path of its own: what it saves and holds is a floor
                # per sequence; Falcon-H1's saves less alone, its backward holds more: 95 MB
                # where the fit through 2-4 chunks gives 62)
                one_args = _kwargs_at(chunk)[i]
                const = max(0, const)
                const += max(0, _saved_bytes(real, one_args, H, chunk) - (const + per_tok * chunk + quad * chunk * chunk))
            fwd = bwd = held = ()
            try:
                curves = [_excess_curves(real, a, H, s) for a, s in zip(args, lens)]
                one = _excess_curves(real, one_args, H, chunk) if chunk else ()
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
                # (the formulas' terms then: a block whose backward cannot run here fails
                # at training time with the real error)
                if notes is not None:   # (an estimate is not kept on disk: _cached)
                    notes["estimated"] = True
                log.warning("model_type %r: block %d's backward could not be measured (%s: %s); "
                            "its transient memory is estimated", family, i, type(e).__name__,
                            str(e).splitlines()[0][:160] if str(e) else "")
            else:
                worst = lambda k: ((0, math.ceil(CHUNKED_MARGIN * max(max(c[k], default=0) / s  # noqa: E731
                                                                      for c, s in zip(curves, lens))), 0),)
                if chunked and not chunk:
                    fwd, bwd, held = (worst(k) for k in range(3))
                else:
                    # (a scan looping over its chunks makes a different number of allocations at
                    # each length: no fit; its worst per token, which the chunk count hardly moves)
                    fwd, bwd, held = (_transient_terms([c[k] for c in curves], lens, up=bool(chunk))
                                      or (worst(k) if chunk else ())
                                      for k in range(3))
                    if chunk:
                        fwd, bwd, held = (_pareto(terms + ((max(max(one[k], default=0), 0), 0, 0),))
                                          for k, terms in enumerate((fwd, bwd, held)))
            del real
            measured[kind] = (max(0, const), max(0, per_tok), max(0, quad), fwd, bwd, held, chunk)
        per_seq, per_token, per_token_seq, fwd_terms, bwd_terms, held_terms, chunk = measured[kind]
        layers.append(LayerSpec(
            name=f"block.{i}", kind="block", index=i + 1, param_count=params, active_param_count=active,
            matmul_flops_fwd_per_token=2 * matmul,
            attn_flops_fwd_per_token_per_seq=0 if types[i] in NO_SOFTMAX_ATTENTION else 2 * nh * hd,
            saved_bytes_per_token={"measured": per_token}, linears=tuple(linears),
            num_experts=E, experts_per_token=k, expert_param_count=expert_params,
            saved_bytes_per_token_per_seq=per_token_seq, saved_bytes_per_sequence=per_seq,
            fwd_transient_terms=fwd_terms, bwd_transient_terms=bwd_terms,
            bwd_offloaded_transient_terms=held_terms, scan_chunk=chunk))
    tied = bool(parts.tied)
    norm_params = numel(parts.norm)
    head_params = norm_params + (0 if tied else numel(parts.head))
    layers.append(LayerSpec(
        name="head", kind="head", index=L + 1, param_count=head_params, active_param_count=norm_params + V * H,
        matmul_flops_fwd_per_token=2 * V * H, attn_flops_fwd_per_token_per_seq=0,
        # the final norm's saves and its output (lm_head's input), measured (Cohere's LayerNorm
        # saves 1.8x the 8 x hidden bytes of the families' RMSNorm formula: its plans 1% over at
        # the head's backward; review), and the loss's fp32 log-softmax
        saved_bytes_per_token={"norm_measured": _norm_saved_per_token(parts.norm, H, lengths),
                               "log_softmax": 4 * V},
        linears=(Linear("lm_head", H, V),)))
    inter = std.get("intermediate_size")
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or family, family=family, hidden_size=H, num_layers=L,
        vocab_size=V, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
        intermediate_size=int(inter) if isinstance(inter, int) and inter > 0 else 4 * H,
        max_position_embeddings=_count(std, "max_position_embeddings", 4096),
        tie_word_embeddings=tied, layers=tuple(layers), hf_config=cfg,
        sliding_window=window, sliding_blocks=sliding,
        context_bytes_terms=context_terms[0] if context_terms else (),
        residual_bytes=residual if residual > 2 else 0)
