"""`lazytrain train` through the Hydra app: outputs, saved models, and bad input (one line, exit 2,
nothing written)."""

import json
import math
import os

import pytest
import torch

from lazytrain.cli import train as cli


def _main(args, capsys):
    rc = cli.main(list(args))
    return rc, capsys.readouterr()


SMALL_BUDGET = ["hardware.device_memory_gib=0.002", "hardware.workspace_gib=0.0001"]


def test_hydra_run_writes_outputs(base_overrides, tmp_path, capsys):
    out = tmp_path / "run"
    rc, io = _main([*base_overrides, "engine=lazytrain", *SMALL_BUDGET, "job.max_steps=4",
                    "save_every=2", f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    assert "plan " in io.out and "loss: first" in io.out
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for k in ("loss", "tokens_per_s", "device_peak_bytes", "lr", "grad_norm"):
        assert all(r[k] is not None for r in recs), k
    plan = json.loads((out / "plan.json").read_text())
    assert plan["status"] in ("optimal", "feasible")
    assert all(0 < r["device_peak_bytes"] <= 0.002 * 2**30 for r in recs)  # the accountant's budget
    trace = [json.loads(l) for l in (out / "trace.jsonl").read_text().splitlines()]
    assert trace and {"start_s", "end_s"} <= set(trace[0]) | {"start_s", "end_s"}
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000004"
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000002", "step_000004"]



@pytest.mark.parametrize("mode", ["full", "lora"])
def test_every_file_a_run_writes_has_the_mode_open_gives(base_overrides, tmp_path, capsys, mode):
    """safetensors writes its files 0600 whatever the umask (safetensors#782), and mkstemp does too:
    checkpoints, the final model or adapter, the token cache and cached plans get the mode any
    other file of the run gets (0o666 & ~umask), so another user or uid can load them."""
    out = tmp_path / "run"
    old = os.umask(0o027)
    try:
        rc, io = _main([*base_overrides, "engine=lazytrain", *SMALL_BUDGET, "job.max_steps=2",
                        f"job.mode={mode}", "save_every=1", f"output_dir={out}"], capsys)
    finally:
        os.umask(old)
    assert rc == 0, io.err
    files = [p for root in (out, tmp_path / "solver_cache") for p in root.rglob("*") if p.is_file()]
    kinds = {p.suffix for p in files}
    assert {".safetensors", ".json"} <= kinds and list((out / "final").glob("*.safetensors"))
    wrong = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files
             if p.stat().st_mode & 0o777 != 0o640}
    assert not wrong, wrong


TIED = ["model.hf_config.tie_word_embeddings=true"]


def _final_state(out, mode, extra=()):
    from transformers import AutoConfig, AutoModelForCausalLM
    if mode == "full":
        return AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    from peft import PeftModel

    from lazytrain.cli.config import load_config, model_spec
    hf = dict(model_spec(load_config(["model=tiny-llama", "model.hf_config.vocab_size=320", *extra])).hf_config)
    torch.manual_seed(0)  # the recipe's seed: the same random base
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf))
    return {k: v for k, v in PeftModel.from_pretrained(base, out / "final").state_dict().items()
            if "lora_" in k}


# (LoRA with tied embeddings is checked against PEFT in tests/runtime/test_lora.py: here engine=torch's
# foreach=False AdamW and the executor's fused one differ by an ulp, which Adam can amplify to ~5e-6
# in an adapter element with a near-zero gradient; the untied case happens to stay within tolerance)
@pytest.mark.parametrize("mode,tied", [("full", False), ("lora", False), ("full", True)])
def test_saved_model_loads_and_engines_agree(base_overrides, tmp_path, capsys, mode, tied):
    """Full FT saves an HF dir `from_pretrained` loads; LoRA a PEFT adapter dir; the streamed run
    (small budget) ends with the same weights as plain PyTorch; also with tied embeddings."""
    states = {}
    extra = TIED if tied else []
    for engine in ("torch", "lazytrain"):
        out = tmp_path / engine
        rc, io = _main([*base_overrides, *extra, f"engine={engine}", f"job.mode={mode}", "job.lora_rank=4",
                        "job.max_steps=3", f"output_dir={out}",
                        *(SMALL_BUDGET if engine == "lazytrain" else [])], capsys)
        assert rc == 0, io.err
        assert (out / "final" / ("adapter_config.json" if mode == "lora" else "config.json")).is_file()
        states[engine] = _final_state(out, mode, extra)
    if tied and mode == "full":
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained(tmp_path / "lazytrain" / "final")
        assert m.get_output_embeddings().weight is m.get_input_embeddings().weight
    a, b = states["torch"], states["lazytrain"]
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    if mode == "lora":
        assert any(float(v.abs().sum()) > 0 for k, v in a.items() if "lora_B" in k)  # trained (B starts at 0)


def test_multirun_sweeps(base_overrides, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, io = _main(["--multirun", *base_overrides, "job.max_steps=2", "optim.lr=1e-3,2e-3",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"], capsys)
    assert rc == 0, io.err
    runs = sorted((tmp_path / "sweep").glob("*/metrics.jsonl"))
    assert len(runs) == 2
    lrs = [json.loads(r.read_text().splitlines()[-1])["lr"] for r in runs]
    assert lrs[0] != lrs[1]


def test_vocab_mismatches_say_what_to_set(base_overrides, tmp_path, capsys):
    ov = [a for a in base_overrides if not a.startswith("model.hf_config.vocab_size")]
    err = _bad(capsys, [*ov, "model.hf_config.vocab_size=256"], tmp_path,
               "but the model's vocab_size is 256; use a matching tokenizer, or model.hf_config.vocab_size=")
    n = int(err.split("the tokenizer has ")[1].split()[0])
    assert f"model.hf_config.vocab_size={n} " in err
    _bad(capsys, ["model=tiny-llama", "data=demo", "data.vocab_size=256"], tmp_path,
         "data.vocab_size=256: the built-in byte-level BPE tokenizer has at least 258 tokens")


def test_multirun_with_output_dir_gives_each_job_its_own(base_overrides, tmp_path, capsys, monkeypatch):
    """One output_dir for a sweep: job N writes into output_dir/N (all in one dir, the second job
    found the first one's checkpoints and stopped), and resume=true continues each."""
    monkeypatch.chdir(tmp_path)
    args = ["--multirun", *base_overrides, "optim.lr=1e-3,2e-3", f"output_dir={tmp_path / 'sw'}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", "save_final_model=false"]
    rc, io = _main([*args, "job.max_steps=2"], capsys)
    assert rc == 0, io.err
    dirs = ["optim.lr=0.001", "optim.lr=0.002"]   # named by the swept values
    recs = [[json.loads(x) for x in (tmp_path / "sw" / n / "metrics.jsonl").read_text().splitlines()] for n in dirs]
    assert [len(r) for r in recs] == [2, 2] and recs[0][-1]["lr"] != recs[1][-1]["lr"]
    # re-run in another order: each job resumes its own run, not the one with its number
    args[args.index("optim.lr=1e-3,2e-3")] = "optim.lr=2e-3,1e-3"
    rc, io = _main([*args, "job.max_steps=3", "resume=true"], capsys)
    assert rc == 0, io.err
    again = [[json.loads(x) for x in (tmp_path / "sw" / n / "metrics.jsonl").read_text().splitlines()] for n in dirs]
    assert [len(r) for r in again] == [3, 3] and [r[:2] for r in again] == recs
    assert again[0][-1]["lr"] < again[1][-1]["lr"]


def test_swept_keys_are_the_sweeps_only():
    argv = ["--multirun", "optim.lr=1e-3,2e-3", "data.files=[a.txt,b.txt]", "job.seq_len=range(64,129,64)",
            "+x.y='a,b'", "seed=choice(1,2)", "hydra.sweep.dir=s,t", "job.batch_size=2", "optim.eps=sort(1,2)",
            "optim.betas= shuffle([0.9,0.99],[0.9,0.999])"]
    assert cli._swept_keys(argv) == ["optim.lr", "job.seq_len", "seed", "optim.eps", "optim.betas"]


def test_sweep_set_in_config_names_the_subdirs(base_overrides, tmp_path, capsys, monkeypatch):
    """A sweep in hydra.sweeper.params (config, not the command line) names the subdirs too."""
    import shutil

    from lazytrain.cli.config import config_dir
    cfgs = tmp_path / "configs"
    shutil.copytree(config_dir(), cfgs)
    with open(cfgs / "train.yaml", "a") as f:
        f.write("\nhydra:\n  sweeper:\n    params:\n      optim.weight_decay: 0.0,0.1\n")
    monkeypatch.setenv("LAZYTRAIN_CONFIG_DIR", str(cfgs))
    monkeypatch.chdir(tmp_path)
    rc, io = _main(["--multirun", *base_overrides, "job.max_steps=1", "save_final_model=false",
                    f"output_dir={tmp_path / 'sw'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"], capsys)
    assert rc == 0, io.err
    assert sorted(p.name for p in (tmp_path / "sw").iterdir()) == ["optim.weight_decay=0.0", "optim.weight_decay=0.1"]


def test_sweep_subdirs_never_collide():
    from omegaconf import OmegaConf
    names = {cli._sweep_subdir(OmegaConf.create({"d": {"n": v}}), ["d.n"], 0)
             for v in ("a/b", "a_b", "a b", None, "None", 0.1, "0.1", ["a b"], ["a_b"], "日本語" * 40)}
    assert len(names) == 10
    assert all(len(n.encode()) <= 120 and n.isascii() for n in names)
    assert cli._sweep_subdir(OmegaConf.create({"o": {"lr": 0.001}}), ["o.lr"], 3) == "o.lr=0.001"


def test_stopped_and_finished_runs_say_so(base_overrides, tmp_path, capsys):
    out = tmp_path / "run"
    rc, io = _main([*base_overrides, "job.max_steps=3", "stop_at_step=2", f"output_dir={out}"], capsys)
    assert rc == 0 and "stopped at step 2 of 3 (stop_at_step=2)" in io.out and "resume=true" in io.out
    rc, io = _main([*base_overrides, "job.max_steps=2", "resume=true", f"output_dir={out}"], capsys)
    assert rc == 0 and "already at step 2 of job.max_steps=2" in io.out


def _bad(capsys, args, tmp_path, match):
    out = tmp_path / "never"
    rc, io = _main([*args, f"output_dir={out}"], capsys)
    assert rc == 2
    err = io.err.strip()
    assert match in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()
    return err


def test_missing_model_path(base_overrides, tmp_path, capsys):
    _bad(capsys, [*base_overrides, f"model.path={tmp_path / 'nope'}"], tmp_path, "does not exist")


def test_missing_tokenizer(base_overrides, tmp_path, capsys):
    _bad(capsys, [*base_overrides, f"data.tokenizer={tmp_path / 'notok'}"], tmp_path,
         "tokenizer dir")


def test_missing_data_and_empty_data(base_overrides, tmp_path, capsys):
    _bad(capsys, [*base_overrides, f"data.files=[{tmp_path / 'nofile.txt'}]"], tmp_path, "does not exist")
    (tmp_path / "empty.txt").write_text("\n\n")
    _bad(capsys, [*base_overrides, f"data.files=[{tmp_path / 'empty.txt'}]"], tmp_path, "no text")


def test_seq_len_longer_than_model(base_overrides, tmp_path, capsys):
    _bad(capsys, [*base_overrides, "job.seq_len=4096"], tmp_path, "longer than the model allows")


def test_nvme_dir_missing_and_not_writable(base_overrides, tmp_path, capsys):
    _bad(capsys, [*base_overrides, f"storage.nvme_dir={tmp_path / 'nvme'}"], tmp_path, "does not exist")
    if os.geteuid() != 0:  # root can write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        _bad(capsys, [*base_overrides, f"storage.nvme_dir={ro}"], tmp_path, "not writable")


def test_nvme_dir_too_small(base_overrides, tmp_path, capsys, monkeypatch):
    import shutil

    import lazytrain.recipes.train as T
    (tmp_path / "nvme").mkdir()
    monkeypatch.setattr(T, "plan_nvme_bytes", lambda plan: 1 << 40)  # a plan that spills 1 TiB
    _bad(capsys, [*base_overrides, f"storage.nvme_dir={tmp_path / 'nvme'}"], tmp_path,
         "the plan puts 1024.0 GiB on NVMe")


def test_unknown_engine_and_model(base_overrides, tmp_path, capsys):
    _bad(capsys, [*base_overrides, "engine=jax"], tmp_path, "unknown engine")
    _bad(capsys, [*base_overrides, "model=no-such-model"], tmp_path, "unknown model")


def test_budget_too_small_exits_2_with_explanation(base_overrides, tmp_path, capsys):
    err = _bad(capsys, [*base_overrides, "hardware.device_memory_gib=0.0001",
                        "hardware.host_memory_gib=4.0002", "hardware.nvme_capacity_gib=0"],
               tmp_path, "does not fit")
    from lazytrain.cli.config import hardware_spec, load_config, model_spec, planner_options
    from lazytrain.plan import plan_job
    from lazytrain.recipes.train import job_spec_of
    cfg = load_config([o for o in base_overrides if not o.startswith("data")] + [
        "hardware.device_memory_gib=0.0001", "hardware.host_memory_gib=4.0002",
        "hardware.nvme_capacity_gib=0"], config_name="train")
    plan = plan_job(model_spec(cfg), hardware_spec(cfg), job_spec_of(cfg)[0], planner_options(cfg),
                    cache_dir=None)
    assert not plan.fits and plan.explanation and plan.explanation[0] in err  # the planner's words


def test_local_hf_model_dir_with_its_tokenizer(base_overrides, text_data, tmp_path, capsys):
    """model.path=DIR: from_pretrained weights; the tokenizer defaults to the model dir."""
    from recipe_helpers import tiny_model_dir
    mdir, src = tiny_model_dir(tmp_path, text_data[1])
    ov = [o for o in base_overrides if not o.startswith(("model=", "model.hf_config", "data.tokenizer"))]
    out = tmp_path / "run"
    rc, io = _main([*ov, f"model.path={mdir}", "job.mode=lora", "job.lora_rank=2", "job.max_steps=2",
                    "optim.warmup_steps=0", f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    # the first loss (computed before the first update) is the loaded model's own loss on the
    # first batch (optim.lr=0 is refused: it trains nothing)
    from lazytrain.data.dataset import build_dataset, load_tokenizer
    ds = build_dataset([text_data[0]], load_tokenizer(mdir), 32, seed=0)
    b = ds.batch(0, 2)
    with torch.no_grad():
        want = float(src(input_ids=b.input_ids, labels=b.labels).loss)
    got = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert abs(got - want) < 1e-5 * want
    (mdir / "model.safetensors").unlink()
    _bad(capsys, [*ov, f"model.path={mdir}"], tmp_path, "holds no *.safetensors")


def test_hardware_measured_without_a_profile(base_overrides, tmp_path, capsys, monkeypatch):
    import shutil

    from lazytrain.cli.config import config_dir
    cfgs = tmp_path / "configs"
    shutil.copytree(config_dir(), cfgs)
    (cfgs / "hardware" / "measured.yaml").unlink(missing_ok=True)
    monkeypatch.setenv("LAZYTRAIN_CONFIG_DIR", str(cfgs))
    _bad(capsys, [*base_overrides, "hardware=measured"], tmp_path, "run `lazytrain profile")


def test_disk_error_during_run_names_the_file(base_overrides, tmp_path, capsys, monkeypatch):
    import lazytrain.recipes.checkpoint as C
    real = C.save_file
    calls = {"n": 0}

    def fail_second_engine_save(tensors, path, *a, **k):
        if path.endswith("engine.safetensors"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError(28, "No space left on device")
        return real(tensors, path, *a, **k)
    monkeypatch.setattr(C, "save_file", fail_second_engine_save)
    out = tmp_path / "run"
    rc, io = _main([*base_overrides, "job.max_steps=4", "save_every=2", f"output_dir={out}"], capsys)
    assert rc == 1
    assert "disk error: [Errno 28] write checkpoint" in io.err and "step_000004" in io.err
    assert "No space left on device" in io.err and "Traceback" not in io.err
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"


def test_pure_bf16_job_runs_on_both_engines(base_overrides, tmp_path, capsys):
    """job.master_dtype=bf16: both engines train the bf16 parameters themselves (no fp32 master,
    bf16 moments, fused AdamW); the streamed run at a small budget ends with the same bf16 weights
    as plain PyTorch, bit for bit."""
    states = {}
    for engine in ("torch", "lazytrain"):
        out = tmp_path / engine
        rc, io = _main([*base_overrides, "job.compute_dtype=bf16", "job.master_dtype=bf16", f"engine={engine}",
                        "job.max_steps=3", f"output_dir={out}", *(SMALL_BUDGET if engine == "lazytrain" else [])],
                       capsys)
        assert rc == 0, io.err
        states[engine] = _final_state(out, "full", [])
    a, b = states["torch"], states["lazytrain"]
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.bfloat16, k
        assert torch.equal(a[k], b[k]), k


def test_master_dtype_is_checked(base_overrides, tmp_path, capsys):
    _bad(capsys, [*base_overrides, "job.master_dtype=fp16"], tmp_path, "master_dtype")
    _bad(capsys, [*base_overrides, "job.master_dtype=bf16", "job.optimizer_state_bits=8"], tmp_path,
         "optimizer_state_bits=8")


def _losses_of_runs(common, runs, tmp_path, capsys):
    """{name: per-step losses} of one `lazytrain train` per entry of `runs` (name -> extra
    overrides), each in tmp_path/name."""
    losses = {}
    for name, extra in runs.items():
        out = tmp_path / name
        rc, io = _main([*common, *extra, f"output_dir={out}"], capsys)
        assert rc == 0, io.err
        losses[name] = [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    return losses


def test_prompt_completion_job_on_both_engines(base_overrides, tmp_path, capsys):
    """data.prompt_field: an SFT job; the streamed executor and plain PyTorch log the same losses
    (prompt positions are ignored by both), which differ from learning the whole rows."""
    from recipe_helpers import TEXT

    sentences = [s.strip() for s in TEXT.replace("\n", " ").split(".") if s.strip()]
    rows = [{"prompt": f"Explain part {i}:", "completion": " " + s + "."} for i, s in enumerate(sentences * 8)]
    sft = tmp_path / "sft.jsonl"
    sft.write_text("\n".join(json.dumps(r) for r in rows))
    common = [a for a in base_overrides if not a.startswith("data.files")] + [
        f"data.files=[{sft}]", "data.text_field=completion", "job.max_steps=3"]
    losses = _losses_of_runs(common, {"torch": ["engine=torch", "data.prompt_field=prompt"],
                                      "lazytrain": ["engine=lazytrain", "data.prompt_field=prompt", *SMALL_BUDGET],
                                      "whole": ["engine=torch"]}, tmp_path, capsys)
    assert len(losses["torch"]) == 3
    assert losses["lazytrain"] == pytest.approx(losses["torch"], rel=1e-5)
    assert abs(losses["whole"][0] - losses["torch"][0]) > 1e-3


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def test_chat_job_on_both_engines(base_overrides, tmp_path, capsys):
    """data.messages_field with data.chat_template (the test tokenizer has none): the streamed
    executor and plain PyTorch log the same losses over the assistant tokens, and the final model's
    tokenizer carries the template (so generation can render chats as training did)."""
    from recipe_helpers import TEXT

    sentences = [s.strip() for s in TEXT.replace("\n", " ").split(".") if s.strip()]
    rows = [{"messages": [{"role": "user", "content": f"Explain part {i}."},
                          {"role": "assistant", "content": s + "."}]} for i, s in enumerate(sentences * 8)]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps(r) for r in rows))
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    common = [a for a in base_overrides if not a.startswith("data.files")] + [
        f"data.files=[{chats}]", "data.messages_field=messages", "job.max_steps=3"]
    _bad(capsys, common, tmp_path, "no chat template")
    common.append(f"data.chat_template={template}")
    losses = _losses_of_runs(common, {"torch": ["engine=torch"],
                                      "lazytrain": ["engine=lazytrain", *SMALL_BUDGET]}, tmp_path, capsys)
    assert len(losses["torch"]) == 3
    assert losses["lazytrain"] == pytest.approx(losses["torch"], rel=1e-5)
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(str(tmp_path / "lazytrain" / "final")).chat_template == CHAT_TEMPLATE
    _bad(capsys, [*common[:-1], f"data.chat_template={tmp_path / 'nope.jinja'}"], tmp_path, "no such file")


def test_eval_split_on_both_engines(base_overrides, tmp_path, capsys):
    """data.eval_fraction holds the last sequences out; eval_every=2 evaluates at steps 2 and 4 (the
    end). Both engines report the same eval losses, and the last one is the saved model's loss on
    the held-out sequences computed by hand; the training data is the rest."""
    from transformers import AutoModelForCausalLM

    from lazytrain.data.dataset import build_dataset, load_tokenizer

    common = [*base_overrides, "job.max_steps=4", "data.eval_fraction=0.25", "eval_every=2", "job.mode=full"]
    got = {}
    for name, extra in (("torch", ["engine=torch"]), ("lazytrain", ["engine=lazytrain", *SMALL_BUDGET])):
        out = tmp_path / name
        rc, io = _main([*common, *extra, f"output_dir={out}"], capsys)
        assert rc == 0, io.err
        recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        got[name] = [(r["step"], r["eval_loss"]) for r in recs if "eval_loss" in r]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["eval_loss"] == got[name][-1][1] and "eval loss (held-out" in io.out
    assert [k for k, _ in got["torch"]] == [2, 4] == [k for k, _ in got["lazytrain"]]
    assert [x for _, x in got["lazytrain"]] == pytest.approx([x for _, x in got["torch"]], rel=1e-5)
    assert got["torch"][0][1] != got["torch"][1][1]
    # by hand: the last quarter of the packed sequences, the final model, token-weighted
    files = [a.split("=", 1)[1].strip("[]") for a in base_overrides if a.startswith("data.files=")]
    tok = load_tokenizer([a.split("=", 1)[1] for a in base_overrides if a.startswith("data.tokenizer=")][0])
    full = build_dataset(files, tok, 32, seed=0)
    _, held = full.split_off(0.25)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "torch" / "final").eval()
    total = count = 0
    with torch.no_grad():
        for b in held.ordered_batches(2):
            n = int((b.labels[:, 1:] != -100).sum())
            total += model(input_ids=b.input_ids, labels=b.labels).loss.item() * n
            count += n
    assert got["torch"][-1][1] == pytest.approx(total / count, rel=1e-5)
    assert summary["dataset_sequences"] == len(full) - len(held)


def test_eval_files_evaluate_at_the_end(base_overrides, tmp_path, capsys):
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": f"Each item {i} is assigned to the target list."}) + "\n"
                            for i in range(40)))
    out = tmp_path / "run"
    rc, io = _main([*base_overrides, "job.max_steps=3", f"data.eval_files=[{held}]", "eval_batches=2",
                    f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    assert "eval loss (held-out, 4 of " in io.out   # eval_batches=2 x batch 2 of the held-out sequences
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "eval_loss" in r] == [3]   # eval_every=0: only at the end
    assert json.loads((out / "summary.json").read_text())["eval_loss"] == recs[-1]["eval_loss"] > 0


def test_a_stopped_and_resumed_run_evaluates_as_an_uninterrupted_one(base_overrides, tmp_path, capsys):
    common = [*base_overrides, "job.max_steps=4", "data.eval_fraction=0.25", "eval_every=3"]
    for out, extra in ((tmp_path / "a", []), (tmp_path / "b", ["stop_at_step=2"]), (tmp_path / "b", ["resume=true"])):
        rc, io = _main([*common, *extra, f"output_dir={out}"], capsys)
        assert rc == 0, io.err
    rows = {k: [(r["step"], r.get("eval_loss")) for r in map(json.loads, (tmp_path / k / "metrics.jsonl").read_text().splitlines())]
            for k in "ab"}
    assert rows["a"] == rows["b"] and [s for s, x in rows["a"] if x is not None] == [3, 4]
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["eval_losses"] == [
        [s, x] for s, x in rows["a"] if x is not None]   # the whole run's, the resumed one's too


def test_eval_data_errors_name_the_eval_setting(base_overrides, tmp_path, capsys):
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "too short"}) + "\n")
    _bad(capsys, [*base_overrides, f"data.eval_files=[{short}]"], tmp_path, "data.eval_files: the data holds")
    # a resume with another held-out fraction trains on other sequences: refused, saying why
    out = tmp_path / "run"
    rc, io = _main([*base_overrides, "job.max_steps=2", "data.eval_fraction=0.2", f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    rc, io = _main([*base_overrides, "job.max_steps=3", "data.eval_fraction=0.3", "resume=true",
                    f"output_dir={out}"], capsys)
    assert rc == 2 and "data.eval_fraction=0.3 holds sequences out of training" in io.err, io.err


def test_a_resume_refused_for_the_new_bos_says_how_to_resume(base_overrides, tmp_path, capsys):
    """A run made before data.add_bos, on a tokenizer that adds a BOS (Llama's), had none; resumed
    with the default (auto) its data differs: the refusal names data.add_bos=false, which resumes."""
    from tokenizers.processors import TemplateProcessing

    from lazytrain.data.dataset import load_tokenizer

    tok_dir = [a.split("=", 1)[1] for a in base_overrides if a.startswith("data.tokenizer=")][0]
    tok = load_tokenizer(tok_dir)
    tok.add_special_tokens({"bos_token": "<s>"})
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    tok.save_pretrained(tmp_path / "tok")
    common = [a for a in base_overrides if not a.startswith("data.tokenizer=")] + [f"data.tokenizer={tmp_path / 'tok'}"]
    out = tmp_path / "run"
    rc, io = _main([*common, "job.max_steps=3", "stop_at_step=2", "data.add_bos=false", f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    record = out / ".hydra" / "overrides.yaml"   # an older run's record has no data.add_bos
    record.write_text("".join(l + "\n" for l in record.read_text().splitlines() if "add_bos" not in l))
    rc, io = _main([*common, "job.max_steps=3", "resume=true", f"output_dir={out}"], capsys)
    assert rc == 2 and "resume those with data.add_bos=false" in io.err, io.err
    rc, io = _main([*common, "job.max_steps=3", "resume=true", "data.add_bos=false", f"output_dir={out}"], capsys)
    assert rc == 0, io.err


def test_eval_settings_are_checked(base_overrides, tmp_path, capsys):
    _bad(capsys, [*base_overrides, "data.eval_fraction=1.5"], tmp_path, "data.eval_fraction must be a number in [0, 1)")
    _bad(capsys, [*base_overrides, "data.eval_fraction=0.5", f"data.eval_files=[{tmp_path}]"], tmp_path,
         "data.eval_files and data.eval_fraction are both set")
    _bad(capsys, [*base_overrides, "eval_every=-1"], tmp_path, "eval_every must be a whole number >= 0")
    _bad(capsys, [*base_overrides, "eval_batches=0"], tmp_path, "eval_batches must be a whole number >= 1")


@pytest.mark.parametrize("arch", ["gemma3_text", "phi3"])
def test_model_types_without_formulas_plan_and_train(base_overrides, tmp_path, capsys, arch):
    """A model_type the planner has no formulas for (spec/generic.py measures it): `lazytrain train
    model.path=DIR` plans, streams it within the planned device peak (op temporaries counted, as
    a GPU's allocator would) and logs the losses plain PyTorch does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"gemma3_text": dict(head_dim=8, final_logit_softcapping=None, sliding_window=16,
                                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
             "phi3": dict(pad_token_id=0)}[arch]
    cfg = AutoConfig.for_model(arch, vocab_size=320, hidden_size=64, intermediate_size=512, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    d = tmp_path / arch
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    common = [a for a in base_overrides if not a.startswith("model")] + [
        f"model.path={d}", "job.max_steps=3", "job.mode=full", "count_op_temporaries=true"]
    recs = {}
    gib = {"gemma3_text": 0.0028, "phi3": 0.0032}[arch]   # too small to keep every layer's weights
    budget = [f"hardware.device_memory_gib={gib}", "hardware.workspace_gib=0.0001"]
    for name, eng in (("torch", ["engine=torch"]), ("lazytrain", ["engine=lazytrain", *budget])):
        out = tmp_path / f"run-{name}"
        rc, io = _main([*common, *eng, f"output_dir={out}"], capsys)
        assert rc == 0, io.err
        recs[name] = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in recs["lazytrain"]] == pytest.approx([r["loss"] for r in recs["torch"]], rel=1e-5)
    plan = json.loads((tmp_path / "run-lazytrain" / "plan.json").read_text())
    assert any(d["param_tier"] != "device" for d in plan["layers"])   # it streams
    assert any(line.startswith(f"model costs measured, not from formulas (no formulas for {arch}")
               for line in plan["explanation"])
    for r in recs["lazytrain"]:
        # (at this toy size the fixed terms dominate: Llama's formula spec, the same run: 0.81)
        assert 0.7 <= r["device_peak_bytes"] / r["predicted_device_peak_bytes"] <= 1.0


def test_multi_process_launch_needs_deepspeed(base_overrides, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "run"
    rc, io = _main([*base_overrides, "engine=lazytrain", f"output_dir={out}"], capsys)
    assert rc == 2 and "WORLD_SIZE=2" in io.err and "engine=deepspeed" in io.err
    assert not (out / "metrics.jsonl").exists()


def test_plan_clipping_follows_the_runs_max_grad_norm(base_overrides):
    """The plan's update timing (job.clip_grad) is the run's: on with optim.max_grad_norm set,
    off with it null; a job.clip_grad that says otherwise is refused (it was replaced without a
    word: job.clip_grad=false clipped at 1.0, a review), one that agrees is taken."""
    from lazytrain.cli.config import ConfigError, load_config
    from lazytrain.recipes.train import job_spec_of
    base = [o for o in base_overrides if not o.startswith("data")]
    assert job_spec_of(load_config(base + ["optim.max_grad_norm=1.0"], config_name="train"))[0].clip_grad is True
    assert job_spec_of(load_config(base + ["optim.max_grad_norm=null"], config_name="train"))[0].clip_grad is False
    assert job_spec_of(load_config(base + ["optim.max_grad_norm=null", "job.clip_grad=false"],
                                   config_name="train"))[0].clip_grad is False
    with pytest.raises(ConfigError, match=r"job.clip_grad=false but optim.max_grad_norm=1.0.*"
                                          r"set optim.max_grad_norm=null for no clipping"):
        job_spec_of(load_config(base + ["optim.max_grad_norm=1.0", "job.clip_grad=false"], config_name="train"))
    with pytest.raises(ConfigError, match=r"job.clip_grad=true but optim.max_grad_norm=null: "):
        job_spec_of(load_config(base + ["optim.max_grad_norm=null", "job.clip_grad=true"], config_name="train"))


PURE_BF16_NO_CLIP = ["job.compute_dtype=bf16", "job.master_dtype=bf16", "optim.max_grad_norm=null",
                     "hardware.device_memory_gib=0.001"]


@pytest.mark.parametrize("extra", [[], PURE_BF16_NO_CLIP,
                                   [*PURE_BF16_NO_CLIP, "model.hf_config.tie_word_embeddings=true"]],
                         ids=["fp32-master", "pure-bf16-no-clip", "pure-bf16-no-clip-tied"])
def test_plan_trace_compares_a_run_with_its_plan(base_overrides, tmp_path, capsys, extra):
    """`lazytrain plan trace RUN_DIR`: per resource, the run's traced seconds and bytes per step next
    to the plan's prediction (a plan that streams and offloads). Pure bf16 without clipping on a
    CPU device: the update reads the gradients in place, and neither side counts a d2h, except,
    with tied embeddings, the embedding's gradients and the head's share of them."""
    from lazytrain.cli import plan as plan_cli
    from lazytrain.plan.tracecmp import compare_run
    out = tmp_path / "run"
    rc, io = _main([*base_overrides, "engine=lazytrain", *SMALL_BUDGET, "job.max_steps=3",
                    "save_every=0", "save_final_model=false", f"output_dir={out}", *extra], capsys)
    assert rc == 0, io.err
    c = compare_run(out)
    assert c.steps == (1, 2) and c.measured_step_s is not None and c.predicted_step_s > 0
    rows = {r.kind: r for r in c.rows}
    assert {"compute_fwd", "compute_bwd", "h2d params"} <= set(rows)
    copied = extra != PURE_BF16_NO_CLIP
    assert ("d2h grads" in rows) == copied
    # weights fetched and gradients leaving: what the cost model counts, to the byte (activation
    # sizes are the cost model's estimates, not asserted)
    for kind in ("h2d params", "d2h grads") if copied else ("h2d params",):
        assert rows[kind].measured_bytes == rows[kind].predicted_bytes > 0, kind
    assert all(rows[k].measured_s > 0 for k in ("compute_fwd", "compute_bwd"))
    assert plan_cli.main(["trace", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "compute_bwd" in shown and "measured/pred" in shown
    assert "steps 2..3" in shown                         # the run's step numbers
    good = (out / "trace.jsonl").read_text()
    (out / "trace.jsonl").write_text(good + '{"step": 2, "ki')   # a killed run's cut-off last line
    assert plan_cli.main(["trace", str(out)]) == 0
    assert "cut off" in capsys.readouterr().out
    (out / "trace.jsonl").write_text("{not json\n" + good)
    assert plan_cli.main(["trace", str(out)]) == 2
    assert "trace.jsonl:1" in capsys.readouterr().err    # names the damaged line
    assert plan_cli.main(["trace", str(tmp_path / "nope")]) == 2
    assert "plan.json not found" in capsys.readouterr().err


def test_count_op_temporaries_option(base_overrides, tmp_path, capsys):
    # CPU device: with the ops' own allocations counted, the same losses and a higher device peak
    recs = {}
    for flag in ("false", "true"):
        out = tmp_path / flag
        rc, io = _main([*base_overrides, "engine=lazytrain", "job.max_steps=2", f"output_dir={out}",
                        f"count_op_temporaries={flag}"], capsys)
        assert rc == 0, io.err
        recs[flag] = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in recs["true"]] == [r["loss"] for r in recs["false"]]
    assert all(a["device_peak_bytes"] > b["device_peak_bytes"] for a, b in zip(recs["true"], recs["false"]))


def test_chunked_loss_job(base_overrides, tmp_path, capsys):
    # job.loss_chunk_tokens reaches the planner (the plan's job) and the executor: same first loss
    recs = {}
    for chunk in (0, 16):
        out = tmp_path / str(chunk)
        rc, io = _main([*base_overrides, "engine=lazytrain", "job.max_steps=2", f"output_dir={out}",
                        f"job.loss_chunk_tokens={chunk}"], capsys)
        assert rc == 0, io.err
        assert json.loads((out / "plan.json").read_text())["job"]["loss_chunk_tokens"] == chunk
        recs[chunk] = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[16][0]["loss"] == pytest.approx(recs[0][0]["loss"], rel=1e-5)


def test_unusable_dtypes_optim_values_and_damaged_weights(base_overrides, tmp_path, capsys):
    """Caught in preflight, before anything is written: a precision the planner knows but training
    cannot use, an optimizer setting that is not a number, a weights file that is not safetensors."""
    _bad(capsys, [*base_overrides, "job.compute_dtype=fp8"], tmp_path, "job.compute_dtype must be one of bf16")
    # fp16 trains with a loss scale and fp32 masters: a bf16 master or a scale that is no power of
    # two is refused
    for engine in ("lazytrain", "torch"):
        _bad(capsys, [*base_overrides, "job.compute_dtype=fp16", "job.master_dtype=bf16", f"engine={engine}"],
             tmp_path, "job.compute_dtype=fp16 needs job.master_dtype=fp32")
    for bad in ("1000", "0", "-65536", "inf", "abc", "true"):
        _bad(capsys, [*base_overrides, "job.compute_dtype=fp16", f"optim.loss_scale={bad}"], tmp_path,
             "optim.loss_scale must be a power of two")
    for bad in (str(2.0 ** 128), str(2.0 ** -130)):   # (inf in float32: every step skipped; NaN weights)
        _bad(capsys, [*base_overrides, "job.compute_dtype=fp16", f"optim.loss_scale={bad}"], tmp_path,
             "optim.loss_scale must be between 2**-126 and 2**127")
    _bad(capsys, [*base_overrides, "optim.loss_scale_growth_interval=0.5"], tmp_path,
         "optim.loss_scale_growth_interval must be a whole number >= 1")
    _bad(capsys, [*base_overrides, "optim.lr=abc"], tmp_path, "optim.lr must be a number, got 'abc'")
    _bad(capsys, [*base_overrides, "optim.betas=[0.9]"], tmp_path, "optim.betas must be two numbers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from lazytrain.cli.config import load_config
    from lazytrain.recipes.train import model_spec

    hf = dict(model_spec(load_config(base_overrides, config_name="train")).hf_config)
    model_dir = tmp_path / "model"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf)).save_pretrained(model_dir)
    weights = next(model_dir.glob("*.safetensors"))
    weights.write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00{}")   # a header that is too small
    capsys.readouterr()   # (save_pretrained's progress bar)
    _bad(capsys, [*[o for o in base_overrides if not o.startswith("model.hf_config")], f"model.path={model_dir}"], tmp_path,
         f"{weights} is not a readable safetensors file")


def test_final_model_on_a_full_disk_names_the_file(base_overrides, tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError: the run still says which file
    and operation failed (exit 1, no traceback), leaves no half-written final dir behind, and the
    last checkpoint stays intact."""
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    def full(self, *a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    out = tmp_path / "run"
    rc, io = _main([*base_overrides, "job.max_steps=2", f"output_dir={out}"], capsys)
    assert rc == 1, io.err
    assert "disk error:" in io.err and "write the final model" in io.err and "final.tmp" in io.err
    assert "No space left on device" in io.err and "Traceback" not in io.err
    assert not (out / "final.tmp").exists() and not (out / "final").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"


def test_bf16_compute_saves_the_fp32_masters(base_overrides, tmp_path, capsys):
    """A full fine-tune computing in bf16 with fp32 masters saves the masters (as engine=torch saves
    its fp32 weights), not their bf16 rounding, which loses part of a fine-tune's small updates."""
    from safetensors.torch import load_file
    out = tmp_path / "lt"
    rc, io = _main([*base_overrides, "engine=lazytrain", "job.compute_dtype=bf16", "job.master_dtype=fp32",
                    "job.max_steps=2", f"output_dir={out}", *SMALL_BUDGET], capsys)
    assert rc == 0, io.err
    saved = {}
    for f in (out / "final").glob("*.safetensors"):
        saved.update(load_file(f))
    trained = [v for k, v in saved.items() if "layers.0.self_attn.q_proj" in k]
    assert trained and all(v.dtype == torch.float32 for v in saved.values())
    assert not torch.equal(trained[0], trained[0].bfloat16().float())   # more than bf16 precision


def test_torch_and_lazytrain_treat_a_nan_gradient_alike(base_overrides, tmp_path, monkeypatch):
    """optim.max_grad_norm=null means no norm: a non-finite gradient is applied by the reference
    engine as by the streaming executor (and torch's AdamW); with a norm (inf: no clipping) the
    step is skipped by both."""
    import math

    from lazytrain.cli.config import load_config
    from lazytrain.recipes import engines as E
    from lazytrain.recipes.train import run

    real = E.TorchEngine.train_step

    def poisoned(self, micro_batches):   # a NaN in the loss of step 2
        self._n = getattr(self, "_n", 0) + 1
        if self._n == 2:
            hook = self.params[0].register_hook(lambda g: torch.full_like(g, float("nan")))
            try:
                return real(self, micro_batches)
            finally:
                hook.remove()
        return real(self, micro_batches)
    monkeypatch.setattr(E.TorchEngine, "train_step", poisoned)
    for norm, poisoned_after in (("null", True), ("inf", False)):
        out = tmp_path / norm
        cfg = load_config([*base_overrides, "job.max_steps=3", f"optim.max_grad_norm={norm}",
                           f"output_dir={out}", "save_final_model=false"], config_name="train")
        run(cfg, out, echo=lambda *_: None)
        recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        assert math.isnan(recs[2]["loss"]) == poisoned_after, (norm, recs)
        assert recs[1]["skipped"] == (not poisoned_after)


def test_lora_targets_the_model_lacks_are_caught_before_anything_is_written(base_overrides, tmp_path, capsys):
    err = _bad(capsys, [*base_overrides, "job.mode=lora", "job.lora_targets=[q_proj,wq]"], tmp_path,
               "job.lora_targets ['wq'] match no linear layer of tiny-llama")
    assert "q_proj" in err and "down_proj" in err   # the names it has


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_fp16_job_scales_its_loss_and_resumes(base_overrides, tmp_path, capsys, mode):
    """job.compute_dtype=fp16 trains on engine=lazytrain and engine=torch (torch.amp.GradScaler):
    a too large first scale overflows, the step is skipped and the scale halves, training goes on;
    metrics.jsonl logs the scale; a stopped run resumes with its scale (the same losses and scales
    as the uninterrupted run); the first losses agree across engines (fp16 vs fp16 autocast)."""
    fp16 = [*base_overrides, "job.compute_dtype=fp16", f"job.mode={mode}", "optim.loss_scale=8388608",
            "optim.loss_scale_growth_interval=2", "job.max_steps=8"]
    recs = {}
    for engine in ("lazytrain", "torch"):
        out = tmp_path / engine
        rc, io = _main([*fp16, f"engine={engine}", f"output_dir={out}"], capsys)
        assert rc == 0, io.err
        recs[engine] = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        r = recs[engine]
        assert r[0]["loss_scale"] == 2.0 ** 23 and r[0]["skipped"]   # overflows at 2**23 (~2**18 here)
        assert sum(not x["skipped"] for x in r) >= 2 and all(math.isfinite(x["loss"]) for x in r)
        for a, b in zip(r, r[1:]):   # halves after a skipped step, doubles after 2 good ones
            assert b["loss_scale"] in (a["loss_scale"] / 2, a["loss_scale"], a["loss_scale"] * 2)
            assert (b["loss_scale"] < a["loss_scale"]) == a["skipped"]
    assert recs["lazytrain"][0]["loss"] == pytest.approx(recs["torch"][0]["loss"], rel=1e-2)
    # the plan times the updates after the whole backward (fp16 waits for the norm), and both
    # engines report the norm with optim.max_grad_norm=null too
    plan = json.loads((tmp_path / "lazytrain" / "plan.json").read_text())
    assert plan["job"]["clip_grad"] is True and plan["job"]["compute_dtype"] == "fp16"
    out = tmp_path / "noclip"
    rc, io = _main([*fp16, "engine=torch", "optim.max_grad_norm=null", "job.max_steps=2", f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    assert all(r["grad_norm"] is not None for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()))
    part = tmp_path / "part"
    rc, io = _main([*fp16, "engine=lazytrain", "stop_at_step=3", f"output_dir={part}"], capsys)
    assert rc == 0, io.err
    rc, io = _main([*fp16, "engine=lazytrain", "resume=true", f"output_dir={part}"], capsys)
    assert rc == 0, io.err
    resumed = [json.loads(l) for l in (part / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["loss_scale"], r["skipped"]) for r in resumed] == \
        [(r["step"], r["loss"], r["loss_scale"], r["skipped"]) for r in recs["lazytrain"]]


def test_an_extended_run_rewrites_a_stale_final_model(base_overrides, tmp_path, capsys):
    """A run of 4 steps writes final/; extended to 6 with resume=true and stopped before its own
    final/ was written (a kill while saving it; here save_final_model=false), a later resume=true
    kept the 4-step final/ and summary.json for good (review). The step final/ holds is recorded
    and a stale one is rewritten, with a summary ending at step 6."""
    from safetensors.torch import load_file

    from lazytrain.recipes.train import final_step

    out = tmp_path / "run"
    rc, io = _main([*base_overrides, "job.max_steps=4", f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    assert final_step(out / "final") == 4
    w4 = load_file(str(out / "final" / "model.safetensors"))
    rc, io = _main([*base_overrides, "job.max_steps=6", "resume=true", "save_final_model=false",
                    f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    assert final_step(out / "final") == 4
    rc, io = _main([*base_overrides, "job.max_steps=6", "resume=true", "save_final_model=true",
                    f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    assert final_step(out / "final") == 6
    w6 = load_file(str(out / "final" / "model.safetensors"))
    assert any(not torch.equal(w4[k], w6[k]) for k in w4)
    assert json.loads((out / "summary.json").read_text())["end_step"] == 6


def test_a_resume_removes_what_a_killed_run_left_half_written(base_overrides, tmp_path, capsys):
    """A run killed while writing a checkpoint or moving `latest` leaves .step_*.tmp (a whole
    engine state) and .latest.*.tmp behind, which nothing removed (review): the next run does."""
    out = tmp_path / "run"
    rc, io = _main([*base_overrides, "job.max_steps=2", f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    ck = out / "checkpoints"
    (ck / ".step_000003.tmp").mkdir()
    (ck / ".step_000003.tmp" / "engine.safetensors").write_bytes(b"x" * 1000)
    (ck / ".latest.abc123.tmp").write_text("step_000003")
    # a resume killed while trimming metrics.jsonl / trace.jsonl left their temp copies (review,
    # 2026-12-01: for good), a final model's write its temp dir
    (out / ".metrics.jsonl.x1.tmp").write_text("{}\n")
    (out / ".trace.jsonl.x2.tmp").write_text("{}\n")
    (out / "final.tmp").mkdir()
    keep = out / "notes.tmp"   # not ours
    keep.write_text("mine")
    rc, io = _main([*base_overrides, "job.max_steps=3", "resume=true", f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    assert ("removed what an interrupted run left half-written: checkpoints/.step_000003.tmp, "
            "checkpoints/.latest.abc123.tmp, .metrics.jsonl.x1.tmp, .trace.jsonl.x2.tmp, final.tmp") in io.out
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert not any(p.name.endswith(".tmp") for p in out.iterdir() if p != keep) and keep.read_text() == "mine"


def test_a_final_model_written_before_the_step_was_recorded_is_kept(base_overrides, tmp_path, capsys):
    """final/ without lazytrain_final.json (a run finished before 2026-12-01): a resume of the
    finished run changes nothing in it (it was rewritten, with a user's file in it deleted: review)."""
    from lazytrain.recipes.train import FINAL_MARK

    out = tmp_path / "run"
    rc, io = _main([*base_overrides, "job.max_steps=2", f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    (out / "final" / FINAL_MARK).unlink()
    (out / "final" / "my_eval.txt").write_text("mine")
    rc, io = _main([*base_overrides, "job.max_steps=2", "resume=true", f"output_dir={out}"], capsys)
    assert rc == 0 and "no steps run" in io.out, io.out
    assert (out / "final" / "my_eval.txt").read_text() == "mine"
    # ... unless the run's summary (written after final/) does not end there having written it: an
    # extended run killed while writing its final model, or run with save_final_model=false (a
    # review found the stale one kept then), left the older one
    rc, io = _main([*base_overrides, "job.max_steps=3", "resume=true", "save_final_model=false",
                    f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    rc, io = _main([*base_overrides, "job.max_steps=3", "resume=true", "save_final_model=true",
                    f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    assert (out / "final" / FINAL_MARK).is_file() and not (out / "final" / "my_eval.txt").exists()


def test_the_summary_says_what_a_cpu_peak_of_engine_torch_is(base_overrides, tmp_path, capsys):
    """engine=torch on a CPU measures the process's peak RSS (interpreter, libraries and all) and
    called it the device peak next to the plan's (review: 405 MiB "measured" against a 257 MiB plan)."""
    out = tmp_path / "run"
    rc, io = _main([*base_overrides, "job.max_steps=2", f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    assert "measured: the process's peak RSS" in io.out
    assert json.loads((out / "summary.json").read_text())["device"] == "cpu"



def test_the_summary_says_a_cpu_peak_leaves_op_temporaries_out(base_overrides, tmp_path, capsys):
    """engine=lazytrain on a CPU counts what the executor places, and the ops' temporaries inside
    a layer only with count_op_temporaries=true, while the plan's peak always holds them: the
    summary put the two side by side as if the same quantity (review: 22.8 MiB measured against
    29.1 MiB predicted, 27.9 MiB with the temporaries counted). It says so now."""
    for count in (False, True):
        out = tmp_path / f"run{count}"
        rc, io = _main([*base_overrides, "engine=lazytrain", "job.max_steps=1", f"count_op_temporaries={count}",
                        f"output_dir={out}"], capsys)
        assert rc == 0, io.err
        assert ("measured: what the executor places" in io.out) is (not count), io.out


def test_planner_cache_false_writes_no_cache_entry(base_overrides, tmp_path, capsys):
    """planner.cache=false read nothing but still wrote the plan into solver_cache/ under train
    (`lazytrain plan` writes nothing with it; review); with the cache on, the entry is written."""
    cache = tmp_path / "solver_cache"
    rc, io = _main([*base_overrides, "job.max_steps=1", "planner.cache=false", f"output_dir={tmp_path / 'a'}"], capsys)
    assert rc == 0, io.err
    assert not list(cache.glob("*.json"))
    rc, io = _main([*base_overrides, "job.max_steps=1", f"output_dir={tmp_path / 'b'}"], capsys)
    assert rc == 0, io.err
    assert len(list(cache.glob("*.json"))) == 1


def test_a_demo_run_started_before_the_jsonl_corpus_is_told_how_to_resume(tmp_path):
    """The built-in data became train.jsonl (a row per document): a demo run started on train.txt
    could not resume and the error did not say why (review); the hint names the file to resume with."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from lazytrain.recipes.train import _data_hints

    cfg = OmegaConf.create({"data": {"builtin": "pydoc-corpus", "files": [], "cache_dir": str(tmp_path / "c"),
                                     "add_bos": "false", "vocab_size": 2048}})
    hint = _data_hints(cfg, SimpleNamespace(tokenizer=None))
    c = tmp_path / "c"
    # (the corpus moved to corpus-v2/ without duplicate texts, 2026-12-01: earlier runs' data and
    # tokenizer are named; the rows, and the one text file for runs from before the rows)
    assert (f"resume those with data.files=[{c / 'corpus' / 'train.jsonl'}] "
            f"data.tokenizer={c / 'tokenizer-2048'}") in hint
    assert f"data.files=[{c / 'corpus' / 'train.txt'}], runs from before they were rows" in hint


def test_plan_trace_leaves_out_skipped_steps(base_overrides, tmp_path, capsys):
    """fp16 runs skip the steps whose gradients overflow: plan trace counted them, their optimizer
    lanes at 0 s, in its medians (review). They are left out, with a note."""
    from lazytrain.cli import plan as plan_cli

    out = tmp_path / "run"
    rc, io = _main([*base_overrides, "engine=lazytrain", "job.compute_dtype=fp16", "optim.loss_scale=8388608",
                    "job.max_steps=8", f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in recs if r["skipped"]]
    assert skipped and len(skipped) < len(recs)
    assert plan_cli.main(["trace", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"{len(skipped)} skipped step(s)" in text and ", ".join(map(str, skipped)) in text
    cells = next(c for c in ([x.strip() for x in line.split("│")] for line in text.splitlines())
                 if len(c) > 3 and c[1] == "optimizer")
    assert float(cells[3]) > 0, cells   # (the skipped steps' 0 s were its median)
