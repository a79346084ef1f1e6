"""data.doc_mask: text documents cut into fixed-length sequences, each attending only to itself
(position ids restarting after every document's EOS), and no document's first token learned as
the target of the one before it."""

from __future__ import annotations

import pytest
import torch
import transformers

from lazytrain.data.dataset import DataError, PackedDataset, _document_positions

EOS = 2


def test_positions_restart_after_each_end_of_document():
    seqs = torch.tensor([[5, 6, EOS, 7, 8, EOS], [9, EOS, EOS, 4, 4, 4]])
    pos, learn = _document_positions(seqs, EOS)
    assert pos.dtype == torch.int32
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 0, 0, 1, 2]]
    # a sequence's first token has no target anyway (the shift); a document's first one after
    # another's end in the same sequence is not learned
    assert learn.tolist() == [[True, True, True, False, True, True], [True, True, False, False, True, True]]


def test_the_dataset_carries_them_through_its_order_and_split():
    stream = torch.tensor([5, 6, EOS, 7, 8, 9, EOS, 3, EOS, 4, 4, 4, 4, EOS, 1])
    ds = PackedDataset(stream, 5, seed=3, doc_sep=EOS)
    assert len(ds) == 3 and ds.tail_tokens == 0
    seen = 0
    for pos in range(len(ds)):
        b = ds.batch(pos, 1)
        ids, labels, positions = b.input_ids[0], b.labels[0], b.position_ids[0]
        want, learn = _document_positions(ids[None], EOS)
        assert positions.tolist() == want[0].tolist()
        assert labels.tolist() == torch.where(learn[0], ids, -100).tolist()
        seen += int((labels == -100).sum())
    assert seen == 4   # (7; 3 and 4 in [9 EOS 3 EOS 4]; 1 in [4 4 4 EOS 1])
    train, held = ds.split_off(0.34)
    assert held.positions is not None and train.positions is not None
    assert ds.fingerprint != PackedDataset(stream, 5, seed=3).fingerprint   # (resume on the other is refused)


def test_each_document_in_a_sequence_gets_the_logits_it_gets_alone():
    """The position ids do what they are for: transformers' packed-sequence mask keeps each
    document to itself (here a tiny Llama, fp32)."""
    cfg = transformers.AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    stream = torch.tensor([11, 12, 13, EOS, 21, 22, 23, 24, EOS, 31, 32, 33])
    ds = PackedDataset(stream, 12, seed=0, doc_sep=EOS)
    b = ds.batch(0, 1)
    with torch.no_grad():
        packed = model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False).logits[0]
        for start, end in ((0, 4), (4, 9), (9, 12)):
            alone = model(input_ids=b.input_ids[:, start:end], use_cache=False).logits[0]
            assert torch.allclose(packed[start:end], alone, atol=1e-5), (start, end)


def test_rows_and_a_doc_mask_do_not_mix():
    with pytest.raises(DataError, match="text streams"):
        PackedDataset(torch.arange(1, 7), 3, learn=torch.ones(6, dtype=torch.bool), doc_sep=EOS)
