"""A config.json that leaves out optional keys is planned as the model transformers builds from it
(spec.model.FAMILY_DEFAULTS), and sliding windows are counted on the layers each family's code
gives one (a review: Qwen3 without head_dim planned 15% small, Qwen3-30B-A3B without num_experts
planned dense, Qwen3-MoE/Qwen2-MoE windows on the wrong layers: device peaks up to 17% above plans)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lazytrain.spec import ModelSpec
from lazytrain.spec.model import FAMILIES, FAMILY_DEFAULTS, ModelConfigError

MINIMAL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=32, vocab_size=128, intermediate_size=96)


def _meta_model(cfg: dict):
    conf = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        return conf, AutoModelForCausalLM.from_config(conf)


@pytest.mark.parametrize("family", FAMILIES)
def test_missing_optional_keys_get_transformers_defaults(family):
    assert set(FAMILY_DEFAULTS) == set(FAMILIES)
    cfg = dict(model_type=family, **MINIMAL)
    spec = ModelSpec.from_hf_config(cfg)
    conf, model = _meta_model(cfg)
    attn = model.model.layers[0].self_attn
    assert spec.num_kv_heads == conf.num_key_value_heads
    assert spec.head_dim == attn.head_dim
    assert spec.max_position_embeddings == conf.max_position_embeddings
    assert spec.param_count == sum(p.numel() for p in model.parameters())
    assert spec.hf_config == cfg   # (the plan records the file as it is)


@pytest.mark.parametrize("family", FAMILIES)
def test_sliding_window_layers_are_the_models(family):
    cfg = dict(model_type=family, **MINIMAL, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    spec = ModelSpec.from_hf_config(cfg)
    conf, model = _meta_model(cfg)
    if family in ("mistral", "mixtral"):     # the attention reads config.sliding_window in every layer
        want = tuple(range(4))
    elif family in ("llama", "olmoe"):       # no sliding window (the key is not read)
        want = ()
    else:                                    # the Qwen families set it per layer
        want = tuple(i for i, lay in enumerate(model.model.layers) if getattr(lay.self_attn, "sliding_window", None))
    assert spec.sliding_blocks == want and (spec.sliding_window == 16) == bool(want)
    if family.startswith("qwen"):   # without use_sliding_window: none
        off = ModelSpec.from_hf_config({**cfg, "use_sliding_window": False})
        assert off.sliding_blocks == () and off.sliding_window is None


def test_boolean_keys_given_as_strings_are_refused():
    for key in ("tie_word_embeddings", "attention_bias"):
        with pytest.raises(ModelConfigError, match=f"{key} must be true or false"):
            ModelSpec.from_hf_config(dict(model_type="llama", **MINIMAL, **{key: "false"}))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "llama"])
@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj", "shared_expert_gate", "gate")])
def test_lora_parameters_are_what_peft_creates(family, targets):
    """The adapters the plan counts are PEFT's on the same model: a router module is not wrapped,
    nor Mixtral's or Qwen2-MoE's routed experts (3-D weights); Qwen2-MoE's shared_expert_gate is
    (review: the spec counted Qwen1.5-MoE's experts' adapters, 16.8x PEFT's, and left that gate
    out). Qwen3-MoE and OLMoE, whose experts PEFT does wrap by MLP names, are checked on the
    attention (their experts' fused gate/up adapter is counted approximately)."""
    from lazytrain.costmodel.layers import check_lora_targets
    from lazytrain.models import apply_lora
    from lazytrain.runtime.testing import tiny_model
    from lazytrain.spec.model import PEFT_WRAPS_EXPERTS

    model = tiny_model(family)
    spec = ModelSpec.from_hf_config(model.config.to_dict())
    wrapped = {n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(spec.lora_target_names()) == wrapped   # what train's check accepts, plan accepts
    usable = tuple(t for t in targets if t in wrapped)
    if family in PEFT_WRAPS_EXPERTS:
        usable = tuple(t for t in usable if t in ("q_proj", "k_proj", "v_proj", "o_proj"))
    peft = apply_lora(model, rank=4, alpha=8.0, targets=usable)
    created = sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n)
    assert spec.lora_param_count(4, usable) == created
    if family not in PEFT_WRAPS_EXPERTS:   # (names train refuses add nothing)
        assert spec.lora_param_count(4, targets) == created
    unusable = tuple(t for t in targets if t not in spec.lora_target_names())
    if unusable:   # (what train refuses, plan refuses too when nothing else matches)
        with pytest.raises(ValueError, match="match no linear layer"):
            check_lora_targets(spec, unusable)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("keys", [{"num_experts": 6}, {"num_local_experts": 6}, {"num_experts": 6, "num_local_experts": 5}])
def test_expert_count_is_read_as_transformers_reads_it(family, keys):
    """Each family's own key and alias direction (Qwen2-MoE ignores num_local_experts: planned with
    it, a model 5x the plan's parameters; review)."""
    cfg = dict(model_type=family, **MINIMAL, moe_intermediate_size=32, num_experts_per_tok=2, **keys)
    conf, model = _meta_model(cfg)
    assert ModelSpec.from_hf_config(cfg).param_count == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family,extra", [
    ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                     layer_types=["sliding_attention", "full_attention"])),
])
def test_measured_specs_offer_the_lora_targets_train_accepts(family, extra):
    """A measured (generic) MoE spec counted its router's bare 2-D weight as a linear, so `plan`
    accepted job.lora_targets=[router], which train refuses (review): only nn.Linear modules."""
    from lazytrain.models.lora import unmatched_targets

    cfg = dict(model_type=family, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=128, intermediate_size=48, head_dim=8, **extra)
    spec = ModelSpec.from_hf_config(cfg)
    conf = AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(conf)
    _, names = unmatched_targets(model, [])
    assert set(spec.lora_target_names()) == set(names)



@pytest.mark.parametrize("family,key", [("mixtral", "num_experts"), ("qwen3_moe", "num_local_experts"),
                                        ("qwen2_moe", "num_experts")])
def test_a_null_expert_count_is_refused(family, key):
    """transformers builds no model from it: plan planned another key's count or the default, and
    train failed with a traceback (review)."""
    with pytest.raises(ModelConfigError, match=f"{key} is null"):
        ModelSpec.from_hf_config(dict(model_type=family, **MINIMAL, **{key: None}))
