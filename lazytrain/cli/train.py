"""`lazytrain train [hydra overrides]`: the training job as a Hydra app.

    lazytrain train model=demo-llama data=demo job.mode=full job.max_steps=200
    lazytrain train --multirun optim.lr=1e-4,3e-4        # sweeps; outputs under multirun/

A single run is checked first (config, plan, data, tokenizer, nvme_dir) by composing the same config
without Hydra's run machinery, so bad input prints one line and exits 2 with nothing written; then
`@hydra.main` runs the job with its run dir as the default output_dir.
"""

from __future__ import annotations

import os
from pathlib import Path

import sys

HYDRA_FLAGS_WITHOUT_RUN = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "--shell-completion",
                           "-sc", "--resolve", "-p", "--package")
MULTIRUN_FLAGS = ("--multirun", "-m")


NO_DIR = ("", "null", "None", "~")


def _normalise(argv: list[str]) -> list[str]:
    """`output_dir=DIR` for a single run: Hydra's own files (.hydra/, train.log) go there too.
    (`model.path=DIR` needs no help: every model config declares `path: null`.)"""
    out = list(argv)
    given = [a.split("=", 1)[1] for a in out if a.startswith("output_dir=")]
    # (output_dir=null / empty: no dir given; as hydra.run.dir it was Hydra's "not Optional" error)
    if given and given[-1] not in NO_DIR and not any(a.startswith("hydra.run.dir=") for a in out):
        # expanded as the recipe expands it: '~/run' put .hydra/ in ./~/run and the outputs in
        # $HOME/run, and resume=true then found no record of the run's settings (review)
        v = given[-1]
        q = v[0] if len(v) >= 2 and v[0] in "'\"" and v[-1] == v[0] else ""
        out.append(f"hydra.run.dir={q}{os.path.expanduser(v[1:-1] if q else v)}{q}")
    return out


def _overrides(argv: list[str]) -> list[str]:
    """The config overrides in argv (Hydra's own flags and hydra.* settings left out)."""
    return [a for a in argv if not a.startswith("-") and "=" in a
            and not a.lstrip("+~").startswith(("hydra.", "hydra/"))]


def _swept_keys(argv: list[str]) -> list[str]:
    """Keys a --multirun sweeps on the command line, as Hydra's own override parser sees them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(_overrides(argv))
    except Exception:  # noqa: BLE001 - Hydra reports a bad override itself, with its message
        return []
    return [o.key_or_group for o in parsed if o.is_sweep_override()]


def _copy_hydra_record(job_dir: Path, out: Path) -> None:
    """Hydra's .hydra/ (config.yaml, overrides.yaml, hydra.yaml) of a sweep job, into its output dir."""
    import shutil

    src = job_dir / ".hydra"
    if src.is_dir() and src.resolve() != (out / ".hydra").resolve():
        shutil.copytree(src, out / ".hydra", dirs_exist_ok=True)


def _named_earlier(root: str, name: str) -> str | None:
    """The subdir of `root` named with the same `key=value` parts as `name` in another order (sweep
    dirs were named in the command line's key order before 2026-12-01), if there is one."""
    parts = sorted(name.split(","))
    try:
        found = [e.path for e in os.scandir(root) if e.is_dir() and sorted(e.name.split(",")) == parts]
    except OSError:
        return None
    return found[0] if len(found) == 1 else None


def _sweep_subdir(cfg, keys: list[str], num: int, ordered: bool = True,
                  choices: dict[str, str] | None = None) -> str:
    """A sweep job's subdir of output_dir: named by its swept values, keys sorted (the same job
    finds its own dir again when the sweep is re-run with resume=true, its keys and values in any
    order; `ordered=False`: in the given order, as named before 2026-12-01), else Hydra's job
    number.
    ASCII letters, digits and =,._+- only; where that (or the value's type: 0.1 vs '0.1') loses
    anything, a hash of the exact values is appended, so two jobs never share a dir. A swept config
    group (model=a,b) is named by its option (`choices`: Hydra's runtime.choices), not by the
    whole config it selects (review: 'model=__path___None,__name____tiny-llama_,...')."""
    import hashlib
    import json

    from omegaconf import OmegaConf

    if not keys:
        return str(num)
    keys = sorted(keys) if ordered else keys
    choices = choices or {}
    values = [(k, choices[k] if k in choices and choices[k] is not None
               else OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v := OmegaConf.select(cfg, k))
               else v) for k in keys]
    # (an option's name is exact as it is: no type to lose, and no hash needed for it)
    exact = ",".join(f"{k}={v}" if k in choices and choices[k] is not None else
                     f"{k}={json.dumps(v, sort_keys=True)}" for k, v in values)
    name = ",".join(f"{k}={v}" for k, v in values)
    name = "".join(c if (c.isascii() and c.isalnum()) or c in "=,._+-" else "_" for c in name)
    if name != exact or len(name) > 120:
        name = name[:100] + "-" + hashlib.sha1(exact.encode()).hexdigest()[:12]
    return name


def _error(msg: str) -> int:
    print(f"lazytrain train: {msg}", file=sys.stderr)
    return 2


class _Stop(BaseException):
    """Ends the Hydra app after a Ctrl-C was reported (a BaseException: Hydra passes it on)."""


def _interrupted(msg: str, code: int = 130) -> int:
    """Ctrl-C: one line (where it stopped, how to continue), not a traceback; 130 as a shell
    reports a process ended by SIGINT (143: SIGTERM)."""
    _error(msg)
    return code


RESUME_NEEDS_OUTPUT_DIR = ("resume=true needs output_dir=DIR, the run to continue: without it the run "
                           "goes to a new Hydra run dir (outputs/DATE/TIME), which holds no checkpoint")


def _resume_without_output_dir(argv: list[str]) -> bool:
    """resume=true (on the command line; the config's default is false) with neither output_dir
    nor a fixed Hydra run/sweep dir."""
    kv = _settings(argv)
    fixed = any(kv.get(k, "null") not in NO_DIR for k in ("hydra.run.dir", "hydra.sweep.dir"))
    return (kv.get("resume", "").lower() == "true" and not fixed
            and kv.get("output_dir", "null") in NO_DIR)


# settings of a run that a resume does not take over: what says to resume, where, and a planned stop
NOT_RESUMED = ("resume", "output_dir", "stop_at_step")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _settings(argv: list[str]) -> dict[str, str]:
    """key -> value text of the command line's `key=value` overrides (+/~ prefixes dropped)."""
    return {_key(a): a.split("=", 1)[1] for a in argv if "=" in a and not a.startswith("-")}


def _with_run_settings(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv, the settings taken over): for `resume=true output_dir=DIR` (a single run), the
    overrides the run was started with (Hydra's DIR/.hydra/overrides.yaml) that this command line
    does not set again, put first, so that a resume needs no more than those two and whatever it
    changes (job.max_steps=...). Hydra then records the whole set for the next resume."""
    kv = _settings(argv)
    out = kv.get("output_dir", "")
    if kv.get("resume", "").lower() != "true" or out in NO_DIR or any(a in MULTIRUN_FLAGS for a in argv):
        return argv, []
    out = _unquoted(f"output_dir={out}")   # (a sweep job's dir, optim.lr=0.003, must be quoted for Hydra)
    record = Path(out).expanduser() / ".hydra" / "overrides.yaml"
    if not record.is_file():
        return argv, []
    import yaml

    try:
        saved = yaml.safe_load(record.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return argv, []   # (the checkpoint's own checks still refuse another job)
    if not isinstance(saved, list):
        return argv, []
    # a group chosen again (hardware=h200) takes its own values: the record's hardware.* are dropped
    groups = {k for k in kv if "." not in k}
    taken = [a for a in saved if isinstance(a, str) and "=" in a and _key(a) not in kv
             and _key(a) not in NOT_RESUMED and not _key(a).startswith(("hydra.", "hydra/"))
             and _key(a).split(".", 1)[0] not in groups]
    # job.clip_grad was ignored by `train` until 2026-12-02 (it clips by optim.max_grad_norm) and is
    # refused now where it disagrees: a run that recorded one is resumed as it ran, without it
    ignored = [a for a in taken if _key(a) == "job.clip_grad"]
    if ignored:
        taken = [a for a in taken if a not in ignored]
        print(f"lazytrain train: resume=true: not taking over the run's {ignored[0]} (`train` clips by "
              "optim.max_grad_norm, as this run did; job.clip_grad follows it)", file=sys.stderr)
    cwd = _recorded_cwd(record.parent / "hydra.yaml")
    if cwd is not None and cwd != Path.cwd():
        taken = [_rerooted(a, cwd) for a in taken]
    return taken + argv, taken


# settings that name files or dirs: relative ones in a run's record are taken from where it started
# (planner.cache_dir has its own resolver, cli.config.planner_cache_dir, for plan and train alike)
PATH_KEYS = ("model.path", "data.files", "data.eval_files", "data.tokenizer", "data.chat_template",
             "data.cache_dir", "storage.nvme_dir", "deepspeed_config")


def _recorded_cwd(hydra_yaml: Path) -> Path | None:
    """The directory the run was started from (Hydra's hydra.runtime.cwd), or None."""
    import yaml

    try:
        cwd = yaml.safe_load(hydra_yaml.read_text())["hydra"]["runtime"]["cwd"]
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError):
        return None
    return Path(cwd) if isinstance(cwd, str) and os.path.isabs(cwd) else None


def _rerooted(override: str, cwd: Path) -> str:
    """`key=value` with the relative paths of a path setting (PATH_KEYS) made absolute under `cwd`,
    the run's starting dir, where they exist there: a resume from another dir reads the run's own
    files. Other settings, absolute and `~` paths, interpolations (`${...}`), paths that do not
    exist under `cwd` (a project moved or mounted elsewhere: they resolve from the current dir, as
    before) and values Hydra cannot parse are left as they are."""
    if _key(override) not in PATH_KEYS:
        return override
    try:
        value = _value(override)
    except Exception:  # noqa: BLE001 (Hydra reports it itself when it parses the command line)
        return override
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) for v in items):
        return override   # (null, numbers)

    def fix(v: str) -> str:
        if not v or os.path.isabs(v) or v.startswith("~") or "${" in v:
            return v
        return str(cwd / v) if (cwd / v).exists() else v

    fixed = [fix(v) for v in items]
    if fixed == items:
        return override
    text = "[" + ",".join(map(_quoted, fixed)) + "]" if isinstance(value, list) else _quoted(fixed[0])
    return override.split("=", 1)[0] + "=" + text


def _quoted_output_dir(arg: str) -> str:
    """`output_dir=V` with V quoted for Hydra where it holds what Hydra would misread (and is not
    quoted already); any other argument as it is."""
    if _key(arg) != "output_dir" or "=" not in arg:
        return arg
    v = arg.split("=", 1)[1]
    if v[:1] in "'\"" or v in ("", "null"):
        return arg
    if any(c in v for c in "=,[]{}()' "):
        return f"output_dir={_quoted(v)}"
    # (what a shell passes for the README's output_dir='~/run': Hydra's grammar refuses ~ # & ! ^ ;
    # < unquoted, with its lexer's exception name as the only word; review)
    try:
        ok = _value(arg) == v
    except Exception:  # noqa: BLE001 - any parse failure: quoted, as the user meant a path
        ok = False
    return arg if ok else f"output_dir={_quoted(v)}"


def _quoted(v: str) -> str:
    from .config import hydra_quoted

    return hydra_quoted(v)


def _value(override: str):
    """The value of `key=value` as Hydra parses it (quotes removed, lists as lists)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides([override])[0].value()


def _unquoted(override: str) -> str:
    """The value of `key=value` as Hydra reads it; the text after '=' if Hydra cannot parse it
    (it reports that itself)."""
    try:
        return str(_value(override))
    except Exception:  # noqa: BLE001
        return override.split("=", 1)[1]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # A sweep job's dir (DIR/optim.lr=0.003) unquoted, as a shell leaves `output_dir='DIR'` (the
    # form the README and the stop/Ctrl-C lines give): quoted for Hydra here, which misread it (a
    # parse error; until 2026-12-01 a refusal telling the user to quote what they had quoted)
    argv = _normalise([_quoted_output_dir(a) for a in argv])
    argv, taken = _with_run_settings(argv)
    if taken:
        print(f"lazytrain train: resume=true: the run's settings from its .hydra/overrides.yaml: "
              f"{' '.join(taken)}", file=sys.stderr)
    from ..cli.config import MEASURED_MISSING, config_dir, load_config
    from ..recipes.train import USER_ERRORS, check_output_dir, preflight
    from ..storage.aligned_io import DiskIOError

    if "hardware=measured" in argv and not (config_dir() / "hardware" / "measured.yaml").is_file():
        return _error(MEASURED_MISSING)
    pre, record = None, None
    no_run = any(a.split("=")[0] in HYDRA_FLAGS_WITHOUT_RUN for a in argv)
    if not no_run and _resume_without_output_dir(argv):   # (--cfg/--help print, whatever resume says)
        return _error(RESUME_NEEDS_OUTPUT_DIR)
    multirun = any(a in MULTIRUN_FLAGS for a in argv)
    if not no_run and not multirun:
        try:
            cfg = load_config(_overrides(argv), config_name="train")
            pre = preflight(cfg)
            if cfg.get("output_dir"):   # (Hydra's default run dir is a new one)
                check_output_dir(cfg, Path(str(cfg.output_dir)).expanduser(), pre)
                if cfg.get("resume"):
                    record = _RunRecord(Path(str(cfg.output_dir)).expanduser())
        except USER_ERRORS as e:
            return _error(str(e))
        except DiskIOError as e:   # (a damaged or unreadable checkpoint state.json, read to check it)
            _error(f"disk error: {e}")
            return 1
        except KeyboardInterrupt:   # (Ctrl-C while the data is tokenized, say): nothing written yet
            return _interrupted("interrupted before training started; nothing was written")
        except Exception as e:  # Hydra config errors arrive as various types; keep them to one line
            if type(e).__module__.startswith(("hydra", "omegaconf")):
                return _error(str(e).splitlines()[0])
            raise
    return _hydra_main(argv, str(config_dir()), pre, record)


class _RunRecord:
    """A resumed run's .hydra/ record as it was before Hydra rewrites it with this command: put
    back when the command is refused before it trains, so the next plain resume=true does not
    take up the refused settings (a refused DeepSpeed change stayed in overrides.yaml, and every
    later resume failed the same way: review)."""

    def __init__(self, out: Path) -> None:
        from ..recipes.checkpoint import latest_checkpoint

        self.dir = out / ".hydra"
        self.files = {p.name: p.read_bytes() for p in self.dir.glob("*.yaml")} if self.dir.is_dir() else {}
        self.latest = latest_checkpoint(out / "checkpoints")
        self.out = out

    def restore_if_untrained(self) -> None:
        from ..recipes.checkpoint import latest_checkpoint

        if not self.files or latest_checkpoint(self.out / "checkpoints") != self.latest:
            return
        try:
            for name, data in self.files.items():
                (self.dir / name).write_bytes(data)
        except OSError:   # (the record only saves retyping: the refusal is what the user must see)
            pass


def _hydra_main(argv: list[str], cfg_dir: str, pre, record: _RunRecord | None = None) -> int:
    swept = _swept_keys(argv)
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    from ..recipes.train import USER_ERRORS, TrainingInterrupted, check_output_dir, preflight, run
    from ..storage.aligned_io import DiskIOError
    try:
        from ..runtime import DeviceBudgetExceeded
    except ImportError:  # a build without the executor: nothing raises it
        class DeviceBudgetExceeded(Exception):
            pass

    status = {"rc": 0}

    @hydra.main(config_path=cfg_dir, config_name="train", version_base=None)
    def _task(cfg: DictConfig) -> float | None:
        hc = HydraConfig.get()
        out = cfg.output_dir or hc.runtime.output_dir
        if cfg.output_dir and str(hc.mode) == "RunMode.MULTIRUN":
            # one output_dir for a sweep: each job in its own subdir, not all in one (the second
            # job would find the first one's checkpoints)
            params = (hc.sweeper.get("params") if hc.sweeper is not None else None) or {}   # hydra.sweeper.params
            keys = swept + [str(k) for k in params if str(k) not in swept]
            choices = {str(k): (None if v is None else str(v)) for k, v in hc.runtime.choices.items()}
            root = os.path.expanduser(str(cfg.output_dir))   # (as the recipe expands it: one dir)
            out = os.path.join(root, _sweep_subdir(cfg, keys, hc.job.num, choices=choices))
            if not os.path.exists(out):
                # a sweep named before 2026-12-01: its keys in the command line's order, and config
                # groups by the whole config they select; the same order finds hashed names too
                names = (os.path.join(root, _sweep_subdir(cfg, keys, hc.job.num, ordered=o, choices=by))
                         for by in (choices, None) for o in (True, False))
                out = next((d for n in names
                            if (d := n if os.path.isdir(n) else _named_earlier(root, os.path.basename(n)))), out)
        if int(os.environ.get("WORLD_SIZE") or 1) > 1 and not cfg.output_dir:
            # Hydra's default run dir is named from each process's clock: ranks could disagree
            status["rc"] = _error("a multi-process launch needs output_dir=DIR, one directory every "
                                  "rank sees (a shared filesystem across nodes)")
            return None
        try:
            from .config import check_hf_config_with_path

            check_hf_config_with_path(cfg, list(hc.overrides.task))   # (a sweep's: load_config's otherwise)
            task_pre = pre
            if cfg.output_dir and str(hc.mode) == "RunMode.MULTIRUN":
                # Hydra records the job's config in its own sweep dir: checked, then copied into the
                # job's output dir, which otherwise had no record of what it ran
                task_pre = preflight(cfg)
                check_output_dir(cfg, Path(out), task_pre)
                _copy_hydra_record(Path(hc.runtime.output_dir), Path(out))
            s = run(cfg, out, pre=task_pre)
        except USER_ERRORS as e:
            if record is not None:
                record.restore_if_untrained()
            status["rc"] = _error(str(e))
            return None
        except TrainingInterrupted as e:   # Ctrl-C: the checkpoints written stay; says how to go on
            status["rc"] = _interrupted(str(e), e.exit_code)
            raise _Stop() from None   # past Hydra (a sweep's later jobs do not start either)
        except DiskIOError as e:  # names the file and the operation; checkpoints are atomic
            _error(f"disk error: {e}")
            status["rc"] = 1
            return None
        except DeviceBudgetExceeded as e:  # the executor's accountant: more than the planned budget
            _error(str(e).splitlines()[0])
            status["rc"] = 1
            return None
        return s.get("last_loss")  # a sweeper's objective

    saved = sys.argv
    sys.argv = ["lazytrain train", *argv]
    try:
        _task()
    except _Stop:
        pass
    except KeyboardInterrupt:   # in Hydra's own set-up or between a sweep's jobs, not in a run
        status["rc"] = _interrupted("interrupted outside training; the checkpoints written are intact "
                                    "(resume=true output_dir=DIR continues a run)")
    finally:
        sys.argv = saved
    return status["rc"]
