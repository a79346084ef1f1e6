"""Data review (2026-12-01, second): chat templates that print today's date made the same rows
other data on another day (a resume refused), a file reached twice was trained twice, the demo
corpus held duplicate texts, and inputs that were tracebacks (a tokenizer.json this `tokenizers`
cannot read, a lone surrogate outside `content`, JSON nested too deeply)."""
import copy
import datetime as dt
import json
import os

import pytest

from lazytrain.data.dataset import DataError, build_dataset, expand_files, load_tokenizer, tokenize_chats
from test_chat import CHATML
from test_dataset import tok  # noqa: F401 - the small tokenizer fixture test_dataset.py builds

DATED = ('{%- if strftime_now is defined %}{%- set date_string = strftime_now("%d %b %Y") %}'
         '{%- else %}{%- set date_string = "26 Jul 2024" %}{%- endif %}'
         '<|im_start|>system\nToday Date: {{ date_string }}<|im_end|>\n' + CHATML)


@pytest.fixture
def dated_tok(tok):  # noqa: F811
    t = copy.deepcopy(tok)
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.chat_template = DATED
    return t


def _rows(path, n=12):
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i} for the item"},
                                                     {"role": "assistant", "content": f"a{i} the sequence"}]})
                            + "\n" for i in range(n)))
    return path


def test_a_template_that_prints_the_date_renders_the_same_tokens_on_any_day(dated_tok, tmp_path, monkeypatch):
    import transformers.utils.chat_template_utils as ctu

    f = _rows(tmp_path / "c.jsonl")
    prints = []
    for day in (dt.datetime(2026, 12, 1, 23, 59), dt.datetime(2026, 12, 2, 0, 1)):
        class Clock(dt.datetime):
            @classmethod
            def now(cls, tz=None, _d=day):
                return _d
        monkeypatch.setattr(ctu, "datetime", Clock)
        ds = build_dataset([f], dated_tok, seq_len=32, seed=0, messages_field="messages")
        prints.append(ds.fingerprint)
        assert ctu.datetime is Clock   # put back after rendering
    assert prints[0] == prints[1]
    ids, _ = tokenize_chats([f], dated_tok, "messages")
    assert "Today Date: 26 Jul 2024" in dated_tok.decode(ids[:40])


def test_a_lone_surrogate_in_another_message_key_is_one_error(dated_tok, tmp_path):
    f = tmp_path / "s.jsonl"
    row = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "ok", "reasoning_content": "half \ud83d"}]}
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"s.jsonl:1: message 1's reasoning_content holds a lone UTF-16 surrogate"):
        tokenize_chats([f], dated_tok, "messages")


def test_a_tokenizer_this_library_cannot_read_is_one_error(tok, tmp_path):  # noqa: F811
    d = tmp_path / "tok"
    tok.save_pretrained(d)
    j = json.loads((d / "tokenizer.json").read_text())
    j["model"]["type"] = "BPE2"   # as a tokenizer.json from a newer `tokenizers` reads here
    (d / "tokenizer.json").write_text(json.dumps(j))
    with pytest.raises(DataError, match=r"cannot load the tokenizer in .*upgrade it"):
        load_tokenizer(d)


def test_json_nested_too_deeply_is_one_error(tok, tmp_path):  # noqa: F811
    f = tmp_path / "deep.jsonl"
    f.write_text(json.dumps({"text": "fine"}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataError, match=r"deep.jsonl:2: not usable JSON \(nested too deeply\)"):
        build_dataset([f], tok, seq_len=8, seed=0)


def test_one_pretty_printed_object_says_what_the_file_must_hold(tok, tmp_path):  # noqa: F811
    f = tmp_path / "obj.json"
    f.write_text(json.dumps({"data": [{"text": "a"}]}, indent=2))
    with pytest.raises(DataError, match=r"obj.json:1: not valid JSON .*one JSON object per line, or one JSON array"):
        build_dataset([f], tok, seq_len=8, seed=0)


def test_a_file_reached_twice_is_read_once(tmp_path, caplog):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "v3.jsonl").write_text('{"text": "a"}\n')
    os.symlink(d / "v3.jsonl", d / "current.jsonl")
    (d / "sub" / "b.txt").write_text("b")
    with caplog.at_level("WARNING"):
        got = expand_files([d, d / "sub"])
    assert sorted(p.name for p in got) == ["b.txt", "current.jsonl"], got   # each real file once
    assert "reached twice, read once" in caplog.text


def test_the_demo_corpus_holds_each_text_once(tmp_path):
    from lazytrain.data.corpus import build_corpus
    train, val = build_corpus(tmp_path, documents=True)
    texts = [json.loads(x)["text"] for p in (train, val) for x in p.read_text().splitlines()]
    assert len(texts) == len(set(texts)) and len(texts) > 50
