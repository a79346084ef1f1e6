"""`lazytrain generate` / `lazytrain moe`: JSON schema, exact tokens, one-line errors on bad input."""

import json

import pytest
import torch

from lazytrain.cli import generate as gen_cli
from lazytrain.cli import moe as moe_cli

STATS_KEYS = {"hit_rate", "prefetch_precision", "prefetch_recall", "bytes_per_token", "stall_s_per_token",
              "predictor_s_per_token", "tokens_per_s"}


def test_convert_then_generate_json(mixtral_store, tmp_path, capsys):
    model, d = mixtral_store
    assert moe_cli.main(["convert", f"model.path={d / 'hf'}", f"out={tmp_path / 's'}", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["moe_layers"] == 4 and info["experts_per_layer"] == [8] * 4
    rc = gen_cli.main([f"model.path={d / 'hf'}", f"moe.store={tmp_path / 's'}", "moe.cache_fraction=0.45",
                       "prompt_ids=[5,17,3,99]", "max_new_tokens=12", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"token_ids", "text", "stats"} and STATS_KEYS <= set(out["stats"])
    ref = model.generate(torch.tensor([[5, 17, 3, 99]]), max_new_tokens=12, do_sample=False)
    assert out["token_ids"] == ref[0, 4:].tolist()
    assert out["stats"]["cache_slots"] == 14


def test_stats_line_without_json(mixtral_store, capsys):
    _, d = mixtral_store
    assert gen_cli.main([f"moe.store={d / 'store'}", "prompt_ids=[1,2]", "max_new_tokens=4"]) == 0
    err = capsys.readouterr().err
    assert "moe: hit" in err and "MiB/token" in err and "slots" in err and "tok/s" in err


def test_text_prompt_and_train_predictor(tiny_moe, tmp_path, capsys):
    from lazytrain.data.tokenizer import build_tokenizer
    from lazytrain.moe import convert_model

    text = tmp_path / "t.txt"
    text.write_text("The cache keeps experts that the router picks often. " * 200)
    tok_dir = build_tokenizer([text], tmp_path / "tok", vocab_size=300)
    model = tiny_moe("mixtral", vocab_size=300)
    convert_model(model, tmp_path / "s", tokenizer_dir=tok_dir)
    assert gen_cli.main([f"moe.store={tmp_path / 's'}", "prompt=The cache", "max_new_tokens=5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["text"], str) and len(out["token_ids"]) == 5
    pred = tmp_path / "p.safetensors"
    assert moe_cli.main(["train-predictor", f"moe.store={tmp_path / 's'}", f"out={pred}",
                         f"predictor_train.text={text}", "predictor_train.max_tokens=1024",
                         "predictor_train.seq_len=64", "predictor_train.steps=20", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert pred.is_file() and 0 <= res["recall_gate"] <= 1 and 0 <= res["recall_predictor"] <= 1
    assert gen_cli.main([f"moe.store={tmp_path / 's'}", "prompt=The cache", "max_new_tokens=5",
                         "moe.prefetch=predictor", f"moe.predictor={pred}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]
    # review: a numeric prompt is text (was the tokenizer's type error); bad predictor settings are
    # one line (seq_len=0 was a ZeroDivisionError traceback); one sequence leaves nothing held out
    # (its "held-out" recall was measured on the training tokens)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    for typed in ("123", "1e3", "true"):   # (Hydra's value was used: 'True', '1000.0')
        assert gen_cli.main([f"moe.store={tmp_path / 's'}", f"prompt={typed}", "max_new_tokens=2", "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["stats"]["prefill_tokens"] == len(tok(typed)["input_ids"]), typed
    base = ["train-predictor", f"moe.store={tmp_path / 's'}", f"out={pred}", f"predictor_train.text={text}"]
    for bad, says in (("predictor_train.seq_len=0", "predictor_train.seq_len must be a whole number >= 1"),
                      ("predictor_train.steps=-1", "predictor_train.steps must be a whole number >= 1")):
        assert moe_cli.main([*base, bad]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
    assert moe_cli.main([*base, "predictor_train.max_tokens=64", "predictor_train.seq_len=64"]) == 2
    assert "leave none to hold out" in capsys.readouterr().err
    # max_new_tokens=1: no decode step, so no decode hit rate (was "hit 100.0%")
    assert gen_cli.main([f"moe.store={tmp_path / 's'}", "prompt=The cache", "max_new_tokens=1"]) == 0
    assert "moe: hit n/a (no decode step)" in capsys.readouterr().err


def test_help_anywhere_and_a_damaged_checkpoint(tiny_moe, tmp_path, capsys):
    """`moe convert --help` printed Hydra's LexerNoViableAltException; converting a truncated
    safetensors file was a traceback (review)."""
    assert moe_cli.main(["convert", "--help"]) == 0
    assert "lazytrain moe" in capsys.readouterr().out
    tiny_moe("mixtral").save_pretrained(tmp_path / "hf")
    f = next((tmp_path / "hf").glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:-100])
    capsys.readouterr()   # (save_pretrained's progress bar)
    assert moe_cli.main(["convert", f"model.path={tmp_path / 'hf'}", f"out={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{f}: not a readable safetensors file" in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_missing_store_path(tmp_path, capsys, err_line):
    assert gen_cli.main([f"moe.store={tmp_path / 'none'}", "prompt_ids=[1]"]) == 2
    assert "does not exist" in err_line()
    assert gen_cli.main([f"moe.store={tmp_path / 'none'}", "prompt=hello"]) == 2
    assert "does not exist" in err_line()
    assert gen_cli.main(["prompt_ids=[1]"]) == 2
    assert "moe.store=STORE_DIR" in err_line()


def test_cache_too_small_says_minimum(mixtral_store, capsys, err_line):
    _, d = mixtral_store
    assert gen_cli.main([f"moe.store={d / 'store'}", "moe.cache_slots=3", "prompt_ids=[1]"]) == 2
    assert "minimum is 8 slots" in err_line()


def test_mismatched_store(mixtral_store, tiny_moe, tmp_path, capsys, err_line):
    _, d = mixtral_store
    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "q")
    assert gen_cli.main([f"model.path={tmp_path / 'q'}", f"moe.store={d / 'store'}", "prompt_ids=[1]"]) == 2
    line = err_line()
    assert "does not match the model" in line and "shape" in line


def test_non_moe_model(tmp_path, capsys, err_line):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "llama")
    assert moe_cli.main(["convert", f"model.path={tmp_path / 'llama'}", f"out={tmp_path / 'o'}"]) == 2
    assert "has no MoE experts layers" in err_line()


def test_unknown_tool(capsys):
    assert moe_cli.main(["shrink"]) == 2
    assert "unknown tool" in capsys.readouterr().err
