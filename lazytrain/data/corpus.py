"""A small real-text corpus built from files every CPython install has.

`pydoc_data.topics` holds the Python language reference and library prose (~0.8 MB of English);
the license texts of the interpreter and of /usr/share/common-licenses (when present) add more.
No network, deterministic for a given Python version.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _sources() -> list[tuple[str, str]]:
    import sys

    from pydoc_data import topics  # ships with every CPython

    docs = [(f"pydoc:{k}", topics.topics[k]) for k in sorted(topics.topics)]
    licenses: list[tuple[str, str]] = []
    for d in (Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}",
              Path("/usr/share/common-licenses")):
        cands = [d / "LICENSE.txt"] if d.name.startswith("python") else sorted(d.glob("*"))
        for p in cands:
            if p.is_file() and p.stat().st_size < 200_000:
                try:
                    licenses.append((f"file:{p}", p.read_text(encoding="utf-8")))
                except (UnicodeDecodeError, OSError):
                    pass
    return docs + licenses


# Where the built-in corpus is built under a cache dir: -v2 since duplicate texts are dropped
# (2026-12-01); `corpus/` is an earlier build, which runs started before resume from.
DEMO_CORPUS = "corpus-v2"


def build_corpus(out_dir: str | Path, val_fraction: float = 0.05, documents: bool = False) -> tuple[Path, Path]:
    """Write train.txt and val.txt (documents separated by blank lines: one text each, for a
    tokenizer to learn from) and train.jsonl / val.jsonl (one row per document: what training
    reads, so every document ends with EOS; read as one text file the demo trained on 93 documents
    without a boundary: review); returns the .txt paths, or with `documents` the .jsonl ones.

    The split is by document (every 1/val_fraction-th document goes to validation) so validation
    text is never seen in training. Rebuilt only when missing.
    """
    out = Path(out_dir)
    paths = [out / n for n in ("train.txt", "val.txt", "train.jsonl", "val.jsonl")]
    if all(p.is_file() for p in paths):
        return (paths[2], paths[3]) if documents else (paths[0], paths[1])
    out.mkdir(parents=True, exist_ok=True)
    every = max(2, round(1 / val_fraction))
    train, val = [], []
    # each text once: /usr/share/common-licenses links GPL to GPL-3 (and LGPL, GFDL), and two
    # pydoc topics share a text; a copy on each side of the split would make the held-out loss
    # one of trained documents (review, 2026-12-01; the corpus dir is versioned for it)
    texts = list(dict.fromkeys(t.strip() for _, t in _sources() if t.strip()))
    for i, text in enumerate(texts):
        (val if i % every == every - 1 else train).append(text)
    for p, docs, rows in ((paths[0], train, False), (paths[1], val, False), (paths[2], train, True),
                          (paths[3], val, True)):
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")  # ranks may race
        text = "".join(json.dumps({"text": d}) + "\n" for d in docs) if rows else "\n\n".join(docs) + "\n"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(p)
    return (paths[2], paths[3]) if documents else (paths[0], paths[1])
