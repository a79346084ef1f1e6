"""`lazytrain demo` (`make demo`): the built-in default job, end to end on any machine.

Builds (once) a corpus of real English prose from the Python docs every CPython ships and a BPE
tokenizer on it, then trains a small Llama (~4M params, random init) through `lazytrain train` with
a plan for a deliberately small device budget, so the run shows the real engine: the plan summary,
a progress bar, the loss falling within a couple of minutes on 2 CPU cores, and a summary of
predicted vs measured step time and device peak. Extra arguments are `lazytrain train` overrides:

    lazytrain demo job.max_steps=300 engine=torch
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEMO_OVERRIDES = [
    "model=demo-llama",
    "data=demo",
    "job.mode=full",
    "job.seq_len=128",
    "job.batch_size=4",
    "job.max_steps=150",
    "optim.lr=2e-3",
    "optim.warmup_steps=10",
    "save_every=50",
    # A device budget smaller than the model's training state, so the plan must stream / offload.
    "hardware.device_memory_gib=0.03",
    "hardware.workspace_gib=0.005",
]


def _engine_override(user: list[str]) -> list[str]:
    if any(a.startswith("engine=") for a in user):
        return []
    try:
        from ..runtime import StreamingExecutor  # noqa: F401
        return ["engine=lazytrain"]
    except ImportError:
        print("demo: the streaming executor is not available in this build; training with "
              "engine=torch (plain PyTorch)", file=sys.stderr)
        return ["engine=torch"]


def loss_curve(metrics_path: Path, points: int = 8) -> str:
    """A compact loss curve: `step loss` at evenly spaced steps."""
    recs = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    if not recs:
        return ""
    idx = sorted({round(i * (len(recs) - 1) / (points - 1)) for i in range(points)})
    return "loss curve: " + "  ".join(f"{recs[i]['step']}:{recs[i]['loss']:.2f}" for i in idx)


def heldout_loss(final_dir: Path, val_txt: Path, seq_len: int, max_sequences: int = 32,
                 add_bos: bool | str = "auto", doc_mask: bool = False) -> float:
    """Mean loss per learned token of the saved model (loaded back with from_pretrained) on
    held-out documents, read as training read its data (BOS; documents kept apart with
    `doc_mask`, as data.doc_mask: the model then gets their position ids)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..data.dataset import build_dataset, load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(final_dir)).eval()
    ds = build_dataset([val_txt], load_tokenizer(final_dir), seq_len, seed=0, add_bos=add_bos, doc_mask=doc_mask)
    total = tokens = 0.0
    with torch.no_grad():
        for b in ds.ordered_batches(8, limit=-(-min(max_sequences, len(ds)) // 8)):
            pos = {} if b.position_ids is None else {"position_ids": b.position_ids}
            n = int((b.labels[:, 1:] != -100).sum())
            total += float(model(input_ids=b.input_ids, labels=b.labels, use_cache=False, **pos).loss) * n
            tokens += n
    return total / tokens


def main(argv: list[str] | None = None) -> int:
    user = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in user):
        print(__doc__)
        return 0
    from . import train

    if not any(a.startswith("output_dir=") for a in user):
        from datetime import datetime
        user = [*user, f"output_dir=outputs/demo-{datetime.now():%Y%m%d-%H%M%S}"]
    args = [*DEMO_OVERRIDES, *_engine_override(user), *user]
    rc = train.main(args)
    out = Path(next(a.split("=", 1)[1] for a in reversed(args) if a.startswith("output_dir=")))
    if rc == 0 and (out / "metrics.jsonl").is_file():
        print(loss_curve(out / "metrics.jsonl"))
        _print_heldout(args, out)
    return rc


def _print_heldout(args: list[str], out: Path) -> None:
    import math

    from .config import load_config

    cfg = load_config([a for a in args if not a.startswith(("hydra.", "--"))], config_name="train")
    from ..data.corpus import DEMO_CORPUS
    val = Path(str(cfg.data.cache_dir)).expanduser() / DEMO_CORPUS / "val.jsonl"
    if cfg.job.mode == "full" and (out / "final").is_dir() and val.is_file():
        loss = heldout_loss(out / "final", val, int(cfg.job.seq_len), add_bos=cfg.data.get("add_bos", "auto"),
                            doc_mask=bool(cfg.data.get("doc_mask", False)))
        vocab = int(cfg.model.hf_config.vocab_size) if cfg.model.get("hf_config") else 0
        ref = f" (uniform guess: ln {vocab} = {math.log(vocab):.2f})" if vocab else ""
        print(f"held-out loss of the saved model on documents never trained on: {loss:.3f}{ref}")
