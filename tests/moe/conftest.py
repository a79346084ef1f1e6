"""Fixtures of the moe tests: tiny MoE models built from configs (random init) and their stores.
(Helpers are fixtures, not imports: the suite runs with --import-mode=importlib.)"""

from __future__ import annotations

import pytest
import torch

SHAPES = {
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128, num_local_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=256),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, moe_intermediate_size=48, intermediate_size=96,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      vocab_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      max_position_embeddings=256),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, moe_intermediate_size=48, intermediate_size=96,
                      shared_expert_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, num_experts=8, num_experts_per_tok=2,
                      max_position_embeddings=256),
    "olmoe": dict(model_type="olmoe", hidden_size=64, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=128, num_experts=8,
                  num_experts_per_tok=2, max_position_embeddings=256),
}


def make_model(kind: str, seed: int = 0, **over):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(SHAPES[kind], **over)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    # Sharper routers than the default init so routing differs clearly between tokens and layers.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] == 8:
                p.normal_(0, 0.5)
    return model


@pytest.fixture(scope="session")
def tiny_moe():
    """make_model(kind, seed=0, **config overrides) -> random-init HF MoE causal LM."""
    return make_model


@pytest.fixture(scope="session")
def mixtral_store(tmp_path_factory):
    from lazytrain.moe import convert_model

    model = make_model("mixtral")
    d = tmp_path_factory.mktemp("mixtral")
    convert_model(model, d / "store")
    model.save_pretrained(d / "hf")
    return model, d


@pytest.fixture
def err_line(capsys):
    """The one `lazytrain ...` error line a CLI call wrote to stderr (and no traceback)."""
    def get() -> str:
        err = capsys.readouterr().err.strip().splitlines()
        lines = [l for l in err if l.startswith("lazytrain ")]
        assert len(lines) == 1 and "Traceback" not in "\n".join(err)
        return lines[0]
    return get
