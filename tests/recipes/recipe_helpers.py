"""Helpers for the recipe tests: a tiny local data set of English prose, a tiny local model dir."""

from __future__ import annotations

from pathlib import Path

TEXT = """The for statement is used to iterate over the elements of a sequence (such as a string,
tuple or list) or other iterable object. The first expression list is evaluated once; it should
yield an iterable object. An iterator is created for the result of that iterable.
The suite is then executed once for each item provided by the iterator, in the order returned by
the iterator. Each item in turn is assigned to the target list using the standard rules for
assignments, and then the suite is executed. When the items are exhausted, the suite in the else
clause, if present, is executed, and the loop terminates.
"""


def write_text_data(d: Path, copies: int = 20) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / "train.txt"
    p.write_text("\n\n".join(TEXT.replace("sequence", f"sequence {i}") for i in range(copies)))
    return p


def tiny_model_dir(tmp_path: Path, tok_dir, seed: int = 5):
    """A local HF model dir (tiny-llama, vocab 320, fp32 weights seeded with `seed`) with the
    tokenizer of `tok_dir`; returns (dir, the model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lazytrain.cli.config import load_config, model_spec
    hf = dict(model_spec(load_config(["model=tiny-llama", "model.hf_config.vocab_size=320"])).hf_config)
    torch.manual_seed(seed)
    src = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf))
    mdir = tmp_path / "my-model"
    src.save_pretrained(mdir)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(mdir)
    return mdir, src


def packed_sft_losses(base_overrides: list[str], tmp_path: Path, engines: dict[str, list[str]]) -> dict[str, list[float]]:
    """Per-step then held-out losses of one short SFT run per engine (name -> extra overrides) on
    60 short prompt/completion rows, several packed to each 128-token sequence."""
    import json

    from lazytrain.cli.config import load_config
    from lazytrain.recipes.train import run

    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Q{i}: what is {i} plus one?", "completion": f" {i + 1}."}) + "\n"
                           for i in range(60)))
    ov = [a for a in base_overrides if not a.startswith("data.files")] + [
        f"data.files=[{sft}]", "data.prompt_field=prompt", "data.text_field=completion", "job.seq_len=128",
        "job.max_steps=3", "save_every=0", "data.eval_fraction=0.2", "eval_every=3"]
    losses = {}
    for engine, extra in engines.items():
        out = tmp_path / engine
        run(load_config([*ov, *extra, f"engine={engine}", f"output_dir={out}"], config_name="train"), out,
            echo=lambda *_: None)
        recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        losses[engine] = [r["loss"] for r in recs] + [r["eval_loss"] for r in recs if "eval_loss" in r]
    return losses


def assert_refused_in_one_line(main, overrides: list[str], cases, out: Path, capsys, alone: bool = True) -> None:
    """Each (extra overrides, what the error says) of `cases` exits 2 with that line and writes
    nothing to `out`; `alone`: nothing else on stderr (False: libraries may warn first, e.g.
    transformers on a model config it builds for the first time)."""
    for extra, said in cases:
        capsys.readouterr()
        assert main([*overrides, *extra, f"output_dir={out}"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines and said in lines[-1], lines
        assert (len(lines) == 1 or not alone) and not out.exists()


def tiny_gpt_oss_dir(tmp_path: Path) -> Path:
    """A local GPT-OSS model dir (vocab 320): a model whose masks ignore the position ids."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=256, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gptoss")
    return tmp_path / "gptoss"
