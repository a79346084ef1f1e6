"""Plan CLI and profile review (2026-12-01, second): budgets echoed rounded ("does not fit 0.01 GiB"
for 0.006), a timed-out MILP's fallback named as a heuristic whose plan `plan compare` shows
slower, --plot formats matplotlib cannot write here, hardware files that are not mappings or are
cut short, and `lazytrain profile` refusing overrides after an option."""

import shutil

import pytest

from lazytrain.cli import config as C
from lazytrain.cli.main import main as cli_main


TINY = ["model=tiny-llama", "model.hf_config.vocab_size=2048", "hardware=cpu", "planner.cache=false"]


def test_an_infeasible_budget_is_echoed_as_given(capsys):
    rc = cli_main(["plan", *TINY, "hardware.device_memory_gib=0.006", "hardware.workspace_gib=0.002"])
    err = capsys.readouterr()
    assert rc == 2
    text = err.out + err.err
    assert "does not fit 0.006 GiB" in text and "0.01 GiB" not in text, text


def test_a_plans_explanation_gives_its_peak_and_budget_unrounded(capsys):
    assert cli_main(["plan", *TINY, "hardware.device_memory_gib=0.009", "hardware.workspace_gib=0.002"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "device peak" in ln and "budget," in ln)
    assert " of 0.009 GiB budget" in line and "0.01 GiB of 0.01 GiB" not in line, line


def test_a_fallback_whose_tiers_were_improved_says_so(capsys):
    rc = cli_main(["plan", "compare", "model=llama3-8b", "hardware=rtx3090", "job.seq_len=2048",
                   "planner.time_limit_s=0.01", "planner.cache=false"])
    out = capsys.readouterr().out
    assert rc == 0
    row = next((r for r in out.splitlines() if "milp (fallback:" in r), None)
    if row is None:
        pytest.skip("the MILP finished within 0.01 s here")
    name = row.split("milp (fallback: ", 1)[1].split(",", 1)[0].split(")", 1)[0]
    heur = next(r for r in out.splitlines() if f" heuristic:{name} " in r)
    if row.split("│")[2:5] != heur.split("│")[2:5]:   # other figures than the heuristic's own row
        assert "tiers improved" in row, (row, heur)
        assert "its tiers then made faster by simplify" in out


def test_a_plot_format_matplotlib_cannot_write_here_is_one_line_and_writes_nothing(tmp_path, capsys):
    import matplotlib.backends.backend_pgf  # noqa: F401
    if shutil.which("xelatex"):
        pytest.skip("xelatex is installed: pgf can be written here")
    j, p = tmp_path / "p.json", tmp_path / "p.pgf"
    rc = cli_main(["plan", *TINY, "--json", str(j), "--plot", str(p)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--plot" in err and "nothing written" in err, err
    assert not j.exists()


@pytest.fixture
def configs(tmp_path, monkeypatch):
    d = tmp_path / "configs"
    shutil.copytree(C.config_dir(), d)
    monkeypatch.setenv("LAZYTRAIN_CONFIG_DIR", str(d))
    return d


def test_a_hardware_file_that_is_a_list_is_one_line(configs, capsys):
    (configs / "hardware" / "measured.yaml").write_text("[1, 2]\n")
    assert cli_main(["plan", "hardware=measured", "planner.cache=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "measured.yaml holds a list, not a mapping" in err, err


def test_a_measured_profile_cut_short_is_refused_not_filled_with_defaults(configs, capsys):
    import yaml
    full = yaml.safe_load((configs / "hardware" / "cpu.yaml").read_text())
    full["name"] = "measured"
    (configs / "hardware" / "measured.yaml").write_text(yaml.safe_dump(full, sort_keys=False))
    assert cli_main(["plan", "hardware=measured", *TINY[:2], "planner.cache=false"]) == 0   # whole: plans
    capsys.readouterr()
    cut = "".join(yaml.safe_dump(full, sort_keys=False).splitlines(keepends=True)[:-3])
    (configs / "hardware" / "measured.yaml").write_text(cut)
    assert cli_main(["plan", "hardware=measured", *TINY[:2], "planner.cache=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert "the measured profile lacks" in err and "run `lazytrain profile` again" in err, err


def test_profile_takes_overrides_after_an_option(monkeypatch, tmp_path):
    from lazytrain.cli import profile as P
    args, _ = P._parse(["hardware=cpu", "--nvme-dir", str(tmp_path), "model=tiny-llama", "--no-layers"])
    assert args.overrides == ["hardware=cpu", "model=tiny-llama"] and args.nvme_dir == str(tmp_path)


def test_step_ranges():
    from lazytrain.plan.tracecmp import step_ranges
    assert step_ranges([1, 2, 3, 5, 7, 8]) == "1..3, 5, 7..8"
    assert step_ranges([4]) == "4"


def test_a_profile_timed_for_other_numerics_is_said(configs, capsys, caplog):
    """measured.profile.json records the compute dtype and optimizer bits it was timed with; a job
    with others was planned with its rates silently (review)."""
    import json

    import yaml
    full = yaml.safe_load((configs / "hardware" / "cpu.yaml").read_text())
    full["name"] = "measured"
    (configs / "hardware" / "measured.yaml").write_text(yaml.safe_dump(full, sort_keys=False))
    det = configs / "hardware" / "measured.profile.json"
    det.write_text(json.dumps({"compute_dtype": "fp32", "host_optimizer_state_bits": 8, "layers": []}))
    args = ["plan", "hardware=measured", *TINY[:2], "planner.cache=false"]
    with caplog.at_level("WARNING", logger="lazytrain"):
        assert cli_main([*args, "job.compute_dtype=bf16"]) == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "timed with compute in fp32 (this job: bf16) and 8-bit optimizer states (this job: 32-bit)" in said
    caplog.clear()
    with caplog.at_level("WARNING", logger="lazytrain"):   # the same numerics: nothing said
        assert cli_main([*args, "job.compute_dtype=fp32", "job.optimizer_state_bits=8"]) == 0
    assert "measured hardware profile" not in " ".join(r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("edit, says", [
    (lambda d: d["layers"][0].__setitem__("name", 5), "name 5"),
    (lambda d: d["predicted"].__setitem__("tokens_per_s", "fast"), "tokens_per_s 'fast'"),
])
def test_plan_show_of_a_hand_damaged_plan_is_one_line(tmp_path, capsys, edit, says):
    import json
    p = tmp_path / "p.json"
    assert cli_main(["plan", *TINY, "--json", str(p)]) == 0
    d = json.loads(p.read_text())
    edit(d)
    p.write_text(json.dumps(d))
    capsys.readouterr()
    assert cli_main(["plan", "show", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a lazytrain plan" in err and says in err, err


def test_plan_show_takes_a_run_dir(tmp_path, capsys):
    assert cli_main(["plan", *TINY, "--json", str(tmp_path / "plan.json")]) == 0
    capsys.readouterr()
    assert cli_main(["plan", "show", str(tmp_path)]) == 0
    assert "device peak" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert cli_main(["plan", "show", str(tmp_path / "empty")]) == 2
    assert "a directory without plan.json" in capsys.readouterr().err
