"""Fixes from the session-17 review of the planner: heuristics that used NVMe with
planner.allow_nvme=false (a device minimum the planner could not reach), ..."""

from dataclasses import replace

import pytest

from lazytrain.cli.config import hardware_spec, job_spec, load_config, model_spec, planner_options
from lazytrain.plan import min_device_bytes, plan_job
from lazytrain.plan.heuristics import HEURISTICS

GiB = 2**30


def _specs(*overrides):
    cfg = load_config(list(overrides))
    return model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg)


def test_nvme_off_holds_for_the_heuristics_and_the_advised_minimum():
    """offload-all pinned its parameters and optimizer state to NVMe even with NVMe off: the
    infeasibility advice quoted its 4.6 GiB minimum (below the 6 GiB just called too small; the real
    one, with NVMe off, is 13.7 GiB), and `plan compare` listed it as fitting, 105 GiB on NVMe."""
    m, hw, job, opts = _specs("model=llama3-8b", "hardware=rtx3090", "job.seq_len=1024", "planner.allow_nvme=false",
                              "hardware.host_memory_gib=133", "hardware.device_memory_gib=6")
    need = min_device_bytes(m, hw, job, opts)
    assert need > 6 * GiB
    at = plan_job(m, replace(hw, device_memory_gib=need / GiB + 0.01), job, opts, cache_dir=None, explain=False)
    assert at.fits and at.predicted.peak_bytes["nvme"] == 0
    for name in HEURISTICS:
        p = plan_job(m, replace(hw, device_memory_gib=24), job, opts, cache_dir=None, explain=False,
                     method=f"heuristic:{name}")
        assert not p.fits or p.predicted.peak_bytes["nvme"] == 0, name
        assert all("nvme" not in (d.param_tier, d.optimizer_tier, d.grad_tier, d.activation_tier) for d in p.layers)


@pytest.fixture
def tiny():
    return _specs("model=tiny-llama", "hardware=cpu")[:3]


@pytest.mark.parametrize("edit", ["status", "tokens_per_s", "compute_s", "solver", "explanation", "no_checksum"])
def test_cache_entries_edited_where_the_replay_cannot_tell_are_re_solved(tiny, tmp_path, caplog, edit):
    """Review: a status flipped to infeasible made a fitting job exit 2 with the fitting plan's
    explanation as advice; an edited tokens/s, compute time, solver status or explanation was
    printed as it read. Every cache entry now carries a checksum of its contents."""
    import json
    import logging

    model, h, job = tiny
    plan = plan_job(model, h, job, cache_dir=tmp_path)
    f = tmp_path / f"{plan.input_hash}.json"
    d = json.loads(f.read_text())
    if edit == "status":
        d["status"] = "infeasible"
    elif edit == "tokens_per_s":
        d["predicted"]["tokens_per_s"] = 1e9
    elif edit == "compute_s":
        d["predicted"]["compute_s"] = 99.0
    elif edit == "solver":
        d["solver"]["gap"] = 0.5
    elif edit == "explanation":
        d["explanation"] = ["an invented line"]
    else:
        d.pop("entry_sha256")
    f.write_text(json.dumps(d))
    with caplog.at_level(logging.WARNING):
        again = plan_job(model, h, job, cache_dir=tmp_path)
    assert "damaged plan cache entry" in caplog.text
    assert (again.status, again.predicted, again.layers, again.explanation, again.solver.gap) == \
        (plan.status, plan.predicted, plan.layers, plan.explanation, plan.solver.gap)
    caplog.clear()
    with caplog.at_level(logging.WARNING):   # the re-solved entry is written back, whole: a hit
        assert plan_job(model, h, job, cache_dir=tmp_path) == again
    assert "cache entry" not in caplog.text


@pytest.mark.parametrize("hardware", ["rtx3090", "cpu"])
def test_the_step_breakdown_names_the_optimizer_it_waits_for(hardware):
    """Review: on a GPU profile (the host optimizer overlapped) the summary called the optimizer's
    unhidden time "exposed transfers": 11.2 s of an 8B step whose transfers take 2.7 s in all. The
    parts now add up to the step with the optimizer's own share, and transfers never exceed the
    links' busy time."""
    from lazytrain.plan.render import summary_lines
    from lazytrain.plan.solve import simulate_plan

    m, hw, job, opts = _specs("model=tiny-llama", f"hardware={hardware}", "job.mode=full")
    p = plan_job(m, hw, job, opts, cache_dir=None)
    d = p.predicted
    assert d.compute_s + d.recompute_s + d.serial_optimizer_s + d.exposed_optimizer_s + d.exposed_transfer_s == \
        pytest.approx(d.step_time_s)
    links = sum(e.end_s - e.start_s for e in simulate_plan(p).events
                if e.resource in ("h2d", "d2h", "nvme_read", "nvme_write"))
    assert d.exposed_transfer_s <= links + 1e-9
    line = summary_lines(p)[3]
    if hardware == "rtx3090":   # overlapped: its unhidden part is named as the optimizer's
        assert d.exposed_optimizer_s > 0.5 * d.step_time_s and "optimizer (not hidden)" in line
    else:                       # on the CPU it runs on the computing cores, said as before
        assert d.exposed_optimizer_s == 0 and d.serial_optimizer_s > 0 and "optimizer (not overlapped)" in line


def test_the_reported_gap_bounds_every_heuristic():
    """Review: the MILP said optimal, gap 0.00%, for a plan 0.044% slower than checkpoint-all's (the
    heuristics are pinned points of the same model). Its symmetry-breaking rows are not exact for
    the step time; the status and gap are now the free model's (the re-solve without the rows), so
    no feasible plan of the cost model beats the reported plan by more than its gap."""
    m, hw, job, opts = _specs("model=mixtral-8x7b", "hardware=a100-80g", "job.seq_len=2048")
    p = plan_job(m, hw, job, opts, cache_dir=None, explain=False)
    assert p.fits and p.solver.gap is not None
    for name in HEURISTICS:
        h = plan_job(m, hw, job, opts, cache_dir=None, explain=False, method=f"heuristic:{name}")
        if h.fits:
            assert p.predicted.step_time_s <= h.predicted.step_time_s * (1 + p.solver.gap) * (1 + 1e-9), name


@pytest.mark.parametrize("setting,msg", [("job.compute_dtype=fp8", "job.compute_dtype must be one of bf16"),
                                         ("job.compute_dtype=int8", "job.compute_dtype must be one of bf16"),
                                         ("job.lora_alpha=abc", "job.lora_alpha must be a number > 0"),
                                         ("job.lora_alpha=0", "job.lora_alpha must be a number > 0")])
def test_plan_refuses_what_train_cannot_run(setting, msg, capsys):
    """Review: `plan` planned an fp8 job (1-byte weights and activations: a bigger batch, a faster
    step) that `train` refuses and nothing computes, and a non-numeric lora_alpha that failed only
    inside LoRA's setup."""
    from lazytrain.cli.main import main as cli_main

    assert cli_main(["plan", "model=tiny-llama", "job.mode=lora", setting, "planner.cache=false"]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


@pytest.mark.parametrize("damage", ["nopeak", "segstart", "optnull", "gapstr"])
def test_plan_show_of_a_damaged_plan_file_is_one_line(damage, tmp_path, capsys):
    """Review: `plan show` on a plan file with one field damaged gave a KeyError, IndexError or
    AttributeError traceback (or a format error naming no file)."""
    import json

    from lazytrain.cli.main import main as cli_main

    good = tmp_path / "plan.json"
    assert cli_main(["plan", "model=tiny-llama", "planner.cache=false", "--json", str(good)]) == 0
    d = json.loads(good.read_text())
    if damage == "nopeak":
        d["predicted"]["peak_bytes"] = {}
    elif damage == "segstart":
        d["layers"][2].update(recompute=True, segment_start=99)
    elif damage == "optnull":
        d["options"] = None
    else:
        d["solver"]["gap"] = "x"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    capsys.readouterr()
    assert cli_main(["plan", "show", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(bad) in err and "not a" in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert cli_main(["plan", "show", str(good)]) == 0   # an intact file still shows


def test_every_k_keeps_to_max_segment_len_and_the_advised_minimum_plans():
    """Review: every-k pinned 4-block segments whatever planner.max_segment_len said; with 1 the
    advice quoted every-k's 15.71 GiB minimum, and planning at 15.71 GiB gave the same advice again."""
    m, hw, job, opts = _specs("model=llama3-8b", "hardware=rtx3090", "job.mode=lora", "job.seq_len=8192",
                              "hardware.nvme_capacity_gib=0", "hardware.host_memory_gib=24",
                              "planner.max_segment_len=1", "hardware.device_memory_gib=15")
    need = min_device_bytes(m, hw, job, opts)
    assert plan_job(m, replace(hw, device_memory_gib=need / GiB + 0.005), job, opts, cache_dir=None,
                    explain=False).fits
    p = plan_job(m, replace(hw, device_memory_gib=40), job, opts, cache_dir=None, explain=False,
                 method="heuristic:every-k")
    starts = [d.segment_start for d in p.layers if d.recompute]
    assert all(starts.count(s) <= 1 for s in starts)   # segments of one block


def test_the_run_summary_median_is_plan_traces():
    """Review: the summary took the upper median of an even number of steps (5.36 s of 2.55 and
    5.36 s) where `plan trace` said 3.96 s."""
    from lazytrain.recipes.engines import StepStats
    from lazytrain.recipes.train import summarize

    m, hw, job, opts = _specs("model=tiny-llama")
    plan = plan_job(m, hw, job, opts, cache_dir=None, explain=False)
    hist = [StepStats(loss=1.0, grad_norm=None, skipped=False, step_time_s=t, device_peak_bytes=0, tokens=64)
            for t in (9.0, 2.5, 5.5)]   # (the first step is warm-up, left out)
    assert summarize(hist, plan, 0, 3, 20.0)["measured_step_time_s"] == 4.0


def test_cbc_reports_no_gap_it_does_not_know():
    """Review: CBC's plans said gap 0.00% even after a time limit (PuLP reports no gap for it)."""
    m, hw, job, opts = _specs("model=tiny-llama", "planner.solver=cbc")
    p = plan_job(m, hw, job, opts, cache_dir=None, explain=False)
    assert p.fits and p.solver.name == "cbc" and p.solver.gap is None


def test_plan_and_train_use_one_cache_dir(tmp_path, monkeypatch):
    """Review: `plan` resolved a relative planner.cache_dir under the checkout when the current dir
    had none, `train` always under the current dir: train missed plan's cached plans (the default
    solver_cache too, run from elsewhere) and could run another plan than the one shown."""
    from lazytrain.cli import config as c

    cfg = load_config(["planner.cache_dir=relcache"])
    absolute = load_config([f"planner.cache_dir={tmp_path}/abs"])
    checkout, elsewhere = tmp_path / "checkout", tmp_path / "cwd"
    (checkout).mkdir()
    (checkout / "pyproject.toml").write_text("")
    elsewhere.mkdir()
    monkeypatch.setattr(c, "repo_root", lambda: checkout)
    monkeypatch.chdir(elsewhere)
    assert c.planner_cache_dir(cfg) == checkout / "relcache"       # the checkout's shared cache
    (elsewhere / "relcache").mkdir()
    assert c.planner_cache_dir(cfg) == elsewhere / "relcache"      # one here wins
    (checkout / "pyproject.toml").unlink()   # an installed package's folder is no cache
    (elsewhere / "relcache").rmdir()
    assert c.planner_cache_dir(cfg) == elsewhere / "relcache"
    assert c.planner_cache_dir(absolute) == tmp_path / "abs"



def test_plan_with_no_measured_profile_says_to_profile(tmp_path, monkeypatch, capsys):
    """Review: `plan hardware=measured` before `lazytrain profile` said only that Hydra could not
    find 'hardware/measured' (train said what to run)."""
    import shutil

    from lazytrain.cli.config import config_dir
    from lazytrain.cli.main import main as cli_main

    cfgs = tmp_path / "configs"
    shutil.copytree(config_dir(), cfgs)
    (cfgs / "hardware" / "measured.yaml").unlink(missing_ok=True)
    monkeypatch.setenv("LAZYTRAIN_CONFIG_DIR", str(cfgs))
    assert cli_main(["plan", "hardware=measured"]) == 2
    assert "run `lazytrain profile hardware=NAME" in capsys.readouterr().err


def test_compare_marks_a_timed_out_milps_fallback(monkeypatch, capsys):
    """Review: `plan compare` showed the heuristic plan a timed-out MILP returned as the MILP's row."""
    import lazytrain.plan as planmod
    from lazytrain.cli.main import main as cli_main
    from lazytrain.plan.plan import FALLBACK_DETAIL

    real = planmod.plan_job

    def timed_out(*a, method="milp", **kw):
        p = real(*a, method=method, **kw)
        if method != "milp":
            return p
        return replace(p, solver=replace(p.solver, status_detail=f"{FALLBACK_DETAIL}0.01 s hit before the MILP "
                                                               f"found a plan; best heuristic (every-k) returned"))
    monkeypatch.setattr(planmod, "plan_job", timed_out)
    assert cli_main(["plan", "compare", "model=tiny-llama", "planner.cache=false"]) == 0
    out = capsys.readouterr().out
    assert "milp (fallback: every-k)" in out and "best heuristic (every-k) returned" in out


def test_max_batch_says_when_the_time_limit_cut_its_search(capsys):
    """Review: a time-limited probe counted as 'does not fit': every row 0 and exit 2 at a 1 ms limit
    for a job `plan` plans, or the MILP's max batch below the heuristics'."""
    from lazytrain.cli.main import main as cli_main

    assert cli_main(["plan", "max-batch", "model=llama3-8b", "hardware=rtx3090", "planner.time_limit_s=0.001",
                     "planner.cache=false"]) == 0
    out = capsys.readouterr().out
    assert "(time limit)" in out and "lower bounds; raise planner.time_limit_s" in out


def test_an_explanation_built_on_a_timed_out_search_is_not_cached(tiny, tmp_path, monkeypatch):
    """Review: a proven infeasibility was explained from sub-solves that hit the time limit ('hit the
    time limit before finding any plan or proving none fits', or a wrong largest batch) and the
    explanation was cached and served on every rerun."""
    from lazytrain.plan import solve

    model, h, job = tiny
    real = solve.min_device_bytes

    def timed_out(*a, **kw):
        return solve.TIMED_OUT
    monkeypatch.setattr(solve, "min_device_bytes", timed_out)
    p = plan_job(model, replace(h, device_memory_gib=0.0001), job, cache_dir=tmp_path)
    assert not p.fits and "(proven)" in p.explanation[0] and "time_limit_s" in p.explanation[0]
    assert not list(tmp_path.glob("*.json"))   # not cached
    monkeypatch.setattr(solve, "min_device_bytes", real)
    p = plan_job(model, replace(h, device_memory_gib=0.0001), job, cache_dir=tmp_path)
    assert "needs at least" in p.explanation[0] and list(tmp_path.glob("*.json"))   # a full answer is


def test_hydras_ways_to_write_a_list_are_kept_and_the_seq16_floor_is_rounded_alike(capsys):
    """Review: `job.lora_targets=q_proj,v_proj` said only 'Ambiguous value' (Hydra's next lines, how
    to write a list, were cut); and the advice rounded the seq-16 floor up to 2 decimals (0.26 GiB)
    but the job's need to 3 digits (0.252): the shorter sequence looked hungrier."""
    import re

    from lazytrain.cli.main import main as cli_main

    assert cli_main(["plan", "job.lora_targets=q_proj,v_proj"]) == 2
    assert "use a list, job.lora_targets=[a,b], or quote it" in capsys.readouterr().err
    assert cli_main(["plan", "model=tiny-llama", "hardware.device_memory_gib=0.01", "planner.cache=false"]) == 2
    io = capsys.readouterr()
    out = io.out + io.err
    need = float(re.search(r"needs at least ([0-9.]+) GiB", out).group(1))
    floor = float(re.search(r"job.seq_len=16 \(it needs ([0-9.]+) GiB", out).group(1))
    assert floor <= need


def test_without_nvme_capacity_the_host_only_fix_is_offered_and_plans():
    """Review: with NVMe capacity 0 the advice said the job needs ~137 GiB of host + NVMe (the
    NVMe layout's total, staging buffers included; everything on the host needs 119.7) and offered
    only NVMe; more host memory plans it too."""
    import re

    m, hw, job, opts = _specs("model=llama3-8b", "hardware=rtx3090", "job.seq_len=2048",
                              "hardware.nvme_capacity_gib=0", "hardware.host_memory_gib=64")
    p = plan_job(m, hw, job, opts, cache_dir=None)
    text = " ".join(p.explanation)
    # (since 2026-12-01 the floor is the host-only layouts' themselves: another review)
    assert not p.fits and "with no NVMe capacity" in text, text
    host = float(re.search(r"add host memory \(hardware.host_memory_gib=([0-9.]+)\)", text).group(1))
    assert plan_job(m, replace(hw, host_memory_gib=host), job, opts, cache_dir=None, explain=False).fits


def test_the_chunked_loss_suggestion_on_a_cpu_device_grows_the_host_too():
    """Review: on a CPU device the chunked-loss suggestion quoted the lower device need alone, which
    did not plan: a CPU device's memory comes out of host RAM, so the host must grow with it."""
    import re

    m, hw, job, opts = _specs("model=small-llama", "job.batch_size=64", "job.seq_len=512",
                              "hardware.device_memory_gib=1", "hardware.host_memory_gib=5.2")
    text = " ".join(plan_job(m, hw, job, opts, cache_dir=None).explanation)
    got = re.search(r"job.loss_chunk_tokens=1024 [^;]*hardware.device_memory_gib=([0-9.]+) and "
                    r"hardware.host_memory_gib=([0-9.]+)", text)
    assert got, text
    dev, host = float(got.group(1)), float(got.group(2))
    assert plan_job(m, replace(hw, device_memory_gib=dev, host_memory_gib=host), replace(job, loss_chunk_tokens=1024),
                    opts, cache_dir=None, explain=False).fits


def test_a_suggestion_check_cut_by_its_cap_does_not_mark_the_answer(tmp_path, monkeypatch):
    """Review of the above: every solver time-out during the explanation was counted, the capped
    suggestion checks' included (and those a heuristic fallback answered), so an infeasible answer
    told the user to raise a limit that does not govern them, and was never cached."""
    from lazytrain.plan import solve

    monkeypatch.setattr(solve, "SUGGESTION_TIME_LIMIT_S", 0.001)   # (10 s: a large model's checks)
    m, hw, job, opts = _specs("model=tiny-llama", "hardware=cpu", "hardware.device_memory_gib=0.05",
                              "job.seq_len=256")
    p = plan_job(m, hw, job, opts, cache_dir=tmp_path)
    assert not p.fits and "needs at least" in p.explanation[0]
    assert not any("time_limit_s" in line for line in p.explanation)
    assert list(tmp_path.glob("*.json"))   # cached


def test_export_deepspeed_refuses_a_damaged_plan_file(tmp_path, capsys):
    """Review: export-deepspeed turned plan files `plan show` refuses (no peaks, a bogus tier, a
    segment start outside the plan) into DeepSpeed configs, exit 0."""
    import json

    from lazytrain.cli.main import main as cli_main
    from lazytrain.cli.plan_export import main as export_main

    good = tmp_path / "plan.json"
    assert cli_main(["plan", "model=tiny-llama", "planner.cache=false", "--json", str(good)]) == 0
    d = json.loads(good.read_text())
    d["layers"][2]["param_tier"] = "gpu9"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    capsys.readouterr()
    assert export_main([str(bad), "--out", str(tmp_path / "ds.json")]) == 2
    assert "not a lazytrain plan" in capsys.readouterr().err and not (tmp_path / "ds.json").exists()
    assert export_main([str(good), "--out", str(tmp_path / "ds.json")]) == 0


def test_a_hand_plan_recomputing_the_head_is_not_replayed_as_another_plan():
    """Review: a (hand-made) plan whose recompute segment spans the embedding or head runs in the
    executor, but the cost model dropped those layers and predicted another plan's peak (16-21% low);
    it says it cannot predict them now. The planner never makes such plans."""
    from lazytrain.plan.solve import assignment_of
    from lazytrain.runtime.testing import hand_plan

    from lazytrain.plan.cache import malformed

    assignment_of(hand_plan(3, segments=[(1, 3)]))   # blocks only: replayed
    for segments, layer in (([(0, 4)], "embed"), ([(1, 2), (3, 4)], "head")):
        plan = hand_plan(3, segments=segments)
        with pytest.raises(ValueError, match=f"{layer}: a recompute segment over the"):
            assignment_of(plan)
        timed = replace(plan, predicted=replace(plan.predicted, step_time_s=1.0))   # (as a file has)
        assert malformed(timed) == ""   # a plan the executor runs: `plan show` still shows it
