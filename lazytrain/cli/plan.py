"""`lazytrain plan` — plan a job and show it, without importing torch.

  lazytrain plan [overrides] [--json PATH] [--plot PATH.png]
  lazytrain plan max-batch [overrides]        largest micro-batch per method, best accumulation split
  lazytrain plan compare [overrides]          MILP vs each heuristic: step time, peak, fits?
  lazytrain plan show PLAN.json [--plot PATH.png]
  lazytrain plan export-deepspeed PLAN.json --out ds_config.json
  lazytrain plan trace RUN_DIR                per resource: the run's traced seconds and bytes per
                                              step vs its plan's prediction

Overrides are Hydra's: model=llama3-8b hardware=rtx3090 job.mode=lora job.batch_size=4
job.seq_len=2048 hardware.device_memory_gib=20 planner.cache=false model.path=DIR ...
Exit codes: 0 ok, 2 infeasible or bad input (nothing written).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from ..plan.render import gib_text, rate_text
from ..spec import GiB, ModelConfigError
from .config import ConfigError, hardware_spec, job_spec, load_config, model_spec, planner_options


def _pop_flag(args: list[str], flag: str) -> str | None:
    if sum(a == flag or a.startswith(flag + "=") for a in args) > 1:   # (was "unknown option")
        raise ConfigError(f"{flag} given more than once")
    if flag in args:
        i = args.index(flag)
        if i + 1 >= len(args):
            raise ConfigError(f"{flag} needs a value")
        val = args[i + 1]
        del args[i:i + 2]
        return val
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            del args[i]
            return a.split("=", 1)[1]
    return None


def _inputs(overrides: list[str]):
    flags = [a for a in overrides if a.startswith("-")]
    if flags:   # left over after the subcommand took its own: a typo (Hydra's lexer error otherwise)
        raise ConfigError(f"unknown option {flags[0]!r} (see `lazytrain plan --help`)")
    cfg = load_config(overrides)
    from .config import check_model_structure, planner_cache_dir, profile_mismatch
    cache_dir = planner_cache_dir(cfg)
    use_cache = bool(cfg.planner.cache)
    # planner.cache=false bypasses the cache both ways: nothing read, nothing written
    model, hw, job = model_spec(cfg), hardware_spec(cfg), job_spec(cfg)
    profile_mismatch(cfg, job)
    check_model_structure(model, job.loss_chunk_tokens)
    return model, hw, job, planner_options(cfg), use_cache, cache_dir if use_cache else None


def _print_plan(plan) -> None:
    from rich.console import Console

    from ..plan.render import render
    render(plan, Console(width=120))


def _check_output(path: str | None, flag: str) -> None:
    """ConfigError unless a file can be written at `path`: checked before solving, so that a typo
    costs no solve and a bad path is one line, not a traceback after the plan was printed. The
    nearest existing folder is probed with a temporary file (permission bits do not say it all:
    root may 'write' /proc)."""
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {p} is a directory; give a file path")
    folder = p.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"{flag} {p}: {folder} is not a directory")
    from ..storage.filemode import cannot_write_in
    why = cannot_write_in(folder)
    if why:
        raise ConfigError(f"{flag} {p}: cannot write in {folder} ({why})")


def _check_plot_format(path: str | None) -> None:
    """ConfigError for a --plot extension matplotlib cannot write (checked before anything is
    solved or written; no extension: matplotlib writes a PNG)."""
    ext = Path(path).suffix.lstrip(".").lower() if path else ""
    if not ext:
        return
    from matplotlib.backend_bases import FigureCanvasBase
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if ext not in formats:
        raise ConfigError(f"--plot {path}: format {ext!r} is not supported; use one of {', '.join(formats)}")


def _write_outputs(plan, json_path: str | None, plot_path: str | None) -> list[str]:
    """Write --plot, then --json (through a temp file, renamed last), both or neither: a failure
    (ConfigError, one line) removes what was already written."""
    from ..plan.plot import plot_plan
    from ..storage.filemode import replace_text
    done: list[Path] = []
    try:
        if plot_path:
            done.append(plot_plan(plan, plot_path))
        if json_path:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            done.insert(0, replace_text(json_path, plan.to_json()))
    except OSError as e:
        for f in done:
            f.unlink(missing_ok=True)
        what = f" {e.filename}" if getattr(e, "filename", None) else ""
        raise ConfigError(f"cannot write{what}: {e.strerror or e}; nothing written") from None
    except (RuntimeError, ValueError) as e:
        # a format matplotlib lists but cannot write here (pgf without xelatex): a traceback before
        for f in done:
            f.unlink(missing_ok=True)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--plot {plot_path}: matplotlib cannot write it here ({msg}); nothing written; "
                          "use another format (.png, .svg, .pdf)") from None
    return [str(f) for f in done]


def cmd_plan(args: list[str]) -> int:
    from ..plan import plan_job
    json_path = _pop_flag(args, "--json")
    plot_path = _pop_flag(args, "--plot")
    # bad output paths are found before the solve (and before anything is written)
    _check_output(json_path, "--json")
    _check_output(plot_path, "--plot")
    _check_plot_format(plot_path)
    model, hw, job, opts, use_cache, cache_dir = _inputs(args)
    plan = plan_job(model, hw, job, opts, cache_dir=cache_dir, use_cache=use_cache)
    if not plan.fits:
        print("infeasible: " + "\n".join(plan.explanation), file=sys.stderr)
        return 2
    _print_plan(plan)
    for f in _write_outputs(plan, json_path, plot_path):
        print(f"wrote {f}")
    return 0


def cmd_show(args: list[str]) -> int:
    from ..plan.plan import Plan
    plot_path = _pop_flag(args, "--plot")
    if len(args) != 1:
        raise ConfigError("usage: lazytrain plan show PLAN.json [--plot PATH.png]")
    _check_output(plot_path, "--plot")
    _check_plot_format(plot_path)
    plan = Plan.load(args[0])
    _print_plan(plan)
    if plot_path:
        if not plan.layers:
            raise ConfigError(f"{args[0]} is a plan with status {plan.status}: it has no layers to plot")
        for f in _write_outputs(plan, None, plot_path):
            print(f"wrote {f}")
    return 0


def cmd_trace(args: list[str]) -> int:
    from ..plan.tracecmp import TRANSFERS, compare_run, step_ranges
    if len(args) != 1:
        raise ConfigError("usage: lazytrain plan trace RUN_DIR  (a `lazytrain train` output_dir)")
    c = compare_run(args[0])

    def ratio(m, p):
        return f"{m / p:.2f}x" if m is not None and p > 0 else "-"
    def mib(r, b):   # bytes only for transfers (compute and optimizer items are seconds)
        return "" if r.kind.split()[0] not in TRANSFERS else "-" if b is None else f"{b / 2**20:,.1f}"
    rows = [(r.kind, f"{r.predicted_s:.4f}", "-" if r.measured_s is None else f"{r.measured_s:.4f}",
             ratio(r.measured_s, r.predicted_s), mib(r, r.predicted_bytes), mib(r, r.measured_bytes))
            for r in c.rows]
    rows.append(("step", f"{c.predicted_step_s:.4f}", "-" if c.measured_step_s is None else f"{c.measured_step_s:.4f}",
                 ratio(c.measured_step_s, c.predicted_step_s), "", ""))
    steps = ("steps " if len(c.steps) > 1 else "step ") + step_ranges(c.first_step + s for s in c.steps)
    _table(f"{args[0]}: busy seconds and MiB per step, median over {steps}",
           ("kind", "predicted s", "measured s", "measured/pred", "predicted MiB", "measured MiB"), rows)
    for note in c.notes:
        print(f"note: {note}")
    cuda = "; on CUDA compute spans are host-side launch windows, not kernel time" if c.device_type == "cuda" else ""
    print("Busy time sums each kind's spans; the step overlaps them. Optimizer spans include waits for "
          f"NVMe-tier state and the copy of new weights to the device (also listed as h2d){cuda}.")
    return 0


def cmd_compare(args: list[str]) -> int:
    from ..plan import HEURISTICS, plan_job
    from ..plan.solve import timed_out
    model, hw, job, opts, use_cache, cache_dir = _inputs(args)
    rows, why = [], []
    for method in ["milp"] + [f"heuristic:{h}" for h in HEURISTICS]:
        plan = plan_job(model, hw, job, opts, cache_dir=cache_dir, use_cache=use_cache, method=method)
        if plan.fits:
            # a MILP that ran out of time returns the best heuristic's plan: the row says so
            label = f"{method} (fallback: {_fallback_name(plan)})" if plan.solver.fell_back else method
            rows.append((label, f"{plan.predicted.step_time_s:.4g}", rate_text(plan.predicted.tokens_per_s),
                         gib_text(plan.predicted.peak_bytes['device']), "yes"))
            if plan.solver.fell_back:
                why.append(f"{method}: {plan.solver.status_detail}")
        else:
            # a time limit proves nothing: unknown, not "no" (review; as plan max-batch says it)
            rows.append((method, "-", "-", "-", "? (time limit)" if timed_out(plan) else "no"))
            # whole, below the table (cut to the column, the amounts it names were lost); a line
            # that names its method already is printed as it is (one cut at its first ': ' left
            # "heuristic:no-checkpoint: raise it for what would fit"; review)
            line = plan.explanation[0] if plan.explanation else "infeasible"
            why.append(line if line.startswith(method + " ") else f"{method}: {line.removeprefix('no plan fits: ')}")
    _table(f"{model.name} on {hw.name}, {job.mode}, batch {job.batch_size} x {job.seq_len}",
           ("method", "step s", "tokens/s", "device GiB", "fits"), rows)
    for line in why:
        print(line)
    # exit 2 when no method fits, as plan and plan max-batch do (not when a time limit left it open)
    return 0 if any(r[-1] != "no" for r in rows) else 2


def _fallback_name(plan) -> str:
    """The heuristic a timed-out MILP returned, from its status line ('... best heuristic (X) returned')."""
    d = plan.solver.status_detail
    name = d.split("best heuristic (", 1)[1].split(")", 1)[0] if "best heuristic (" in d else "heuristic"
    return f"{name}, tiers improved" if "tiers then made faster" in d else name


MAX_BATCH_CAP = 4096   # plan max-batch searches up to this micro-batch


def cmd_max_batch(args: list[str]) -> int:
    from ..plan import HEURISTICS, best_split, max_batch, plan_job
    model, hw, job, opts, use_cache, cache_dir = _inputs(args)
    rows = []
    best = {}
    cut_short = False
    for method in ["milp"] + [f"heuristic:{h}" for h in HEURISTICS]:
        cut: dict = {}
        b = max_batch(model, hw, job, opts, method, limit=MAX_BATCH_CAP, report=cut)
        best[method] = b
        cut_short |= bool(cut)
        tps = "-"
        if b:
            p = plan_job(model, hw, replace(job, batch_size=b), opts, cache_dir=cache_dir,
                         use_cache=use_cache, method=method)
            tps = rate_text(p.predicted.tokens_per_s) if p.fits else "-"
        # the search stops at its cap: a batch there is a lower bound, not the largest
        # (a time limit that cut the search short leaves a lower bound too)
        shown = (f">= {b} (search cap)" if b >= MAX_BATCH_CAP else f">= {b} (time limit)" if cut else str(b))
        rows.append((method, shown, tps))
    _table(f"largest micro-batch: {model.name} on {hw.name}, {job.mode}, seq {job.seq_len}, "
           f"device {hw.device_memory_gib:g} GiB", ("method", "max batch", "tokens/s at max"), rows)
    if cut_short:
        print(f"some searches hit planner.time_limit_s={opts.time_limit_s} before deciding a batch: those "
              f"rows are lower bounds; raise planner.time_limit_s for the largest")
    global_batch = job.batch_size * job.grad_accum
    if best["milp"] and global_batch > 1:
        splits = best_split(model, hw, job, opts, global_batch, best["milp"])
        _table(f"global batch {global_batch}: micro-batch x accumulation, fastest first",
               ("micro-batch", "grad_accum", "step s", "tokens/s"),
               [(str(b), str(g), f"{p.predicted.step_time_s:.4g}", rate_text(p.predicted.tokens_per_s))
                for b, g, p in splits])
    if not best["milp"] and not cut_short:   # (the table alone said 0 without a reason: review)
        one = plan_job(model, hw, replace(job, batch_size=1), opts, cache_dir=cache_dir, use_cache=use_cache)
        if one.explanation:
            print(f"batch 1 does not fit either: {one.explanation[0]}")
            for line in one.explanation[1:]:
                print(f"  {line}")
    return 0 if best["milp"] or cut_short else 2   # (unknown is not "does not fit")


def _table(title: str, header: tuple[str, ...], rows: list[tuple]) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title)
    for h in header:
        t.add_column(h)
    for r in rows:
        t.add_row(*r)
    Console(width=140).print(t)


def main(argv: list[str]) -> int:
    args = list(argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    sub = args[0] if args and "=" not in args[0] and not args[0].startswith("-") else None
    try:
        if sub == "show":
            return cmd_show(args[1:])
        if sub == "compare":
            return cmd_compare(args[1:])
        if sub == "max-batch":
            return cmd_max_batch(args[1:])
        if sub == "trace":
            return cmd_trace(args[1:])
        if sub == "export-deepspeed":
            from .plan_export import main as export_main
            return export_main(args[1:])
        if sub is not None:
            raise ConfigError(f"unknown plan subcommand {sub!r}; valid: show, compare, max-batch, trace, "
                              "export-deepspeed")
        return cmd_plan(args)
    except (ConfigError, ModelConfigError, ValueError) as e:
        print(f"lazytrain plan: {e}", file=sys.stderr)
        return 2
    except OSError as e:   # a file the command reads or writes: one line, not a traceback
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"lazytrain plan: {where}{e.strerror or e}", file=sys.stderr)
        return 2
