"""`lazytrain demo`: builds the real-text corpus and tokenizer, plans for a small budget, trains."""

import json

from lazytrain.cli import demo


def test_demo_runs_on_real_text_with_the_streaming_engine(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "demo"
    rc = demo.main([f"data.cache_dir={tmp_path / 'cache'}", "job.max_steps=6", "optim.warmup_steps=2",
                    "progress=false", f"output_dir={out}", f"planner.cache_dir={tmp_path / 'sc'}"])
    io = capsys.readouterr()
    assert rc == 0, io.err
    assert "loss curve: 1:" in io.out and "predicted" in io.out and "held-out loss" in io.out
    assert (tmp_path / "cache" / "corpus" / "train.txt").stat().st_size > 200_000  # real prose
    plan = json.loads((out / "plan.json").read_text())
    assert any(d["param_tier"] != "device" for d in plan["layers"])  # the demo's plan streams
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and recs[-1]["loss"] < recs[0]["loss"]
    assert json.loads((out / "summary.json").read_text())["engine"] == "lazytrain"
