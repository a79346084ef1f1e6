"""Hydra config loading and the builder layer: config objects stop here, library code below
takes plain typed arguments (ModelSpec, HardwareSpec, JobSpec, PlannerOptions)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..plan.plan import PlannerOptions
from ..spec import HardwareSpec, JobSpec, ModelSpec


class ConfigError(ValueError):
    """A user-facing configuration problem; the message says what to do."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def config_dir() -> Path:
    return Path(os.environ.get("LAZYTRAIN_CONFIG_DIR", repo_root() / "configs")).resolve()


def available(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def _check_group_choices(overrides: list[str]) -> None:
    for ov in overrides:
        key, _, value = ov.lstrip("+~").partition("=")
        if key in ("model", "hardware", "moe", "data") and value:
            if value == "measured" and key == "hardware":
                continue
            names = available(key)
            if names and value not in names:
                raise ConfigError(f"unknown {key} {value!r}; valid: {', '.join(names)}")


def load_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    """Compose the config the way `@hydra.main` would, for commands that are not Hydra apps."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    _check_group_choices(overrides)
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            return compose(config_name=config_name, overrides=overrides)
    except HydraException as e:
        lines = str(e).splitlines()
        # keep Hydra's hint for a key the config does not declare ("To append to your config use +k=v")
        hint = [x for x in lines[1:2] if x.startswith("To append")]
        raise ConfigError(" ".join(lines[:1] + hint)) from None


def model_spec(cfg: DictConfig) -> ModelSpec:
    m = cfg.model
    path = m.get("path")
    if path:
        p = Path(str(path)).expanduser()
        if not p.exists():
            raise ConfigError(f"model.path {p} does not exist")
        return ModelSpec.from_pretrained_dir(p)
    if m.get("hf_config") is None:
        raise ConfigError("model needs either model.path=DIR or an hf_config in configs/model/*.yaml")
    return ModelSpec.from_hf_config(OmegaConf.to_container(m.hf_config, resolve=True), name=m.get("name"))


def model_hf_config(cfg: DictConfig) -> dict[str, Any]:
    return dict(model_spec(cfg).hf_config)


def hardware_spec(cfg: DictConfig) -> HardwareSpec:
    d = OmegaConf.to_container(cfg.hardware, resolve=True)
    try:
        return HardwareSpec.from_dict(d)
    except (TypeError, ValueError) as e:
        hint = ("; this profile was written by `lazytrain profile`: run it again to refresh "
                "configs/hardware/measured.yaml" if d.get("name") == "measured" else "")
        raise ConfigError(f"hardware: {e}{hint}") from None


def job_spec(cfg: DictConfig) -> JobSpec:
    d = OmegaConf.to_container(cfg.job, resolve=True)
    try:
        return JobSpec.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"job: {e}") from None


def planner_options(cfg: DictConfig) -> PlannerOptions:
    try:
        return PlannerOptions.from_dict(OmegaConf.to_container(cfg.planner, resolve=True))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"planner: {e}") from None
