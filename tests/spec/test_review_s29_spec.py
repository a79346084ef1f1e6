"""Session 29: a multimodal family's size keys given at the top level, where transformers does not
read them (its language model's sizes are text_config's), planned transformers' default model
without a word; refused now, naming what transformers would have built."""

from __future__ import annotations

import pytest

from lazytrain.spec import ModelSpec
from lazytrain.spec.model import ModelConfigError

SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
TEXT = {"model_type": "gemma3_text", **SIZES, "intermediate_size": 128, "head_dim": 16, "num_key_value_heads": 2}


def test_top_level_sizes_of_a_multimodal_config_are_refused():
    with pytest.raises(ModelConfigError, match=r"config \(gemma3\): hidden_size=64 \(text_config: 2304\).* "
                                               r"at the top level: .*move them there"):
        ModelSpec.from_hf_config({"model_type": "gemma3", **SIZES})


def test_sizes_in_text_config_plan_and_agreeing_top_level_copies_are_fine():
    nested = ModelSpec.from_hf_config({"model_type": "gemma3", "text_config": TEXT})
    assert (nested.hidden_size, nested.vocab_size, len(nested.blocks)) == (64, 256, 2)
    both = ModelSpec.from_hf_config({"model_type": "gemma3", **SIZES, "text_config": TEXT})
    assert both.layers == nested.layers and both.hidden_size == nested.hidden_size
    with pytest.raises(ModelConfigError, match=r"vocab_size=300 \(text_config: 256\)"):
        ModelSpec.from_hf_config({"model_type": "gemma3", **SIZES, "vocab_size": 300, "text_config": TEXT})
