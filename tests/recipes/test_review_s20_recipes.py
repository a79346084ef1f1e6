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
