"""`lazytrain plan trace` after a resume (review, 2026-12-01): a resume that planned again (another
budget) overwrote plan.json, and its steps and the earlier ones were compared with it alike; the
resumed process's first step (a warm-up) counted in the medians."""

import json

from lazytrain.cli import plan as plan_cli
from lazytrain.cli import train as cli
from lazytrain.plan.tracecmp import compare_run


def test_trace_leaves_out_steps_run_under_another_plan_and_each_process_warm_up(base_overrides, tmp_path, capsys):
    out = tmp_path / "run"
    args = [*base_overrides, "engine=lazytrain", "job.max_steps=6", "save_every=1", "save_final_model=false",
            f"output_dir={out}"]
    assert cli.main([*args, "hardware.device_memory_gib=0.002", "hardware.workspace_gib=0.0001",
                     "stop_at_step=3"]) == 0
    # resumed with room for everything: another plan, plan.json overwritten
    assert cli.main([*args, "resume=true", "hardware.device_memory_gib=1"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    pred = [r["predicted_step_time_s"] for r in rows]
    assert pred[0] == pred[2] != pred[3] == pred[5], pred
    capsys.readouterr()
    c = compare_run(out)
    # steps 1-3 ran another plan; step 4 (trace step 3) is the resumed process's warm-up
    assert c.steps == (4, 5), c.steps
    assert any("3 step(s) ran under another plan than plan.json" in n and ": 1..3" in n for n in c.notes), c.notes
    assert plan_cli.main(["trace", str(out)]) == 0
    assert "median over steps 5..6" in capsys.readouterr().out


def test_an_eval_file_that_is_also_trained_on_is_refused(base_overrides, tmp_path, capsys):
    f = next(a.split("=", 1)[1].strip("[]") for a in base_overrides if a.startswith("data.files="))
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "train.txt").write_bytes(open(f, "rb").read())
    (d / "val.txt").write_bytes(open(f, "rb").read()[:4000])
    args = [a for a in base_overrides if not a.startswith("data.files=")]
    rc = cli.main([*args, f"data.files=[{d}]", f"data.eval_files=[{d / 'val.txt'}]", "job.max_steps=1",
                   f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "val.txt is also trained on (reached through data.files): not held out" in err, err


def test_demo_data_in_a_cache_dir_that_cannot_be_made_is_one_line(tmp_path, capsys):
    rc = cli.main(["data=demo", "data.cache_dir=/proc/lazytrain-demo", "job.max_steps=1",
                   f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "data.cache_dir /proc/lazytrain-demo: the built-in corpus cannot be built there" in err


def test_the_eval_summary_says_what_the_last_partial_sequence_left_out(base_overrides, tmp_path, capsys):
    f = next(a.split("=", 1)[1].strip("[]") for a in base_overrides if a.startswith("data.files="))
    ev = tmp_path / "ev.txt"
    ev.write_bytes(open(f, "rb").read()[:3000])
    rc = cli.main([*base_overrides, f"data.eval_files=[{ev}]", "job.max_steps=2", f"output_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert rc == 0
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0 < s["eval_tail_tokens"] < 32
    assert f"the last {s['eval_tail_tokens']} tokens, short of a sequence, not evaluated" in out
