"""The token cache is keyed by everything that changes the tokens, survives corrupt entries, and
the tokens themselves do not depend on how long documents are chunked for the tokenizer."""
import json
import logging
import shutil

import pytest
import torch

from lazytrain.data.dataset import DataError, build_dataset, load_tokenizer, tokenize_files
from lazytrain.data.tokenizer import build_tokenizer

TEXT = ("The for statement is used to iterate over the elements of a sequence.\n\n"
        "    Each item in turn is assigned to the target list.\n") * 40


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "t.txt").write_text(TEXT)
    return build_tokenizer([d / "t.txt"], d / "tok", vocab_size=300)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def _cached_then_fresh(files, tok_a, tok_b, cache, **kw):
    """Build with `tok_a` into `cache`, then with `tok_b` from it; also `tok_b` uncached."""
    build_dataset(files, tok_a, 8, cache_dir=cache, **kw)
    return (build_dataset(files, tok_b, 8, cache_dir=cache, **kw).sequences,
            build_dataset(files, tok_b, 8, cache_dir=None, **kw).sequences)


def _edit_json(path, edit):
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


@pytest.mark.parametrize("change", ["eos_token", "normalizer"])
def test_cache_key_covers_the_whole_tokenizer(tmp_path, tok_dir, tok, change):
    # same vocabulary, other tokens: another EOS (Llama-3 base vs instruct) or another normalizer
    other = tmp_path / "tok2"
    shutil.copytree(tok_dir, other)
    if change == "eos_token":
        _edit_json(other / "tokenizer_config.json", lambda c: c.update(eos_token="<|pad|>"))
    else:
        _edit_json(other / "tokenizer.json", lambda c: c.update(normalizer={"type": "Lowercase"}))
    tok2 = load_tokenizer(other)
    assert tok2.get_vocab() == tok.get_vocab()
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": f"The elements {i}."}) + "\n" for i in range(40)))
    cached, fresh = _cached_then_fresh([f], tok, tok2, tmp_path / "cache")
    assert torch.equal(cached, fresh)
    # the same tokenizer loaded again (from another dir) still hits
    build_dataset([f], load_tokenizer(shutil.copytree(tok_dir, tmp_path / "tok3")), 8, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("tokens-*.safetensors"))) == 2


def test_cache_key_respects_file_boundaries(tmp_path, tok):
    x, y = tmp_path / "x.txt", tmp_path / "y.txt"
    x.write_text("alpha beta gamma " * 8)
    y.write_text("delta epsilon " * 8)
    build_dataset([x, y], tok, 8, cache_dir=tmp_path / "cache")
    # the same bytes, one document fewer (one EOS fewer)
    x.write_text("alpha beta gamma " * 8 + "delta epsilon " * 8)
    y.write_text("")
    cached = build_dataset([x, y], tok, 8, cache_dir=tmp_path / "cache").sequences
    assert torch.equal(cached, build_dataset([x, y], tok, 8).sequences)


def test_cache_key_respects_the_parse_mode(tmp_path, tok):
    rows = "".join(json.dumps({"text": f"row {i} some words here"}) + "\n" for i in range(20))
    (tmp_path / "a.jsonl").write_text(rows)
    (tmp_path / "a.txt").write_text(rows)
    build_dataset([tmp_path / "a.jsonl"], tok, 8, cache_dir=tmp_path / "cache")
    cached = build_dataset([tmp_path / "a.txt"], tok, 8, cache_dir=tmp_path / "cache").sequences
    assert torch.equal(cached, build_dataset([tmp_path / "a.txt"], tok, 8).sequences)


def test_cache_hits_when_files_move(tmp_path, tok):
    # the key is the content, not where it lives: a moved corpus keeps its cache
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.txt").write_text(TEXT)
    build_dataset([tmp_path / "a"], tok, 8, cache_dir=tmp_path / "cache")
    (tmp_path / "a").rename(tmp_path / "b")
    build_dataset([tmp_path / "b"], tok, 8, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("tokens-*.safetensors"))) == 1


def test_non_utf8_jsonl_names_file_and_line(tmp_path, tok):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not UTF-8 text") as ei:
        build_dataset([f], tok, 4)
    assert "\n" not in str(ei.value)


def _not_tokens(path):
    from safetensors.torch import save_file

    save_file({"other": torch.zeros(3)}, str(path))


def _change_a_token(path):
    """One token id + 1, the file otherwise whole (its checksum the old one): it trained on, or
    crashed the embedding with an id out of range, and a resume was refused as "other data"."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    d = load_file(str(path))
    d["tokens"][5] += 1
    save_file(d, str(path), metadata=meta)


def _older_entry(path):
    """An entry written before checksums: read as a miss once, then rewritten with one."""
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(path)), str(path))


@pytest.mark.parametrize("corrupt", [lambda p: p.write_bytes(p.read_bytes()[:40]),
                                     lambda p: p.write_bytes(b""), _not_tokens, _change_a_token,
                                     _older_entry],
                         ids=["truncated", "empty", "no-tokens", "changed-token", "no-checksum"])
def test_corrupt_cache_file_is_a_miss(tmp_path, tok, caplog, corrupt):
    f = tmp_path / "a.txt"
    f.write_text(TEXT)
    want = build_dataset([f], tok, 8, cache_dir=tmp_path / "cache").sequences
    (entry,) = (tmp_path / "cache").glob("tokens-*.safetensors")
    corrupt(entry)
    with caplog.at_level(logging.WARNING, logger="lazytrain.data.dataset"):
        got = build_dataset([f], tok, 8, cache_dir=tmp_path / "cache").sequences
    assert torch.equal(got, want)
    assert any("token cache" in r.getMessage() and entry.name in r.getMessage() for r in caplog.records)
    # rewritten: the next build reads it without a warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lazytrain.data.dataset"):
        assert torch.equal(build_dataset([f], tok, 8, cache_dir=tmp_path / "cache").sequences, want)
    assert not caplog.records


def _newline_bpe():
    """A byte-level BPE (GPT-2 pre-tokenizer, as build_tokenizer's) trained on whole documents, so
    it merges runs like "\\n\\n   " the way Llama-3 / Qwen vocabularies do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert "ĊĊĠĠĠ" in t.get_vocab()
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>")


def _metaspace_bpe():
    """A SentencePiece-style tokenizer: every input gets a "▁" prefix, so no cut is exact."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    t.decoder = decoders.Metaspace(prepend_scheme="always")
    t.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["</s>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>")


@pytest.mark.parametrize("make_tok", [_newline_bpe, _metaspace_bpe])
def test_chunked_tokenization_equals_whole_documents(tmp_path, make_tok):
    t = make_tok()
    f = tmp_path / "d.txt"
    f.write_text(TEXT)
    whole = tokenize_files([f], t, chunk_chars=10 ** 9)
    assert whole.numel() < len(TEXT)
    for chunk_chars in (60, 100, 200, 333, 1000):
        assert torch.equal(tokenize_files([f], t, chunk_chars=chunk_chars), whole), chunk_chars


def test_a_cache_dir_that_cannot_take_the_tokens_is_a_warning(tok, tmp_path, caplog):
    """A file in the way of data.cache_dir (or a full disk) was a FileExistsError / SafetensorError
    traceback: the cache only saves time, so it is a warning and the data is built uncached."""
    f = tmp_path / "a.txt"
    f.write_text(TEXT)
    (tmp_path / "blocker").write_text("x")
    with caplog.at_level(logging.WARNING):
        ds = build_dataset([f], tok, seq_len=16, cache_dir=tmp_path / "blocker" / "cache")
    assert len(ds) > 0 and "were not cached" in caplog.text
    assert torch.equal(ds.sequences, build_dataset([f], tok, seq_len=16).sequences)


def test_a_text_file_with_a_bom_gives_the_same_tokens(tok, tmp_path):
    """The UTF-8 BOM of a text file became 3 trained tokens (JSONL rows already dropped it)."""
    plain, bom = tmp_path / "plain.txt", tmp_path / "bom.txt"
    plain.write_text(TEXT, encoding="utf-8")
    bom.write_text(TEXT, encoding="utf-8-sig")
    assert bom.read_bytes()[:3] == b"\xef\xbb\xbf"
    assert torch.equal(tokenize_files([plain], tok), tokenize_files([bom], tok))
