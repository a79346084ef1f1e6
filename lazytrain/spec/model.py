"""ModelSpec: a causal LM described layer by layer from its Hugging Face config, without weights.

Per layer (embedding, each decoder block, final norm + head): parameter count, forward FLOPs per
token, bytes of every activation the layer saves for backward (per token, for HF's implementation:
fp32-upcast RMSNorm, SDPA attention, SwiGLU MLP), and the boundary activation size.
Pure Python: no torch, no transformers, for the families it has formulas for (FAMILIES); any other
model_type is measured from the model transformers builds (spec/generic.py, which needs both).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe")
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
REQUIRED_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "vocab_size", "intermediate_size")
# Families whose routed experts PEFT's LoRA wraps (3-D weights, by MLP target names; peft 0.21)
PEFT_WRAPS_EXPERTS = ("qwen3_moe", "olmoe")
# The keys each MoE family's transformers config takes its expert count from, the first set one
# winning (its attribute_map: Mixtral's num_experts is an alias of num_local_experts and wins over
# it, Qwen3-MoE's and OLMoE's the other way round; Qwen2-MoE has no alias, num_local_experts is
# ignored), and its default.
EXPERT_COUNT_KEYS = {"mixtral": ("num_experts", "num_local_experts"), "qwen2_moe": ("num_experts",),
                     "qwen3_moe": ("num_local_experts", "num_experts"),
                     "olmoe": ("num_local_experts", "num_experts")}
EXPERT_COUNT_DEFAULT = {"mixtral": 8, "qwen2_moe": 60, "qwen3_moe": 128, "olmoe": 64}
# transformers' defaults for the keys a family's config.json may leave out (its config class's
# field defaults), so the plan is for the model transformers builds from the same file (a review
# found a Qwen3 without head_dim planned at 64 where transformers uses 128: a device peak 17% above
# the plan; Qwen3-30B-A3B without num_experts planned dense). None: derived in the class's
# __post_init__ (kv heads = heads, head_dim = hidden // heads), as the readers below do.
# tests/spec/test_family_defaults.py checks the table against transformers' classes.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(num_key_value_heads=None, head_dim=None, max_position_embeddings=2048),
    "mistral": dict(num_key_value_heads=8, head_dim=None, max_position_embeddings=131072, sliding_window=4096),
    "qwen2": dict(num_key_value_heads=32, max_position_embeddings=32768, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28),
    "qwen3": dict(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28),
    "mixtral": dict(num_key_value_heads=8, head_dim=None, max_position_embeddings=131072, sliding_window=None,
                    num_experts_per_tok=2),
    "qwen2_moe": dict(num_key_value_heads=16, max_position_embeddings=32768, use_sliding_window=False,
                      sliding_window=4096, max_window_layers=28, decoder_sparse_step=1, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, num_experts_per_tok=4),
    "qwen3_moe": dict(num_key_value_heads=4, max_position_embeddings=32768, use_sliding_window=False,
                      sliding_window=4096, decoder_sparse_step=1, moe_intermediate_size=768,
                      num_experts_per_tok=8),
    "olmoe": dict(num_key_value_heads=None, max_position_embeddings=4096, num_experts_per_tok=8),
}


class ModelConfigError(ValueError):
    """A config.json that cannot describe a model we plan for."""


@dataclass(frozen=True)
class Linear:
    """One linear projection inside a block (per expert for expert linears)."""
    name: str            # e.g. "q_proj", "experts.gate_proj"
    in_features: int
    out_features: int
    count: int = 1       # how many copies (experts) the block holds
    active: int = 1      # how many of them a token uses (top-k for experts)
    lora: bool = True    # an nn.Linear PEFT's LoRA can wrap (a measured spec's bare router weight is not)


@dataclass(frozen=True)
class LayerSpec:
    name: str                           # "embed", "block.3", "head"
    kind: str                           # "embed" | "block" | "head"
    index: int                          # position in execution order (0 = embed)
    param_count: int
    active_param_count: int             # params a token touches (MoE: top-k experts)
    matmul_flops_fwd_per_token: int     # 2 * active matmul params
    attn_flops_fwd_per_token_per_seq: int  # causal attention: x seq_len
    saved_bytes_per_token: Mapping[str, int]  # activation name -> bytes/token saved for backward
    linears: tuple[Linear, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_param_count: int = 0         # one expert's parameters
    # saved for backward per token x sequence length (an eager attention's probabilities; measured
    # specs only, spec/generic.py: the families' formulas have none)
    saved_bytes_per_token_per_seq: int = 0
    saved_bytes_per_sequence: int = 0     # (likewise: what it saves whatever the length, per sequence)
    # bytes a block holds beyond what it saves, at the worst moments of its forward and of its
    # backward (its saved activations freed as autograd frees them; or all alive to the end, as
    # when they were brought back from the host): (constant, per token, per token x sequence)
    # terms, the largest of which applies (measured specs only, spec/generic.py; () where not
    # measured: the cost model's formulas)
    fwd_transient_terms: tuple[tuple[int, int, int], ...] = ()
    bwd_transient_terms: tuple[tuple[int, int, int], ...] = ()
    bwd_offloaded_transient_terms: tuple[tuple[int, int, int], ...] = ()
    # a chunked scan's chunk (Mamba-2's 256 tokens): the block pads each sequence to whole chunks,
    # and its measured terms hold for whole chunks (the cost model pads the length; 0: none)
    scan_chunk: int = 0

    def flops_fwd(self, tokens: int, seq_len: int) -> float:
        return tokens * (self.matmul_flops_fwd_per_token
                         + self.attn_flops_fwd_per_token_per_seq * seq_len)

    def flops_bwd(self, tokens: int, seq_len: int, weight_grads: bool = True) -> float:
        """Backward FLOPs: input grads (1x fwd matmul) + weight grads (1x, full FT only); attention 2x."""
        mm = tokens * self.matmul_flops_fwd_per_token * (2 if weight_grads else 1)
        return mm + 2 * tokens * self.attn_flops_fwd_per_token_per_seq * seq_len

    def saved_bytes(self, tokens: int) -> int:
        return tokens * sum(self.saved_bytes_per_token.values())


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    layers: tuple[LayerSpec, ...]
    hf_config: Mapping[str, Any] = field(default_factory=dict, compare=False)
    # sliding-window attention in some layer: past this many tokens the model builds a [batch, 1,
    # seq, seq] mask (and repeats k/v to every head for SDPA), which the cost model counts
    sliding_window: int | None = None
    sliding_blocks: tuple[int, ...] = ()   # the blocks (0-based) that use it
    # what the blocks' shared arguments (masks, rotary tables) take for one sequence of S tokens:
    # (constant, x S, x S^2) bytes (measured specs only, spec/generic.py)
    context_bytes_terms: tuple[int, ...] = ()
    # bytes per element of the residual stream between blocks where the model keeps it in a dtype
    # of its own whatever it computes in (Mamba's and Mamba-2's `residual_in_fp32`: 4, measured);
    # 0: the compute dtype
    residual_bytes: int = 0

    # ---- derived -------------------------------------------------------------------------
    @property
    def param_count(self) -> int:
        return sum(layer.param_count for layer in self.layers)

    @property
    def is_moe(self) -> bool:
        return any(layer.num_experts for layer in self.layers)

    @property
    def blocks(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if layer.kind == "block")

    def boundary_bytes_per_token(self, dtype_bytes: int) -> int:
        """The residual stream between blocks: what a checkpoint keeps per token (in the model's
        own residual dtype where it has one: a bf16 Mamba's boundaries are fp32; counted at 2
        bytes, a deep Mamba's plan recomputing every block measured 1.07-1.16x its device peak)."""
        return self.hidden_size * max(dtype_bytes, self.residual_bytes)

    def lora_linears(self, layer: "LayerSpec") -> tuple[Linear, ...]:
        """The linears of `layer` PEFT's LoRA wraps when a target names them: `nn.Linear` modules,
        not (in the families' specs, transformers 5) the router `gate`, a module of its own; routed
        experts' 3-D weights only in the families whose experts PEFT wraps by MLP name (Qwen3-MoE,
        OLMoE: counted as r x experts x (in + out) per projection, where PEFT's fused gate/up
        adapter holds more; their activations are not modelled either, the executor warns). A
        review found Qwen1.5-MoE's planned adapters 16.8x PEFT's: its experts are not wrapped."""
        experts_wrapped = self.family in PEFT_WRAPS_EXPERTS or self.family not in FAMILIES
        return tuple(lin for lin in layer.linears
                     if lin.lora and (lin.count == 1 or experts_wrapped)
                     and not (self.family in FAMILIES and lin.name == "gate"))

    def lora_target_names(self) -> list[str]:
        """Names (last part, as PEFT matches them) a LoRA target may take: those of `nn.Linear`
        modules (the train recipe refuses any other before PEFT sees it), so routed experts' names
        only where a dense block has such a linear too."""
        return sorted({lin.name.split(".")[-1] for layer in self.layers for lin in self.lora_linears(layer)
                       if lin.count == 1})

    def lora_param_count(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters for LoRA of `rank` on the wrappable linears whose name ends with a
        target the train recipe accepts (`lora_target_names`)."""
        ok = set(targets) & set(self.lora_target_names())
        total = 0
        for layer in self.layers:
            for lin in self.lora_linears(layer):
                if lin.name.split(".")[-1] in ok:
                    total += lin.count * rank * (lin.in_features + lin.out_features)
        return total

    # ---- serialisation -------------------------------------------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        for key in ("context_bytes_terms", "residual_bytes"):   # (absent where unset: hashes as before)
            if not d[key]:
                del d[key]
        for ld in d["layers"]:   # (absent where 0: the families' specs, and their plans' hashes, as before)
            for key in ("saved_bytes_per_token_per_seq", "saved_bytes_per_sequence", "fwd_transient_terms",
                        "bwd_transient_terms", "bwd_offloaded_transient_terms", "scan_chunk"):
                if not ld[key]:
                    del ld[key]
            for lin in ld["linears"]:   # (likewise: absent where True)
                if lin.get("lora", True):
                    lin.pop("lora", None)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelSpec":
        d = json.loads(text)
        layers = []
        for ld in d.pop("layers"):
            ld["linears"] = tuple(Linear(**lin) for lin in ld["linears"])
            for key in ("fwd_transient_terms", "bwd_transient_terms", "bwd_offloaded_transient_terms"):
                if key in ld:
                    ld[key] = tuple(tuple(t) for t in ld[key])
            layers.append(LayerSpec(**ld))
        for key in ("sliding_blocks", "context_bytes_terms"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(layers=tuple(layers), **d)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str | None = None) -> "ModelSpec":
        return _build(dict(config) if isinstance(config, Mapping) else config, name)

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, name: str | None = None) -> "ModelSpec":
        p = Path(path)
        cfg_path = p / "config.json"
        if not cfg_path.is_file():
            raise ModelConfigError(f"{p}: no config.json (model.path must be a local Hugging Face model dir)")
        try:
            cfg = decode_json_floats(json.loads(cfg_path.read_text()))
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{cfg_path}: not valid JSON ({e})") from None
        return _build(cfg, name or p.name)


# ---- construction from an HF config ---------------------------------------------------------

_JSON_FLOATS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def decode_json_floats(obj: Any) -> Any:
    """A config.json's values with transformers' markers for floats JSON cannot hold
    ({"__float__": "Infinity"}, as `save_pretrained` writes Mamba-2's time_step_limit) turned back
    into floats, as `from_pretrained` does; `AutoConfig.for_model(**dict)` would keep the marker
    and refuse it."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in _JSON_FLOATS:
            return _JSON_FLOATS[obj["__float__"]]
        return {k: decode_json_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_json_floats(v) for v in obj]
    return obj


def _get(cfg: dict, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _count(cfg: dict, key: str, default: Any = None, hint: str = "") -> int:
    """cfg[key] (or `default` where the config has none) as a whole number >= 1; a
    ModelConfigError naming the key otherwise (a null, 0, -3 or 64.9 would fail far from here, or
    plan a model that cannot exist)."""
    v = cfg.get(key)
    if v is None:
        v = default
    if key not in cfg and v is None:
        raise ModelConfigError(f"config is missing required key {key}{hint}")
    ok = isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()
    if not ok or v < 1:
        raise ModelConfigError(f"config: {key} must be a whole number >= 1, got {v!r}{hint}")
    return int(v)


def _expert_count(cfg: dict, family: str) -> tuple[str, Any]:
    """(the key, the value) of the family's expert count as transformers reads it (EXPERT_COUNT_KEYS)."""
    keys = EXPERT_COUNT_KEYS[family]
    for k in keys:   # (transformers builds no model from a null count: train failed in a traceback)
        if k in cfg and cfg[k] is None:
            raise ModelConfigError(f"config: {k} is null; give the number of experts or leave the key out")
    key = next((k for k in keys if cfg.get(k) is not None), keys[0])
    return key, cfg.get(key) if cfg.get(key) is not None else EXPERT_COUNT_DEFAULT[family]


def _check_moe(cfg: dict, family: str, num_layers: int) -> None:
    """The expert layout `_moe_layout` reads, checked once with the key named."""
    key, E = _expert_count(cfg, family)
    if family in ("mixtral", "olmoe"):
        E = _count(cfg, key, E)
    else:   # qwen3_moe / qwen2_moe: no experts (0) means every block is dense
        if E == 0:
            return
        E = _count(cfg, key, E)
        sparse = [i for i in range(num_layers) if _moe_layout_sparse(cfg, i)]
        if sparse:
            _count(cfg, "moe_intermediate_size", hint=f" (the experts' width; {family} blocks "
                                                      f"{sparse[:4]}{'...' if len(sparse) > 4 else ''} are sparse)")
    k = _count(cfg, "num_experts_per_tok", 8 if family == "olmoe" else 2)
    if k > E:
        raise ModelConfigError(f"config: num_experts_per_tok={k} exceeds the number of experts ({E})")


def _moe_layout_sparse(cfg: dict, i: int) -> bool:
    """Whether a qwen MoE block i routes to experts (decoder_sparse_step, mlp_only_layers)."""
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return i not in set(cfg.get("mlp_only_layers") or []) and (i + 1) % step == 0


def _build(cfg: dict, name: str | None) -> ModelSpec:
    if not isinstance(cfg, Mapping):
        raise ModelConfigError(f"config is a JSON {type(cfg).__name__}, not an object of Hugging Face "
                               f"config keys")
    # Some configs (multimodal wrappers) nest the LM under text_config.
    if "text_config" in cfg and "hidden_size" not in cfg:
        outer = {k: cfg[k] for k in ("_experts_implementation", "experts_implementation") if k in cfg}
        cfg = {**outer, **cfg["text_config"]}
    if "model_type" not in cfg:
        raise ModelConfigError("config is missing required keys: model_type")
    family = cfg["model_type"]
    attn = cfg.get("attn_implementation", cfg.get("_attn_implementation"))
    if family not in FAMILIES or (attn is not None and not str(attn).startswith(("sdpa", "flash"))):
        # no formulas for it: measured from the model transformers builds (spec/generic.py); so is
        # a family with formulas configured for another attention than SDPA's (eager: its
        # probabilities saved per token x sequence; the formulas planned a Llama so 3.5x under its
        # peak: review)
        from .generic import spec_from_structure

        return spec_from_structure(cfg, name)
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing:
        raise ModelConfigError(f"config is missing required keys: {', '.join(missing)}")
    raw, cfg = cfg, {**FAMILY_DEFAULTS[family], **cfg}   # (keys the file names, None included, are its own)
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
        # a JSON string "false" would read as True; transformers refuses such a config
        if key in cfg and not isinstance(cfg[key], bool) and cfg[key] is not None:
            raise ModelConfigError(f"config: {key} must be true or false, got {cfg[key]!r}")

    H = _count(cfg, "hidden_size")
    L = _count(cfg, "num_hidden_layers")
    V = _count(cfg, "vocab_size")
    nh = _count(cfg, "num_attention_heads")
    nkv = _count(cfg, "num_key_value_heads", nh)
    if nh % nkv:   # grouped-query attention shares each k/v head among a whole number of q heads
        raise ModelConfigError(f"config: num_key_value_heads={nkv} does not divide num_attention_heads={nh}")
    hd = _count(cfg, "head_dim", H // nh, hint="" if cfg.get("head_dim") is not None else
                f" (hidden_size // num_attention_heads = {H} // {nh}; set head_dim)")
    inter = _count(cfg, "intermediate_size")
    tied = bool(cfg.get("tie_word_embeddings", False))
    if family in MOE_FAMILIES:
        _check_moe(cfg, family, L)

    layers: list[LayerSpec] = [LayerSpec(
        name="embed", kind="embed", index=0, param_count=V * H, active_param_count=V * H,
        matmul_flops_fwd_per_token=0, attn_flops_fwd_per_token_per_seq=0,
        saved_bytes_per_token={"input_ids": 8},
    )]
    for i in range(L):
        layers.append(_block(cfg, family, i, H, nh, nkv, hd, inter))
    head_params = H + (0 if tied else V * H)  # final norm (+ lm_head unless tied to the embedding)
    layers.append(LayerSpec(
        name="head", kind="head", index=L + 1, param_count=head_params,
        active_param_count=H + V * H,
        matmul_flops_fwd_per_token=2 * V * H, attn_flops_fwd_per_token_per_seq=0,
        # Saved for backward: final RMSNorm (fp32 upcast input + rstd + bf16 normed), lm_head
        # input, and the loss's fp32 log-softmax output (measured: HF upcasts the logits, but
        # neither the bf16 logits nor their fp32 copy is saved). The logits themselves are
        # transient: the cost model adds them (forward: bf16 + fp32 + log-softmax at once).
        saved_bytes_per_token={"norm_fp32_in": 4 * H, "norm_out": 2 * H, "lm_head_in": 2 * H,
                               "log_softmax": 4 * V},
        linears=(Linear("lm_head", H, V),),
    ))
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or family, family=family, hidden_size=H,
        num_layers=L, vocab_size=V, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
        intermediate_size=inter,
        max_position_embeddings=_count(cfg, "max_position_embeddings"),
        tie_word_embeddings=tied, layers=tuple(layers), hf_config=raw,
        sliding_window=(sw := _sliding_window(cfg, family, L))[0], sliding_blocks=sw[1],
    )


def _sliding_window(cfg: dict, family: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(the attention window, the blocks that use it) when at least one layer uses sliding-window
    attention, as each family's transformers code reads the config (defaults filled in from
    FAMILY_DEFAULTS), else (None, ()). Mistral and Mixtral: every layer, when sliding_window is set
    (layer_types ignored). Qwen: only with use_sliding_window; Qwen2/Qwen3 the layers from
    max_window_layers on (or layer_types'), Qwen2-MoE the even ones below max_window_layers (or
    layer_types'), Qwen3-MoE every layer. Llama and OLMoE have none (a sliding_window key is unused)."""
    w = cfg.get("sliding_window")
    if not w or family in ("llama", "olmoe"):
        return None, ()
    if family in ("mistral", "mixtral"):
        return int(w), tuple(range(num_layers))
    if not cfg.get("use_sliding_window", False):
        return None, ()
    types = cfg.get("layer_types") if family != "qwen3_moe" else None
    if types is None:
        mwl = int(cfg.get("max_window_layers", num_layers))
        if family == "qwen3_moe":
            types = ["sliding_attention"] * num_layers
        elif family == "qwen2_moe":
            types = ["sliding_attention" if (i + 1) % 2 and i < mwl else "full_attention" for i in range(num_layers)]
        else:
            types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(num_layers)]
    blocks = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (int(w), blocks) if blocks else (None, ())


def _moe_layout(cfg: dict, family: str, i: int) -> tuple[int, int, int, int]:
    """(num_experts, top_k, expert_intermediate, shared_intermediate) for block i; zeros if dense."""
    if family == "mixtral":
        return int(_expert_count(cfg, family)[1]), \
            int(_get(cfg, "num_experts_per_tok", default=2)), int(cfg["intermediate_size"]), 0
    if family in ("qwen3_moe", "qwen2_moe"):
        E = int(_expert_count(cfg, family)[1])
        if E == 0 or not _moe_layout_sparse(cfg, i):
            return 0, 0, 0, 0
        shared = int(cfg.get("shared_expert_intermediate_size", 0) or 0) if family == "qwen2_moe" else 0
        return E, int(_get(cfg, "num_experts_per_tok", default=2)), int(cfg["moe_intermediate_size"]), shared
    if family == "olmoe":
        return int(_expert_count(cfg, family)[1]), \
            int(_get(cfg, "num_experts_per_tok", default=8)), int(cfg["intermediate_size"]), 0
    return 0, 0, 0, 0


EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")


def experts_implementation(cfg: Mapping[str, Any]) -> str:
    """The HF experts implementation an MoE config runs with: a "_experts_implementation" (or
    "experts_implementation") key when the caller put one in the config dict, else HF's default,
    "grouped_mm" (which falls back to an equivalent autograd function where torch lacks it).
    Raises ModelConfigError for one whose saved bytes the memory model does not know."""
    impl = _get(dict(cfg), "_experts_implementation", "experts_implementation", default="grouped_mm")
    if impl not in EXPERTS_IMPLEMENTATIONS:
        raise ModelConfigError(
            f"experts implementation {impl!r}: the planner's memory model knows "
            f"{', '.join(EXPERTS_IMPLEMENTATIONS)} (what each saves for backward per routed token); "
            f"plan with one of them")
    return str(impl)


def _block(cfg: dict, family: str, i: int, H: int, nh: int, nkv: int, hd: int, inter: int) -> LayerSpec:
    q_out, kv_out = nh * hd, nkv * hd
    if family in ("qwen2", "qwen2_moe"):
        qkv_bias, o_bias = True, False
    else:
        b = bool(cfg.get("attention_bias", False))
        qkv_bias, o_bias = b, b
    linears = [Linear("q_proj", H, q_out), Linear("k_proj", H, kv_out),
               Linear("v_proj", H, kv_out), Linear("o_proj", q_out, H)]
    params = H * q_out + 2 * H * kv_out + q_out * H
    params += (q_out + 2 * kv_out) * qkv_bias + H * o_bias
    params += 2 * H  # input_layernorm + post_attention_layernorm
    if family in ("qwen3", "qwen3_moe"):
        params += 2 * hd  # per-head q_norm, k_norm
    elif family == "olmoe":
        params += q_out + kv_out  # q_norm, k_norm over the whole projection
    attn_params = params

    E, k, moe_inter, shared_inter = _moe_layout(cfg, family, i)
    mlp_bias = bool(cfg.get("mlp_bias", False)) if family == "llama" else False
    expert_params = 0
    if E:
        expert_params = 3 * H * moe_inter
        router = H * E
        params += router + E * expert_params
        active_mlp = router + k * expert_params
        linears += [Linear("gate", H, E),
                    Linear("experts.gate_proj", H, moe_inter, E, k),
                    Linear("experts.up_proj", H, moe_inter, E, k),
                    Linear("experts.down_proj", moe_inter, H, E, k)]
        if shared_inter:
            shared = 3 * H * shared_inter + H  # shared expert + its sigmoid gate
            params += shared
            active_mlp += shared
            linears += [Linear("shared_expert.gate_proj", H, shared_inter),
                        Linear("shared_expert.up_proj", H, shared_inter),
                        Linear("shared_expert.down_proj", shared_inter, H),
                        Linear("shared_expert_gate", H, 1)]
        # Per routed (token, expert) pair with HF's default experts implementation (grouped_mm;
        # measured with saved-tensor hooks): the gathered input, gate/up output,
        # silu output, their product (down_proj's input) and the expert's output (kept by the
        # multiply with its routing weight), bf16, plus three int64 index vectors; per token the
        # router's fp32 softmax and the top-k's indices, values and their sum. A shared expert:
        # a dense MLP plus its output, kept by the multiply with its sigmoid gate.
        mlp_act_per_token = (k * (4 * moe_inter + 2 * H) * 2 + 4 * E + 36 * k + 4
                             + ((8 * shared_inter + 2 * H + 4) if shared_inter else 0))
        # HF's experts implementation (`from_pretrained(..., experts_implementation=...)`; not in
        # config.json: lazytrain builds models with the default, grouped_mm): the eager loop's
        # index_add_ also keeps its source (the weighted expert output, per pair); batched_mm's
        # bmm keeps every pair's gathered expert weights (gate_up and down).
        impl = experts_implementation(cfg)
        if impl == "eager":
            mlp_act_per_token += k * 2 * H
        elif impl == "batched_mm":
            mlp_act_per_token += k * 3 * H * moe_inter * 2
    else:
        mlp = 3 * H * inter + (2 * inter + H) * mlp_bias
        params += mlp
        active_mlp = mlp
        linears += [Linear("gate_proj", H, inter), Linear("up_proj", H, inter),
                    Linear("down_proj", inter, H)]
        mlp_act_per_token = 4 * inter * 2  # gate out, up out, silu(gate), silu*up (bf16)

    active = attn_params + active_mlp
    saved = {
        # two RMSNorms, each: fp32 upcast input + normalised bf16 (weight multiply) + output
        "norms": 2 * (4 * H + 2 * H + 2 * H),
        # Qwen3's per-head / OLMoE's whole-projection q_norm and k_norm: fp32 upcast input + bf16
        # normalised values (the weight multiply's) + the fp32 rstd per head / per token
        **({"qk_norm": 6 * (q_out + kv_out) + 4 * (nh + nkv)} if family in ("qwen3", "qwen3_moe") else
           {"qk_norm": 6 * (q_out + kv_out) + 8} if family == "olmoe" else {}),
        # SDPA keeps q, k, v (after RoPE), output and logsumexp; o_proj keeps its contiguous input
        "attention": 2 * (q_out + 2 * kv_out + q_out) + 4 * nh + 2 * q_out,
        "mlp": mlp_act_per_token,
    }
    return LayerSpec(
        name=f"block.{i}", kind="block", index=i + 1, param_count=params,
        active_param_count=active, matmul_flops_fwd_per_token=2 * (active - 2 * H),
        attn_flops_fwd_per_token_per_seq=2 * nh * hd,  # QK^T and AV, causal half: 2*2*S*nh*hd/2
        saved_bytes_per_token=saved, linears=tuple(linears),
        num_experts=E, experts_per_token=k, expert_param_count=expert_params,
    )
