"""data.doc_mask=true on text: the plan counts the masks (job.packed_rows), the streamed executor
trains exactly as plain PyTorch with the documents kept apart, and what cannot be is refused."""

import json

import pytest

from lazytrain.cli import train as cli
from recipe_helpers import assert_refused_in_one_line, tiny_gpt_oss_dir


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _documents(tmp_path):
    """A JSONL file of short documents (one sentence of prose each), several to a 128-token sequence."""
    from recipe_helpers import TEXT

    docs = [f"{line.strip()} ({i})" for i in range(8) for line in TEXT.split(".") if line.strip()]
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return f


def test_documents_kept_apart_train_alike_on_the_executor_and_plain_pytorch(base_overrides, tmp_path):
    common = [a for a in base_overrides if not a.startswith(("job.max_steps", "data.files"))] + [
        f"data.files=[{_documents(tmp_path)}]", "job.max_steps=3", "save_every=0",
        "job.seq_len=128"]   # (several documents to a sequence)
    runs = {"torch": [], "lazytrain": ["hardware.device_memory_gib=0.004", "hardware.workspace_gib=0.0001"],
            "apart": ["data.doc_mask=false"]}
    for name, extra in runs.items():
        engine = "torch" if name == "apart" else name
        assert cli.main([*common, "data.doc_mask=true" if name != "apart" else "data.doc_mask=false", *extra,
                         f"engine={engine}", f"output_dir={tmp_path / name}"]) == 0
    plan = json.loads((tmp_path / "lazytrain" / "plan.json").read_text())
    assert plan["job"]["packed_rows"] is True
    assert _losses(tmp_path / "lazytrain") == pytest.approx(_losses(tmp_path / "torch"), rel=1e-5)
    # (the masks and the unlearned document starts make a difference: the test would pass with neither)
    assert _losses(tmp_path / "apart") != pytest.approx(_losses(tmp_path / "torch"), rel=1e-3)


def test_bad_doc_mask_settings_are_one_line(base_overrides, tmp_path, capsys):
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Q{i}", "completion": f" A{i}."}) + "\n" for i in range(20)))
    assert_refused_in_one_line(cli.main, base_overrides, (
        (["data.doc_mask=1"], "data.doc_mask must be true or false, got 1"),
        ([f"data.files=[{sft}]", "data.prompt_field=prompt", "data.text_field=completion", "data.doc_mask=true"],
         "data.doc_mask=true is for text documents"),
        (["data.doc_mask=true", "job.packed_rows=false"],
         "job.packed_rows=false but the data is text documents kept apart (data.doc_mask=true)")),
        tmp_path / "never", capsys)


def test_a_model_that_cannot_keep_documents_apart_is_refused(base_overrides, tmp_path, capsys):
    """GPT-OSS builds its masks without the position ids: documents would see each other."""
    ov = [a for a in base_overrides if not a.startswith("model")] + [f"model.path={tiny_gpt_oss_dir(tmp_path)}"]
    assert_refused_in_one_line(cli.main, ov, [(["data.doc_mask=true"], "data.doc_mask=true: documents packed into "
                                               "one sequence would see each other in gpt_oss")],
                               tmp_path / "never", capsys, alone=False)


def test_a_resume_with_doc_mask_changed_says_so(base_overrides, tmp_path, capsys):
    common = [a for a in base_overrides if not a.startswith(("job.max_steps", "data.files"))] + [
        f"data.files=[{_documents(tmp_path)}]", "job.seq_len=64", "save_every=1", f"output_dir={tmp_path / 'run'}"]
    assert cli.main([*common, "job.max_steps=2", "data.doc_mask=false"]) == 0
    capsys.readouterr()
    assert cli.main([*common, "job.max_steps=3", "data.doc_mask=true", "resume=true"]) == 2
    err = capsys.readouterr().err
    assert "the checkpoint was written with data.doc_mask=false, this run has true" in err, err
