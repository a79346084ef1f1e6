"""Plan -> DeepSpeed config: pure mapping, no torch or deepspeed needed."""

import sys

import pytest

from lazytrain.integrations.ds_config import ds_config_from_plan, largest_param_numel
from lazytrain.spec import JobSpec

from ds_plan_factory import TINY_LLAMA, make_plan


def test_host_plan_offloads_params_and_optimizer_to_cpu():
    cfg, dropped = ds_config_from_plan(make_plan())
    z = cfg["zero_optimization"]
    assert z["stage"] == 3
    assert z["offload_param"]["device"] == "cpu"
    assert z["offload_optimizer"]["device"] == "cpu"
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 1
    assert cfg["bf16"] == {"enabled": True}
    assert cfg["lazytrain"]["recompute_blocks"] == []
    assert dropped == []


def test_device_params_are_not_offloaded_and_job_maps():
    plan = make_plan(param_tier="device", job=JobSpec(batch_size=3, seq_len=16, grad_accum=4,
                                                      compute_dtype="fp32"))
    cfg, _ = ds_config_from_plan(plan)
    assert "offload_param" not in cfg["zero_optimization"]
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["gradient_accumulation_steps"] == 4
    assert "bf16" not in cfg and "fp16" not in cfg


def test_nvme_plan_uses_the_settings_that_work_here(tmp_path):
    cfg, dropped = ds_config_from_plan(make_plan(param_tier="nvme", optimizer_tier="nvme"),
                                       nvme_dir=str(tmp_path))
    z = cfg["zero_optimization"]
    assert z["offload_param"]["device"] == "nvme" and z["offload_param"]["nvme_path"] == str(tmp_path)
    assert z["offload_optimizer"]["device"] == "nvme"
    assert z["stage3_max_reuse_distance"] == 0
    assert z["offload_param"]["buffer_count"] == 32
    # the embedding (vocab x hidden) is the largest tensor of the tiny model
    assert z["offload_param"]["buffer_size"] >= 256 * 64 == largest_param_numel(TINY_LLAMA)
    assert dropped == []


def test_mixed_tiers_take_the_majority_and_report_the_rest():
    # blocks 0..3 (indices 1..4) on nvme hold most parameters; embed/head on host
    plan = make_plan(param_tier="host", overrides={i: {"param_tier": "nvme"} for i in range(1, 5)})
    cfg, dropped = ds_config_from_plan(plan)
    assert cfg["zero_optimization"]["offload_param"]["device"] == "nvme"
    assert len(dropped) == 1 and "param_tier=host for embed, head" in dropped[0]


def test_recompute_maps_to_blocks_and_segments_and_offload_are_dropped():
    # one segment over blocks 1..2 (indices 2,3) kept on host, block 3 (index 4) alone, head recomputed
    plan = make_plan(recompute=frozenset({2, 3, 4, 5}), segment_starts={2: 2, 3: 2, 4: 4, 5: 5},
                     activation_tiers={2: "host", 3: "none", 1: "nvme"})
    cfg, dropped = ds_config_from_plan(plan)
    assert cfg["lazytrain"]["recompute_blocks"] == [1, 2, 3]
    text = "\n".join(dropped)
    assert "recompute of head" in text
    assert "segment block.1..block.2 recomputed per layer (keeps 2 inputs" in text
    assert "activation_tier=host for block.1" in text
    assert "activation_tier=nvme for block.0" in text
    assert len(dropped) == 4


def test_grad_nvme_and_8bit_are_reported():
    plan = make_plan(overrides={1: {"grad_tier": "nvme"}}, job=JobSpec(batch_size=1, seq_len=8,
                                                                         optimizer_state_bits=8))
    _, dropped = ds_config_from_plan(plan)
    assert any("grad_tier=nvme for block.0" in d for d in dropped)
    assert any("optimizer_state_bits=8" in d for d in dropped)


def test_overrides_deep_merge():
    cfg, _ = ds_config_from_plan(make_plan(), overrides={
        "zero_optimization": {"offload_param": {"device": "none"}, "sub_group_size": 7}, "x": 1})
    z = cfg["zero_optimization"]
    assert z["offload_param"]["device"] == "none" and z["sub_group_size"] == 7
    assert z["offload_optimizer"]["device"] == "cpu" and cfg["x"] == 1


def test_infeasible_plan_is_refused_with_its_explanation():
    with pytest.raises(ValueError, match="needs 3 GiB more"):
        ds_config_from_plan(make_plan(status="infeasible"))


def test_config_module_imports_no_torch():
    import subprocess
    code = ("import sys, lazytrain.integrations.ds_config, lazytrain.cli.plan_export; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_clipping_bf16_master_and_chunked_loss_are_expressed_or_reported():
    """DeepSpeed 0.19 clips at 1.0 when gradient_clipping is absent: a plan whose job does not clip
    exports 0.0. Pure-bf16 training and a chunked loss have no DeepSpeed equivalent: reported."""
    DeepSpeedConfig = pytest.importorskip("deepspeed.runtime.config").DeepSpeedConfig   # what DeepSpeed reads

    plan = make_plan(job=JobSpec(batch_size=1, seq_len=8, clip_grad=False, master_dtype="bf16",
                                 loss_chunk_tokens=4))
    cfg, dropped = ds_config_from_plan(plan)
    assert cfg["gradient_clipping"] == 0.0
    ds_cfg = {k: v for k, v in cfg.items() if k != "lazytrain"}
    assert DeepSpeedConfig(ds_cfg).gradient_clipping == 0.0
    assert any(d.startswith("master_dtype=bf16") for d in dropped)
    assert any(d.startswith("loss_chunk_tokens=4") for d in dropped)
    clipped, _ = ds_config_from_plan(make_plan(job=JobSpec(batch_size=1, seq_len=8, clip_grad=True)))
    assert "gradient_clipping" not in clipped   # the threshold is the recipe's, set by its trainer


def test_largest_parameter_counts_fused_experts_as_one():
    """DeepSpeed's NVMe buffer_size must hold the largest parameter; transformers fuses a routed
    MoE layer's gate and up projections into one [E, 2I, H] tensor: counted as such (a Mixtral's
    was counted at half its size), checked against the model transformers builds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lazytrain.cli.config import load_config, model_spec
    hf = dict(model_spec(load_config(["model=tiny-mixtral"])).hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf["model_type"], **{
            k: v for k, v in hf.items() if k != "model_type"}))
    assert largest_param_numel(hf) == max(p.numel() for p in model.parameters())


def test_nvme_swap_buffers_are_counted_in_pinned_host_memory():
    """ZeRO-Infinity's swap buffers are page-locked host memory allocated at start: buffer_count x
    buffer_size in the compute dtype for parameters (32 x the largest parameter here: 31 GiB for an
    8B model's embedding), buffer_count x the largest fp32 sub-group for the optimizer."""
    from lazytrain.integrations.ds_config import _largest_sub_group, pinned_swap_buffers, pinned_swap_note
    assert _largest_sub_group([5, 5, 5, 1], 8) == 10 and _largest_sub_group([3], 8) == 3
    assert _largest_sub_group([9, 1, 1], 8) == 9
    llama8b = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    nvme = {"zero_optimization": {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}}}
    plan = make_plan(llama8b)
    cfg, _ = ds_config_from_plan(plan, overrides=nvme)
    (p_sec, p_bytes, _), (o_sec, o_bytes, _) = pinned_swap_buffers(cfg, plan)
    assert p_sec == "offload_param" and p_bytes == 32 * 128256 * 4096 * 2   # bf16
    # sub-groups fill to sub_group_size; with the state on NVMe it is chosen so that no group is
    # larger than the largest parameter, the embedding (DeepSpeed's 1e9: groups of ~1e9 + one
    # matrix, 16 GB of buffers; a review)
    # (the head's group: lm_head plus the norms before it)
    assert o_sec == "offload_optimizer" and 4 * 4 * 128256 * 4096 <= o_bytes <= 4 * 4 * (128256 * 4096 + 4 * 4096)
    assert cfg["zero_optimization"]["sub_group_size"] < 1e9
    cfg_1e9, _ = ds_config_from_plan(plan, overrides={"zero_optimization": {
        **nvme["zero_optimization"], "sub_group_size": 1_000_000_000}})   # (the user's own stays)
    assert 4 * 4 * 1e9 <= pinned_swap_buffers(cfg_1e9, plan)[1][1] <= 4 * 4 * (1e9 + 14336 * 4096)
    line, over = pinned_swap_note(cfg, plan)
    assert "buffer_count 32 x buffer_size 525,336,576 x 2 B" in line
    assert over and "more than this host's 20 GiB" in line   # (make_plan's CPU profile: 23.5 - 4 GiB)
    # LoRA: only the adapters are in the optimizer's sub-groups
    lora = make_plan(llama8b, job=JobSpec(batch_size=1, seq_len=32, mode="lora"))
    cfg, _ = ds_config_from_plan(lora, overrides=nvme)
    o_bytes = pinned_swap_buffers(cfg, lora)[1][1]
    # (adapters gathered into groups of at least NVME_MIN_SUB_GROUP elements)
    from lazytrain.integrations.ds_config import NVME_MIN_SUB_GROUP
    total = _lora_total(llama8b, lora.job)
    assert 4 * 4 * min(total, NVME_MIN_SUB_GROUP) <= o_bytes <= 4 * 4 * min(total, 2 * NVME_MIN_SUB_GROUP)
    # more than the host can spare is said, with what to lower
    cfg, _ = ds_config_from_plan(make_plan(), overrides={"zero_optimization": {
        "offload_param": {"device": "nvme", "buffer_count": 10**6}}})
    line, over = pinned_swap_note(cfg, make_plan())
    assert over and "offload_param.buffer_count" in line and "sub_group_size" in line
    assert pinned_swap_buffers(ds_config_from_plan(make_plan())[0], make_plan()) == []   # nothing on NVMe


def _lora_total(model_config, job):
    from lazytrain.spec import ModelSpec
    return ModelSpec.from_hf_config(dict(model_config)).lora_param_count(job.lora_rank, tuple(job.lora_targets))


def test_swap_buffer_figures_skip_values_deepspeed_must_refuse_and_a_tied_head():
    """Review: non-integer swap settings (buffer_count=abc, buffer_size=null, sub_group_size='1e9')
    were turned into ints for the figures and raised a traceback before DeepSpeed's parser could
    refuse them in one line; a tied lm_head was counted again in the optimizer's sub-groups (+28%
    for a Qwen2.5-0.5B shape)."""
    from lazytrain.integrations.ds_config import _trainable_sizes, pinned_swap_buffers
    from lazytrain.spec import ModelSpec

    plan = make_plan()
    for bad in ({"offload_param": {"device": "nvme", "buffer_count": "abc"}},
                {"offload_param": {"device": "nvme", "buffer_size": None}},
                {"offload_optimizer": {"device": "nvme"}, "sub_group_size": "1e9"}):
        cfg, _ = ds_config_from_plan(plan, overrides={"zero_optimization": bad})
        assert all(sec not in bad for sec, _, _ in pinned_swap_buffers(cfg, plan))
    # what DeepSpeed's parser takes as counts is counted: digit strings, whole floats
    cfg, _ = ds_config_from_plan(plan, overrides={"zero_optimization": {"offload_param": {
        "device": "nvme", "buffer_count": "8", "buffer_size": 1e6}}})
    assert pinned_swap_buffers(cfg, plan)[0][1] == 8 * 1_000_000 * 2
    qwen = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
    spec = ModelSpec.from_hf_config(qwen)
    assert sum(_trainable_sizes(make_plan(qwen), spec)) == sum(layer.param_count for layer in spec.layers)


def test_deepspeed_steps_report_its_fp16_loss_scale():
    """engine=deepspeed's metrics had no loss_scale under fp16 (review): the step reports DeepSpeed's
    own scale as it was for the step's backward (read before the step, which may back it off)."""
    import types

    import torch

    from lazytrain.integrations.deepspeed import DeepSpeedTrainer, _fp16_loss_scale

    class Opt:
        cur_scale = 65536.0

    class Engine:
        device = torch.device("cpu")
        optimizer = Opt()

        def __init__(self, fp16):
            self.fp16 = fp16

        def fp16_enabled(self):
            return self.fp16

        def gradient_accumulation_steps(self):
            return 1

        def train(self):
            pass

        def __call__(self, input_ids, labels, use_cache):
            return types.SimpleNamespace(loss=torch.tensor(2.0))

        def backward(self, loss):
            pass

        def step(self):
            self.optimizer.cur_scale /= 2   # an overflow: DeepSpeed backs off

        def get_global_grad_norm(self):
            return float("inf")

        def was_step_applied(self):
            return False

    assert _fp16_loss_scale(Engine(False)) is None
    fake = types.SimpleNamespace(engine=Engine(True), _cuda=False)
    res = DeepSpeedTrainer.train_step(fake, [(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))])
    assert res.loss_scale == 65536.0 and res.skipped
