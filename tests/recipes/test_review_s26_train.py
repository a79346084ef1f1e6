"""Session 26: packed SFT rows attend only to themselves, and the plan counts their masks."""

import json

import pytest

from lazytrain.cli import train as cli
from recipe_helpers import assert_refused_in_one_line, tiny_gpt_oss_dir


def _sft(tmp_path):
    rows = [{"prompt": f"Question {i}: what does a loop do?", "completion": f" It repeats, item {i}."}
            for i in range(40)]
    f = tmp_path / "sft.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_the_plan_of_packed_rows_counts_their_masks(base_overrides, tmp_path, capsys):
    sft = _sft(tmp_path)
    common = [a for a in base_overrides if not a.startswith("data.files")] + [
        f"data.files=[{sft}]", "data.text_field=completion", "job.seq_len=64", "job.max_steps=1"]
    for name, extra, rows in (("sft", ["data.prompt_field=prompt"], True), ("text", [], False)):
        out = tmp_path / name
        assert cli.main([*common, *extra, f"output_dir={out}"]) == 0
        assert json.loads((out / "plan.json").read_text())["job"]["packed_rows"] is rows
    capsys.readouterr()
    for extra, said in ((["data.prompt_field=prompt", "job.packed_rows=false"],
                         "job.packed_rows=false but the data is prompt/completion or chat rows, packed several to a "
                         "sequence: job.packed_rows follows the data"),
                        (["job.packed_rows=true"], "job.packed_rows=true but the data is not packed rows (text, or "
                                                   "data.pack_rows=false)"),
                        # (0 == False and 1 == True: data.pack_rows=0 packed: review)
                        (["data.prompt_field=prompt", "data.pack_rows=0"],
                         "data.pack_rows must be auto, true or false, got 0"),
                        (["data.prompt_field=prompt", "data.pack_rows=1"],
                         "data.pack_rows must be auto, true or false, got 1")):
        assert_refused_in_one_line(cli.main, common, [(extra, said)], tmp_path / "never", capsys)


def test_packed_rows_train_alike_on_the_executor_and_plain_pytorch(base_overrides, tmp_path):
    """Several rows to a sequence (seq_len 128): the streamed executor's per-step and held-out
    losses are plain PyTorch's, both handing the rows' position ids to the model."""
    from recipe_helpers import packed_sft_losses

    losses = packed_sft_losses(base_overrides, tmp_path, {
        "torch": [], "lazytrain": ["hardware.device_memory_gib=0.004", "hardware.workspace_gib=0.0001"]})
    assert len(losses["torch"]) == 4
    assert losses["lazytrain"] == pytest.approx(losses["torch"], rel=1e-5)


def test_a_model_that_cannot_keep_packed_rows_apart_gets_a_sequence_per_row(base_overrides, tmp_path, capsys,
                                                                            caplog):
    """GPT-OSS builds its masks without the position ids (review: its packed rows trained attending
    to each other, unsaid): data.pack_rows=auto gives each row a sequence of its own, with a
    warning, on every engine alike; data.pack_rows=true refuses it in one line."""
    import logging

    from lazytrain.cli.config import load_config
    from lazytrain.recipes.train import run

    tiny_gpt_oss_dir(tmp_path)
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Q{i}: what is {i} plus one?", "completion": f" {i + 1}."}) + "\n"
                           for i in range(40)))
    ov = [a for a in base_overrides if not a.startswith(("data.files", "model=", "model.hf_config"))] + [
        f"model.path={tmp_path / 'gptoss'}", f"data.files=[{sft}]", "data.prompt_field=prompt",
        "data.text_field=completion", "job.seq_len=64", "job.max_steps=2", "save_every=0"]
    losses = {}
    for engine in ("torch", "lazytrain"):
        out = tmp_path / engine
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lazytrain"):
            run(load_config([*ov, f"engine={engine}", f"output_dir={out}"], config_name="train"), out,
                echo=lambda *_: None)
        assert any("gpt_oss cannot keep rows packed into one sequence apart" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert json.loads((out / "plan.json").read_text())["job"]["packed_rows"] is False
        recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        assert all(r["tokens"] == 2 * 64 for r in recs)
        losses[engine] = [r["loss"] for r in recs]
    assert losses["lazytrain"] == pytest.approx(losses["torch"], rel=1e-5)
    capsys.readouterr()
    assert_refused_in_one_line(cli.main, ov, [(["data.pack_rows=true"], "data.pack_rows=true: rows packed into one "
                                               "sequence would see each other in gpt_oss")], tmp_path / "never", capsys)
