"""Measured specs (families without formulas) are kept on disk between processes: a second
`lazytrain plan` of a large hybrid config was measured again each time (MiniMax-Text-01's ~1 min,
Qwen3-Next-80B's ~24 s). Keyed by the config, the planner's code and the torch/transformers
versions; a damaged file is measured anew; off where LAZYTRAIN_SPEC_CACHE says so."""

from __future__ import annotations

import json
import logging

import pytest

from lazytrain.spec import ModelSpec
from lazytrain.spec import generic

CFG = {"model_type": "olmo2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "specs"
    monkeypatch.setenv(generic.SPEC_CACHE_ENV, str(d))
    _clear()
    yield d
    _clear()   # (what later tests get is measured with their own patches, not served from these)


def _clear():
    for f in (generic._cached, generic._structure_cached, generic._packed_cached):
        f.cache_clear()


def _no_measuring(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("measured again")
    monkeypatch.setattr(generic, "_measure", refuse)


def test_a_measured_spec_is_kept_and_served_by_the_next_process(cache, monkeypatch):
    first = ModelSpec.from_hf_config(CFG)
    files = list(cache.glob("spec-*.json"))
    assert len(files) == 1
    generic._cached.cache_clear()   # (as a new process)
    _no_measuring(monkeypatch)
    again = ModelSpec.from_hf_config(CFG)
    assert again == first and again.to_json() == first.to_json()
    # another config is another file
    monkeypatch.undo()
    monkeypatch.setenv(generic.SPEC_CACHE_ENV, str(cache))
    ModelSpec.from_hf_config({**CFG, "intermediate_size": 192})
    assert len(list(cache.glob("spec-*.json"))) == 2


@pytest.mark.parametrize("damage", ["truncated", "spec edited", "not json"])
def test_a_damaged_file_is_measured_anew_and_rewritten(cache, monkeypatch, caplog, damage):
    first = ModelSpec.from_hf_config(CFG)
    (path,) = cache.glob("spec-*.json")
    raw = path.read_text()
    if damage == "truncated":
        path.write_text(raw[: len(raw) // 2])
    elif damage == "spec edited":   # valid JSON, a number changed: the checksum says so
        d = json.loads(raw)
        d["value"] = d["value"].replace('"hidden_size": 64', '"hidden_size": 65')
        assert d["value"] != json.loads(raw)["value"]
        path.write_text(json.dumps(d))
    else:
        path.write_bytes(b"\x00\xff" * 10)
    generic._cached.cache_clear()
    calls = []
    measure = generic._measure
    monkeypatch.setattr(generic, "_measure", lambda *a: calls.append(1) or measure(*a))
    with caplog.at_level(logging.WARNING, logger=generic.log.name):
        again = ModelSpec.from_hf_config(CFG)
    assert calls == [1] and again == first
    assert "is damaged" in caplog.text and str(path) in caplog.text
    generic._cached.cache_clear()
    _no_measuring(monkeypatch)
    assert ModelSpec.from_hf_config(CFG) == first   # rewritten whole


def test_other_planner_code_measures_anew(cache, monkeypatch):
    ModelSpec.from_hf_config(CFG)
    generic._cached.cache_clear()
    # (the planner's code is part of the hash of every lazytrain source file the key holds)
    monkeypatch.setattr(generic, "_package_fingerprint", lambda: "other code")
    calls = []
    measure = generic._measure
    monkeypatch.setattr(generic, "_measure", lambda *a: calls.append(1) or measure(*a))
    ModelSpec.from_hf_config(CFG)
    assert calls == [1] and len(list(cache.glob("spec-*.json"))) == 2


def test_off_keeps_nothing_and_an_unwritable_dir_only_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    generic._cached.cache_clear()
    try:
        for off in ("off", "", "0"):
            monkeypatch.setenv(generic.SPEC_CACHE_ENV, off)
            generic._cached.cache_clear()
            ModelSpec.from_hf_config(CFG)
        assert not (tmp_path / "home").exists()
        (tmp_path / "f").write_text("x")
        monkeypatch.setenv(generic.SPEC_CACHE_ENV, str(tmp_path / "f" / "specs"))
        generic._cached.cache_clear()
        with caplog.at_level(logging.WARNING, logger=generic.log.name):
            spec = ModelSpec.from_hf_config(CFG)
        assert spec.hidden_size == 64 and "cannot keep the measured spec" in caplog.text
        # unset: the user's cache dir
        monkeypatch.delenv(generic.SPEC_CACHE_ENV)
        assert generic.spec_cache_dir() == tmp_path / "home" / ".cache" / "lazytrain" / "specs"
    finally:
        generic._cached.cache_clear()


def test_the_structure_verdict_is_kept_too(cache, monkeypatch):
    """The plan-time structure probe builds the whole model (MiniMax-Text-01: ~20 s of its decay
    tables, measured spec or not): its verdict is kept like the spec, a problem line or none."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gemma2", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16).to_dict()
    cfg = {k: v for k, v in cfg.items() if k not in ("transformers_version", "architectures")}
    why = generic.structure_problem(cfg)
    assert "after the last block" in why   # (its final_logit_softcapping)
    assert generic.structure_problem({**CFG}) is None
    assert len(list(cache.glob("structure-*.json"))) == 2
    generic._structure_cached.cache_clear()

    def refuse(*a, **k):
        raise AssertionError("probed again")
    monkeypatch.setattr(generic, "_structure_probe", refuse)
    assert generic.structure_problem(cfg) == why and generic.structure_problem({**CFG}) is None
    generic._structure_cached.cache_clear()


def test_a_probe_that_could_not_run_is_not_kept(cache, monkeypatch):
    monkeypatch.setattr(generic, "_structure_probe", lambda *a: (None, False))
    generic._structure_cached.cache_clear()
    assert generic.structure_problem({**CFG, "hidden_size": 32}) is None
    assert not list(cache.glob("structure-*.json"))
    generic._structure_cached.cache_clear()


def test_a_spec_with_an_estimated_block_is_not_kept(cache, monkeypatch, caplog):
    """A block whose backward could not be measured here gets estimated terms and a warning; kept,
    every later process planned with the estimate and no warning (review)."""
    def fail(*a, **k):
        raise RuntimeError("cannot allocate memory")
    monkeypatch.setattr(generic, "_excess_curves", fail)
    with caplog.at_level(logging.WARNING, logger=generic.log.name):
        ModelSpec.from_hf_config(CFG)
    assert "could not be measured" in caplog.text
    assert not list(cache.glob("spec-*.json"))


def test_other_lazytrain_code_or_kernel_packages_measure_anew(cache, monkeypatch):
    """The key covered spec/, costmodel/, plan/ and models/adapter.py only; a measurement also runs
    the accountant and the chunked loss, and transformers swaps in mamba-ssm / fla kernels."""
    ModelSpec.from_hf_config(CFG)
    _clear()
    monkeypatch.setattr(generic, "_package_fingerprint", lambda: "other files")
    ModelSpec.from_hf_config(CFG)
    assert len(list(cache.glob("spec-*.json"))) == 2
    _clear()
    monkeypatch.setattr(generic, "KERNEL_PACKAGES", ("torch",))   # (a package now "installed")
    ModelSpec.from_hf_config(CFG)
    assert len(list(cache.glob("spec-*.json"))) == 3
