"""Train a small byte-level BPE tokenizer locally and save it as a Hugging Face tokenizer dir
(`AutoTokenizer.from_pretrained(dir)` loads it offline)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

MIN_VOCAB = 258


def build_tokenizer(text_files: list[str | Path], out_dir: str | Path, vocab_size: int = 2048) -> Path:
    """Train (once) and save; returns the directory."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"data.vocab_size={vocab_size}: a byte-level BPE tokenizer has at least "
                         f"{MIN_VOCAB} tokens (256 bytes and 2 special tokens)")
    out = Path(out_dir)
    if (out / "tokenizer.json").is_file():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(p) for p in text_files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|pad|>", bos_token="<|endoftext|>")
    # into a per-process temp dir, then renamed: several processes (a multi-GPU launch) may build
    # it at once, and none may see a half-written tokenizer.json
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fast.save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:   # another process got there first (the dir exists and is not empty)
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "tokenizer.json").is_file():
            raise
    return out
