"""Convert a Hugging Face MoE checkpoint (or an in-memory model) into an expert store.

Two on-disk layouts are read, shard by shard and expert by expert (never all experts in RAM):
- per-expert keys, what `save_pretrained` writes in transformers 5 for compatibility:
  `...block_sparse_moe.experts.3.w1.weight` (Mixtral) or `...mlp.experts.3.gate_proj.weight` (Qwen, OLMoE);
- fused keys, the in-memory layout: `...mlp.experts.gate_up_proj [E, 2I, H]`, `...down_proj [E, H, I]`.
Key renames (e.g. Mixtral's block_sparse_moe -> mlp) come from transformers' own conversion mapping.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from torch import nn

from .arch import MoeLayer, build_meta_model, config_dtype, find_moe_layers
from ..spec.model import decode_json_floats
from .store import COPIED_FILES, ExpertStore, StoreError, StoreMismatchError, StoreWriter

# Per-expert projection names -> role; gate and up are concatenated [gate; up] like transformers does.
_GATE, _UP, _DOWN = ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")


def _expert_param_set(layers: list[MoeLayer]) -> set[str]:
    return {f"{ml.experts_name}.{t.name}" for ml in layers for t in ml.tensors}


def convert_model(model: nn.Module, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    """Write the store of an in-memory model (fused expert parameters)."""
    hf_config = model.config.to_dict()
    refuse_quantized(hf_config, "the model")   # (a quantized model's config carries its quantization_config)
    _check_rebuilt_buffers(model)
    layers = find_moe_layers(model)
    writer = StoreWriter(out_dir, hf_config)
    for ml in layers:
        params = {t.name: getattr(ml.experts, t.name) for t in ml.tensors}
        writer.write_layer(ml, lambda e, p=params: {k: v[e] for k, v in p.items()})
    skip = _expert_param_set(layers)
    if getattr(model.config, "tie_word_embeddings", False):
        # A tied lm_head is the embedding itself: safetensors refuses shared tensors, and
        # load_streamed ties it again (as convert_checkpoint, whose checkpoints omit it).
        skip.add("lm_head.weight")
    writer.write_non_expert({k: v for k, v in model.state_dict().items() if k not in skip})
    _copy_tokenizer(tokenizer_dir, writer.dir)
    if getattr(model, "generation_config", None) is not None:
        # This model's own (eos ids, repetition penalty, ...): what its generate() uses.
        model.generation_config.save_pretrained(writer.dir)
    return writer.close()


def _check_rebuilt_buffers(model: nn.Module) -> None:
    """StoreError when a non-persistent buffer (rotary inv_freq) differs from the one its module
    builds from the config: no store holds such buffers, the streamed model rebuilds them, and its
    outputs would differ from this model's. `model.to(torch.bfloat16)` does that: it rounds
    inv_freq to bf16, which transformers keeps fp32 (a review measured logits 0.015 apart)."""
    for name, m in model.named_modules():
        names = set(getattr(m, "_non_persistent_buffers_set", ()))
        # Dynamic and long RoPE rewrite `inv_freq` in a forward past the trained length (transformers'
        # dynamic_rope_update): it depends on the sequences the model has run, not on its weights.
        # Their `original_inv_freq` is what the module builds from the config, and is compared instead.
        rope = getattr(m, "rope_type", None)
        if any("dynamic" in r or r == "longrope" for r in (rope.values() if isinstance(rope, dict) else [rope])
               if isinstance(r, str)):
            names = {b for b in names if not (b.endswith("inv_freq") and not b.endswith("original_inv_freq")
                                              and b.removesuffix("inv_freq") + "original_inv_freq" in names)}
        bufs = [(b, t) for b in sorted(names)
                if isinstance(t := getattr(m, b, None), torch.Tensor) and t.is_floating_point() and not t.is_meta]
        if not bufs or not hasattr(m, "config"):
            continue
        try:
            fresh = type(m)(config=m.config)
        except Exception:   # noqa: BLE001 - a module not built from its config alone: nothing to compare
            continue
        for b, t in bufs:
            f = getattr(fresh, b, None)
            if isinstance(f, torch.Tensor) and (f.dtype != t.dtype or not torch.equal(f, t.detach().cpu())):
                raise StoreError(
                    f"{name}.{b} is {str(t.dtype).removeprefix('torch.')} where its module builds it "
                    f"{str(f.dtype).removeprefix('torch.')}{' with other values' if f.dtype == t.dtype else ''} "
                    f"(model.to(dtype) casts buffers too): the streamed model rebuilds it, so its outputs "
                    f"would differ from this model's; convert a model loaded with "
                    f"from_pretrained(..., dtype=...) or the checkpoint dir (convert_checkpoint)")


def _copy_tokenizer(src: str | Path | None, dst: Path) -> None:
    if src is None:
        return
    for name in COPIED_FILES:
        p = Path(src) / name
        if p.is_file():
            shutil.copy2(p, dst / name)


def _shards(hf_dir: Path) -> list[Path]:
    idx = hf_dir / "model.safetensors.index.json"
    if idx.is_file():
        files = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
        return [hf_dir / f for f in files]
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise StoreError(f"{hf_dir}: no *.safetensors files (only safetensors checkpoints are read)")
    return files


def _renamer(model: nn.Module):
    """transformers' own key renames for this model type (not its expert merges: we do those)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        renames = [t for t in get_model_conversion_mapping(model) if type(t) is WeightRenaming]
        return lambda k: rename_source_key(k, renames, [])[0]
    except Exception:  # an older/newer transformers without this API: names are used as they are
        return lambda k: k


def _locate(src: Path, meta: nn.Module, layers: list[MoeLayer]) -> tuple[dict, dict, dict]:
    """Where each tensor the store holds lives in the checkpoint, under in-memory names:
    non-expert name -> (file, key); fused (experts_name, param) and per-expert
    (experts_name, expert, projection) -> (file, key)."""

    rename = _renamer(meta)
    sd = meta.state_dict()
    expected = set(sd.keys())
    prefixes = {ml.experts_name: ml for ml in layers}
    per_expert = re.compile(r"^(.*)\.(\d+)\.(\w+)\.weight$")
    non_expert: dict[str, tuple[Path, str]] = {}
    fused: dict[tuple[str, str], tuple[Path, str]] = {}
    split: dict[tuple[str, int, str], tuple[Path, str]] = {}
    for shard in _shards(src):
        with _safe_open(shard) as f:
            for key in f.keys():
                name = rename(key)
                if name not in expected and key in expected:
                    # as transformers' loader: a rename that makes a model key into a non-key is
                    # undone (DeepSeek-V4's `.norm.` -> `.kv_norm.` caught the final model.norm)
                    name = key
                owner, _, leaf = name.rpartition(".")
                m = per_expert.match(name)
                if owner in prefixes:
                    fused[(owner, leaf)] = (shard, key)
                elif m and m.group(1) in prefixes:
                    split[(m.group(1), int(m.group(2)), m.group(3))] = (shard, key)
                elif name in expected:
                    non_expert[name] = (shard, key)
                    if not sd[name].is_floating_point():   # (an integer buffer is what it is)
                        continue
                else:
                    continue
                _refuse_unfloat(f, key, shard)
    return non_expert, fused, split


def _refuse_unfloat(f, key: str, shard: Path) -> None:
    """StoreError for a weight stored in other than F64/F32/F16/BF16 (FP8 or integer codes: a
    quantized checkpoint, whose values mean nothing without their scales)."""
    dt = f.get_slice(key).get_dtype()
    if dt not in _SAFETENSORS_DTYPES:
        raise StoreError(f"{shard}: {key} is stored as {dt}, not as floating-point weights (a quantized "
                         "checkpoint?); convert a bf16/fp16/fp32 copy of the model instead")


def refuse_quantized(hf_config: dict, where: str) -> None:
    """StoreError for a quantized checkpoint (config.json `quantization_config`: FP8 blocks with
    `weight_scale_inv`, GPTQ/AWQ packed integers, bitsandbytes ...): its stored tensors are not the
    weights, and the store keeps weights as they are (until 2026-12-02 an FP8 Qwen3-MoE converted
    without a word: the scales dropped, the raw FP8 values cast to bf16, and generate served
    nonsense; a review)."""
    q = hf_config.get("quantization_config")
    if q:
        how = q.get("quant_method", "?") if isinstance(q, dict) else "?"
        raise StoreError(
            f"{where} is a quantized checkpoint (quantization_config: quant_method={how}); expert "
            "stores hold unquantized weights: convert a bf16/fp16/fp32 copy of the model instead (on a "
            "machine without a GPU, transformers' from_pretrained dequantizes an fp8 one to bf16 and "
            "save_pretrained writes that copy)")


def read_hf_config(src: Path) -> dict:
    """A model dir's config.json as a dict, with transformers' float markers decoded."""
    if not (src / "config.json").is_file():
        raise StoreError(f"model.path {src} has no config.json (is it a Hugging Face model directory?)")
    return decode_json_floats(json.loads((src / "config.json").read_text()))


def convert_checkpoint(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert a local HF checkpoint directory (config.json + safetensors) into a store."""
    src = Path(hf_dir).expanduser()
    hf_config = read_hf_config(src)
    refuse_quantized(hf_config, f"model.path {src}")
    if Path(out_dir).expanduser().resolve() == src.resolve():
        raise StoreError(f"out={out_dir} is model.path itself; convert into a directory of its own")
    meta = build_meta_model(hf_config)
    layers = find_moe_layers(meta)
    expected = set(meta.state_dict().keys())
    non_expert, fused, split = _locate(src, meta, layers)

    # The experts are stored in the dtype from_pretrained loads the model in (the config's; without
    # one, the checkpoint's first floating tensor's): an fp32 checkpoint whose config says bf16 runs
    # in bf16 there, and did in fp32 here before 2026-12-01 (a review).
    dtype = config_dtype(hf_config) or _first_float_dtype(src)
    if dtype is not None and dtype != next(iter(layers[0].experts.parameters())).dtype:
        meta = meta.to(dtype)              # meta tensors: a change of label, no memory
        layers = find_moe_layers(meta)
    skip = _expert_param_set(layers)
    missing = sorted(k for k in expected - skip - set(non_expert)
                     if not (k == "lm_head.weight" and hf_config.get("tie_word_embeddings")))
    if missing:
        raise StoreError(f"{src}: checkpoint lacks {len(missing)} weights the model needs, "
                         f"e.g. {', '.join(missing[:3])}")
    files = _OpenShards()   # each shard's header is parsed once, not once per tensor
    try:
        # every expert's weights found, in their shapes, before anything is written (a missing or
        # misshapen one, found at its layer, left the layers before it behind in `out`)
        for ml in layers:
            for t in ml.tensors:
                _check_expert_shapes(ml, t, fused, split, src, files)
        writer = StoreWriter(out_dir, hf_config)
        for ml in layers:
            writer.write_layer(ml, _expert_reader(ml, fused, split, files))
        tensors = {name: files[shard].get_tensor(key) for name, (shard, key) in non_expert.items()}
    finally:
        files.clear()       # unmap the source shards
    writer.write_non_expert(tensors)
    _copy_tokenizer(src, writer.dir)
    return writer.close()


def _first_float_dtype(src: Path) -> torch.dtype | None:
    """transformers' dtype="auto" without a config dtype: the first floating tensor of the first
    checkpoint file, in its key order (get_state_dict_dtype)."""
    with _safe_open(_shards(src)[0]) as f:
        for key in f.keys():
            dt = _SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())
            if dt is not None and dt.is_floating_point:
                return dt
    return None


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _check_expert_shapes(ml: MoeLayer, t, fused: dict, split: dict, src: Path, files: "_OpenShards") -> None:
    """StoreError unless every expert's tensor t is in the checkpoint with the model's shape: one
    fused [experts, ...] tensor, or per-expert parts that concatenate to it."""
    if (ml.experts_name, t.name) in fused:
        shard, key = fused[(ml.experts_name, t.name)]
        got = tuple(files[shard].get_slice(key).get_shape())
        if got != (ml.num_experts, *t.shape):
            raise StoreError(f"{src}: {ml.experts_name} {t.name}: {key} is {list(got)}, the model's is "
                             f"{[ml.num_experts, *t.shape]}")
        return
    for e in range(ml.num_experts):
        hits = _split_parts(ml, e, t.name, split)
        if hits is None:
            raise StoreError(f"{src}: no weights for {ml.experts_name} expert {e} {t.name} "
                             "(neither fused nor per-expert keys found)")
        shapes = [tuple(files[shard].get_slice(key).get_shape()) for shard, key in hits]
        rows = sum(sh[0] for sh in shapes if sh)
        if any(len(sh) != len(t.shape) or sh[1:] != t.shape[1:] for sh in shapes) or rows != t.shape[0]:
            raise StoreError(f"{src}: {ml.experts_name} expert {e} {t.name}: {', '.join(k for _, k in hits)} "
                             f"are {[list(sh) for sh in shapes]}, which do not make the model's {list(t.shape)}")


def _safe_open(shard: Path):
    """safe_open, with a damaged file a StoreError naming it (a traceback from `moe convert` before)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(shard), "pt")
    except SafetensorError as e:
        raise StoreError(f"{shard}: not a readable safetensors file ({str(e).splitlines()[0]}); "
                         "download or save it again") from None


class _OpenShards(dict):
    """Path -> open safetensors handle, opened on first use and kept for the conversion."""

    def __missing__(self, shard: Path):
        f = self[shard] = _safe_open(shard)
        return f


def _expert_reader(ml: MoeLayer, fused: dict, split: dict, files: _OpenShards):
    def read(e: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for t in ml.tensors:
            if (ml.experts_name, t.name) in fused:
                shard, key = fused[(ml.experts_name, t.name)]
                out[t.name] = files[shard].get_slice(key)[e]   # reads only expert e's rows
            else:   # (found before anything was written: _check_expert_shapes)
                parts = [files[shard].get_tensor(key) for shard, key in _split_parts(ml, e, t.name, split)]
                out[t.name] = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
            # in the model's dtype, as from_pretrained casts them (one stored in another was
            # refused mid-write before 2026-12-01, after the old store was gone: a review)
            out[t.name] = out[t.name].to(getattr(torch, t.dtype))
        return out

    return read


def _split_parts(ml: MoeLayer, e: int, name: str, split: dict) -> list[tuple[Path, str]] | None:
    """The per-expert keys that make expert e's `name`, in concatenation order; None if any lacks."""
    roles = {"gate_up_proj": (_GATE, _UP), "down_proj": (_DOWN,), "up_proj": (_UP,)}.get(name)
    parts = []
    for role in roles or ():
        hit = next((split[(ml.experts_name, e, n)] for n in role if (ml.experts_name, e, n) in split), None)
        if hit is None:
            return None
        parts.append(hit)
    return parts or None


# ---- does a store hold the weights of a checkpoint? -------------------------------------------------
def _has_weights(hf_dir: Path) -> bool:
    return (hf_dir / "model.safetensors.index.json").is_file() or any(hf_dir.glob("*.safetensors"))


SAMPLE_EDGE_ROWS = 64    # rows compared at each end of a non-expert tensor (special tokens' rows sit there)
SAMPLE_SPREAD_ROWS = 16  # and rows spread evenly between


def _ends(f, key: str, vocab: int = 0) -> list[torch.Tensor]:
    """Rows of tensor `key` of an open safetensors file compared against the store: its first and
    last rows (0-d/1-d: all of it); a tensor with `vocab` rows (an embedding, a head) also its
    first and last SAMPLE_EDGE_ROWS and SAMPLE_SPREAD_ROWS spread between, or all of it when that
    is no less. (The first and last row alone passed a model.path whose embedding and head rows
    40..89 were trained after conversion, new tokens' rows, and the store's old weights were
    served: review.)"""
    sl = f.get_slice(key)
    shape = sl.get_shape()
    if len(shape) < 2:
        return [f.get_tensor(key)]
    if shape[0] != vocab:
        return [sl[:1], sl[-1:]]
    if shape[0] <= 2 * SAMPLE_EDGE_ROWS + SAMPLE_SPREAD_ROWS:
        return [f.get_tensor(key)]
    rows = shape[0]
    step = (rows - 2 * SAMPLE_EDGE_ROWS) // (SAMPLE_SPREAD_ROWS + 1)
    mids = [SAMPLE_EDGE_ROWS + step * (k + 1) for k in range(SAMPLE_SPREAD_ROWS)]
    return [sl[:SAMPLE_EDGE_ROWS], sl[rows - SAMPLE_EDGE_ROWS:], *(sl[r:r + 1] for r in mids)]


def _differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> str | None:
    """How two samples differ (dtype, shape or bytes), or None."""
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return "differs"
        if x.dtype != y.dtype:
            # a store made from the same weights in another dtype (convert_model of a bf16 copy):
            # the same values once rounded to the store's dtype
            if not (x.is_floating_point() and torch.equal(_raw(x.to(y.dtype)), _raw(y))):
                ours, theirs = (str(t.dtype).removeprefix("torch.") for t in (x, y))
                return f"differs ({ours} in model.path, {theirs} in the store)"
        elif not torch.equal(_raw(x), _raw(y)):
            return "differs"
    return None if len(a) == len(b) else "differs"


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _store_expert_ends(store: ExpertStore, layer: int, e: int) -> dict[str, list[torch.Tensor]]:
    """First and last rows of each tensor of expert e's record, read at their offsets (a few KB,
    not the whole record: one expert of a large model is hundreds of MB)."""
    lr = store.layers[layer]
    out = {}
    with open(store.dir / lr.file, "rb") as f:
        for spec, off in zip(lr.tensors, lr.offsets):
            matrix = len(spec.shape) >= 2
            n = spec.shape[0] if matrix else 1          # a 1-d bias: read whole, as one row
            shape = (1, *spec.shape[1:]) if matrix else spec.shape
            out[spec.name] = []
            for r in (0, n - 1) if matrix else (0,):
                f.seek(e * lr.record_bytes + off + r * (spec.nbytes // n))
                raw = bytearray(f.read(spec.nbytes // n))
                out[spec.name].append(torch.frombuffer(raw, dtype=getattr(torch, spec.dtype)).view(shape))
    return out


def _checkpoint_expert_ends(ml: MoeLayer, e: int, name: str, fused: dict, split: dict,
                            files: _OpenShards) -> list[torch.Tensor] | None:
    """The same rows of expert e's `name` in the checkpoint (fused or per-expert keys)."""
    if (ml.experts_name, name) in fused:
        shard, key = fused[(ml.experts_name, name)]
        sl = files[shard].get_slice(key)
        return [sl[e:e + 1, :1][0], sl[e:e + 1, -1:][0]] if len(sl.get_shape()) > 2 else [sl[e:e + 1][0]]
    hits = _split_parts(ml, e, name, split)
    if hits is None:
        return None
    (s0, k0), (s1, k1) = hits[0], hits[-1]
    return [files[s0].get_slice(k0)[:1], files[s1].get_slice(k1)[-1:]]


def _first_difference(src: Path, store: ExpertStore, meta: nn.Module) -> str | None:
    from safetensors import safe_open

    layers = find_moe_layers(meta)
    tied = getattr(meta.config, "tie_word_embeddings", False)
    text = meta.config.get_text_config() if hasattr(meta.config, "get_text_config") else meta.config
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    non_expert, fused, split = _locate(src, meta, layers)
    files = _OpenShards()
    try:
        with safe_open(str(store.non_expert_path), "pt") as st:
            stored = set(st.keys())
            for name, (shard, key) in non_expert.items():
                if name not in stored or (tied and name == "lm_head.weight"):
                    continue        # lacking in the store: load_streamed says so
                why = _differ(_ends(files[shard], key, vocab), _ends(st, name, vocab))
                if why:
                    return f"{name} {why}"
        # every expert of every MoE layer (an expert-only fine-tune changes no other tensor; a
        # review's changed experts 1..7 passed when only expert 0 of two layers was compared)
        for i in range(len(layers)):
            for e in range(store.layers[i].num_experts):
                theirs = _store_expert_ends(store, i, e)
                for t in store.layers[i].tensors:
                    ours = _checkpoint_expert_ends(layers[i], e, t.name, fused, split, files)
                    why = _differ(ours, theirs[t.name]) if ours is not None else None
                    if why:
                        return f"{layers[i].experts_name}.{t.name} expert {e} {why}"
        return None
    finally:
        files.clear()


def check_store_source(hf_dir: str | Path, store: ExpertStore, meta: nn.Module) -> None:
    """Refuse a store converted from other weights than the checkpoint at `hf_dir`: model.path only
    supplies config, tokenizer and generation config, the weights served are the store's, so
    another checkpoint of the same architecture would silently answer with the store's model.
    Compares the first and last rows of every non-expert tensor and of every expert of every MoE
    layer (a few KB each: ~30 MB for Mixtral-8x7B), and 144 rows of the vocabulary-sized ones
    (`_ends`); a dir without safetensors files (config only) is not checked. Rows compared by
    none of these samples are not checked: re-convert after changing weights."""
    from safetensors import SafetensorError

    src = Path(hf_dir).expanduser()
    if not _has_weights(src):
        return
    try:
        diff = _first_difference(src, store, meta)
    except (SafetensorError, OSError) as e:
        raise StoreError(f"model.path {src}: cannot read its weights to check expert store {store.dir} "
                         f"against them ({e})") from None
    if diff:
        raise StoreMismatchError(
            f"expert store {store.dir} was converted from other weights than model.path {src} ({diff}); "
            f"reconvert: `lazytrain moe convert model.path={src} out={store.dir}`")
