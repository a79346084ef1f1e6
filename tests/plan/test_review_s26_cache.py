"""Session 26: the plan cache's key leaves out job settings no plan depends on (LoRA's alpha and
the order of its targets): one solve serves them all, each plan carrying the job it was asked for.
And model.hf_config keys no transformers code reads."""

from lazytrain.plan.solve import plan_job
from lazytrain.runtime.testing import hardware_for_tests
from lazytrain.plan.plan import PlannerOptions
from lazytrain.spec import JobSpec, ModelSpec

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def test_lora_alpha_and_target_order_share_one_cached_plan(tmp_path, monkeypatch):
    import lazytrain.plan.solve as solve

    calls = []
    real = solve._solve

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(solve, "_solve", counting)
    model, hw, opts = ModelSpec.from_hf_config(CFG), hardware_for_tests(), PlannerOptions()
    first = JobSpec(mode="lora", seq_len=64, lora_alpha=16.0, lora_targets=("q_proj", "v_proj"))
    again = JobSpec(mode="lora", seq_len=64, lora_alpha=32.0, lora_targets=("v_proj", "q_proj"))
    a = plan_job(model, hw, first, opts, cache_dir=tmp_path)
    b = plan_job(model, hw, again, opts, cache_dir=tmp_path)
    assert len(calls) == 1 and a.input_hash == b.input_hash
    assert b.job == again and a.job == first   # each plan carries the job asked for
    assert b.layers == a.layers
    # another rank plans otherwise: solved again
    plan_job(model, hw, JobSpec(mode="lora", seq_len=64, lora_rank=4), opts, cache_dir=tmp_path)
    assert len(calls) > 1
    # a full job keeps its LoRA rank in the key (an infeasible one's advice plans LoRA with it:
    # review), not its alpha
    plan_job(model, hw, JobSpec(mode="full", seq_len=64), opts, cache_dir=tmp_path)
    n = len(calls)
    c = plan_job(model, hw, JobSpec(mode="full", seq_len=64, lora_alpha=8.0), opts, cache_dir=tmp_path)
    assert len(calls) == n and c.job.lora_alpha == 8.0
    plan_job(model, hw, JobSpec(mode="full", seq_len=64, lora_rank=64), opts, cache_dir=tmp_path)
    assert len(calls) > n


def test_hf_config_keys_no_code_reads_are_refused_with_the_closest(caplog):
    """A typo under model.hf_config (transformers keeps any keyword as an attribute) planned and
    trained the model without it, unsaid; keys transformers converts or reads are kept."""
    import pytest

    from lazytrain.cli.config import ConfigError, load_config, model_spec

    with pytest.raises(ConfigError, match=r"model.hf_config.hiden_size: not a setting of llama's config "
                                          r".*did you mean model.hf_config.hidden_size\?"):
        model_spec(load_config(["model=tiny-llama", "+model.hf_config.hiden_size=64"]))
    with pytest.raises(ConfigError, match=r"model.hf_config.num_locl_experts: .*did you mean "
                                          r"model.hf_config.num_local_experts\?"):
        model_spec(load_config(["model=tiny-mixtral", "+model.hf_config.num_locl_experts=4"]))
    # an unread key without a close declared one (a published config's: DeepSeek-V3's ep_size): a
    # warning, not a refusal; also one another family's shipped config uses (review: Mixtral took
    # Qwen-MoE's decoder_sparse_step unsaid)
    import logging

    with caplog.at_level(logging.WARNING, logger="lazytrain"):
        assert model_spec(load_config(["model=tiny-llama", "+model.hf_config.ep_size=1"])).family == "llama"
        model_spec(load_config(["model=tiny-mixtral", "+model.hf_config.decoder_sparse_step=2"]))
    assert "model.hf_config: ep_size: not a setting of llama's config; no transformers code reads it" in caplog.text
    assert "model.hf_config: decoder_sparse_step: not a setting of mixtral's config" in caplog.text
    # converted (rope_theta -> rope_parameters), declared, or read undeclared (Qwen3-MoE's head_dim)
    assert model_spec(load_config(["model=tiny-llama", "+model.hf_config.rope_theta=5e5"])).family == "llama"
    assert model_spec(load_config(["model=qwen3-30b-a3b"])).family == "qwen3_moe"


def test_the_shipped_model_configs_hold_no_unread_hf_config_key():
    """`model_spec` skips the transformers check (and its torch import) for keys the shipped
    configs use, so those keys must all be read."""
    from omegaconf import OmegaConf

    from lazytrain.cli.config import _shipped_hf_keys, config_dir, load_config, unused_hf_config_keys

    assert "hidden_size" in _shipped_hf_keys("llama") and "decoder_sparse_step" not in _shipped_hf_keys("mixtral")
    for f in sorted((config_dir() / "model").glob("*.yaml")):
        cfg = load_config([f"model={f.stem}"])
        if cfg.model.get("hf_config") is not None:
            assert unused_hf_config_keys(OmegaConf.to_container(cfg.model.hf_config, resolve=True)) == [], f.stem
