"""Fixes from the session-25 review of the training data: rows packed whole, no second EOS,
skipped rows counted."""

import json
import logging

import pytest

import torch

from lazytrain.data.dataset import PackedDataset, bos_for, build_dataset, tokenize_files, tokenize_pairs
from test_dataset import tok  # noqa: F401 - the small tokenizer fixture test_dataset.py builds

WORDS = "the iterable yields each value of the list in order until the loop ends".split()


def _sft(path, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        k, m = (int(x) for x in torch.randint(2, 12, (2,), generator=g))
        rows.append({"prompt": f"question {i}: " + " ".join(WORDS[:k]), "completion": " " + " ".join(WORDS[-m:])})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _rows(path, tok):
    lens: list[int] = []
    ids, learn = tokenize_pairs([path], tok, "prompt", "completion", bos=bos_for(tok), row_lengths=lens)
    out, at = [], 0
    for n in lens:
        out.append((ids[at:at + n].tolist(), learn[at:at + n].tolist()))
        at += n
    return out


def test_each_sequence_is_whole_rows_then_padding(tmp_path, tok):
    """Rows were cut at fixed window edges: a completion crossing one was trained in the next
    window without its prompt (review: 14.5% of learned targets at seq_len 512, 93.7% at 48)."""
    f = _sft(tmp_path / "sft.jsonl")
    rows = _rows(f, tok)
    seq = 128
    assert max(len(ids) for ids, _ in rows) <= seq < sum(len(ids) for ids, _ in rows) // 4
    ds = build_dataset([f], tok, seq_len=seq, prompt_field="prompt", text_field="completion")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    r = 0
    for x, m in zip(ds.sequences.tolist(), ds.learn.tolist()):   # (stored in stream order)
        at = 0
        while r < len(rows) and at + len(rows[r][0]) <= seq:
            ids, learn = rows[r]
            assert x[at:at + len(ids)] == ids and m[at:at + len(ids)] == learn, (r, x)
            at, r = at + len(ids), r + 1
        assert at > 0 and x[at:] == [pad] * (seq - at) and not any(m[at:]), x
    assert r == len(rows)   # every row, once
    b = ds.batch(0, len(ds))   # (padding is not learned)
    assert ((b.labels == -100) | (b.input_ids != pad) | (pad == tok.eos_token_id)).all()


def test_a_row_longer_than_the_sequence_starts_one_and_runs_on(tmp_path, tok, caplog):
    f = tmp_path / "long.jsonl"
    f.write_text(json.dumps({"prompt": "a question", "completion": " " + " ".join(WORDS * 6)}) + "\n" +
                 json.dumps({"prompt": "q", "completion": " end"}) + "\n" +
                 json.dumps({"prompt": "q", "completion": " yes"}) + "\n")
    rows = _rows(f, tok)
    seq = 17
    with caplog.at_level(logging.WARNING, logger="lazytrain.data.dataset"):
        ds = build_dataset([f], tok, seq_len=seq, prompt_field="prompt", text_field="completion")
    later = sum(rows[0][1][seq:])
    assert f"1 of 3 rows are longer than job.seq_len={seq}: each runs on into the next sequences, whose " \
           f"{later} learned tokens" in caplog.text, caplog.text
    # row 0 from a window's start; each next window begins with the last token before it, as context
    ids0, learn0 = rows[0]
    got, at, w = ds.sequences.tolist(), 0, 0
    while at < len(ids0):
        take = ids0[at:at + seq]
        assert got[w][:len(take)] == take, w
        if at:   # the context token is not learned again
            assert not ds.learn[w, 0]
        at, w = at + seq - 1, w + 1
    # every learned token of every row is a target exactly once (a window's first token is none:
    # the model shifts the labels): a review found continuation windows dropping one each, and a
    # row of seq_len + 1 losing its EOS
    b = ds.batch(0, len(ds))
    assert int((b.labels[:, 1:] != -100).sum()) == sum(sum(m[1:]) for _, m in rows)


@pytest.mark.parametrize("n", [7, 8, 9, 15, 16, 17, 23])
def test_rows_at_the_window_edges_keep_every_target(n):
    seq = 8
    lens = [n, seq, seq + 1, 3, n]
    toks, learn = [], []
    for r, m in enumerate(lens):
        toks += [100 * (r + 1) + j for j in range(m)]
        learn += [False] + [True] * (m - 1)
    ds = PackedDataset(torch.tensor(toks), seq, learn=torch.tensor(learn), rows=torch.tensor(lens), pad_id=0)
    b = next(ds.ordered_batches(len(ds)))
    targets = b.labels[:, 1:][b.labels[:, 1:] != -100].tolist()
    want = [t for t, m in zip(toks, learn) if m]
    assert sorted(targets) == sorted(want)   # each once


def test_rows_survive_the_token_cache(tmp_path, tok):
    f = _sft(tmp_path / "sft.jsonl", n=25, seed=3)
    a = build_dataset([f], tok, seq_len=40, prompt_field="prompt", text_field="completion", cache_dir=tmp_path / "c")
    b = build_dataset([f], tok, seq_len=40, prompt_field="prompt", text_field="completion", cache_dir=tmp_path / "c")
    assert len(list((tmp_path / "c").glob("tokens-*.safetensors"))) == 1
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.learn, b.learn)
    assert a.fingerprint == b.fingerprint


def test_row_lengths_must_add_up():
    import pytest

    from lazytrain.data.dataset import DataError

    with pytest.raises(DataError, match="row lengths do not add up"):
        PackedDataset(torch.arange(10), 4, learn=torch.ones(10, dtype=torch.bool), rows=torch.tensor([3, 3]))


def test_text_or_completion_ending_with_eos_gets_no_second_one(tmp_path, tok):
    """TRL adds EOS only where the completion does not end with it; a second one taught the model
    to predict EOS after EOS (review)."""
    eos = tok.eos_token
    f = tmp_path / "a.txt"
    f.write_text("the loop ends." + eos)
    ids = tokenize_files([f], tok).tolist()
    assert ids.count(tok.eos_token_id) == 1 and ids[-1] == tok.eos_token_id
    f.write_text("the loop ends.")
    assert tokenize_files([f], tok).tolist() == ids
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "q", "completion": " the loop." + eos}) + "\n")
    ids, learn = tokenize_pairs([p], tok, "prompt", "completion")
    assert ids.tolist().count(tok.eos_token_id) == 1 and ids[-1] == tok.eos_token_id and learn[-1]


def test_empty_completions_are_counted(tmp_path, tok, caplog):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"q{i}", "completion": c})
                           for i, c in enumerate([" yes", "", "  ", None, " no"])) + "\n")
    with caplog.at_level(logging.WARNING, logger="lazytrain.data.dataset"):
        tokenize_pairs([p], tok, "prompt", "completion")
    assert "skipped 3 prompt/completion row(s) whose completion is empty" in caplog.text, caplog.text


# DeepSeek-R1's template (tool branches left out): the generation prompt opens "<think>\n", a past
# assistant turn renders "<｜Assistant｜>" + its content after any reasoning
R1 = ("{% set ns = namespace(system_prompt='') %}"
      "{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}"
      "{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}"
      "{%- if message['role'] == 'user' %}{{'<｜User｜>' + message['content']}}{%- endif %}"
      "{%- if message['role'] == 'assistant' and message['content'] is not none %}{% set content = message['content'] %}"
      "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
      "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor -%}"
      "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")


def test_a_deepseek_r1_template_marks_the_answer(tmp_path, tok):
    """Every row was refused, one-turn rows too, with advice about later messages (review)."""
    import copy

    from lazytrain.data.dataset import tokenize_chats

    t = copy.deepcopy(tok)
    t.add_special_tokens({"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                          "additional_special_tokens": ["<｜User｜>", "<｜Assistant｜>"]})
    t.chat_template = R1
    f = tmp_path / "r1.jsonl"
    conv = [{"role": "user", "content": "How often?"},
            {"role": "assistant", "content": "<think>\nonce per item\n</think>\n\nOnce per item."},
            {"role": "user", "content": "And the loop?"}, {"role": "assistant", "content": "Until it ends."}]
    f.write_text(json.dumps({"messages": conv}) + "\n")
    ids, learn = tokenize_chats([f], t, "messages")
    spans, run = [], []
    for x, m in zip(ids.tolist(), learn.tolist()):
        if m:
            run.append(x)
        elif run:
            spans.append(t.decode(run))
            run = []
    spans += [t.decode(run)] if run else []
    assert spans == ["\n\nOnce per item.<｜end▁of▁sentence｜>", "Until it ends.<｜end▁of▁sentence｜>"], spans
    # an answer starting "<" (it shares "<" with the prompt's "<think>"): the whole dataset was
    # refused (a review of the fix above)
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "Bold?"},
                                          {"role": "assistant", "content": "<b>bold</b> answer"}]}) + "\n")
    ids, learn = tokenize_chats([f], t, "messages")
    assert t.decode(ids[learn].tolist()) == "<b>bold</b> answer<｜end▁of▁sentence｜>"
