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
    assert (tmp_path / "cache" / "corpus-v2" / "train.txt").stat().st_size > 200_000  # real prose
    plan = json.loads((out / "plan.json").read_text())
    assert any(d["param_tier"] != "device" for d in plan["layers"])  # the demo's plan streams
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and recs[-1]["loss"] < recs[0]["loss"]
    assert json.loads((out / "summary.json").read_text())["engine"] == "lazytrain"


def test_the_demo_corpus_trains_with_a_boundary_after_every_document(tmp_path):
    """Read as one text file, the corpus's ~90 documents had no EOS between them (review): the
    training file has one row per document, each ending with EOS in the token stream."""
    from lazytrain.data.corpus import build_corpus
    from lazytrain.data.dataset import load_tokenizer, tokenize_files
    from lazytrain.data.tokenizer import build_tokenizer

    train_txt, _ = build_corpus(tmp_path / "corpus")
    train_docs, val_docs = build_corpus(tmp_path / "corpus", documents=True)
    rows = [json.loads(line)["text"] for line in train_docs.read_text().splitlines()]
    assert len(rows) > 50 and "\n\n".join(rows) + "\n" == train_txt.read_text()
    tok = load_tokenizer(build_tokenizer([train_txt], tmp_path / "tok", vocab_size=512))
    ids = tokenize_files([train_docs], tok)
    assert int((ids == tok.eos_token_id).sum()) == len(rows)
