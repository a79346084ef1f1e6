"""Position ids of packed rows (data.dataset._pack_rows): each row piece and each sequence's
padding counts from 0, so that the model keeps every row's attention to itself."""

from __future__ import annotations

import torch

from lazytrain.data.dataset import PackedDataset, _pack_rows


def _pack(rows, seq_len):
    n = sum(rows)
    tokens = torch.arange(100, 100 + n)
    learn = torch.ones(n, dtype=torch.bool)
    return _pack_rows(tokens, learn, torch.tensor(rows), seq_len, pad_id=0)


def test_each_row_and_the_padding_count_from_zero():
    tokens, learn, pos = _pack([3, 2, 4], 6)
    assert pos.dtype == torch.int32
    assert pos.tolist() == [0, 1, 2, 0, 1, 0,    # rows 0 and 1, one padding token
                            0, 1, 2, 3, 0, 1]    # row 2, two padding tokens
    assert tokens.tolist() == [100, 101, 102, 103, 104, 0, 105, 106, 107, 108, 0, 0]


def test_a_long_rows_continuation_counts_from_its_context_token():
    # a row of 8 at seq_len 5: tokens 0-4, then 4-7 (token 4 again as context), then padding
    tokens, learn, pos = _pack([8, 2], 5)
    assert tokens.tolist() == [100, 101, 102, 103, 104, 104, 105, 106, 107, 0, 108, 109, 0, 0, 0]
    assert pos.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 1, 0, 1, 2]


def test_batches_carry_the_positions_and_text_batches_none():
    n = 3 + 2 + 4
    ds = PackedDataset(torch.arange(1, n + 1), 6, seed=0, learn=torch.ones(n, dtype=torch.bool),
                       rows=torch.tensor([3, 2, 4]))
    b = ds.batch(0, 2)
    assert b.position_ids.dtype == torch.long and b.position_ids.shape == b.input_ids.shape
    # the positions travel with their sequence through the seeded order
    for row_ids, row_pos in zip(b.input_ids.tolist(), b.position_ids.tolist()):
        want = [0, 1, 2, 0, 1, 0] if row_ids[0] == 1 else [0, 1, 2, 3, 0, 1]
        assert row_pos == want
    assert len(b.micro_batch()) == 3 and b.micro_batch()[2] is b.position_ids
    train, held = ds.split_off(0.5)
    assert torch.equal(next(held.ordered_batches(1)).position_ids, ds.positions[1:2].long())
    assert torch.equal(train.positions, ds.positions[:1])
    text = PackedDataset(torch.arange(1, 13), 6, seed=0)
    tb = text.batch(0, 2)
    assert tb.position_ids is None and len(tb.micro_batch()) == 2
    # the positions are part of what a resume checks (the dataset's fingerprint)
    other = PackedDataset(torch.arange(1, n + 1), 6, seed=0, learn=torch.ones(n, dtype=torch.bool),
                          rows=torch.tensor([3, 2, 4]))
    other.positions = other.positions.clone()
    other.positions[0, 5] = 3
    assert other.fingerprint != ds.fingerprint


def test_a_rows_first_token_is_never_the_previous_rows_target():
    """Review: a row whose first token is learned (an empty prompt without BOS) was trained as the
    target of the row before it, which it cannot see; run alone it is no target."""
    n = 3 + 4
    tokens = torch.arange(100, 100 + n)
    learn = torch.ones(n, dtype=torch.bool)   # every token learned, the rows' first ones too
    out, mask, pos = _pack_rows(tokens, learn, torch.tensor([3, 4]), 8, pad_id=0)
    assert out[:7].tolist() == list(range(100, 107))
    assert mask.tolist() == [False, True, True, False, True, True, True, False]


def test_unpacked_rows_get_a_sequence_each_and_no_positions():
    n = 3 + 2 + 4
    ds = PackedDataset(torch.arange(1, n + 1), 8, seed=0, learn=torch.ones(n, dtype=torch.bool),
                       rows=torch.tensor([3, 2, 4]), pack=False)
    assert ds.sequences.tolist() == [[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 0, 0, 0, 0, 0, 0], [6, 7, 8, 9, 0, 0, 0, 0]]
    assert ds.positions is None and ds.batch(0, 2).position_ids is None
