"""Fixes from the session-25 planner review: measured specs count convolutions as convolutions,
and the plan cache's key follows the libraries a measured spec is built with."""

import pytest

from lazytrain.spec import ModelSpec

QWEN3_NEXT = dict(model_type="qwen3_next", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
                  linear_key_head_dim=16, linear_value_head_dim=16,
                  layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])


def test_a_convolution_weight_is_not_an_expert_stack():
    """Qwen3-Next's linear-attention blocks hold a Conv1d [128, 1, 4]: taken as 128 experts of 196
    parameters (expert count, active parameters and FLOPs wrong in 3 of 4 blocks: review)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = ModelSpec.from_hf_config(QWEN3_NEXT)
    kw = {k: v for k, v in QWEN3_NEXT.items() if k != "model_type"}
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_next", **kw))
    for b, blk in zip(spec.blocks, m.model.layers):
        experts = sum(p.numel() for n, p in blk.named_parameters() if "mlp.experts" in n)
        total = sum(p.numel() for p in blk.parameters())
        assert b.num_experts == 4 and b.expert_param_count == experts // 4, b
        assert b.active_param_count == total - experts + 2 * (experts // 4)


def test_mamba2_is_measured_not_refused_for_experts():
    mamba = {"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4, "head_dim": 32,
             "vocab_size": 256, "num_attention_heads": 4, "state_size": 16, "n_groups": 1, "expand": 2,
             "conv_kernel": 4}
    spec = ModelSpec.from_hf_config(mamba)
    assert all(b.num_experts == 0 for b in spec.blocks)


@pytest.mark.parametrize("pkg", ["torch", "transformers"])
def test_the_plan_cache_key_holds_the_libraries_measured_specs_are_built_with(pkg):
    from importlib import metadata

    from lazytrain.plan.solve import versions

    assert versions()[pkg] == metadata.version(pkg)


def test_a_model_whose_blocks_return_more_is_one_line_not_a_crash():
    """Bamba's loop unpacks two values from each block: `plan` printed a bare 'not enough values
    to unpack', `train` a traceback (review). Now a ModelConfigError naming the model type."""
    from transformers import AutoConfig

    from lazytrain.spec.model import ModelConfigError

    cfg = AutoConfig.for_model("bamba", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=320,
                               attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                               mamba_n_groups=1).to_dict()
    cfg = {k: v for k, v in cfg.items() if k not in ("transformers_version", "architectures")}
    with pytest.raises(ModelConfigError, match=r"model_type 'bamba': the planner cannot measure it"):
        ModelSpec.from_hf_config(cfg)


def test_structure_problem_of_an_unbuildable_family_is_no_verdict():
    """An UnboundLocalError escaped where the family's default config could not be built (review)."""
    from lazytrain.spec.generic import structure_problem

    assert structure_problem({"model_type": "no_such_family", "hidden_size": 8}) is None


def test_the_plan_cache_key_takes_24_and_24_0_gib_as_one():
    """`hardware.device_memory_gib=24` and `=24.0` made two cache entries (a re-solve; review)."""
    from dataclasses import replace

    from lazytrain.plan.plan import input_hash
    from lazytrain.plan.solve import PlannerOptions
    from lazytrain.runtime.testing import hardware_for_tests
    from lazytrain.spec import JobSpec

    hw = hardware_for_tests()
    job = JobSpec(batch_size=2, seq_len=64)
    key = lambda h, j: input_hash({"model_type": "llama"}, h, j, PlannerOptions(), "milp", {})  # noqa: E731
    assert key(replace(hw, device_memory_gib=24), job) == key(replace(hw, device_memory_gib=24.0), job)
    assert key(replace(hw, device_memory_gib=24), job) != key(replace(hw, device_memory_gib=25), job)
    assert key(hw, replace(job, lora_alpha=32)) == key(hw, replace(job, lora_alpha=32.0))
    assert key(hw, job) != key(hw, replace(job, batch_size=3))
