import pytest

from lazytrain.spec import HardwareSpec, JobSpec, ModelSpec


def llama(layers=4, hidden=64, inter=176, vocab=256, heads=4, kv=2, **kw):
    return ModelSpec.from_hf_config(dict(model_type="llama", hidden_size=hidden, intermediate_size=inter,
                                         num_hidden_layers=layers, num_attention_heads=heads,
                                         num_key_value_heads=kv, vocab_size=vocab,
                                         max_position_embeddings=4096, **kw))


def hw(**kw):
    d = dict(name="test", device_type="cuda", device_memory_gib=1.0, host_memory_gib=8.0,
             nvme_capacity_gib=16.0, h2d_gbps=12.0, d2h_gbps=12.0, nvme_read_gbps=2.8,
             nvme_write_gbps=3.3, device_tflops=20.0, efficiency=0.5, host_memory_gbps=20.0,
             workspace_gib=0.01, host_reserve_gib=0.5)
    d.update(kw)
    return HardwareSpec(**d)


@pytest.fixture
def small():
    return llama(layers=6, hidden=256, inter=704, vocab=1024), hw(), JobSpec(batch_size=2, seq_len=256)


@pytest.fixture
def make_llama():
    return llama


@pytest.fixture
def make_hw():
    return hw
