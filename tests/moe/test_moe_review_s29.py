"""Session 29 review of the MoE-on-SSD path (each failed before its fix)."""

from __future__ import annotations

import json

import pytest
import torch

from lazytrain.cli import moe as moe_cli
from lazytrain.moe import StoreMismatchError, convert_checkpoint, generate

PROMPT = [45, 50, 60, 70, 80]


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in err if line.startswith("lazytrain ")]
    assert len(lines) == 1 and "Traceback" not in "\n".join(err), err
    return lines[0]


def test_a_model_path_whose_new_tokens_rows_changed_is_not_served_the_stores_weights(tiny_moe, tmp_path):
    """Only the first and last row of the embedding and head were compared: a model.path whose rows
    40..89 (new tokens' rows) were trained after conversion was served the store's old weights."""
    m = tiny_moe("mixtral", vocab_size=1000)
    m.save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "store")
    with torch.no_grad():
        m.model.embed_tokens.weight[40:90].normal_(0, 1.0)
        m.lm_head.weight[40:90].normal_(0, 1.0)
    m.save_pretrained(tmp_path / "hf")
    with pytest.raises(StoreMismatchError, match=r"\((model\.embed_tokens|lm_head)\.weight differs\)"):
        generate(tmp_path / "store", prompt_ids=PROMPT, max_new_tokens=2, model_path=tmp_path / "hf")


@pytest.mark.parametrize("dtype,what", [("bogus", "not a torch dtype; the MoE engine serves"),
                                        ("float8_e4m3fn", "the MoE engine serves"),
                                        ("float64", "the MoE engine serves")])
def test_a_config_dtype_the_engine_cannot_serve_is_one_line(tiny_moe, tmp_path, capsys, dtype, what):
    """`dtype: bogus` / float8 were AttributeError / TypeError tracebacks; float64 converted, then
    generate failed mid-prefill (grouped_mm has no float64)."""
    d = tmp_path / "hf"
    tiny_moe("mixtral").save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "dtype": dtype}))
    capsys.readouterr()
    assert moe_cli.main(["convert", f"model.path={d}", f"out={tmp_path / 's'}"]) == 2
    line = _err_line(capsys)
    assert f"config.json's dtype is '{dtype}': {what} weights in float32, bfloat16, float16" in line, line
    assert not (tmp_path / "s").exists()


def test_a_predictor_setting_that_is_not_a_number_is_named(tiny_moe, tmp_path, capsys):
    from lazytrain.data.tokenizer import build_tokenizer
    from lazytrain.moe import convert_model

    text = tmp_path / "t.txt"
    text.write_text("The cache keeps experts that the router picks often. " * 50)
    tok = build_tokenizer([text], tmp_path / "tok", vocab_size=300)
    convert_model(tiny_moe("mixtral", vocab_size=300), tmp_path / "s", tokenizer_dir=tok)
    capsys.readouterr()
    assert moe_cli.main(["train-predictor", f"moe.store={tmp_path / 's'}", f"out={tmp_path / 'p.safetensors'}",
                         f"predictor_train.text={text}", "predictor_train.steps=abc"]) == 2
    assert "predictor_train.steps must be a whole number >= 1, got 'abc'" in _err_line(capsys)
