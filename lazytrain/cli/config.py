"""Hydra config loading and the builder layer: config objects stop here, library code below
takes plain typed arguments (ModelSpec, HardwareSpec, JobSpec, PlannerOptions)."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..plan.plan import PlannerOptions
from ..spec import HardwareSpec, JobSpec, ModelSpec
from ..spec.job import short_dtype


class ConfigError(ValueError):
    """A user-facing configuration problem; the message says what to do."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def planner_cache_dir(cfg) -> Path:
    """planner.cache_dir as `plan` and `train` both use it: an absolute path as it is; a relative
    one (the default `solver_cache`) under the current dir where that exists, else under the source
    checkout this package runs from (its shared cache, when run from elsewhere), else the current
    dir (an installed package's folder is not a cache). Before 2026-12-01 `train` took it from the
    current dir only and missed the plans `plan` had cached in the checkout."""
    d = Path(str(cfg.planner.cache_dir)).expanduser()
    if d.is_absolute() or (Path.cwd() / d).exists():
        return d if d.is_absolute() else Path.cwd() / d
    root = repo_root()
    return root / d if (root / "pyproject.toml").is_file() else Path.cwd() / d


def hydra_quoted(v: str) -> str:
    """`v` as a single-quoted Hydra value (backslashes escape only before a quote or at the end)."""
    v = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", v)
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, v) + "'"


MEASURED_MISSING = ("hardware=measured: no measured profile yet; run `lazytrain profile hardware=NAME "
                    "model=...` first (it writes configs/hardware/measured.yaml)")


def config_dir() -> Path:
    return Path(os.environ.get("LAZYTRAIN_CONFIG_DIR", repo_root() / "configs")).resolve()


def available(group: str) -> list[str]:
    d = config_dir() / group   # (options in subfolders are chosen as group=sub/name, as Hydra does)
    return sorted(p.relative_to(d).with_suffix("").as_posix() for p in d.rglob("*.yaml"))


def _check_group_choices(overrides: list[str]) -> None:
    for ov in overrides:
        key, _, value = ov.lstrip("+~").partition("=")
        if key in ("model", "hardware", "moe", "data") and value:
            names = available(key)
            if value == "measured" and key == "hardware" and value not in names:
                raise ConfigError(MEASURED_MISSING)
            if names and value not in names:
                raise ConfigError(f"unknown {key} {value!r}; valid: {', '.join(names)}")


def declared_bools(root: Path | None = None) -> frozenset[str]:
    """Dotted keys that are true/false in some config file (top-level files at the root, a
    group's files under the group's name, or the root for `# @package _global_` ones)."""
    return _declared(root, bools=True)


def declared_keys(root: Path | None = None, config_name: str | None = None,
                  groups: set[str] | None = None) -> frozenset[str]:
    """Every dotted key the config files declare (their mappings and their values; where
    declared_bools looks): for one command, its primary config (`config_name`, with the top-level
    files its defaults list names) and the config groups it has (`groups`); None: all of them."""
    return _declared(root, bools=False, config_name=config_name, groups=groups)


# Settings whose content is the user's to choose (added with `+`): DeepSpeed's own config, and the
# HF config of a model built from its config.
FREE_FORM = ("deepspeed", "model.hf_config")


def _free_form(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") for f in FREE_FORM)


def unknown_setting(key: str, declared: frozenset[str] | None = None) -> str:
    """The line for a key the command's config files do not declare: the section's settings and the
    closest one, or that it belongs to another command."""
    import difflib

    declared = declared if declared is not None else declared_keys()
    if key in declared_keys() or key.split(".")[0] in FREE_FORM:
        # (declared, but for another command: plan's optim.*, train's prompt, generate's job.*)
        return f"{key}: not a setting of this command (another lazytrain command's config declares it)"
    section, _, leaf = key.rpartition(".")
    fixed = ""
    if section and section not in declared:   # (a section mistyped, optimm.lr: its closest, if any)
        near = difflib.get_close_matches(section, sorted(k for k in declared if "." not in k), n=1)
        if not near:
            return f"{key}: no such setting (no section {section!r})"
        fixed = f"no section {section!r}; "
        section = near[0]
    names = sorted(k.rpartition(".")[2] for k in declared if k.rpartition(".")[0] == section)
    near = [n for n in difflib.get_close_matches(leaf, names, n=2) if n != leaf or fixed][:1]
    hint = f"; did you mean {section + '.' if section else ''}{near[0]}?" if near else ""
    return f"{key}: no such setting ({fixed}{section or 'top-level'} settings: {', '.join(names)}){hint}"


_INTERP = re.compile(r"\$\{([^${}]*)\}")
_KEYLIKE = re.compile(r"^\.*[A-Za-z_][\w.]*$")


def _refs_in(text: str, parent: str) -> set[str]:
    """Dotted keys one interpolation string reads: `${a.b}`, relative `${.x}` (from `parent`), and
    key-like arguments of a resolver (`${oc.select:optim.base_lr,3e-4}`)."""
    out: set[str] = set()
    for body in _INTERP.findall(text):
        name, colon, args = body.partition(":")
        cands = [a.strip() for a in args.split(",")] if colon else [body.strip()]
        for c in cands:
            if not _KEYLIKE.match(c):
                continue
            dots = len(c) - len(c.lstrip("."))
            if dots:   # relative: one dot is the node's own parent, each more one level up
                base = parent.split(".") if parent else []
                base = base[:len(base) - (dots - 1)] if dots > 1 else base
                c = ".".join([*base, c.lstrip(".")])
            out.add(c)
    return out


def _referenced(cfg: DictConfig) -> set[str]:
    """Dotted keys an interpolation anywhere in `cfg` (mappings and lists) reads: a helper the user
    added with `+` for others to interpolate (`+optim.base_lr=1e-4 optim.lr='${optim.base_lr}'`,
    `data.files=[${root}/a.jsonl]`) is read."""
    from omegaconf import ListConfig

    refs: set[str] = set()

    def walk(node, path: str) -> None:
        is_list = isinstance(node, ListConfig)
        for k in (range(len(node)) if is_list else node.keys()):
            v = node._get_node(k)
            if v is None:
                continue
            if v._is_interpolation():
                refs.update(_refs_in(str(v._value()), path))
            elif isinstance(v, (DictConfig, ListConfig)) and not v._is_missing() and not v._is_none():
                walk(v, path if is_list else (f"{path}.{k}" if path else str(k)))

    walk(cfg, "")
    return refs


def chosen_groups(root: Path, config_name: str, extra: tuple[str, ...] = ()) -> set[str]:
    """The config groups a command has: those its primary config's defaults lists name, and `extra`,
    those the command adds itself (generate's and moe's `+moe=default`). A group chosen on the
    command line beyond these (`plan +data=text`) is no setting of the command."""
    names = {d.name for d in root.iterdir() if d.is_dir()}
    chosen: set[str] = set(extra)
    for f in _top_files(root, config_name):
        for d in _defaults(f):
            if isinstance(d, dict):
                chosen.update(k.split()[-1].split("@")[0].strip("/") for k in d)   # ("override model")
    return chosen & names


def check_declared_keys(cfg: DictConfig, config_name: str = "config", root: Path | None = None,
                        extra_groups: tuple[str, ...] = ()) -> None:
    """ConfigError for a setting the command's config files do not declare (added with `+`/`++`:
    Hydra's own hint for a mistyped key, `+optim.learning_rate=0.1`, trained at the default lr
    without a word: a review). A key an interpolation reads passes (and what lies under it), and so
    does a config dir that has no config files (nothing to check against)."""
    root = root or config_dir()
    if not root.is_dir():
        return
    declared = declared_keys(root, config_name, chosen_groups(root, config_name, extra_groups))
    refs = _referenced(cfg)

    def read(key: str) -> bool:      # the key, or something under one, is what a reference reads
        return any(r == key or key.startswith(r + ".") for r in refs)

    def holds_read(key: str) -> bool:   # a section some reference reads into (walked, not skipped)
        return any(r.startswith(key + ".") for r in refs)

    def walk(node, prefix: str) -> None:
        for k in node.keys():
            key = f"{prefix}{k}"
            if read(key) or (_free_form(key) and key.split(".")[0] in declared):
                continue
            if key not in declared and not holds_read(key):
                raise ConfigError(unknown_setting(key, declared))
            v = node._get_node(k)
            if isinstance(v, DictConfig) and not v._is_missing() and not v._is_none() and not v._is_interpolation():
                walk(v, key + ".")

    walk(cfg, "")


def check_read_sections(overrides: list[str], reads: tuple[str, ...], command: str) -> None:
    """ConfigError for an override of a setting the command composes but never reads (generate's
    and moe's config has plan's job.*, planner.*, hardware: set there, they changed nothing)."""
    for o in overrides:
        if o.startswith("~") or "=" not in o:
            continue
        key = o.lstrip("+").split("=", 1)[0]
        if key.startswith("hydra.") or key.startswith("hydra/"):
            continue
        if not any(key == r or key.startswith(r + ".") for r in reads):
            raise ConfigError(f"{key}: not a setting of `lazytrain {command}` (it reads "
                              f"{', '.join(reads)})")


def check_hf_config_with_path(cfg: DictConfig, overrides: list[str]) -> None:
    """ConfigError for model.hf_config overrides next to model.path: the model's own config.json is
    used, and the overrides were ignored without a word. (A deletion, `~model.hf_config`, is fine.)"""
    if not cfg.get("model") or not cfg.model.get("path") or not Path(str(cfg.model.path)).expanduser().exists():
        return   # (a missing model.path is said first, by model_spec)
    keys = [o.lstrip("+").split("=", 1)[0] for o in overrides if not o.startswith("~")]
    touched = [k for k in keys if k == "model.hf_config" or k.startswith("model.hf_config.")]
    if touched:
        raise ConfigError(f"{touched[0]} does not apply with model.path (the model's own config.json "
                          f"describes it); edit {Path(str(cfg.model.path)).expanduser() / 'config.json'} "
                          "or leave model.path out")


def _top_files(root: Path, config_name: str) -> list[Path]:
    """The primary config file and the top-level files its defaults list names (train -> config)."""
    out: list[Path] = []
    todo = [config_name]
    while todo:
        f = root / f"{todo.pop()}.yaml"
        if f in out or not f.is_file():
            continue
        out.append(f)
        todo += [d.lstrip("/") for d in _defaults(f) if isinstance(d, str) and d != "_self_"]
    return out


def _declared(root: Path | None, bools: bool, config_name: str | None = None,
              groups: set[str] | None = None) -> frozenset[str]:
    root = root or config_dir()
    keys: set[str] = set()

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict):
            if prefix and not bools:
                keys.add(prefix[:-1])
            for k, v in node.items():
                if prefix or k != "defaults":
                    walk(v, f"{prefix}{k}.")
        elif not bools or isinstance(node, bool):
            keys.add(prefix[:-1])

    tops = sorted(root.glob("*.yaml")) if config_name is None else _top_files(root, config_name)
    grouped = [f for f in sorted(root.glob("*/**/*.yaml"))
               if groups is None or f.relative_to(root).parts[0] in groups]
    for f in tops + grouped:
        got = _yaml_file(f)
        if got is None:
            continue   # (composing reports a broken file, with its name)
        text, node = got
        group = f.relative_to(root).parts[0] if f.parent != root else None
        if group and not bools:
            keys.add(group)   # (the group itself: model, hardware, ...)
        walk(node, "" if group is None or _global_package(text) else f"{group}.")
    return frozenset(keys)


_YAML_CACHE: dict[Path, tuple[tuple[int, int], str, Any]] = {}


def _yaml_file(f: Path) -> tuple[str, Any] | None:
    """(text, parsed YAML) of a config file, or None when it cannot be read or parsed (composing
    reports such a file, with its name). Parsed once per content (keyed on mtime and size): a
    command checks its keys in load_config and again in preflight, over ~25 files each time."""
    import yaml

    try:
        st = f.stat()
        stamp = (st.st_mtime_ns, st.st_size)
        hit = _YAML_CACHE.get(f)
        if hit is None or hit[0] != stamp:
            text = f.read_text(encoding="utf-8")
            hit = _YAML_CACHE[f] = (stamp, text, yaml.safe_load(text))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return hit[1], hit[2]


def _defaults(f: Path) -> list:
    """A config file's defaults list ([] when it has none or cannot be read)."""
    got = _yaml_file(f)
    node = got[1] if got is not None else None
    return (node.get("defaults") or []) if isinstance(node, dict) else []


def _global_package(text: str) -> bool:
    """A `# @package _global_` header: among the comment lines a file starts with (Hydra's header)."""
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            return False
        if "@package" in line:
            return "_global_" in line
    return False


def check_bool_settings(cfg: DictConfig) -> None:
    """ConfigError for a true/false setting given anything else: Hydra reads `=no` or `='false'` as
    a string, which Python takes as true (`hardware.nvme_full_duplex=no` planned full duplex)."""
    for key in sorted(declared_bools()):
        v = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if v is not None and not isinstance(v, bool):
            raise ConfigError(f"{key} must be true or false, got {v!r}")


def load_config(overrides: list[str], config_name: str = "config", extra_groups: tuple[str, ...] = ()) -> DictConfig:
    """Compose the config the way `@hydra.main` would, for commands that are not Hydra apps.
    `extra_groups`: groups the command adds itself (see chosen_groups)."""
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    _check_group_choices(overrides)
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = compose(config_name=config_name, overrides=overrides)
    except yaml.YAMLError as e:   # a hand-edited config file (measured.yaml, say) that does not parse
        where = getattr(e, "problem_mark", None)
        at = f"{where.name}, line {where.line + 1}" if where is not None else "a config file"
        raise ConfigError(f"{at} is not valid YAML ({getattr(e, 'problem', None) or e}); fix or remove it"
                          + ("; `lazytrain profile` writes configs/hardware/measured.yaml afresh"
                             if "measured.yaml" in at else "")) from None
    except HydraException as e:
        lines = str(e).splitlines()
        # keep Hydra's hint for a key the config does not declare ("To append to your config use +k=v")
        if lines and lines[0].startswith("Ambiguous value"):   # (k=a,b: Hydra's numbered ways, in one line)
            key = lines[0].split("'", 2)[1].split("=", 1)[0] if lines[0].count("'") >= 2 else "key"
            raise ConfigError(f"{lines[0]}; use a list, {key}=[a,b], or quote it, {key}='a,b' (or "
                              f"--multirun to sweep over it)") from None
        m = re.match(r"Could not override '([^'@]+)'", lines[0]) if lines else None
        if m and not _free_form(m.group(1)):
            # (not Hydra's "To append to your config use +k=v": nothing would read it)
            root = config_dir()
            declared = declared_keys(root, config_name, chosen_groups(root, config_name, extra_groups))
            raise ConfigError(unknown_setting(m.group(1), declared)) from None
        hint = [x for x in lines[1:2] if x.startswith("To append")]
        raise ConfigError(" ".join(lines[:1] + hint)) from None
    _check_group_nodes(cfg, overrides)
    check_declared_keys(cfg, config_name, extra_groups=extra_groups)
    check_hf_config_with_path(cfg, overrides)
    check_bool_settings(cfg)
    return cfg


def _check_group_nodes(cfg: DictConfig, overrides: list[str]) -> None:
    """ConfigError for a config group whose chosen file is not a mapping of settings (a
    measured.yaml that holds `[1, 2]` was an omegaconf traceback: a review)."""
    for d in sorted(p for p in config_dir().iterdir() if p.is_dir()):
        node = cfg.get(d.name)
        if node is None or isinstance(node, DictConfig):
            continue
        choice = next((o.split("=", 1)[1] for o in reversed(overrides)
                       if o.lstrip("+").split("=", 1)[0] == d.name and "=" in o), None)
        f = d / f"{choice}.yaml" if choice else f"{d.name}'s default file in {d}"
        raise ConfigError(f"{f} holds a {type(node).__name__.removesuffix('Config').lower()}, not a mapping "
                          "of settings; fix or remove it"
                          + ("; `lazytrain profile` writes it afresh" if choice == "measured" else ""))


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
    hf = OmegaConf.to_container(m.hf_config, resolve=True)
    spec = ModelSpec.from_hf_config(hf, name=m.get("name"))
    # (only for keys the shipped model configs do not use: the check imports transformers and with
    # it torch, ~2 s, which `lazytrain plan` otherwise never loads)
    unused = unused_hf_config_keys(hf) if set(hf) - {"model_type"} - _shipped_hf_keys(spec.family) else []
    typos = [(k, near) for k, near in unused if near]
    if typos:   # (a key with a close declared one: a typo, refused)
        k, near = typos[0]
        raise ConfigError(f"model.hf_config.{k}: not a setting of {spec.family}'s config (transformers would "
                          f"keep it and no code would read it); did you mean model.hf_config.{near}?"
                          + (f" (also: {', '.join(k for k, _ in unused if k != typos[0][0])})" if len(unused) > 1 else ""))
    if unused:   # (published config.json files carry such keys: DeepSeek-V3's ep_size; review)
        import logging

        logging.getLogger("lazytrain").warning(
            "model.hf_config: %s: not %s of %s's config; no transformers code reads %s (ignored)",
            ", ".join(k for k, _ in unused), "settings" if len(unused) > 1 else "a setting", spec.family,
            "them" if len(unused) > 1 else "it")
    return spec


@functools.cache
def _shipped_hf_keys(family: str) -> frozenset[str]:
    """The hf_config keys of the configs/model/*.yaml of model_type `family` (all read by
    transformers: checked by a test)."""
    import yaml

    keys: set[str] = set()
    for f in sorted((config_dir() / "model").glob("*.yaml")):
        d = yaml.safe_load(f.read_text()) or {}
        hf = (d.get("hf_config") or {}) if isinstance(d, dict) else {}
        if isinstance(hf, dict) and hf.get("model_type") == family:
            keys |= set(hf)
    return frozenset(keys)


def unused_hf_config_keys(hf: dict[str, Any]) -> list[tuple[str, str | None]]:
    """Keys of a from-config model's hf_config that its transformers config class neither declares
    nor turns into another setting (a typo, `hiden_size`: transformers keeps any keyword as an
    attribute, the model reads `hidden_size`, and the run trained another model without a word),
    each with the closest declared key or None. Kept: legacy keys the class converts (`rope_theta`
    into `rope_parameters`, `torch_dtype` into `dtype`: they change the built config), and keys
    that transformers' code names without declaring them (Qwen3-MoE's attention reads
    `getattr(config, "head_dim", ...)`): searched for in the family's package and transformers'
    shared modules (~4 MB of source, only when a key is undeclared)."""
    import difflib
    import inspect
    import re
    from pathlib import Path

    from transformers import AutoConfig

    hf = dict(hf)
    family = hf.pop("model_type", None)
    try:
        cls = type(AutoConfig.for_model(family))
    except (ValueError, KeyError, TypeError):   # (ModelSpec said what it makes of the family)
        return []
    known = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "attribute_map", None) or {})
    for base in cls.__mro__:
        known |= set(getattr(base, "__annotations__", None) or {})
    odd = sorted(k for k in hf if k not in known)
    if not odd:
        return []
    import transformers

    root = Path(transformers.__file__).parent
    family_dir = Path(inspect.getfile(cls)).parent
    for d in (family_dir, root, root / "integrations"):   # (the family's own package first: small)
        source = "\n".join(f.read_text(errors="replace") for f in sorted(d.glob("*.py")))
        odd = [k for k in odd if not re.search(rf"\b{re.escape(k)}\b", source)]
        if not odd:
            return []
    full = AutoConfig.for_model(family, **hf).to_dict()
    out = []
    for k in odd:
        without = AutoConfig.for_model(family, **{kk: v for kk, v in hf.items() if kk != k}).to_dict()
        if {kk: v for kk, v in full.items() if kk != k} == without:
            # (a close one only: at difflib's default 0.6, ep_size was "did you mean hidden_size")
            near = difflib.get_close_matches(k, sorted(x for x in known if not x.startswith("_")), n=1, cutoff=0.8)
            out.append((k, near[0] if near else None))
    return out


def check_model_structure(mspec: ModelSpec, chunk_tokens: int = 0) -> None:
    """ConfigError when the streaming executor would refuse the model's structure (spec.generic.
    structure_problem: its forward computes more than embed -> blocks -> final norm -> head), said
    before any weight loads or plan solves (the executor said it only once built: review). The
    families with formulas (spec.model.FAMILIES) compute nothing else; the others are probed."""
    from ..spec.model import FAMILIES

    if mspec.family in FAMILIES:
        return
    from ..spec.generic import structure_problem

    why = structure_problem(dict(mspec.hf_config), chunk_tokens)
    if why:
        raise ConfigError(f"the streaming executor cannot train this model exactly: {why}; engine=torch "
                          f"trains it unchanged (without streaming)")


def model_hf_config(cfg: DictConfig) -> dict[str, Any]:
    return dict(model_spec(cfg).hf_config)


def hardware_spec(cfg: DictConfig) -> HardwareSpec:
    d = OmegaConf.to_container(cfg.hardware, resolve=True)
    if d.get("name") == "measured":
        # `lazytrain profile` writes every field: one missing means a file cut short, which the
        # defaults silently filled (a CPU device planned as a GPU: a review)
        from dataclasses import fields
        lack = [f.name for f in fields(HardwareSpec) if f.name not in d]
        if lack:
            raise ConfigError(f"hardware: the measured profile lacks {', '.join(lack)} (cut short, or written by an "
                              "older lazytrain); run `lazytrain profile` again to refresh "
                              "configs/hardware/measured.yaml")
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


def profile_mismatch(cfg: DictConfig, job: JobSpec) -> str | None:
    """With `hardware=measured`: a warning (logged, and returned) when the profile was timed for
    other numerics than `job`'s: its per-layer efficiency was measured in its compute dtype and its
    host_memory_gbps with its optimizer's states (measured.profile.json records both; nothing read
    them, and a profile timed in fp32 planned a bf16 job silently: a review). None otherwise."""
    import json
    import logging

    if cfg.hardware.get("name") != "measured":
        return None
    try:
        det = json.loads((config_dir() / "hardware" / "measured.profile.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(det, dict):
        return None
    diffs = []
    dt = det.get("compute_dtype")   # (the matmul peak and the per-layer times were taken in it)
    if isinstance(dt, str) and short_dtype(dt) != job.compute_dtype:
        diffs.append(f"compute in {dt} (this job: {job.compute_dtype})")
    bits = det.get("host_optimizer_state_bits")
    if bits and job.mode == "full" and int(bits) != job.optimizer_state_bits:
        diffs.append(f"{bits}-bit optimizer states (this job: {job.optimizer_state_bits}-bit)")
    if not diffs:
        return None
    msg = (f"the measured hardware profile was timed with {' and '.join(diffs)}: its rates may misjudge "
           f"this job's step; run `lazytrain profile` with this job's settings to plan it with its own")
    logging.getLogger("lazytrain").warning(msg)
    return msg
