"""`lazytrain plan export-deepspeed PLAN.json --out ds_config.json`: the plan as a DeepSpeed ZeRO-3
config, with the plan decisions DeepSpeed cannot express printed. Imports no torch.

    lazytrain plan export-deepspeed outputs/run/plan.json --out ds_config.json
    lazytrain plan export-deepspeed plan.json --out ds.json --nvme-dir /mnt/nvme/ds \
        --set zero_optimization.sub_group_size=100000000
    deepspeed --num_gpus 8 your_train.py --deepspeed_config ds.json   # or: lazytrain train engine=deepspeed
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..integrations.ds_config import default_nvme_dir, ds_config_from_plan, pinned_swap_note, uses_nvme, whole
from ..plan.plan import Plan


def _check_shape(cfg: dict) -> None:
    """ValueError for --set values that break the config's structure (zero_optimization=5, an
    offload section or lazytrain.recompute_blocks set to null): they were written, then crashed
    the summary with a traceback (review)."""
    z = cfg.get("zero_optimization")
    if not isinstance(z, dict):
        raise ValueError(f"zero_optimization must map DeepSpeed's ZeRO keys to values, got {z!r}")
    for sec in ("offload_param", "offload_optimizer"):
        if sec in z and not isinstance(z[sec], dict):
            raise ValueError(f"zero_optimization.{sec} must map keys to values (device, ...), got {z[sec]!r}")
    lt = cfg.get("lazytrain")
    blocks = lt.get("recompute_blocks") if isinstance(lt, dict) else None
    if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        raise ValueError(f"lazytrain.recompute_blocks must be a list of block indices, got {blocks!r}")


def _parse_set(items: list[str]) -> dict[str, Any]:
    """`a.b.c=VALUE` (VALUE parsed as JSON when it is JSON, else kept as a string) -> nested dict."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY.PATH=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        value = whole(value)   # (1e8: DeepSpeed reads sizes such as aio.block_size as they are)
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r} conflicts with an earlier --set")
        node[leaf] = value
    return out


def _compact(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs) or "none"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lazytrain plan export-deepspeed",
                                description="Write a DeepSpeed ZeRO-3 config that expresses a lazytrain plan.")
    p.add_argument("plan", help="plan.json written by `lazytrain plan` or `lazytrain train`")
    p.add_argument("--out", required=True, help="where to write the DeepSpeed config (JSON)")
    p.add_argument("--nvme-dir", default=None, help="nvme_path for NVMe-tier offload")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config entry, e.g. zero_optimization.stage3_max_live_parameters=1e9")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    path = Path(args.plan)
    try:
        plan = Plan.parse(path.read_text())   # (the structure `plan show` checks too: review)
    except FileNotFoundError:
        print(f"export-deepspeed: plan file {path} not found", file=sys.stderr)
        return 2
    except OSError as e:   # e.g. a run dir given instead of its plan.json
        hint = f"; its plan is {path / 'plan.json'}" if path.is_dir() and (path / "plan.json").is_file() else ""
        print(f"export-deepspeed: cannot read {path} ({e.strerror or e}){hint}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"export-deepspeed: {path} is {e}", file=sys.stderr)
        return 2
    try:
        cfg, dropped = ds_config_from_plan(plan, overrides=_parse_set(args.sets), nvme_dir=args.nvme_dir)
        _check_shape(cfg)
    except ValueError as e:
        print(f"export-deepspeed: {e}", file=sys.stderr)
        return 2
    pinned = pinned_swap_note(cfg, plan)
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(cfg, indent=2) + "\n")
        tmp.replace(out)
    except OSError as e:
        print(f"export-deepspeed: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    z = cfg["zero_optimization"]
    print(f"wrote {out}: ZeRO-3, params -> {z.get('offload_param', {}).get('device', 'none')}, "
          f"optimizer -> {z.get('offload_optimizer', {}).get('device', 'none')}, "
          f"recompute blocks {_compact(cfg['lazytrain']['recompute_blocks'])}")
    if cfg["lazytrain"]["recompute_blocks"]:   # (DeepSpeed ignores the lazytrain key: review)
        print("note: DeepSpeed does not read the recompute blocks (they sit under the config's \"lazytrain\" "
              "key); your script applies them with lazytrain.integrations.deepspeed.apply_recompute(model, "
              "blocks) before deepspeed.initialize, as DeepSpeedTrainer does")
    if args.nvme_dir is None and uses_nvme(cfg):
        print(f"note: NVMe offload writes to {default_nvme_dir()} (the default); --nvme-dir DIR puts it "
              f"on the drive you mean")
    if pinned is not None:
        print(("warning: " if pinned[1] else "note: ") + pinned[0])
    if "gradient_clipping" not in cfg:   # (the plan clips, but its threshold is the recipe's setting)
        print("note: DeepSpeed clips at its default gradient_clipping=1.0 (lazytrain train's "
              "optim.max_grad_norm default); --set gradient_clipping=X for the threshold your run uses")
    if dropped:
        print(f"{len(dropped)} plan decision(s) DeepSpeed cannot express:")
        for line in dropped:
            print(f"  - {line}")
    else:
        print("every plan decision is expressed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
