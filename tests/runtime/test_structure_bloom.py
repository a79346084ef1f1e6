"""A model with two weighted modules next to its blocks (Bloom: a norm on the embedding's output and
the final norm) is refused with their names, not "found 2 other modules"."""
import pytest
from transformers import BloomConfig, BloomForCausalLM

from lazytrain.models.adapter import ModelStructureError, find_parts


def test_bloom_refusal_names_the_modules():
    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=16, n_layer=2, n_head=2))
    with pytest.raises(ModelStructureError, match=r"BloomModel: expected exactly one final norm next to the "
                                                  r"blocks, found 2 modules with parameters there: "
                                                  r"word_embeddings_layernorm \(LayerNorm\), ln_f \(LayerNorm\)"):
        find_parts(model)
