"""`lazytrain <command> [args]`: dispatch to one module per command, imported lazily so that
`lazytrain plan` never imports torch."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "plan": ("lazytrain.cli.plan", "plan a job (MILP), inspect, compare, find the max batch"),
    "train": ("lazytrain.cli.train", "fine-tune (LoRA or full) with a plan; Hydra app"),
    "profile": ("lazytrain.cli.profile", "measure this machine's links and layer costs"),
    "generate": ("lazytrain.cli.generate", "generate text; MoE experts streamed from SSD"),
    "moe": ("lazytrain.cli.moe", "MoE tools: convert (expert store), train-predictor"),
    "demo": ("lazytrain.cli.demo", "the built-in default job (`make demo`)"),
}


def usage() -> str:
    lines = ["usage: lazytrain <command> [args]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import os

    if os.environ.get("LAZYTRAIN_CONFIG_DIR"):
        # the dir as this command line meant it: Hydra's jobs may change into their own dirs
        # (hydra.job.chdir=true), where a relative one named nothing (every sweep job refused)
        os.environ["LAZYTRAIN_CONFIG_DIR"] = os.path.abspath(os.environ["LAZYTRAIN_CONFIG_DIR"])
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"lazytrain: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[cmd][0])
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:
        # Ctrl-C while torch and the command load (the first second or two), before any command's
        # own handling: a traceback from torch/__init__.py before (review)
        print(f"lazytrain {cmd}: interrupted while starting; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
