import json

import pytest
import torch

from lazytrain.data.dataset import DataError, PackedDataset, build_dataset, expand_files, load_tokenizer
from lazytrain.data.tokenizer import build_tokenizer

TEXT = ("The for statement is used to iterate over the elements of a sequence. "
        "Each item in turn is assigned to the target list.\n") * 40


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "t.txt").write_text(TEXT)
    return load_tokenizer(build_tokenizer([d / "t.txt"], d / "tok", vocab_size=300))


def test_packing_labels_and_eos(tmp_path, tok):
    a, b = tmp_path / "a.txt", tmp_path / "b.jsonl"
    a.write_text(TEXT)
    b.write_text("\n".join(json.dumps({"text": f"document number {i} about iterables"}) for i in range(30)))
    ds = build_dataset([a, b], tok, seq_len=16, seed=0)
    stream = ds.sequences.flatten()
    n_a = len(tok(TEXT, add_special_tokens=False)["input_ids"])
    assert stream[n_a].item() == tok.eos_token_id  # EOS closes each document
    assert int((stream == tok.eos_token_id).sum()) >= 30
    bt = ds.batch(0, 4)
    assert bt.input_ids.shape == (4, 16) and torch.equal(bt.input_ids, bt.labels)
    assert tok.decode(ds.sequences[0]).startswith("The for statement")


def test_order_is_deterministic_permutation_and_resumable(tmp_path, tok):
    tokens = torch.arange(1000)
    ds = PackedDataset(tokens, seq_len=10, seed=3)
    firsts = [int(ds.sequence_at(i)[0]) // 10 for i in range(100)]
    assert sorted(firsts) == list(range(100)) and firsts != list(range(100))  # an epoch: a permutation
    epoch2 = [int(ds.sequence_at(100 + i)[0]) // 10 for i in range(100)]
    assert sorted(epoch2) == list(range(100)) and epoch2 != firsts           # reshuffled per epoch
    # resuming at a position gives exactly the stream an uninterrupted reader sees
    full, pos = [], 0
    for _ in range(30):
        mbs, pos = ds.step_batches(pos, 3, 2)
        full += [m.input_ids for m in mbs]
    ds2 = PackedDataset(tokens, seq_len=10, seed=3)
    rest, pos2 = [], 13 * 6
    for _ in range(17):
        mbs, pos2 = ds2.step_batches(pos2, 3, 2)
        rest += [m.input_ids for m in mbs]
    assert all(torch.equal(x, y) for x, y in zip(full[26:], rest)) and pos2 == pos
    assert PackedDataset(tokens, 10, seed=4).sequence_at(0).tolist() != ds.sequence_at(0).tolist()


def test_token_cache_roundtrip(tmp_path, tok):
    a = tmp_path / "a.txt"
    a.write_text(TEXT)
    d1 = build_dataset([a], tok, 8, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("tokens-*.safetensors"))) == 1
    d2 = build_dataset([a], tok, 8, cache_dir=tmp_path / "cache")
    assert torch.equal(d1.sequences, d2.sequences)


def test_directory_expands_to_text_and_jsonl(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "x.txt").write_text("a")
    (tmp_path / "sub" / "y.jsonl").write_text("{}")
    (tmp_path / "z.bin").write_bytes(b"\0")
    assert [p.name for p in expand_files([tmp_path])] == ["y.jsonl", "x.txt"]


@pytest.mark.parametrize("setup,match", [
    (lambda d: [d / "missing.txt"], "does not exist"),
    (lambda d: [(d / "e.txt", (d / "e.txt").write_text("  \n"))[0]], "hold no text"),
    (lambda d: [(d / "b.jsonl", (d / "b.jsonl").write_text('{"text": "ok"}\n{oops\n'))[0]], r"b.jsonl:2: not valid JSON"),
    (lambda d: [(d / "f.jsonl", (d / "f.jsonl").write_text('{"body": "x"}\n'))[0]], "no 'text' field"),
    (lambda d: [(d / "s.txt", (d / "s.txt").write_text("short"))[0]], "fewer than one sequence"),
    (lambda d: [(d / "empty", (d / "empty").mkdir())[0]], "holds no"),
])
def test_bad_data_one_line_errors(tmp_path, tok, setup, match):
    with pytest.raises(DataError, match=match) as ei:
        build_dataset(setup(tmp_path), tok, seq_len=64)
    assert "\n" not in str(ei.value)


def test_missing_tokenizer_dir(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no tokenizer"):
        load_tokenizer(tmp_path / "empty")


def test_prompt_completion_learns_only_completions(tmp_path, tok):
    rows = [{"prompt": f"Question {i}: what does the for statement iterate over?",
             "completion": f" the elements of a sequence, item {i}"} for i in range(40)]
    f = tmp_path / "sft.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    ds = build_dataset([f], tok, seq_len=32, seed=0, prompt_field="prompt", text_field="completion",
                       cache_dir=tmp_path / "cache")
    # the learn mask against an independent tokenisation of the rows, packed whole: a row that does
    # not fit the rest of a sequence starts the next (one longer than a sequence runs on, from the
    # token before as context), padded
    wins = [[]]
    for r in rows:
        p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        c = tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        if wins[-1] and len(wins[-1]) + len(p) + len(c) > 32:
            wins.append([])
        for t in [(x, False) for x in p] + [(x, True) for x in c]:
            if len(wins[-1]) == 32:   # runs on: the next window starts with this one's last token
                wins.append([(wins[-1][-1][0], False)])
            wins[-1].append(t)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    wins = [w + [(pad, False)] * (32 - len(w)) for w in wins]
    want_x = torch.tensor([[x for x, _ in w] for w in wins])
    want_y = torch.where(torch.tensor([[m for _, m in w] for w in wins]), want_x, -100)
    keep = (want_y[:, 1:] != -100).any(dim=1)
    got = {tuple(x.tolist()): tuple(y.tolist()) for x, y in
           ((ds.batch(k, 1).input_ids[0], ds.batch(k, 1).labels[0]) for k in range(len(ds)))}
    assert len(ds) == int(keep.sum())
    assert got == {tuple(x.tolist()): tuple(y.tolist()) for x, y in zip(want_x[keep], want_y[keep])}
    assert any(-100 in y for y in got.values()) and any(v != -100 for y in got.values() for v in y)
    # the cache keeps the mask; the same files read as plain text are a different dataset
    again = build_dataset([f], tok, seq_len=32, seed=0, prompt_field="prompt", text_field="completion",
                          cache_dir=tmp_path / "cache")
    assert torch.equal(again.batch(0, 3).labels, ds.batch(0, 3).labels)
    plain = build_dataset([f], tok, seq_len=32, seed=0, text_field="completion", cache_dir=tmp_path / "cache")
    assert plain.learn is None and torch.equal(plain.batch(0, 2).labels, plain.batch(0, 2).input_ids)


def test_prompt_completion_drops_sequences_with_nothing_to_learn(tok):
    tokens = torch.arange(12) % 7
    learn = torch.tensor([False] * 4 + [False, True, False, False] + [True] * 4)
    ds = PackedDataset(tokens, 4, learn=learn)
    # row 0: nothing; row 1: only position 1 (a target after the shift); row 2: all
    assert len(ds) == 2 and torch.equal(ds.sequences, tokens[4:].view(2, 4))
    with pytest.raises(DataError, match="no sequence .* holds a completion token"):
        PackedDataset(tokens, 4, learn=torch.tensor([True] + [False] * 11))


@pytest.mark.parametrize("content,name,match", [
    ('{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n', "p.jsonl", r"p.jsonl:2: no 'completion' field \(set data.text_field\)"),
    ('{"question": "a", "completion": "b"}\n', "q.jsonl", r"no 'prompt' field \(set data.prompt_field\)"),
    ("plain text", "t.txt", "must be JSONL"),
])
def test_prompt_completion_bad_rows(tmp_path, tok, content, name, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=match):
        build_dataset([tmp_path / name], tok, seq_len=8, prompt_field="prompt", text_field="completion")


def test_a_json_file_holding_one_array_of_rows_is_read_as_its_rows(tmp_path):
    """`json.dump(rows, f)` output (one-line or pretty-printed) was read as JSON lines: "no 'text'
    field" on line 1, or "not valid JSON"."""
    import json as _json

    from lazytrain.data.dataset import DataError, read_documents, read_pairs

    rows = [{"text": "first doc"}, {"text": "second doc"}]
    one, pretty = tmp_path / "one.json", tmp_path / "pretty.json"
    one.write_text(_json.dumps(rows))
    pretty.write_text("\n  " + _json.dumps(rows, indent=2))
    assert list(read_documents(one)) == list(read_documents(pretty)) == ["first doc", "second doc"]
    pairs = tmp_path / "pairs.json"
    pairs.write_text(_json.dumps([{"p": "q?", "a": "yes"}]))
    assert list(read_pairs(pairs, "p", "a")) == [("q?", "yes")]
    bad = tmp_path / "bad.json"
    bad.write_text(_json.dumps([{"text": "ok"}, {"body": "x"}]))
    with pytest.raises(DataError, match=r"bad.json\[1\]: no 'text' field \(set data.text_field\)"):
        list(read_documents(bad))
    bad.write_text(_json.dumps([{"text": ["a"]}]))
    with pytest.raises(DataError, match=r"bad.json\[0\]: field 'text' is a JSON array"):
        list(read_documents(bad))


def test_a_chat_row_under_the_default_field_says_what_it_is(tmp_path):
    import json as _json

    from lazytrain.data.dataset import DataError, read_documents

    f = tmp_path / "chat.jsonl"
    f.write_text(_json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match=r"chat.jsonl:1: no 'text' field .*chat row \('messages'\)"):
        list(read_documents(f))


def test_a_data_dir_follows_linked_subdirs_once(tmp_path):
    """A symlinked sub-directory's files are taken (rglob skipped them silently, while taking a
    symlinked file: review); a link back up the tree is not a loop; hidden dirs stay skipped."""
    from lazytrain.data.dataset import expand_files

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "a.txt").write_text("a")
    d = tmp_path / "data"
    (d / ".hidden").mkdir(parents=True)
    (d / ".hidden" / "h.txt").write_text("h")
    (d / "b.txt").write_text("b")
    (d / "linked").symlink_to(elsewhere, target_is_directory=True)
    (d / "up").symlink_to(d, target_is_directory=True)
    assert [p.relative_to(d).as_posix() for p in expand_files([d])] == ["b.txt", "linked/a.txt"]
    # a dir reachable as itself and through a link is taken as itself, whatever order the
    # filesystem lists them in (the first listed decided the data order: review)
    (d / "v3").mkdir()
    (d / "v3" / "c.txt").write_text("c")
    (d / "a_latest").symlink_to(d / "v3", target_is_directory=True)
    assert [p.relative_to(d).as_posix() for p in expand_files([d])] == ["b.txt", "linked/a.txt", "v3/c.txt"]


def test_long_documents_cut_inside_whitespace_runs_tokenize_as_whole():
    """A byte-level BPE that merges newline runs, documents cut into pieces at line breaks inside
    runs longer than the check's window: 17 of 30 such documents came out with other tokens than
    the whole document (review); the window now spans the run."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lazytrain.data.dataset import _pieces

    rnd = random.Random(0)
    texts = ["word " * rnd.randint(1, 5) + "\n" * rnd.randint(1, 40) for _ in range(5000)]
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>")
    for trial in range(6):
        r = random.Random(trial)
        doc = "".join("some words here\n" + "\n" * r.randint(300, 900) for _ in range(40))
        pieces = list(_pieces(tok, doc, 4096))
        assert "".join(pieces) == doc   # (in fewer pieces where no cut in a run is exact)
        got = [i for p in pieces for i in tok(p, add_special_tokens=False)["input_ids"]]
        assert got == tok(doc, add_special_tokens=False)["input_ids"], trial


def test_jsonl_with_a_utf8_bom_reads_its_rows(tmp_path):
    """A UTF-8 byte-order mark (Windows editors write one) before JSONL rows or a JSON array was a
    hard error ("Unexpected UTF-8 BOM"); it is skipped."""
    from lazytrain.data.dataset import read_documents

    for name, body in (("a.jsonl", '{"text": "one"}\n{"text": "two"}\n'), ("b.json", '[{"text": "one"}, {"text": "two"}]')):
        p = tmp_path / name
        p.write_bytes(b"\xef\xbb\xbf" + body.encode())
        assert list(read_documents(p)) == ["one", "two"]
