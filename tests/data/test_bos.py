"""data.add_bos: a BOS before each document (and prompt/completion row) where the tokenizer adds one
itself (Llama, Mistral), so a base model trains on the framing it sees at inference."""
import copy
import json

import pytest
import torch
from tokenizers.processors import TemplateProcessing

from lazytrain.data.dataset import DataError, bos_for, build_dataset
from test_dataset import TEXT, tok  # noqa: F401 - the small tokenizer fixture test_dataset.py builds


@pytest.fixture
def bos_tok(tok):  # noqa: F811
    """The test tokenizer made to add "<s>" in front of what it encodes, as Llama's does."""
    t = copy.deepcopy(tok)
    t.add_special_tokens({"bos_token": "<s>"})
    t.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", t.bos_token_id)])
    assert t("a")["input_ids"][0] == t.bos_token_id
    return t


def _docs(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": f"document {i} about iterables"}) + "\n" for i in range(8)))
    return f


def test_auto_follows_the_tokenizer(tmp_path, tok, bos_tok):  # noqa: F811
    assert bos_for(tok) is None and bos_for(bos_tok) == bos_tok.bos_token_id
    f = _docs(tmp_path)
    plain = build_dataset([f], tok, seq_len=4).sequences.flatten()
    framed = build_dataset([f], bos_tok, seq_len=4).sequences.flatten()
    first = tok("document 0 about iterables", add_special_tokens=False)["input_ids"]
    assert plain[:len(first) + 1].tolist() == [*first, tok.eos_token_id]   # nothing in front
    doc = bos_tok("document 0 about iterables", add_special_tokens=False)["input_ids"]
    n = len(doc) + 2
    assert framed[:n].tolist() == [bos_tok.bos_token_id, *doc, bos_tok.eos_token_id]
    assert int((framed == bos_tok.bos_token_id).sum()) >= framed.numel() // n - 1


def test_true_false_and_bad_values(tmp_path, tok, bos_tok):  # noqa: F811
    f = _docs(tmp_path)
    off = build_dataset([f], bos_tok, seq_len=4, add_bos=False).sequences
    assert not bool((off == bos_tok.bos_token_id).any())
    on = build_dataset([f], tok, seq_len=4, add_bos="true").sequences.flatten()
    assert on[0].item() == tok.bos_token_id   # the built-in tokenizer's BOS, asked for
    no_bos = copy.deepcopy(tok)
    no_bos.bos_token = None
    with pytest.raises(DataError, match="add_bos=true, but the tokenizer has no bos_token"):
        build_dataset([f], no_bos, seq_len=4, add_bos=True)
    with pytest.raises(DataError, match=r"data\.add_bos='yes': use auto, true or false"):
        build_dataset([f], tok, seq_len=4, add_bos="yes")


def test_prompt_rows_get_an_unlearned_bos(tmp_path, bos_tok):
    f = tmp_path / "sft.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"Q{i}:", "completion": " the for statement"}) + "\n"
                         for i in range(6)))
    ds = build_dataset([f], bos_tok, seq_len=64, prompt_field="prompt", text_field="completion")
    stream, learn = ds.sequences.flatten(), ds.learn.flatten()
    at = stream == bos_tok.bos_token_id
    assert int(at.sum()) == 6 and not bool(learn[at].any())
    assert stream[0].item() == bos_tok.bos_token_id


def test_cache_entries_with_and_without_bos_differ(tmp_path, bos_tok):
    f, cache = _docs(tmp_path), tmp_path / "cache"
    a = build_dataset([f], bos_tok, seq_len=4, cache_dir=cache)
    b = build_dataset([f], bos_tok, seq_len=4, cache_dir=cache, add_bos=False)
    assert len(list(cache.glob("tokens-*.safetensors"))) == 2
    assert not torch.equal(a.sequences[:1], b.sequences[:1])


def test_text_that_starts_with_the_bos_gets_no_second_one(tmp_path, bos_tok):
    """A prompt rendered with apply_chat_template(tokenize=False) starts with the BOS text already
    (review: auto gave every such row two)."""
    f = tmp_path / "sft.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"<s>Q{i}:", "completion": " the for statement"}) + "\n" for i in range(4)))
    stream = build_dataset([f], bos_tok, seq_len=8, prompt_field="prompt", text_field="completion").sequences.flatten()
    d = tmp_path / "d.jsonl"
    d.write_text("".join(json.dumps({"text": "<s>document about iterables"}) + "\n" for _ in range(4)))
    docs = build_dataset([d], bos_tok, seq_len=4).sequences.flatten()
    for s in (stream, docs):
        b = bos_tok.bos_token_id
        assert s[0].item() == b and not bool(((s[1:] == b) & (s[:-1] == b)).any())   # never two in a row
        assert int((s == b).sum()) == 4


def test_add_bos_is_checked_for_chat_rows_too(tmp_path, tok):  # noqa: F811
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match=r"data\.add_bos='bogus'"):
        build_dataset([f], tok, seq_len=4, messages_field="messages", add_bos="bogus")
