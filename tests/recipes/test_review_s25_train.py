"""Fixes from the session-25 reviews of `lazytrain train` and `lazytrain plan`."""

import pytest

from lazytrain.cli import train as cli
from lazytrain.cli.main import main as cli_main

# A Cohere2 model: its forward scales the logits (logit_scale) after the head, which the streaming
# executor's embed -> blocks -> norm -> head would not
# (eos inside the tiny vocabulary: Cohere2's default 255001 made transformers warn, through a logging
# handler an earlier test may have left on a closed stream: "--- Logging error ---" in stderr)
COHERE2 = ["model.hf_config.model_type=cohere2", "model.name=tiny-cohere2", "+model.hf_config.eos_token_id=2"]


def test_plan_refuses_a_model_the_executor_cannot_run_exactly(base_overrides, tmp_path, capsys):
    """`lazytrain plan` planned it (exit 0) on the meta device, where the executor's probe cannot
    run; `train` then died with a traceback after loading and planning (review)."""
    plan_args = [o for o in base_overrides if o.startswith(("model", "planner", "job.seq_len"))]
    rc = cli_main(["plan", *plan_args, *COHERE2, "hardware.device_memory_gib=0.02"])
    err = capsys.readouterr().err
    assert rc == 2 and "the streaming executor cannot train this model exactly: Cohere2ForCausalLM" in err, err
    assert "logit_scale" in err and "Traceback" not in err
    # where the config value disables it, it plans
    assert cli_main(["plan", *plan_args, *COHERE2, "+model.hf_config.logit_scale=1.0",
                     "hardware.device_memory_gib=1"]) == 0, capsys.readouterr().err


def test_train_refuses_it_in_one_line_before_writing_and_engine_torch_trains_it(base_overrides, tmp_path, capsys):
    out = tmp_path / "r"
    rc = cli.main([*base_overrides, *COHERE2, "engine=lazytrain", f"output_dir={out}"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot train this model exactly" in err and "engine=torch" in err, err
    assert "Traceback" not in err and not out.exists()
    assert cli.main([*base_overrides, *COHERE2, "job.max_steps=2", f"output_dir={tmp_path / 't'}"]) == 0


def test_the_executors_own_refusal_is_one_line_too(base_overrides, tmp_path, capsys, monkeypatch):
    """Where the plan-time probe cannot run (it passes the model), the executor's refusal, once
    the model is loaded, is one line as well (a ModelStructureError traceback before)."""
    import lazytrain.spec.generic as generic

    monkeypatch.setattr(generic, "structure_problem", lambda cfg, chunk_tokens=0: None)
    rc = cli.main([*base_overrides, *COHERE2, "engine=lazytrain", f"output_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "engine=lazytrain cannot train this model exactly: Cohere2ForCausalLM" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("family,extra,refused", [
    ("gemma2", {}, "after the last block"),                               # final_logit_softcapping
    ("granite", {"embedding_multiplier": 12.0}, "before block 0"),
    ("granite", {"embedding_multiplier": 1.0, "logits_scaling": 1.0}, None),
    ("gemma3_text", {}, None),                                            # its scale is in the embedding
    ("llama", {"vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": [128001, 128009]}, None),
])
def test_structure_problem_on_configs(family, extra, refused):
    from transformers import AutoConfig

    from lazytrain.spec.generic import structure_problem

    cfg = AutoConfig.for_model(family, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, **extra).to_dict()
    cfg = {k: v for k, v in cfg.items() if k not in ("transformers_version", "architectures")}
    why = structure_problem(cfg)
    assert (why is None) if refused is None else (refused in (why or "")), why


def test_eval_settings_without_eval_data_are_refused(base_overrides, tmp_path, capsys):
    """eval_every=2 eval_batches=3 without data.eval_files / eval_fraction: exit 0, no evaluation,
    no word (review)."""
    out = tmp_path / "r"
    rc = cli.main([*base_overrides, "eval_every=2", "eval_batches=3", f"output_dir={out}"])
    err = capsys.readouterr().err
    assert rc == 2 and "eval_every=2 and eval_batches=3 evaluate on data.eval_files or data.eval_fraction" in err, err
    assert not out.exists()


def test_a_resume_on_other_evaluation_data_says_so(base_overrides, text_data, tmp_path, capsys):
    """A changed data.eval_files resumed silently: one eval_loss curve over two sets (review)."""
    import shutil

    f, _ = text_data
    ev = tmp_path / "eval.txt"
    ev.write_text(f.read_text()[:4000])
    out = tmp_path / "r"
    common = [*base_overrides, f"data.eval_files=[{ev}]", "eval_every=2", f"output_dir={out}"]
    assert cli.main([*common, "stop_at_step=2"]) == 0
    capsys.readouterr()
    shutil.copy(ev, tmp_path / "old.txt")
    ev.write_text(f.read_text()[4000:9000])
    assert cli.main([*common, "resume=true"]) == 0
    said = "".join(capsys.readouterr())
    assert "the evaluation data differ from the checkpoint's run (token fingerprint" in said, said
    assert "eval_loss from step 3 on is not comparable" in said
    # the same data again: nothing said
    out2 = tmp_path / "r2"
    common2 = [c if not c.startswith("output_dir=") else f"output_dir={out2}" for c in common]
    assert cli.main([*common2, "stop_at_step=2"]) == 0
    capsys.readouterr()
    assert cli.main([*common2, "resume=true"]) == 0
    assert "evaluation data differ" not in "".join(capsys.readouterr())


def test_sigterm_finishes_the_step_checkpoints_it_and_resume_continues(base_overrides, tmp_path, capsys,
                                                                       monkeypatch):
    """SIGTERM (a scheduler's preemption) killed the run with no word, losing up to save_every
    steps (review). Now the running step ends, is checkpointed, and the run stops with one line,
    exit 143; a resume gives the uninterrupted run's losses."""
    import json
    import os
    import signal

    from lazytrain.runtime.executor import StreamingExecutor

    small = ["engine=lazytrain", "hardware.device_memory_gib=0.002", "hardware.workspace_gib=0.0001"]
    args = [*base_overrides, *small, "job.max_steps=5", "save_every=2", "save_final_model=false"]
    real, calls = StreamingExecutor._micro_batch, [0]

    def micro_batch(self, *a, **k):
        calls[0] += 1
        if calls[0] == 3:   # during step 3 (one micro-batch a step)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *a, **k)

    monkeypatch.setattr(StreamingExecutor, "_micro_batch", micro_batch)
    out, ref = tmp_path / "run", tmp_path / "ref"
    rc = cli.main([*args, f"output_dir={out}"])
    err = capsys.readouterr().err.strip()
    assert rc == 143 and err == (f"lazytrain train: stopped by SIGTERM after step 3 of 5; the last checkpoint is "
                                 f"step 3: continue with resume=true output_dir={out}"), err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL   # put back
    monkeypatch.undo()
    assert cli.main([*args, f"output_dir={out}", "resume=true"]) == 0
    assert cli.main([*args, f"output_dir={ref}"]) == 0

    def losses(d):
        return [json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert losses(out) == losses(ref) and len(losses(ref)) == 5


def test_ctrl_c_while_the_command_loads_is_one_line(monkeypatch, capsys):
    """In the first second or two (torch importing) Ctrl-C gave a traceback (review)."""
    import importlib

    from lazytrain.cli import main as entry

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted)
    assert cli_main(["train", "job.max_steps=1"]) == 130
    assert capsys.readouterr().err.strip() == "lazytrain train: interrupted while starting; nothing was written"
    assert entry.main is cli_main


@pytest.mark.parametrize("fail", ["tensors", "state", "fsync"])
def test_a_failed_checkpoint_write_names_the_file(tmp_path, monkeypatch, fail):
    """A full disk was reported at the checkpoint's temp dir, not the file (safetensors' error and
    a failed fsync carry no file name; review)."""
    import os

    import torch

    import lazytrain.recipes.checkpoint as C
    import lazytrain.storage.atomic as A
    from lazytrain.recipes import checkpoint as ckpt
    from lazytrain.storage.aligned_io import DiskIOError

    root = tmp_path / "ck"
    if fail == "tensors":
        from safetensors import SafetensorError

        def boom(*a, **k):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        monkeypatch.setattr(C, "save_file", boom)
        want = "engine.safetensors"
    elif fail == "state":
        real = type(root).write_text

        def write_text(self, *a, **k):
            if self.name == "state.json":
                raise OSError(28, "No space left on device")
            return real(self, *a, **k)
        monkeypatch.setattr(type(root), "write_text", write_text)
        want = "state.json"
    else:
        def fsync(fd):
            raise OSError(5, "Input/output error")
        monkeypatch.setattr(A.os, "fsync", fsync)
        want = ""   # whichever file fsync_tree reaches first: a file in the temp dir, not the dir
    with pytest.raises(DiskIOError) as e:
        ckpt.save_checkpoint(root, 1, {"data_position": 1}, engine_tensors={"w": torch.ones(3)})
    where = str(e.value).split("write checkpoint ", 1)[1].split(" (", 1)[0]
    assert os.path.basename(where).endswith(want) and os.path.basename(os.path.dirname(where)) == \
        ".step_000001.tmp", str(e.value)


def test_resuming_a_checkpoint_from_before_whole_row_packing_says_why(base_overrides, tmp_path, capsys):
    """A review checkpointed an SFT run with the code before 2026-12-02 and resumed it with the
    same settings: "use the same settings". Such a checkpoint (no data_packing record) now gets
    the reason: the rows are packed otherwise since."""
    import json

    from lazytrain.recipes import checkpoint as ckpt

    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Question {i}: what does a loop do?",
                                       "completion": f" It repeats, item {i}."}) + "\n" for i in range(40)))
    out = tmp_path / "r"
    args = [*base_overrides, f"data.files=[{sft}]", "data.prompt_field=prompt", "data.text_field=completion",
            "job.seq_len=64", f"output_dir={out}"]
    assert cli.main([*args, "stop_at_step=2"]) == 0
    last = ckpt.latest_checkpoint(out / "checkpoints")
    state = json.loads((last / "state.json").read_text())
    from lazytrain.recipes.train import DATA_PACKING

    assert state["data_packing"] == DATA_PACKING == 4
    # as the code before wrote it: no record (1: rows cut at fixed edges) or 2 (rows attending to
    # the rows before them), and another dataset fingerprint
    for record, why in ((None, "its rows cut at fixed sequence edges"),
                        (2, "its packed rows attending to the rows before them in a sequence"),
                        (3, "a row's first token, where learned, the target of the row before it")):
        if record is None:
            state.pop("data_packing", None)
        else:
            state["data_packing"] = record
        state["dataset"]["fingerprint"] = "0" * 16
        state.pop(ckpt.STATE_SUM)
        state[ckpt.STATE_SUM] = ckpt._state_crc(state)
        (last / "state.json").write_text(json.dumps(state, indent=1))
        capsys.readouterr()
        assert cli.main([*args, "resume=true"]) == 2
        err = capsys.readouterr().err
        assert "prompt/completion and chat rows are packed whole since 2026-12-02, each attending only to " \
               f"itself (a later change), and this checkpoint was written before ({why}): it cannot " \
               "continue" in err, err


def test_sigterm_in_the_last_step_lets_the_run_finish(base_overrides, tmp_path, capsys, monkeypatch):
    """It exited 143 'stopped after step 6 of 6', without final/ or summary.json (review)."""
    import os
    import signal

    from lazytrain.runtime.executor import StreamingExecutor

    real, calls = StreamingExecutor._micro_batch, [0]

    def micro_batch(self, *a, **k):
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *a, **k)

    monkeypatch.setattr(StreamingExecutor, "_micro_batch", micro_batch)
    out = tmp_path / "run"
    rc = cli.main([*base_overrides, "engine=lazytrain", "hardware.device_memory_gib=0.002",
                   "hardware.workspace_gib=0.0001", "job.max_steps=3", f"output_dir={out}"])
    assert rc == 0, capsys.readouterr().err
    assert (out / "final").is_dir() and (out / "summary.json").is_file()
