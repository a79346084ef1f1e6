"""Review (session 13) of the data reader: JSONL values that are not strings, lone surrogates, file
suffixes in any case, `.ndjson`, hidden files in a data dir, and the dataset's token fingerprint."""
import json

import pytest
import torch

from lazytrain.data.dataset import DataError, PackedDataset, build_dataset, expand_files, tokenize_files
from test_dataset import tok  # noqa: F401 - the small tokenizer fixture test_dataset.py builds


def _jsonl(path, *rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("value, what", [
    (["first paragraph", "second paragraph"], "a JSON array"),
    ([{"role": "user", "content": "hi"}], "a JSON array"),      # a chat-style messages list
    ({"role": "user", "content": "hi"}, "a JSON object"),
    (True, "a JSON boolean"), (3.0, "a JSON number"), (7, "a JSON number")])
def test_a_value_that_is_not_a_string_names_file_line_field_and_type(tmp_path, tok, value, what):
    """Until session 13 these were str()-ed and trained on as Python's repr ("['first ...']")."""
    f = _jsonl(tmp_path / "a.jsonl", {"text": "fine"}, {"text": value})
    with pytest.raises(DataError, match=rf"a\.jsonl:2: field 'text' is {what}, not a string; "
                                        r"data\.text_field must name a string field"):
        tokenize_files([f], tok)


def test_prompt_that_is_not_a_string_names_its_config_key(tmp_path, tok):
    f = _jsonl(tmp_path / "sft.jsonl", {"prompt": ["a", "b"], "completion": "c"})
    with pytest.raises(DataError, match=r"sft\.jsonl:1: field 'prompt' is a JSON array.*data\.prompt_field"):
        build_dataset([f], tok, 4, prompt_field="prompt", text_field="completion")


def test_null_and_strings_still_read(tmp_path, tok):
    f = _jsonl(tmp_path / "a.jsonl", {"text": None}, {"text": "hello world"}, {"text": ""})
    ids = tokenize_files([f], tok)
    assert tok.decode(ids.tolist()) == "hello world" + tok.eos_token   # null/empty rows are skipped


def test_lone_surrogate_names_file_and_line(tmp_path, tok):
    """JSON's "\\ud83d" (half an emoji) decodes to a str that is not valid Unicode; the tokenizer
    failed on it with a raw traceback naming no file."""
    f = tmp_path / "s.jsonl"
    f.write_text('{"text": "fine"}\n{"text": "broken emoji \\ud83d here"}\n')
    with pytest.raises(DataError, match=r"s\.jsonl:2: field 'text' holds a lone UTF-16 surrogate"):
        tokenize_files([f], tok)
    f.write_text('{"text": "a whole emoji \\ud83d\\ude00 is fine"}\n')   # a surrogate pair: one char
    assert tokenize_files([f], tok)[-1].item() == tok.eos_token_id


@pytest.mark.parametrize("name", ["b.JSONL", "c.ndjson", "d.NDJSON", "e.Jsonl"])
def test_jsonl_suffix_in_any_case_and_ndjson_are_read_as_jsonl(tmp_path, tok, name):
    f = _jsonl(tmp_path / name, {"text": "hello world"})
    assert tok.decode(tokenize_files([f], tok).tolist()) == "hello world" + tok.eos_token


def test_data_dir_takes_suffixes_in_any_case_and_skips_hidden(tmp_path):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / ".ipynb_checkpoints").mkdir()
    (d / "sub" / ".cache").mkdir()
    for rel in ("x.jsonl", "y.JSONL", "z.TXT", "w.ndjson", "sub/v.Md",                   # taken
                ".ipynb_checkpoints/x-checkpoint.jsonl", ".hidden.txt", "sub/.cache/u.txt",  # hidden
                "notes.csv"):                                                              # other
        (d / rel).write_text("x")
    assert [p.relative_to(d).as_posix() for p in expand_files([d])] == \
        ["sub/v.Md", "w.ndjson", "x.jsonl", "y.JSONL", "z.TXT"]
    # a hidden file named explicitly is read, and a data dir that is itself hidden is walked
    assert expand_files([d / ".hidden.txt"]) == [d / ".hidden.txt"]
    assert [p.name for p in expand_files([d / ".ipynb_checkpoints"])] == ["x-checkpoint.jsonl"]
    only_hidden = tmp_path / "h"
    (only_hidden / ".git").mkdir(parents=True)
    (only_hidden / ".git" / "a.txt").write_text("x")
    with pytest.raises(DataError, match="hidden ones are skipped"):
        expand_files([only_hidden])


def test_fingerprint_follows_the_tokens_not_the_files(tmp_path, tok):
    rows = [{"text": f"document number {i} about iterables"} for i in range(40)]
    a = _jsonl(tmp_path / "a.jsonl", *rows)
    (tmp_path / "moved").mkdir()
    b = _jsonl(tmp_path / "moved" / "b.jsonl", *rows)               # same rows, another name and place
    c = _jsonl(tmp_path / "c.jsonl", *reversed(rows))          # same rows, another order
    fa, fb, fc = (build_dataset([p], tok, 8).fingerprint for p in (a, b, c))
    assert fa == fb and fa != fc
    t = torch.arange(40)
    learn = torch.ones(40, dtype=torch.bool)
    assert PackedDataset(t, 8, learn=learn).fingerprint != PackedDataset(t, 8).fingerprint
    assert PackedDataset(t, 8, seed=1).fingerprint == PackedDataset(t, 8, seed=2).fingerprint  # (seed: its own key)
