"""engine=deepspeed: the user's own DeepSpeed settings (`deepspeed_config=FILE`, then
`+deepspeed.KEY.PATH=VALUE`) over the config derived from the plan, refused where they would make
it another job, and checked by DeepSpeed's own parser before anything is written."""

from __future__ import annotations

import collections.abc
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..cli.config import ConfigError
from ..integrations.ds_config import deep_merge, ds_config_from_plan, pinned_swap_note, uses_nvme, whole
from ..plan.plan import Plan
from ..storage.filemode import file_in_the_way
from .engines import EngineUnavailable


# DeepSpeed keys that define the job itself: lazytrain's own settings set them, on every engine alike
DS_JOB_KEYS = {
    "train_batch_size": "job.batch_size and job.grad_accum",
    "train_micro_batch_size_per_gpu": "job.batch_size",
    "gradient_accumulation_steps": "job.grad_accum",
    "optimizer": "optim.*: lazytrain runs AdamW with optim.lr/betas/eps/weight_decay",
    "scheduler": "optim.lr, optim.warmup_steps and optim.min_lr_ratio",
    "gradient_clipping": "optim.max_grad_norm",
    "bf16": "job.compute_dtype",
    "bfloat16": "job.compute_dtype",
    "amp": "job.compute_dtype",
    "torch_autocast": "job.compute_dtype",
    "lazytrain": "the plan (its recompute decisions)",
    # the blocks recompute through Hugging Face's checkpointing as the plan says, never through
    # deepspeed.checkpointing: a section here would be accepted and never used
    "activation_checkpointing": "the plan's recompute decisions, from hardware.device_memory_gib; run by "
                                "Hugging Face checkpointing, which this section does not configure",
}


def _ds_clean(node: Any) -> Any:
    """Drop "auto" values (Hugging Face Trainer's DeepSpeed configs: "fill in from the trainer",
    which here is the plan's or the job's value) and the sections left empty by that; whole
    numbers written as floats (Hydra reads 2e8 as a float) become ints, which DeepSpeed's
    directly-read sections (aio) need."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if v == "auto":
                continue
            c = _ds_clean(v)
            if isinstance(v, dict) and v and not c:
                continue
            out[k] = c
        return out
    if isinstance(node, list):
        return [_ds_clean(v) for v in node]
    return whole(node)


def deepspeed_overrides(cfg: DictConfig) -> dict[str, Any]:
    """The user's DeepSpeed settings for engine=deepspeed, to deep-merge over the config derived from
    the plan: the JSON file `deepspeed_config`, then the keys under `deepspeed` (`+deepspeed.K.P=V`).
    ConfigError (one line) for settings given to another engine, an unreadable file, keys that
    define the job (DS_JOB_KEYS, fp16.enabled; all of them named at once) or a ZeRO stage other
    than 3."""
    path = cfg.get("deepspeed_config")
    dotted = cfg.get("deepspeed")
    # (a non-mapping, deepspeed=5, was a ValueError traceback here, before the check below)
    dotted = (OmegaConf.to_container(dotted, resolve=True) if OmegaConf.is_config(dotted)
              else dotted if dotted is not None else {})
    if not path and not dotted:
        return {}
    if cfg.engine != "deepspeed":
        raise ConfigError(f"deepspeed_config / deepspeed.* settings are for engine=deepspeed; this run "
                          f"has engine={cfg.engine}")
    if not isinstance(dotted, dict):
        raise ConfigError("deepspeed must map DeepSpeed config keys to values "
                          "(+deepspeed.zero_optimization.sub_group_size=2e8)")
    over: dict[str, Any] = {}
    if path:
        p = Path(str(path)).expanduser()
        try:
            over = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"deepspeed_config: {p} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"deepspeed_config: cannot read {p} ({e})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"deepspeed_config: {p} is not valid JSON ({e})") from None
        if not isinstance(over, dict):
            raise ConfigError(f"deepspeed_config: {p} must hold a JSON object, not a {type(over).__name__}")
    over = _ds_clean(deep_merge(over, dotted))
    ac = over.get("activation_checkpointing")
    if isinstance(ac, dict) and not any(ac.values()):
        # all false / null / 0: DeepSpeed's defaults, found in many published configs; it asks for
        # nothing, so it is dropped like "auto" values rather than refused (a set value is refused)
        del over["activation_checkpointing"]
    bad = [f"{key} ({where})" for key, where in DS_JOB_KEYS.items() if key in over]
    if isinstance(over.get("fp16"), dict) and "enabled" in over["fp16"]:
        bad.append("fp16.enabled (job.compute_dtype; its loss-scale settings are yours to set)")
    problems = []
    if bad:
        problems.append(f"{', '.join(bad)} come(s) from lazytrain's own settings (the same job on every "
                        f"engine); set them there and remove them from the DeepSpeed settings")
    zero = over.get("zero_optimization")
    # compared as text: DeepSpeed takes "3" as well as 3 (and _ds_clean made 3.0 an int)
    if isinstance(zero, dict) and str(zero.get("stage", 3)).strip() != "3":
        problems.append(f"zero_optimization.stage={zero['stage']}: lazytrain runs DeepSpeed with ZeRO "
                        f"stage 3 (its checkpoint, resume and final-model paths are built and tested for it)")
    if problems:   # all at once: a user should not find the next one on the next try
        raise ConfigError("deepspeed: " + "; and ".join(problems))
    if isinstance(zero, dict) and "stage" in zero:
        zero["stage"] = 3   # (the number: code reading the config compares it as one)
    return over


def check_deepspeed_config(plan: Plan, overrides: dict[str, Any], nvme_dir: str | None) -> list[str]:
    """The config DeepSpeed will be given, checked by DeepSpeed's own parser: a bad value, or a
    misspelt key in a section DeepSpeed validates, is a ConfigError now rather than a traceback after
    the model is built; NVMe offload without DeepSpeed's async_io op is one too, and NVMe swap
    buffers that would pin more host memory than the hardware config has to spare. Returns notes:
    how much the swap buffers pin, and your keys its parser never reads (misspelt, or read only
    later by the engine). Skipped when
    DeepSpeed is not importable: the engine reports that when it starts."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfig

        from ..integrations.deepspeed import check_available
    except Exception:  # noqa: BLE001 - missing or broken: EngineUnavailable says so later
        return []
    cfg, _ = ds_config_from_plan(plan, overrides=overrides, nvme_dir=nvme_dir)
    cfg.pop("lazytrain", None)
    notes = []
    pinned = pinned_swap_note(cfg, plan)
    if pinned is not None:
        line, over = pinned
        if over:   # (DeepSpeed would allocate them at start: the run killed, or the host swapping)
            raise ConfigError(f"deepspeed: {line}")
        notes.append(f"deepspeed: {line}")
    # a path no directory can be made at is the user's to fix whatever is installed: said before
    # the async_io check (the engine's mkdir said it only where libaio was installed)
    for sec in ("offload_param", "offload_optimizer"):
        off = (cfg.get("zero_optimization") or {}).get(sec)
        if isinstance(off, dict) and off.get("device") == "nvme" and off.get("nvme_path"):
            path = Path(str(off["nvme_path"])).expanduser()
            if (above := file_in_the_way(path)) is not None:
                raise ConfigError(f"deepspeed: zero_optimization.{sec}.nvme_path {path} cannot be made: "
                                  f"{above} is a file, not a directory")
    if uses_nvme(cfg) and (msg := check_available(nvme=True)):
        raise EngineUnavailable(msg)
    # counts DeepSpeed's parser takes but its engine cannot (buffer_count=0 passed the parser and
    # failed in deepspeed.initialize with an IndexError, after plan.json was written: review)
    zero = cfg.get("zero_optimization") or {}
    bad = [f"zero_optimization.{sec}.{k}={v!r}" for sec in ("offload_param", "offload_optimizer")
           if isinstance(zero.get(sec), dict) for k in ("buffer_count", "buffer_size")
           if (v := zero[sec].get(k)) is not None and not _at_least_one(v)]
    if bad:
        raise ConfigError(f"deepspeed: {', '.join(bad)}: a buffer count and size must be at least 1")
    try:
        DeepSpeedConfig(cfg)
    except Exception as e:  # noqa: BLE001 - pydantic ValidationError, AssertionError, ValueError...
        lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()][:3]
        raise ConfigError(f"deepspeed: DeepSpeed rejects the config ({'; '.join(lines) or type(e).__name__})") from None
    unread = _unread_by_deepspeed(cfg, overrides, DeepSpeedConfig)
    return notes + [f"deepspeed: DeepSpeed's config parser does not read {k} (misspelt?); DeepSpeed may "
                    f"ignore it" for k in unread]


def _at_least_one(v) -> bool:
    """A number >= 1 as DeepSpeed's parser takes one (an int, a float, a numeric string)."""
    if isinstance(v, bool):
        return False
    try:
        return float(v) >= 1
    except (TypeError, ValueError):
        return True   # (not a number at all: DeepSpeed's parser's to refuse, in its words)


class _ReadRecorder(dict):
    """A config dict that records which of its keys are looked up (get, [], in), not iterated."""

    def __init__(self, d=(), path: tuple = (), seen: set | None = None) -> None:
        super().__init__(d)
        self._path, self._seen = path, seen if seen is not None else set()

    def _mark(self, k) -> None:
        self._seen.add((*self._path, k))

    def __getitem__(self, k):
        self._mark(k)
        return super().__getitem__(k)

    def get(self, k, default=None):
        self._mark(k)
        return super().get(k, default)

    def __contains__(self, k) -> bool:
        self._mark(k)
        return super().__contains__(k)

    def pop(self, k, *default):
        self._mark(k)
        return super().pop(k, *default)

    def keys(self):   # `k in d.keys()` is a lookup too; iterating it is not
        return collections.abc.KeysView(self)

    def __iter__(self):
        # Overridden (unchanged) so that `Model(**d)` takes CPython's generic path, keys() then
        # d[k], which records each key: a dict subclass with dict's own __iter__ is copied
        # entry by entry without a lookup, and a whole pydantic-read section looked unread.
        return super().__iter__()


def _unread_by_deepspeed(cfg: dict[str, Any], overrides: dict[str, Any], parser) -> list[str]:
    """Your keys DeepSpeed's parser never looks up, where it looks up others beside them (a section
    it hands to a validating model as a whole is that model's to check). Best effort: [] if the
    recording run fails."""
    seen: set[tuple] = set()

    def wrap(d, path):
        return _ReadRecorder({k: wrap(v, (*path, k)) for k, v in d.items()}, path, seen) \
            if isinstance(d, dict) else d

    try:
        parser(wrap(cfg, ()))
    except Exception:  # noqa: BLE001 - only a hint; the real check passed above
        return []
    parents = {p[:-1] for p in seen}

    def paths(d, path=()):
        for k, v in d.items():
            yield (*path, k)
            if isinstance(v, dict):
                yield from paths(v, (*path, k))

    return [".".join(map(str, p)) for p in paths(overrides) if p not in seen and p[:-1] in parents]
