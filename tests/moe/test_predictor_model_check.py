"""A routing predictor records which model it was trained on (a crc of the routers' weights): one
trained on another model of the same shapes is refused in one line (it was taken, and prefetched
worse: hit rate 0.53 vs 0.63 in a review's case, 2026-12-02). Files without the record still load."""

import pytest
import torch

from lazytrain.cli import generate as gen_cli
from lazytrain.cli import moe as moe_cli
from lazytrain.moe.arch import find_moe_layers
from lazytrain.moe.predictor import PredictorHeads, TrainedPredictor, routers_crc32


def test_predictor_from_another_model_is_refused(tiny_moe, tmp_path, capsys):
    from lazytrain.data.tokenizer import build_tokenizer
    from lazytrain.moe import convert_model

    text = tmp_path / "t.txt"
    text.write_text("The cache keeps experts that the router picks often. " * 200)
    tok = build_tokenizer([text], tmp_path / "tok", vocab_size=300)
    for name, seed in (("a", 0), ("b", 1)):      # same shapes, other weights
        convert_model(tiny_moe("mixtral", seed=seed, vocab_size=300), tmp_path / name, tokenizer_dir=tok)
    pred = tmp_path / "pa.safetensors"
    assert moe_cli.main(["train-predictor", f"moe.store={tmp_path / 'a'}", f"out={pred}", f"predictor_train.text={text}",
                         "predictor_train.max_tokens=512", "predictor_train.seq_len=64", "predictor_train.steps=5",
                         "--json"]) == 0
    capsys.readouterr()
    run = ["prompt=The cache", "max_new_tokens=3", "moe.prefetch=predictor", f"moe.predictor={pred}"]
    assert gen_cli.main([f"moe.store={tmp_path / 'a'}", *run]) == 0
    capsys.readouterr()
    assert gen_cli.main([f"moe.store={tmp_path / 'b'}", *run]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained for another model" in err[0] and "train-predictor" in err[0]


def test_a_file_without_the_record_still_loads(tiny_moe, tmp_path):
    layers = find_moe_layers(tiny_moe("mixtral"))
    heads = PredictorHeads(layers[0].router.weight.shape[1], [ml.num_experts for ml in layers], 16)
    loaded = PredictorHeads.load(heads.save(tmp_path / "old.safetensors"))
    assert "routers_crc32" not in loaded.meta
    TrainedPredictor(loaded, layers)
    rec = PredictorHeads.load(heads.save(tmp_path / "new.safetensors", {"routers_crc32": routers_crc32(layers)}))
    TrainedPredictor(rec, layers)
    other = find_moe_layers(tiny_moe("mixtral", seed=3))
    with pytest.raises(ValueError, match="trained for another model"):
        TrainedPredictor(rec, other)
    # the same model in bf16 (a bf16 store of it) is the same model
    TrainedPredictor(rec, find_moe_layers(tiny_moe("mixtral").to(torch.bfloat16)))


def test_the_streamed_model_builds_no_autograd_graph(mixtral_store):
    import torch

    from lazytrain.moe import load_streamed

    _, d = mixtral_store
    eng = load_streamed(d / "store", prefetch="none")
    try:
        assert not any(p.requires_grad for p in eng.model.parameters())
        assert eng.model(torch.tensor([[5, 6, 7]]), use_cache=False).logits.grad_fn is None
    finally:
        eng.close()
