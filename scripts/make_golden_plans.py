"""Regenerate the golden plans committed in solver_cache/golden/ (a regression guard: the test
suite re-plans each and expects the same predicted step time).

    .venv/bin/python scripts/make_golden_plans.py
"""

from pathlib import Path

from lazytrain.cli.config import hardware_spec, job_spec, load_config, model_spec, planner_options
from lazytrain.plan import plan_job

JOBS = {
    "tiny-llama_cpu_full": ["model=tiny-llama", "hardware=cpu"],
    "llama3-8b_rtx3090_full_s2048": ["model=llama3-8b", "hardware=rtx3090", "job.seq_len=2048"],
    "llama3-8b_rtx3090_lora_b4_s2048": ["model=llama3-8b", "hardware=rtx3090", "job.mode=lora",
                                        "job.batch_size=4", "job.seq_len=2048"],
    "mixtral-8x7b_rtx3090_lora_s1024": ["model=mixtral-8x7b", "hardware=rtx3090", "job.mode=lora",
                                        "job.seq_len=1024"],
}


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "solver_cache" / "golden"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json"):
        old.unlink()
    for name, overrides in JOBS.items():
        cfg = load_config(overrides)
        plan = plan_job(model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg),
                        cache_dir=None)
        assert plan.fits, name
        (out / f"{name}.json").write_text(plan.to_json())
        print(f"{name}: {plan.status} step {plan.predicted.step_time_s:.4g} s  -> {name}.json")


if __name__ == "__main__":
    main()
