"""Packed token datasets from local text / JSONL files, in a deterministic, resumable order.

Every document is tokenized, followed by the tokenizer's EOS, and the documents are concatenated and
cut into sequences of `seq_len` tokens (the tail that does not fill a sequence is dropped).
Labels equal input_ids (Hugging Face convention: the causal LM shifts them internally).

Prompt/completion data (supervised fine-tuning): with `prompt_field` set, each JSONL row gives a
prompt (`prompt_field`) and a completion (`text_field`); both are tokenized separately (so the
boundary is exact), packed as prompt + completion + EOS, and only completion and EOS tokens are
learned: prompt positions get label -100, which the loss ignores. Sequences with nothing to learn
(e.g. all prompt) are dropped.

Order: epoch e visits the sequences in `randperm(n, seed + e)` order, so the whole stream is a pure
function of (files, tokenizer, seq_len, seed) and a single integer — the number of sequences already
consumed — is the data position a checkpoint saves to resume exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")


class DataError(ValueError):
    """A user-facing data problem; the message is one actionable line."""


def load_tokenizer(tokenizer_dir: str | Path):
    """An HF tokenizer from a local dir (never the hub)."""
    p = Path(tokenizer_dir).expanduser()
    if not p.is_dir():
        raise DataError(f"tokenizer dir {p} does not exist (data.tokenizer must be a local "
                        f"Hugging Face tokenizer dir with tokenizer.json or tokenizer_config.json)")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise DataError(f"{p} holds no tokenizer (no tokenizer.json / tokenizer_config.json)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load the tokenizer in {p}: {str(e).splitlines()[0]}") from None


def expand_files(files: Sequence[str | Path]) -> list[Path]:
    """Files as given; a directory contributes its *.txt/*.md/*.jsonl files in sorted order."""
    out: list[Path] = []
    for f in files:
        p = Path(f).expanduser()
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file()
                           and q.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES)
            if not found:
                raise DataError(f"data dir {p} holds no .txt/.md/.jsonl files")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"data file {p} does not exist")
    if not out:
        raise DataError("no data files given (set data.files=[PATH,...])")
    return out


def _jsonl_rows(path: Path, fields: dict[str, str]) -> Iterator[tuple[str, ...]]:
    """The values of `fields` (field -> the config key that names it) in each row of a JSONL file;
    a null value reads as empty text."""
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            for field, key in fields.items():
                if not isinstance(obj, dict) or field not in obj:
                    raise DataError(f"{path}:{lineno}: no {field!r} field (set {key})")
            yield tuple("" if obj[field] is None else str(obj[field]) for field in fields)


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """Documents of one file: a text file is one document; JSONL gives one per line (`text_field`)."""
    if path.suffix in JSONL_SUFFIXES:
        for (text,) in _jsonl_rows(path, {text_field: "data.text_field"}):
            yield text
    else:
        try:
            yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_pairs(path: Path, prompt_field: str, text_field: str) -> Iterator[tuple[str, str]]:
    """(prompt, completion) rows of one JSONL file."""
    if path.suffix not in JSONL_SUFFIXES:
        raise DataError(f"{path}: prompt/completion data (data.prompt_field={prompt_field!r}) must be "
                        f"JSONL with {prompt_field!r} and {text_field!r} fields")
    if prompt_field == text_field:
        raise DataError(f"data.prompt_field and data.text_field are both {text_field!r}; the completion "
                        f"needs its own field")
    yield from _jsonl_rows(path, {prompt_field: "data.prompt_field", text_field: "data.text_field"})


def tokenize_pairs(files: Sequence[Path], tokenizer, prompt_field: str,
                   text_field: str = "text") -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt/completion rows as one token stream and a bool mask of the tokens to learn."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos_token; documents cannot be separated")
    ids: list[int] = []
    learn: list[bool] = []
    for path in files:
        for prompt, completion in read_pairs(path, prompt_field, text_field):
            if not completion.strip():
                continue
            p = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
            c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [eos]
            ids += p + c
            learn += [False] * len(p) + [True] * len(c)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(learn, dtype=torch.bool)


def tokenize_files(files: Sequence[Path], tokenizer, text_field: str = "text",
                   chunk_chars: int = 1 << 16) -> torch.Tensor:
    """All documents as one 1-D int64 token stream, EOS after each document."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos_token; documents cannot be separated")
    ids: list[int] = []
    for path in files:
        for doc in read_documents(path, text_field):
            if not doc.strip():
                continue
            # Split long documents at line breaks so the fast tokenizer works on bounded inputs;
            # byte-level BPE never merges across "\n" + next char boundaries we cut at.
            start = 0
            while start < len(doc):
                end = min(len(doc), start + chunk_chars)
                if end < len(doc):
                    nl = doc.rfind("\n", start, end)
                    end = nl + 1 if nl > start else end
                ids += tokenizer(doc[start:end], add_special_tokens=False)["input_ids"]
                start = end
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor   # [B, S] int64
    labels: torch.Tensor      # [B, S] int64 (input_ids, -100 where not learned; the model shifts)


class PackedDataset:
    """Fixed-length sequences cut from one token stream, visited in a seeded, resumable order.

    `learn`: optional bool stream (same length as `tokens`) of the tokens to learn; the others get
    label -100. Sequences with no learned target (positions 1.. after the model's shift) are dropped.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int = 0,
                 learn: torch.Tensor | None = None) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        n = tokens.numel() // seq_len
        if n == 0:
            raise DataError(f"the data holds {tokens.numel()} tokens, fewer than one sequence of "
                            f"seq_len={seq_len}; add data or lower job.seq_len")
        self.seq_len = seq_len
        self.seed = seed
        self.sequences = tokens[: n * seq_len].view(n, seq_len)  # [N, S]
        self.learn: torch.Tensor | None = None
        if learn is not None:
            if learn.shape != tokens.shape:
                raise DataError("the learn mask and the token stream differ in length")
            masks = learn[: n * seq_len].view(n, seq_len)
            keep = masks[:, 1:].any(dim=1)
            if not bool(keep.any()):
                raise DataError(f"no sequence of seq_len={seq_len} holds a completion token to learn "
                                f"(are the prompts longer than job.seq_len?)")
            self.sequences, self.learn = self.sequences[keep], masks[keep]
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def __len__(self) -> int:
        return self.sequences.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.sequences.numel()

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self), generator=g), epoch
        return self._perm

    def _index(self, position: int) -> int:
        epoch, i = divmod(position, len(self))
        return int(self._order(epoch)[i])

    def sequence_at(self, position: int) -> torch.Tensor:
        """The sequence consumed at stream position `position` (0-based, across epochs)."""
        return self.sequences[self._index(position)]

    def batch(self, position: int, batch_size: int) -> Batch:
        """`batch_size` consecutive sequences starting at `position`."""
        idx = [self._index(position + b) for b in range(batch_size)]
        x = self.sequences[idx]  # [B, S] (a copy)
        if self.learn is None:
            return Batch(input_ids=x, labels=x.clone())
        return Batch(input_ids=x, labels=torch.where(self.learn[idx], x, torch.full_like(x, -100)))

    def step_batches(self, position: int, batch_size: int, grad_accum: int) -> tuple[list[Batch], int]:
        """The micro-batches of one optimizer step and the position after it."""
        out = []
        for _ in range(grad_accum):
            out.append(self.batch(position, batch_size))
            position += batch_size
        return out, position


def build_dataset(files: Sequence[str | Path], tokenizer, seq_len: int, seed: int = 0,
                  text_field: str = "text", cache_dir: str | Path | None = None,
                  prompt_field: str | None = None) -> PackedDataset:
    """Tokenize (or load the cached tokens of) `files` and pack them into `seq_len` sequences.

    `prompt_field`: JSONL prompt/completion rows, learning only the completions (module doc).
    The cache is keyed by the files' bytes, the fields and the tokenizer's vocabulary, stored as
    safetensors.
    """
    paths = expand_files(files)
    data = None
    cache_path = None
    if cache_dir is not None:
        h = hashlib.sha256(b"lazytrain-tokens-v2")   # v2: null JSONL fields read as empty text
        for p in paths:
            h.update(p.read_bytes())
        h.update(text_field.encode())
        if prompt_field is not None:
            h.update(b"\0prompt:" + prompt_field.encode())
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        cache_path = Path(cache_dir) / f"tokens-{h.hexdigest()[:16]}.safetensors"
        if cache_path.is_file():
            from safetensors.torch import load_file
            data = load_file(str(cache_path))
    if data is None:
        if prompt_field is None:
            data = {"tokens": tokenize_files(paths, tokenizer, text_field)}
        else:
            tokens, learn = tokenize_pairs(paths, tokenizer, prompt_field, text_field)
            data = {"tokens": tokens, "learn": learn}
        if cache_path is not None:
            from safetensors.torch import save_file
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_name(f".{cache_path.name}.{os.getpid()}.tmp")  # ranks may race
            save_file(data, str(tmp))
            tmp.replace(cache_path)
    tokens = data["tokens"]
    if tokens.numel() == 0:
        raise DataError(f"the data files ({', '.join(str(p) for p in paths[:3])}"
                        f"{', ...' if len(paths) > 3 else ''}) hold no text")
    return PackedDataset(tokens, seq_len, seed, learn=data.get("learn"))
