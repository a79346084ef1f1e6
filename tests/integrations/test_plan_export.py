"""`lazytrain plan export-deepspeed`: file in, config out, dropped decisions printed, bad input one line."""

import json

from ds_plan_factory import make_plan

from lazytrain.cli.plan_export import main


def test_export_writes_config_and_lists_dropped(tmp_path, capsys):
    plan = make_plan(recompute=frozenset({2, 3}), segment_starts={2: 2, 3: 2}, activation_tiers={2: "nvme"})
    src = tmp_path / "plan.json"
    src.write_text(plan.to_json())
    out = tmp_path / "sub" / "ds.json"
    rc = main([str(src), "--out", str(out), "--set", "zero_optimization.sub_group_size=1000",
               "--set", "zero_optimization.offload_param.pin_memory=true"])
    assert rc == 0
    cfg = json.loads(out.read_text())
    assert cfg["zero_optimization"]["sub_group_size"] == 1000
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert cfg["lazytrain"]["recompute_blocks"] == [1, 2]
    text = capsys.readouterr().out
    assert "2 plan decision(s) DeepSpeed cannot express" in text
    assert "segment block.1..block.2" in text and "activation_tier=nvme for block.1" in text
    # DeepSpeed ignores the "lazytrain" key: a script of one's own must apply the recompute (review)
    assert "DeepSpeed does not read the recompute blocks" in text and "apply_recompute" in text


def test_export_all_expressed(tmp_path, capsys):
    src = tmp_path / "plan.json"
    src.write_text(make_plan().to_json())
    assert main([str(src), "--out", str(tmp_path / "ds.json")]) == 0
    text = capsys.readouterr().out
    assert "every plan decision is expressed" in text and "apply_recompute" not in text   # (none to apply)


def test_nvme_offload_without_nvme_dir_says_where_it_writes(tmp_path, capsys):
    src = tmp_path / "plan.json"
    src.write_text(make_plan().to_json())
    over = ["--set", "zero_optimization.offload_optimizer.device=nvme"]
    assert main([str(src), "--out", str(tmp_path / "a.json"), *over]) == 0
    assert "NVMe offload writes to" in capsys.readouterr().out
    assert main([str(src), "--out", str(tmp_path / "b.json"), "--nvme-dir", str(tmp_path), *over]) == 0
    assert "NVMe offload writes to" not in capsys.readouterr().out
    assert json.loads((tmp_path / "b.json").read_text())["zero_optimization"]["offload_optimizer"]["nvme_path"] == str(tmp_path)


def test_bad_inputs_give_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing.json"), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not found" in err and len(err.splitlines()) == 1
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 99}')
    assert main([str(bad), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not a lazytrain plan" in err and len(err.splitlines()) == 1
    inf = tmp_path / "inf.json"
    inf.write_text(make_plan(status="infeasible").to_json())
    assert main([str(inf), "--out", str(tmp_path / "o.json")]) == 2
    assert "infeasible" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_export_writes_whole_sizes_and_says_how_it_clips(tmp_path, capsys):
    """`--set aio.block_size=1e6` was written as 1000000.0 (DeepSpeed reads aio sizes as they are),
    and a clipping plan's export left DeepSpeed's 1.0 default unsaid."""
    from lazytrain.spec import JobSpec

    src = tmp_path / "plan.json"
    src.write_text(make_plan(job=JobSpec(batch_size=1, seq_len=64, clip_grad=True)).to_json())
    out = tmp_path / "ds.json"
    assert main([str(src), "--out", str(out), "--set", "aio.block_size=1e6",
                 "--set", "zero_optimization.sub_group_size=1e8", "--set", "x.frac=0.5"]) == 0
    cfg = json.loads(out.read_text())
    assert cfg["aio"]["block_size"] == 1000000 and isinstance(cfg["aio"]["block_size"], int)
    assert isinstance(cfg["zero_optimization"]["sub_group_size"], int) and cfg["x"]["frac"] == 0.5
    text = capsys.readouterr().out
    assert "gradient_clipping" not in cfg and "DeepSpeed clips at its default gradient_clipping=1.0" in text
    assert main([str(src), "--out", str(out), "--set", "gradient_clipping=0.5"]) == 0
    assert "clips at its default" not in capsys.readouterr().out


def test_a_set_that_breaks_the_configs_structure_is_one_line_and_writes_nothing(tmp_path, capsys):
    """--set zero_optimization=5 (or an offload section / recompute_blocks set to null) was written,
    then the summary crashed with a traceback (review)."""
    src = tmp_path / "plan.json"
    src.write_text(make_plan().to_json())
    for i, bad in enumerate(["zero_optimization=5", "zero_optimization.offload_optimizer=null",
                             "lazytrain.recompute_blocks=null"]):
        out = tmp_path / f"o{i}.json"
        assert main([str(src), "--out", str(out), "--set", bad]) == 2, bad
        err = capsys.readouterr().err.strip()
        assert err.startswith("export-deepspeed: ") and len(err.splitlines()) == 1, err
        assert not out.exists()
