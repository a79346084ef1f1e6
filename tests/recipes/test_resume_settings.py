"""`lazytrain train output_dir=DIR resume=true` continues the run with the settings it was started
with (Hydra's DIR/.hydra/overrides.yaml): none need repeating, and those given again win."""
import json

from lazytrain.cli import train as cli


def _losses(out):
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def test_a_resume_takes_the_runs_settings(base_overrides, tmp_path, capsys):
    small = ["hardware.device_memory_gib=0.002", "hardware.workspace_gib=0.0001", "engine=lazytrain"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert cli.main([*base_overrides, *small, "job.max_steps=4", f"output_dir={whole}"]) == 0
    assert cli.main([*base_overrides, *small, "job.max_steps=4", "stop_at_step=2", f"output_dir={part}"]) == 0
    capsys.readouterr()
    assert cli.main([f"output_dir={part}", "resume=true"]) == 0   # nothing else: the run's own settings
    err = capsys.readouterr().err
    assert "the run's settings from its .hydra/overrides.yaml" in err and "model=tiny-llama" in err
    assert "stop_at_step" not in err.split("overrides.yaml:")[1]   # a planned stop is not taken over
    assert _losses(part) == _losses(whole)
    # a setting given again wins over the record (here: a longer run)
    assert cli.main([f"output_dir={part}", "resume=true", "job.max_steps=5"]) == 0
    assert [s for s, _ in _losses(part)] == [1, 2, 3, 4, 5]


def test_no_record_leaves_the_command_line_as_it_is(base_overrides, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    argv = [f"output_dir={out}", "resume=true", "job.max_steps=3"]
    assert cli._with_run_settings(argv) == (argv, [])
    (out / ".hydra").mkdir()
    (out / ".hydra" / "overrides.yaml").write_text("{not: [a list")
    assert cli._with_run_settings(argv) == (argv, [])   # unreadable: the checkpoint's checks decide
    (out / ".hydra" / "overrides.yaml").write_text("- model=tiny-llama\n- job.max_steps=9\n- stop_at_step=2\n"
                                                   "- +deepspeed.x=1\n")
    got, taken = cli._with_run_settings(argv)
    assert taken == ["model=tiny-llama", "+deepspeed.x=1"] and got == [*taken, *argv]
    assert cli._with_run_settings([*argv, "--multirun"])[1] == []


def test_a_group_chosen_again_drops_the_records_values_under_it(tmp_path):
    """Review: `hardware=h200` on a resume kept the record's hardware.device_memory_gib=0.5 (the
    old machine's figures, silently: the checkpoint does not compare hardware)."""
    out = tmp_path / "run"
    (out / ".hydra").mkdir(parents=True)
    (out / ".hydra" / "overrides.yaml").write_text(
        "- model=tiny-llama\n- hardware=cpu\n- hardware.device_memory_gib=0.5\n- job.seq_len=32\n")
    _, taken = cli._with_run_settings([f"output_dir={out}", "resume=true", "hardware=h200"])
    assert taken == ["model=tiny-llama", "job.seq_len=32"]


def test_a_sweep_jobs_quoted_dir_is_found(tmp_path):
    """A sweep job's dir is named after its values (optim.lr=0.003), which Hydra needs quoted."""
    out = tmp_path / "sweep" / "optim.lr=0.003"
    (out / ".hydra").mkdir(parents=True)
    (out / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.003\n- model=tiny-llama\n")
    _, taken = cli._with_run_settings([f"output_dir='{out}'", "resume=true"])
    assert taken == ["optim.lr=0.003", "model=tiny-llama"]


def test_the_printed_resume_command_quotes_a_sweep_jobs_dir(tmp_path):
    from lazytrain.recipes.train import _dir_override

    assert _dir_override(tmp_path / "run") == f"output_dir={tmp_path / 'run'}"
    job = tmp_path / "sweep" / "optim.lr=0.003"
    assert _dir_override(job) == f"output_dir='{job}'"
    argv = [_dir_override(job), "resume=true"]   # what the line prints is what finds the record
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.003\n")
    assert cli._with_run_settings(argv)[1] == ["optim.lr=0.003"]


def test_relative_paths_in_the_record_resolve_from_where_the_run_started(base_overrides, tmp_path,
                                                                           monkeypatch, capsys):
    """A run started in one dir with relative data/tokenizer paths is resumed from another: the
    record's relative paths are taken from the run's starting dir (Hydra's hydra.runtime.cwd), not
    the current one (before: a missing-file error, or another dir's file of the same name)."""
    data, tok = (a.split("=", 1)[1] for a in base_overrides if a.startswith(("data.files=", "data.tokenizer=")))
    data = data.strip("[]")
    start = tmp_path / "start dir"
    (start / "corpus").mkdir(parents=True)
    (start / "corpus" / "notes.txt").write_bytes(open(data, "rb").read())
    (start / "tok").symlink_to(tok)
    rel = [a for a in base_overrides if not a.startswith(("data.files=", "data.tokenizer="))]
    rel += ["data.files=[corpus/notes.txt]", "data.tokenizer=tok"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    monkeypatch.chdir(start)
    assert cli.main([*rel, "job.max_steps=4", f"output_dir={whole}"]) == 0
    assert cli.main([*rel, "job.max_steps=4", "stop_at_step=2", f"output_dir={part}"]) == 0
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "corpus").mkdir(parents=True)
    (elsewhere / "corpus" / "notes.txt").write_text("other text " * 200)   # same name, other data
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert cli.main([f"output_dir={part}", "resume=true"]) == 0
    err = capsys.readouterr().err
    assert f"data.files=['{start}/corpus/notes.txt']" in err and f"data.tokenizer='{start}/tok'" in err
    assert _losses(part) == _losses(whole)


def test_rerooting_keeps_other_settings_and_quotes_paths(tmp_path):
    start = tmp_path / "the start"
    for f in ("m", "a.txt", "it's.jinja"):
        (start / f).parent.mkdir(parents=True, exist_ok=True)
        (start / f).write_text("x")
    out = tmp_path / "run"
    (out / ".hydra").mkdir(parents=True)
    (out / ".hydra" / "overrides.yaml").write_text(
        "- model.path=m\n- data.files=[a.txt,/abs/b.txt,'~/c.txt',gone.txt]\n- optim.lr=0.1\n"
        "- data.cache_dir=null\n- data.chat_template=\"it's.jinja\"\n- data.tokenizer='${oc.env:TOK}/t'\n"
        "- planner.cache_dir=cache\n")
    (out / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {start}\n")
    _, taken = cli._with_run_settings([f"output_dir={out}", "resume=true"])
    # what exists under the start dir is taken from there; an interpolation (review: made
    # '/start//srv/...'), a path not there (a moved project: from here, as before) and the plan
    # cache (its own resolver) are left as given
    assert taken == [f"model.path='{start}/m'", f"data.files=['{start}/a.txt','/abs/b.txt','~/c.txt','gone.txt']",
                     "optim.lr=0.1", "data.cache_dir=null", f"data.chat_template='{start}/it\\'s.jinja'",
                     "data.tokenizer='${oc.env:TOK}/t'", "planner.cache_dir=cache"]
    (out / ".hydra" / "hydra.yaml").write_text("hydra: [broken")
    _, taken = cli._with_run_settings([f"output_dir={out}", "resume=true"])
    assert taken[0] == "model.path=m"   # no readable record of the start dir: as given
    (out / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {tmp_path / 'moved away'}\n")
    _, taken = cli._with_run_settings([f"output_dir={out}", "resume=true"])
    assert taken[0] == "model.path=m"   # the project moved: relative paths resolve from here


def test_hydra_quoting_round_trips():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for v in ["it's.txt", "x\\y", "x\\'y", "end\\", "a b,c[d]=e", "q''", "é ü"]:
        assert parser.parse_overrides(["k=" + cli._quoted(v)])[0].value() == v


def test_a_lora_resume_with_other_adapters_or_base_weights_is_refused(text_data, tmp_path, capsys):
    """Review: a LoRA resume with other job.lora_targets trained on and dropped the checkpoint's
    k/v/o adapters without a word (the engines load the keys the new model has); another lora_alpha
    rescaled the trained update; another model dir with the same architecture was accepted."""
    import shutil

    from recipe_helpers import tiny_model_dir

    mdir, _ = tiny_model_dir(tmp_path, text_data[1])
    f, tok = text_data
    run = tmp_path / "run"
    common = [f"model.path={mdir}", "data=text", f"data.files=[{f}]", f"data.tokenizer={tok}",
              "job.seq_len=32", "job.batch_size=2", "job.max_steps=4", "job.mode=lora", "engine=torch",
              "progress=false", "job.compute_dtype=fp32", f"planner.cache_dir={tmp_path / 'cache'}"]
    assert cli.main([*common, "stop_at_step=2", f"output_dir={run}"]) == 0
    for change, msg in [("job.lora_targets=[q_proj]", "job.lora_targets ['k_proj', 'o_proj', 'q_proj', 'v_proj'] -> ['q_proj']"),
                        ("job.lora_alpha=64", "job.lora_alpha 32.0 -> 64.0"),
                        ("job.lora_rank=8", "job.lora_rank 16 -> 8")]:
        capsys.readouterr()
        assert cli.main([f"output_dir={run}", "resume=true", change]) == 2, change
        err = capsys.readouterr().err
        assert "cannot resume: the checkpoint's LoRA adapters differ" in err and msg in err, err
    other, _ = tiny_model_dir(tmp_path / "b", text_data[1], seed=6)   # same architecture, other weights
    assert cli.main([f"output_dir={run}", "resume=true", f"model.path={other}"]) == 2
    assert "model.path holds other base weights" in capsys.readouterr().err
    moved = tmp_path / "moved-model"
    shutil.copytree(mdir, moved)   # the same weights elsewhere resume
    assert cli.main([f"output_dir={run}", "resume=true", f"model.path={moved}"]) == 0


def test_a_sweep_dir_as_the_shell_passes_it_is_read_as_the_path(base_overrides, tmp_path, capsys):
    """`output_dir=DIR/optim.lr=0.003` unquoted got Hydra's raw 'mismatched input' error, then
    (s19) a refusal saying to quote it; but `output_dir='DIR'`, the form the README and the stop
    line give, reaches the program unquoted from a shell (review s21). It is the path now."""
    out = tmp_path / "sweep" / "optim.lr=0.003"
    assert cli.main([*base_overrides, f"output_dir={out}", "job.max_steps=2"]) == 0
    assert (out / "metrics.jsonl").is_file()
    assert cli.main([f"output_dir={out}", "resume=true", "job.max_steps=3"]) == 0, capsys.readouterr().err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_recorded_job_clip_grad_is_not_taken_over(tmp_path, capsys):
    """Review (2026-12-02): a run started with job.clip_grad=false (ignored by train then: it
    clipped by optim.max_grad_norm) was refused on resume once a disagreeing job.clip_grad was;
    it resumes as it ran, and says so."""
    out = tmp_path / "run"
    (out / ".hydra").mkdir(parents=True)
    (out / ".hydra" / "overrides.yaml").write_text("- model=tiny-llama\n- job.clip_grad=false\n- job.seq_len=32\n")
    _, taken = cli._with_run_settings([f"output_dir={out}", "resume=true"])
    assert taken == ["model=tiny-llama", "job.seq_len=32"]
    assert "not taking over the run's job.clip_grad=false" in capsys.readouterr().err
