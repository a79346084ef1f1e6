"""Shared bits of `lazytrain generate` and `lazytrain moe`: config composition and error lines."""

from __future__ import annotations

import sys

# Errors a user can fix: printed as one line, exit code 2 (never a traceback).
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, OSError, KeyError)


# What generate and moe read of the config they compose (config.yaml's job.*, planner.*, hardware and
# model=... are plan's: set for these commands they changed nothing, without a word: a review)
READS = ("model.path", "moe", "prompt", "prompt_ids", "max_new_tokens", "out", "predictor_train")


def compose(overrides: list[str], command: str = "generate"):
    """The Hydra config with the `moe` group selected (every model config declares `path`)."""
    from ..cli.config import check_read_sections, load_config

    ovs = list(overrides)
    check_read_sections(ovs, READS, command)
    if not any(o.lstrip("+").startswith("moe=") for o in ovs):
        ovs.insert(0, "+moe=default")
    return load_config(ovs, extra_groups=("moe",))


def whole_setting(name: str, v, lo: int) -> int:
    """A whole number >= lo, or ValueError naming the setting (1.7 was truncated to 1; a negative
    prefetch_extra crashed mid-generation)."""
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():   # ('3', quoted: int("3") took it)
        v = int(v)
    if isinstance(v, bool) or not (isinstance(v, int) or isinstance(v, float) and v.is_integer()) or v < lo:
        raise ValueError(f"{name} must be a whole number >= {lo}, got {v!r}")
    return int(v)


def engine_kwargs(cfg) -> dict:
    m = cfg.moe
    return dict(model_path=cfg.model.get("path"), cache_slots=m.cache_slots,
                cache_fraction=m.cache_fraction, eviction=m.eviction, prefetch=m.prefetch,
                predictor_path=m.predictor,
                lookahead=m.lookahead if str(m.lookahead) == "auto" else whole_setting("moe.lookahead", m.lookahead, 1),
                prefetch_extra=whole_setting("moe.prefetch_extra", m.prefetch_extra, 0),
                device=m.device, io_workers=whole_setting("moe.io_workers", m.io_workers, 1),
                queue_depth=m.queue_depth, verify=m.verify,
                direct=bool(m.direct_io), host_cache_fraction=m.get("host_cache_fraction", 0.0) or 0.0,
                host_cache_slots=m.get("host_cache_slots", None))


def fail(cmd: str, e: BaseException) -> int:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, KeyError):
        msg = f"missing key {msg}"
    print(f"lazytrain {cmd}: error: {msg}", file=sys.stderr)
    return 2
