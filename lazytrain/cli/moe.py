"""`lazytrain moe <tool> [overrides]`

  convert          model.path=HF_DIR out=STORE_DIR      write the expert store (per-expert or fused checkpoints)
  train-predictor  model.path=HF_DIR moe.store=STORE_DIR out=FILE [predictor_train.steps=400 ...]
                   record router traces on local text, fit the next-layer predictor, print held-out recall
  inspect          moe.store=STORE_DIR                   layers, experts, record size, I/O mode
Add --json for machine-readable output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

USAGE = __doc__


def _convert(cfg) -> dict:
    from ..moe.convert import convert_checkpoint

    if not cfg.model.get("path"):
        raise ValueError("convert needs model.path=HF_DIR (a local Hugging Face checkpoint directory)")
    if not cfg.out:
        raise ValueError("convert needs out=STORE_DIR")
    src = Path(str(cfg.model.path)).expanduser()
    if not src.exists():
        raise FileNotFoundError(f"model.path {src} does not exist")
    out = convert_checkpoint(src, cfg.out)
    return _inspect_dir(out)


def _inspect_dir(path) -> dict:
    from ..moe.store import ExpertStore

    st = ExpertStore(path)
    try:
        return {"store": str(st.dir), "moe_layers": st.num_layers,
                "experts_per_layer": [lr.num_experts for lr in st.layers],
                "top_k": st.layers[0].top_k, "record_bytes": st.record_bytes,
                "expert_bytes_total": sum(lr.record_bytes * lr.num_experts for lr in st.layers),
                "io_mode": st.io_mode}
    finally:
        st.close()


def _train_predictor(cfg) -> dict:
    from ..moe.api import load_tokenizer, train_predictor
    from ..moe.cliutil import engine_kwargs, whole_setting
    from ..moe.engine import load_streamed

    if not cfg.moe.store:
        raise ValueError("train-predictor needs moe.store=STORE_DIR")
    if not cfg.out:
        raise ValueError("train-predictor needs out=FILE (e.g. out=predictor.safetensors)")
    pt = cfg.predictor_train
    tok = load_tokenizer(cfg.model.get("path"), cfg.moe.store)
    if tok is None:
        raise ValueError("train-predictor needs a tokenizer (in model.path or the store) to read text")
    if pt.text:
        text = Path(str(pt.text)).expanduser().read_text(encoding="utf-8")
    else:
        from ..data.corpus import DEMO_CORPUS, build_corpus

        train_txt, _ = build_corpus(Path.home() / ".cache" / "lazytrain" / DEMO_CORPUS)
        text = train_txt.read_text(encoding="utf-8")
    # (each named when it is not a whole number: `steps=abc` said only "invalid literal for int()")
    max_tokens = whole_setting("predictor_train.max_tokens", pt.max_tokens, 1)
    seq_len = whole_setting("predictor_train.seq_len", pt.seq_len, 1)
    steps = whole_setting("predictor_train.steps", pt.steps, 1)
    width = whole_setting("predictor_train.width", pt.width, 1)
    try:
        lr = float(pt.lr)
    except (TypeError, ValueError):
        raise ValueError(f"predictor_train.lr must be a number, got {pt.lr!r}") from None
    ids = tok(text[: max_tokens * 8]).input_ids
    kw = engine_kwargs(cfg)
    kw["prefetch"] = "none"
    eng = load_streamed(cfg.moe.store, **kw)
    try:
        return train_predictor(eng, ids, cfg.out, seq_len=seq_len, max_tokens=max_tokens,
                               steps=steps, lr=lr, width=width,
                               log=lambda s: print(s, file=sys.stderr))
    finally:
        eng.close()


def _inspect(cfg) -> dict:
    store = cfg.moe.store or cfg.out
    if not store:
        raise ValueError("inspect needs moe.store=STORE_DIR")
    return _inspect_dir(store)


TOOLS = {"convert": _convert, "train-predictor": _train_predictor, "inspect": _inspect}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help") or any(a in ("-h", "--help") for a in argv):
        print(USAGE)   # (`moe convert --help` went to Hydra: "LexerNoViableAltException")
        return 0
    tool, rest = argv[0], argv[1:]
    if tool not in TOOLS:
        print(f"lazytrain moe: unknown tool {tool!r}; valid: {', '.join(TOOLS)}", file=sys.stderr)
        return 2
    as_json = "--json" in rest
    from ..moe.cliutil import USER_ERRORS, compose, fail

    try:
        cfg = compose([a for a in rest if a != "--json"], command="moe")
        res = TOOLS[tool](cfg)
    except USER_ERRORS as e:
        return fail(f"moe {tool}", e)
    if as_json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    return 0
