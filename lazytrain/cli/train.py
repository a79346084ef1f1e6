"""`lazytrain train [hydra overrides]`: the training job as a Hydra app.

    lazytrain train model=demo-llama data=demo job.mode=full job.max_steps=200
    lazytrain train --multirun optim.lr=1e-4,3e-4        # sweeps; outputs under multirun/

A single run is checked first (config, plan, data, tokenizer, nvme_dir) by composing the same config
without Hydra's run machinery, so bad input prints one line and exits 2 with nothing written; then
`@hydra.main` runs the job with its run dir as the default output_dir.
"""

from __future__ import annotations

import os

import sys

HYDRA_FLAGS_WITHOUT_RUN = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "--shell-completion",
                           "-sc", "--resolve", "-p", "--package")
MULTIRUN_FLAGS = ("--multirun", "-m")


def _normalise(argv: list[str]) -> list[str]:
    """`output_dir=DIR` for a single run: Hydra's own files (.hydra/, train.log) go there too.
    (`model.path=DIR` needs no help: every model config declares `path: null`.)"""
    out = list(argv)
    given = [a.split("=", 1)[1] for a in out if a.startswith("output_dir=")]
    if given and not any(a.startswith("hydra.run.dir=") for a in out):
        out.append(f"hydra.run.dir={given[-1]}")
    return out


def _overrides(argv: list[str]) -> list[str]:
    """The config overrides in argv (Hydra's own flags and hydra.* settings left out)."""
    return [a for a in argv if not a.startswith("-") and "=" in a
            and not a.lstrip("+~").startswith(("hydra.", "hydra/"))]


def _swept_keys(argv: list[str]) -> list[str]:
    """Keys a --multirun sweeps on the command line: a comma outside brackets and quotes, or a
    sweep function (range, choice, interval, glob)."""
    keys = []
    for a in _overrides(argv):
        k, v = a.split("=", 1)
        depth, quote, top = 0, None, []
        for ch in v:
            if quote:
                quote = None if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch in "[{(":
                depth += 1
            elif ch in "]})":
                depth -= 1
            elif depth == 0:
                top.append(ch)
        if "," in top or v.startswith(("range(", "choice(", "interval(", "glob(")):
            keys.append(k.lstrip("+~"))
    return keys


def _sweep_subdir(cfg, keys: list[str], num: int) -> str:
    """A sweep job's subdir of output_dir: named by its swept values (the same job finds its own
    dir again when the sweep is re-run with resume=true, in any order), else Hydra's job number."""
    from omegaconf import OmegaConf

    if not keys:
        return str(num)
    name = ",".join(f"{k}={OmegaConf.select(cfg, k)}" for k in keys)
    name = "".join(c if c.isalnum() or c in "=,._+-" else "_" for c in name)
    if len(name) > 120:
        import hashlib
        name = name[:100] + "-" + hashlib.sha1(name.encode()).hexdigest()[:12]
    return name


def _error(msg: str) -> int:
    print(f"lazytrain train: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = _normalise(list(sys.argv[1:] if argv is None else argv))
    from ..cli.config import config_dir, load_config
    from ..recipes.train import USER_ERRORS, preflight

    if "hardware=measured" in argv and not (config_dir() / "hardware" / "measured.yaml").is_file():
        return _error("hardware=measured: no measured profile yet; run `lazytrain profile hardware=NAME "
                      "model=...` first (it writes configs/hardware/measured.yaml)")
    pre = None
    no_run = any(a.split("=")[0] in HYDRA_FLAGS_WITHOUT_RUN for a in argv)
    multirun = any(a in MULTIRUN_FLAGS for a in argv)
    if not no_run and not multirun:
        try:
            cfg = load_config(_overrides(argv), config_name="train")
            pre = preflight(cfg)
        except USER_ERRORS as e:
            return _error(str(e))
        except Exception as e:  # Hydra config errors arrive as various types; keep them to one line
            if type(e).__module__.startswith(("hydra", "omegaconf")):
                return _error(str(e).splitlines()[0])
            raise
    return _hydra_main(argv, str(config_dir()), pre)


def _hydra_main(argv: list[str], cfg_dir: str, pre) -> int:
    swept = _swept_keys(argv)
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    from ..recipes.train import USER_ERRORS, run
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
            out = os.path.join(str(cfg.output_dir), _sweep_subdir(cfg, swept, hc.job.num))
        if int(os.environ.get("WORLD_SIZE") or 1) > 1 and not cfg.output_dir:
            # Hydra's default run dir is named from each process's clock: ranks could disagree
            status["rc"] = _error("a multi-process launch needs output_dir=DIR, one directory every "
                                  "rank sees (a shared filesystem across nodes)")
            return None
        try:
            s = run(cfg, out, pre=pre)
        except USER_ERRORS as e:
            status["rc"] = _error(str(e))
            return None
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
    finally:
        sys.argv = saved
    return status["rc"]
