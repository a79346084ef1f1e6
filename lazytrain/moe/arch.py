"""Find the MoE layers of a Hugging Face causal LM from its module structure.

transformers 5 decorates every experts class with `@use_experts_implementation` (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, ...): the experts of one layer are one module holding fused 3-D parameters
`[num_experts, ...]` (`gate_up_proj`, `down_proj`, or `up_proj` without a gate) and the router is a
sibling module with `weight [num_experts, hidden]` and `top_k`. We find both by that structure, never
by a list of class names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ..spec.model import decode_json_floats


class NotMoeModelError(ValueError):
    """The model has no experts layers that lazytrain can stream."""


@dataclass(frozen=True)
class ExpertTensorSpec:
    """One tensor of one expert, as it sits in the fused parameter (per-expert slice)."""

    name: str                 # parameter name on the experts module: gate_up_proj | down_proj | up_proj | *_bias
    shape: tuple[int, ...]    # per-expert shape, e.g. (2*I, H)
    dtype: str                # torch dtype name without "torch.", e.g. "float32"

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass
class MoeLayer:
    """One MoE layer of a live model (modules, not a decision: mutable references)."""

    index: int                # position among MoE layers (0..n_moe-1)
    block_index: int          # decoder layer index in the model
    experts_name: str         # module path of the experts module, e.g. model.layers.3.mlp.experts
    experts: nn.Module
    router: nn.Module
    num_experts: int
    top_k: int
    tensors: tuple[ExpertTensorSpec, ...]


def _is_experts_module(m: nn.Module) -> bool:
    # The decorator sets these attributes in __init__; forward is wrapped (functools.wraps).
    return (hasattr(m, "has_gate") and hasattr(m, "is_transposed") and hasattr(m, "num_experts")
            and hasattr(type(m).forward, "__wrapped__"))


def _find_router(parent: nn.Module, num_experts: int) -> nn.Module | None:
    for _, child in parent.named_children():
        w = getattr(child, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == num_experts \
                and hasattr(child, "top_k"):
            return child
    return None


def expert_param_names(experts: nn.Module) -> list[str]:
    """The fused per-expert parameters of an experts module (3-D, or 2-D biases), in a fixed order."""
    n = experts.num_experts
    names = [name for name, p in experts.named_parameters(recurse=False)
             if p.dim() >= 2 and p.shape[0] == n]
    order = {"gate_up_proj": 0, "up_proj": 1, "down_proj": 2}
    return sorted(names, key=lambda s: (order.get(s.replace("_bias", ""), 9), s.endswith("_bias"), s))


def find_moe_layers(model: nn.Module) -> list[MoeLayer]:
    """All experts layers in module order; raises NotMoeModelError when there are none."""
    modules = dict(model.named_modules())
    layers: list[MoeLayer] = []
    for name, m in modules.items():
        if not _is_experts_module(m):
            continue
        parent = modules[name.rsplit(".", 1)[0]] if "." in name else model
        router = _find_router(parent, m.num_experts)
        if router is None:
            raise NotMoeModelError(f"{name}: experts module without a router sibling "
                                   "(weight [num_experts, hidden] and top_k); not supported")
        found = re.search(r"layers\.(\d+)\.", name)
        tensors = tuple(
            ExpertTensorSpec(pn, tuple(getattr(m, pn).shape[1:]), str(getattr(m, pn).dtype).split(".")[-1])
            for pn in expert_param_names(m))
        layers.append(MoeLayer(len(layers), int(found.group(1)) if found else len(layers), name, m,
                               router, int(m.num_experts), int(router.top_k), tensors))
    if not layers:
        cls = type(model).__name__
        other = next((n for n in modules if n.rsplit(".", 1)[-1] in ("experts", "expert", "moe", "experts_mlp")), None)
        if other is not None:   # (JetMoE, LongCat-Flash: experts of their own making)
            raise NotMoeModelError(f"{cls} has no MoE experts layers lazytrain can stream: {other} "
                                   f"({type(modules[other]).__name__}) is not transformers' fused experts layout "
                                   f"(the experts-implementation interface Mixtral, Qwen-MoE, OLMoE and "
                                   f"DeepSeek use); not supported")
        raise NotMoeModelError(f"{cls} has no MoE experts layers (nothing to stream); "
                               "use a Mixtral/Qwen2-MoE/Qwen3-MoE/OLMoE-style model")
    return layers


def build_meta_model(hf_config: dict | object, dtype: torch.dtype | None = None) -> nn.Module:
    """The causal LM for `hf_config` with every parameter on the meta device (no memory), built in
    the config's dtype, or in `dtype` as `from_pretrained(..., dtype=dtype)` builds it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = hf_config
    if isinstance(hf_config, dict):
        check_config_dtype(hf_config)
        d = decode_json_floats(dict(hf_config))
        cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, **({} if dtype is None else {"dtype": dtype}))
    return model.eval()


# the dtypes the experts' kernels run (grouped_mm has no float64, and nothing here runs fp8 weights
# without a quantization_config saying how)
SERVED_DTYPES = ("float32", "bfloat16", "float16")


def check_config_dtype(hf_config: dict) -> None:
    """ValueError (one line) where config.json names a dtype the engine cannot serve: `dtype: bogus`
    and float8 were tracebacks from transformers; float64 converted, then failed mid-prefill (review)."""
    for key in ("dtype", "torch_dtype"):
        name = hf_config.get(key)
        if name is None or name == "auto":
            continue
        short = str(name).removeprefix("torch.")
        if short not in SERVED_DTYPES:
            known = isinstance(getattr(torch, short, None), torch.dtype)
            raise ValueError(f"config.json's {key} is {name!r}: {'' if known else 'not a torch dtype; '}the MoE "
                             f"engine serves weights in {', '.join(SERVED_DTYPES)}; convert the checkpoint to "
                             f"one of them (or fix the key)")


def config_dtype(hf_config: dict) -> torch.dtype | None:
    """The dtype config.json names (`dtype`, or the older `torch_dtype`), which `from_pretrained`
    loads the weights in by default (dtype="auto"); None when it names none."""
    for key in ("dtype", "torch_dtype"):
        name = hf_config.get(key)
        if isinstance(name, str) and isinstance(getattr(torch, name.removeprefix("torch."), None), torch.dtype):
            return getattr(torch, name.removeprefix("torch."))
    return None


def load_dtypes(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype `from_pretrained(..., dtype=dtype)` gives each floating state-dict entry, whatever
    the checkpoint stores, for a `model` built in `dtype` (build_meta_model): `dtype`, except what
    the model's code makes in another dtype and its `_keep_in_fp32_modules(_strict)` (fp32 under
    fp16; the strict ones under bf16 too)."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    pats = [(re.compile(str(glob).replace("*", ".*")), d) for glob, d in plan.items()]
    out = {}
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            out[k] = next((d for pat, d in pats if pat.search(k)), v.dtype)
    return out
