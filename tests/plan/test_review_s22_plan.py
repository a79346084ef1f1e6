"""Session 22: a suggestion check cut by the suggestions' own time cap vs by planner.time_limit_s."""

import pytest

from lazytrain.cli.config import hardware_spec, job_spec, load_config, model_spec, planner_options
from lazytrain.plan import plan_job, solve


@pytest.mark.parametrize("planner_limit,marked", [(30.0, False), (1.0, True)])
def test_only_planner_time_limit_cuts_mark_the_answer(tmp_path, monkeypatch, planner_limit, marked):
    """Every suggestion check that does not plan is made to count as cut by its time limit. Cut by
    the suggestions' own cap (below planner.time_limit_s), a check's suggestion is just not made:
    the answer does not depend on planner.time_limit_s and is cached (session 17). The session-21
    fix marked every cut check, which told the user to raise planner.time_limit_s, a limit that
    does not govern these checks, and kept the answer out of the cache (a test of session 17 failed
    only when a check happened to be cut: CI, 2026-12-02). Cut by planner.time_limit_s itself
    (at or below the cap), the answer is marked and not cached (session 21)."""
    monkeypatch.setattr(solve, "SUGGESTION_TIME_LIMIT_S", 1.0)
    monkeypatch.setattr(solve, "timed_out", lambda p: not p.fits)
    checks = []
    check0 = solve._check

    def check(*a):
        checks.append(a[2].mode)
        return check0(*a)

    monkeypatch.setattr(solve, "_check", check)
    # (the session-21 case: its advice checks LoRA, NVMe and host-memory suggestions)
    cfg = load_config(["model=llama3.1-405b", "hardware=rtx3090", "hardware.host_memory_gib=64",
                       f"planner.time_limit_s={planner_limit}"])
    p = plan_job(model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg), cache_dir=tmp_path)
    assert not p.fits and checks, (checks, p.explanation)
    assert any("time_limit_s" in line for line in p.explanation) == marked, p.explanation
    assert bool(list(tmp_path.glob("*.json"))) == (not marked)
