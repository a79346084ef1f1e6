"""Chat rows (data.messages_field): rendered with the tokenizer's chat template, only the assistant
messages' tokens learned; bad rows and templates whose turns cannot be marked are one clear error."""
import copy
import json
import logging

import pytest
import torch

from lazytrain.data.dataset import (DataError, build_dataset, read_chat_template, tokenize_chats)
from test_dataset import tok  # noqa: F401 - the small tokenizer fixture test_dataset.py builds

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def chat_tok(tok):  # noqa: F811 - the fixture imported above
    t = copy.deepcopy(tok)
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.chat_template = CHATML
    return t


def _jsonl(path, *rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does a for statement do?"},
        {"role": "assistant", "content": "It iterates over a sequence."},
        {"role": "user", "content": "And each item?"},
        {"role": "assistant", "content": "Each item is assigned to the target list."}]


def _spans(ids, learn):
    """The learned tokens as runs of consecutive positions."""
    runs, cur = [], []
    for i, keep in zip(ids.tolist(), learn.tolist()):
        if keep:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def test_only_assistant_messages_and_their_end_of_turn_are_learned(tmp_path, chat_tok):
    f = _jsonl(tmp_path / "chats.jsonl", {"messages": CONV},
               {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]})
    ids, learn = tokenize_chats([f], chat_tok, "messages")
    # the stream is the two conversations as the template renders them, nothing added
    want = [t for row in (CONV, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}])
            for t in chat_tok(chat_tok.apply_chat_template(row, tokenize=False), add_special_tokens=False)["input_ids"]]
    assert ids.tolist() == want
    spans = [chat_tok.decode(s) for s in _spans(ids, learn)]
    assert spans == ["It iterates over a sequence.<|im_end|>\n",
                     "Each item is assigned to the target list.<|im_end|>\n", "Hello.<|im_end|>\n"]
    unlearned = chat_tok.decode(ids[~learn].tolist())
    assert "Be brief." in unlearned and "What does a for statement do?" in unlearned
    assert unlearned.count("<|im_start|>assistant\n") == 3   # the generation prompt is not learned


def test_packed_labels_ignore_everything_but_the_assistant_tokens(tmp_path, chat_tok):
    f = _jsonl(tmp_path / "chats.jsonl", *[{"messages": CONV}] * 6)
    ds = build_dataset([f], chat_tok, seq_len=16, seed=0, messages_field="messages")
    lens: list[int] = []
    ids, learn = tokenize_chats([f], chat_tok, "messages", row_lengths=lens)
    # rows packed whole (since 2026-12-02): a row longer than a sequence starts one and runs on,
    # each next sequence beginning with the token before it as context (not learned again)
    wins, at = [[]], 0
    for n in lens:
        if wins[-1] and len(wins[-1]) + n > 16:
            wins.append([])
        for t, m in zip(ids[at:at + n].tolist(), learn[at:at + n].tolist()):
            if len(wins[-1]) == 16:
                wins.append([(wins[-1][-1][0], False)])
            wins[-1].append((t, m))
        at += n
    pad = chat_tok.pad_token_id if chat_tok.pad_token_id is not None else chat_tok.eos_token_id
    wins = [w + [(pad, False)] * (16 - len(w)) for w in wins]
    seqs = torch.tensor([[t for t, _ in w] for w in wins])
    masks = torch.tensor([[m for _, m in w] for w in wins])
    keep = masks[:, 1:].any(dim=1)   # sequences with no target after the shift are dropped
    assert 0 < int(keep.sum()) < len(wins)
    assert torch.equal(ds.sequences, seqs[keep]) and torch.equal(ds.learn, masks[keep])
    b = ds.batch(0, len(ds))
    learned = b.labels != -100
    assert torch.equal(b.labels[learned], b.input_ids[learned])
    assert int(learned.sum()) == int(masks[keep].sum())
    text = chat_tok.decode(b.input_ids[learned].tolist())
    assert "iterates" in text and "Be brief" not in text and "for statement" not in text


def test_chat_tokens_are_cached_with_their_mask(tmp_path, chat_tok):
    f = _jsonl(tmp_path / "chats.jsonl", *[{"messages": CONV}] * 4)
    cache = tmp_path / "cache"
    a = build_dataset([f], chat_tok, seq_len=16, messages_field="messages", cache_dir=cache)
    assert len(list(cache.glob("tokens-*.safetensors"))) == 1
    b = build_dataset([f], chat_tok, seq_len=16, messages_field="messages", cache_dir=cache)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.learn, b.learn)
    # the same file read as plain text rows is another cache entry, not these tokens
    _jsonl(tmp_path / "t.jsonl", *[{"text": "x", "messages": CONV}] * 4)
    build_dataset([tmp_path / "t.jsonl"], chat_tok, seq_len=2, cache_dir=cache)
    build_dataset([tmp_path / "t.jsonl"], chat_tok, seq_len=2, cache_dir=cache, messages_field="messages")
    assert len(list(cache.glob("tokens-*.safetensors"))) == 3


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path, tok):  # noqa: F811
    f = _jsonl(tmp_path / "chats.jsonl", {"messages": CONV})
    with pytest.raises(DataError, match=r"no chat template.*data\.chat_template=FILE"):
        build_dataset([f], tok, seq_len=8, messages_field="messages")


def test_a_template_that_rewrites_earlier_turns_is_refused_for_the_row(tmp_path, chat_tok):
    """Like Qwen3's template, which drops earlier assistant turns' reasoning: the last turn renders
    otherwise than it does once the conversation goes on, so its span cannot be marked."""
    chat_tok.chat_template = CHATML.replace("{{ m['content'] }}", "{% if m['role'] == 'assistant' and not loop.last %}"
                                            "(earlier answer){% else %}{{ m['content'] }}{% endif %}")
    f = _jsonl(tmp_path / "chats.jsonl", {"messages": CONV[1:3]}, {"messages": CONV})
    with pytest.raises(DataError, match=r"chats\.jsonl:2: the chat template renders message 2 \(assistant\) "
                                        r"differently once later messages follow it.*one assistant turn per row"):
        tokenize_chats([f], chat_tok, "messages")


def test_a_turn_that_does_not_end_on_a_token_boundary_is_refused(tmp_path, chat_tok):
    # the answer runs straight into the next turn's text: "atem" + "ent" tokenize as "ate" + "ment"
    chat_tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                              "{% if add_generation_prompt %}{% endif %}")
    f = _jsonl(tmp_path / "chats.jsonl", {"messages": [{"role": "user", "content": "The st"},
                                                       {"role": "assistant", "content": "atem"},
                                                       {"role": "user", "content": "ent"}]})
    enc = lambda s: chat_tok(s, add_special_tokens=False)["input_ids"]   # noqa: E731
    assert enc("The statement")[:len(enc("The statem"))] != enc("The statem")   # (the premise)
    with pytest.raises(DataError, match=r"chats\.jsonl:1: message 1 \(assistant\) does not start or end on a "
                                        r"token boundary"):
        tokenize_chats([f], chat_tok, "messages")


def test_a_template_that_raises_names_the_row(tmp_path, chat_tok):
    chat_tok.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}"
                              "{% endif %}" + CHATML)
    f = _jsonl(tmp_path / "chats.jsonl", {"messages": CONV[1:3]}, {"messages": CONV})
    with pytest.raises(DataError, match=r"chats\.jsonl:2: the chat template refused the conversation "
                                        r"\(\w+: must start with user\)"):
        tokenize_chats([f], chat_tok, "messages")


@pytest.mark.parametrize("row, msg", [
    ({"text": "no messages"}, r":1: no 'messages' field \(set data\.messages_field\)"),
    ({"messages": "hi"}, r":1: field 'messages' is str, not a list of messages"),
    ({"messages": {"role": "user"}}, r":1: field 'messages' is a JSON object, not a list"),
    ({"messages": [{"content": "hi"}]}, r":1: message 0 is not an object with a string 'role'"),
    ({"messages": ["hi"]}, r":1: message 0 is not an object with a string 'role'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     r":1: message 0's content is a JSON array, not a string \(content parts"),
    ({"messages": [{"role": "user", "content": "\ud83d"}]}, r":1 message 0: field 'content' holds a lone UTF-16 surrogate"),
    # an assistant turn with nothing to learn (a misspelt key rendered as an empty answer: only the
    # end-of-turn tokens were learned, without a word; review, session 29)
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "text": "It is 1."}]},
     r":1: message 1 is an assistant turn with no 'content' \(its keys: role, text\) and no tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
     r":1: message 1 is an assistant turn with an empty 'content'"),
])
def test_bad_rows_are_one_line_naming_file_and_row(tmp_path, chat_tok, row, msg):
    f = tmp_path / "chats.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"chats\.jsonl" + msg):
        tokenize_chats([f], chat_tok, "messages")


def test_rows_without_an_assistant_turn_are_skipped_with_a_warning(tmp_path, chat_tok, caplog):
    f = _jsonl(tmp_path / "chats.jsonl", {"messages": CONV[:2]}, {"messages": CONV[:3]})
    with caplog.at_level(logging.WARNING, logger="lazytrain.data.dataset"):
        ids, learn = tokenize_chats([f], chat_tok, "messages")
    assert "skipped 1 chat row(s) without an assistant message" in caplog.text
    assert chat_tok.decode(ids.tolist()) == chat_tok.apply_chat_template(CONV[:3], tokenize=False)
    with pytest.raises(DataError, match=r"no chat row has an assistant message"):
        build_dataset([_jsonl(tmp_path / "q.jsonl", {"messages": CONV[:2]})], chat_tok, seq_len=4,
                      messages_field="messages")


def test_prompt_and_messages_fields_together_are_refused(tmp_path, chat_tok):
    f = _jsonl(tmp_path / "chats.jsonl", {"messages": CONV})
    with pytest.raises(DataError, match=r"prompt_field='prompt' and data\.messages_field='messages' are both set"):
        build_dataset([f], chat_tok, seq_len=8, prompt_field="prompt", messages_field="messages")


def test_a_text_file_is_not_chat_data(tmp_path, chat_tok):
    (tmp_path / "a.txt").write_text("plain text")
    with pytest.raises(DataError, match=r"a\.txt: chat data \(data\.messages_field='messages'\) must be JSONL"):
        tokenize_chats([tmp_path / "a.txt"], chat_tok, "messages")


def test_chat_template_file(tmp_path):
    good = tmp_path / "chat.jinja"
    good.write_text(CHATML)
    assert read_chat_template(good) == CHATML
    # {% generation %} (HF's assistant-mask tag) parses as apply_chat_template parses it
    tagged = tmp_path / "tagged.jinja"
    tagged.write_text(CHATML.replace("{{ m['content'] }}", "{% generation %}{{ m['content'] }}{% endgeneration %}"))
    assert "generation" in read_chat_template(tagged)
    with pytest.raises(DataError, match=r"data\.chat_template=.*missing\.jinja: no such file"):
        read_chat_template(tmp_path / "missing.jinja")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(DataError, match=r"bad\.jinja:1: not a valid Jinja template"):
        read_chat_template(bad)


def test_a_template_that_closes_the_conversation_marks_every_turn(tmp_path, chat_tok):
    """Phi-3's template ends a conversation rendered without a generation prompt with EOS: a turn
    that later ones follow renders without it. Every turn is marked (review: multi-turn rows were
    refused); the closing EOS is learned after the last turn only."""
    chat_tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>"]})
    chat_tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                              "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}")
    conv = [m for m in CONV if m["role"] != "system"]
    f = _jsonl(tmp_path / "chats.jsonl", {"messages": conv})
    ids, learn = tokenize_chats([f], chat_tok, "messages")
    assert [chat_tok.decode(s) for s in _spans(ids, learn)] == [
        "It iterates over a sequence.<|end|>\n",
        "Each item is assigned to the target list.<|end|>\n" + chat_tok.eos_token]


def test_a_template_that_trims_the_content_marks_it(tmp_path, chat_tok):
    """Llama-3's and Gemma's templates render `content | trim` (review: a trailing newline in the
    content made the row refused)."""
    chat_tok.chat_template = CHATML.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    f = _jsonl(tmp_path / "chats.jsonl", {"messages": [{"role": "user", "content": "Hi"},
                                                       {"role": "assistant", "content": "Hello.\n"}]})
    ids, learn = tokenize_chats([f], chat_tok, "messages")
    assert [chat_tok.decode(s) for s in _spans(ids, learn)] == ["Hello.<|im_end|>\n"]
