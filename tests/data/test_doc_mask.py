"""data.doc_mask: text documents cut into fixed-length sequences, each attending only to itself
(position ids restarting where each document begins), and no document's first token learned as
the target of the one before it. Where documents begin comes from tokenization, not from EOS
tokens: a tokenizer whose BOS is its EOS, or an EOS string inside a text, split documents."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from lazytrain.data.dataset import DataError, PackedDataset, _document_positions, build_dataset
from lazytrain.data.tokenizer import build_tokenizer


def test_positions_restart_where_each_document_begins():
    # documents of 3, 5, 1 and 3 tokens, cut into sequences of 6
    pos, learn = _document_positions(torch.tensor([3, 5, 1, 3]), 2, 6)
    assert pos.dtype == torch.int32
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 0, 0, 1, 2]]
    # a sequence's first token has no target anyway (the shift); a document's first one after
    # another's end in the same sequence is not learned
    assert learn.tolist() == [[True, True, True, False, True, True], [True, True, False, False, True, True]]


def test_the_dataset_carries_them_through_its_order_and_split():
    docs = torch.tensor([3, 4, 2, 5, 1])
    stream = torch.arange(100, 100 + int(docs.sum()))
    ds = PackedDataset(stream, 5, seed=3, docs=docs)
    assert len(ds) == 3 and ds.tail_tokens == 0
    want_pos, want_learn = _document_positions(docs, 3, 5)
    for p in range(len(ds)):
        b = ds.batch(p, 1)
        i = int(b.input_ids[0, 0] - 100) // 5   # (which sequence this is: the tokens count up)
        assert b.position_ids[0].tolist() == want_pos[i].tolist()
        assert b.labels[0].tolist() == torch.where(want_learn[i], b.input_ids[0], -100).tolist()
    train, held = ds.split_off(0.34)
    assert held.positions is not None and train.positions is not None
    assert ds.fingerprint != PackedDataset(stream, 5, seed=3).fingerprint   # (resume on the other is refused)
    # the unused end of the stream is still reported (data.eval_files: "not evaluated")
    assert PackedDataset(stream, 4, docs=docs).tail_tokens == 3


def _tiny_llama():
    cfg = transformers.AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=320)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _check_documents_alone(ds, tok, texts, bos: bool):
    """Each document of the first sequence gets the logits it gets alone, and all its tokens but
    the first (after another document) are learned."""
    model = _tiny_llama()
    b = ds.ordered_batches(1).__next__()
    ids = b.input_ids[0]
    start = 0
    with torch.no_grad():
        packed = model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False).logits[0]
        for text in texts:
            doc = ([tok.bos_token_id] if bos else []) + tok(text, add_special_tokens=False)["input_ids"] + \
                [tok.eos_token_id]
            end = min(start + len(doc), ids.numel())
            assert ids[start:end].tolist() == doc[:end - start]
            alone = model(input_ids=ids[None, start:end], use_cache=False).logits[0]
            assert torch.allclose(packed[start:end], alone, atol=1e-5), text
            assert b.position_ids[0, start:end].tolist() == list(range(end - start))
            assert (b.labels[0, start + 1:end] != -100).all() and (start == 0 or b.labels[0, start] == -100)
            start = end
            if start >= ids.numel():
                break


def test_a_tokenizer_whose_bos_is_its_eos_keeps_each_document_whole(tmp_path):
    """lazytrain's own tokenizer (and GPT-NeoX's, StarCoder's, ...) has one id for BOS and EOS:
    with a BOS before each document, splitting at every token after an EOS cut each document
    after its BOS (its first text token unlearned, the rest without the BOS in view; review)."""
    texts = ["The loop runs once for each item.", "An iterator is created for the result.",
             "When the items are exhausted the loop ends."]
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok_dir = build_tokenizer([f], tmp_path / "tok", vocab_size=300)
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    assert tok.bos_token_id == tok.eos_token_id
    ds = build_dataset([f], tok, 48, add_bos=True, doc_mask=True)
    _check_documents_alone(ds, tok, texts, bos=True)


def test_an_eos_string_inside_a_text_does_not_split_it(tmp_path):
    texts = ["Text that quotes <|endoftext|> in the middle of itself.", "A second document follows."]
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok_dir = build_tokenizer([f], tmp_path / "tok", vocab_size=300)
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    assert tok.eos_token_id in tok(texts[0], add_special_tokens=False)["input_ids"]
    ds = build_dataset([f], tok, 30, add_bos=False, doc_mask=True)
    _check_documents_alone(ds, tok, texts, bos=False)


def test_rows_and_document_lengths_do_not_mix():
    with pytest.raises(DataError, match="document lengths"):
        PackedDataset(torch.arange(1, 7), 3, learn=torch.ones(6, dtype=torch.bool), docs=torch.tensor([6]))
    with pytest.raises(DataError, match="document lengths"):
        PackedDataset(torch.arange(1, 7), 3, docs=torch.tensor([2, 3]))
