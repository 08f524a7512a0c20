"""Packing sequences into rows: whole sequences only, within the row budget, shapes from the
ladder fixed before the run, groups kept apart, and little padding."""
import numpy as np
import pytest

from rstar2_jax.train.packing import PackShapes, first_fit_decreasing, pack, row_bucket


def test_row_lengths_are_a_ladder_up_to_the_longest_sequence():
    assert PackShapes(10240).row_lengths() == (1280, 2560, 3840, 5120, 6400, 7680, 8960, 10240)
    assert PackShapes(336).row_lengths() == (128, 256, 336)


def test_row_counts_come_from_eighth_octave_buckets():
    assert [row_bucket(n) for n in range(1, 22)] == [*range(1, 17), 18, 18, 20, 20, 22]
    assert row_bucket(33) == 36 and row_bucket(65) == 72 and row_bucket(72) == 72
    for n in range(1, 1000):
        assert n <= row_bucket(n) <= 1.125 * n


def test_first_fit_decreasing_places_each_sequence_whole():
    lengths = [5, 0, 9, 3, 7, 2]
    bins = first_fit_decreasing(lengths, 10)
    assert bins == [[2], [4, 3], [0, 5]]  # 9 | 7 + 3 | 5 + 2; the empty one left out
    with pytest.raises(ValueError, match="11 tokens does not fit a row of 10"):
        first_fit_decreasing([3, 11], 10)


def test_pack_takes_the_shape_of_fewest_tokens_and_keeps_groups_apart():
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 1500, 37).tolist()
    shapes = PackShapes(2048, row_multiple=2)
    packing = pack(lengths, shapes, groups=3)
    rows = len(packing.rows)
    assert rows % 6 == 0 and packing.row_tokens in shapes.row_lengths()
    placed = sorted(i for row in packing.rows for i in row)
    assert placed == list(range(37))  # each sequence once, whole
    for r, row in enumerate(packing.rows):
        assert sum(lengths[i] for i in row) <= packing.row_tokens
        assert all(i % 3 == r % 3 for i in row)  # row r holds group r % 3's sequences
    assert packing.segments >= max(len(row) for row in packing.rows)
    assert packing.segments & (packing.segments - 1) == 0
    # No other shape of the ladder holds the batch in fewer tokens.
    for row_tokens in shapes.row_lengths():
        if row_tokens >= max(lengths):
            per_group = max(len(first_fit_decreasing(lengths[g::3], row_tokens)) for g in range(3))
            assert row_bucket(-(-per_group // 2)) * 2 * 3 * row_tokens >= rows * packing.row_tokens
    padding = 1 - sum(lengths) / (rows * packing.row_tokens)
    assert padding < 0.2, padding

    segment_lengths = packing.segment_lengths(lengths)
    places = packing.places(lengths)
    for r, row in enumerate(packing.rows):
        assert segment_lengths[r, :len(row)].tolist() == [lengths[i] for i in row]
        assert not segment_lengths[r, len(row):].any()
        starts = np.cumsum([0] + [lengths[i] for i in row])[:-1]
        assert [tuple(places[i]) for i in row] == [(r, s) for s in starts]


def test_a_sequence_longer_than_the_budget_is_an_error_before_any_work():
    with pytest.raises(ValueError, match="2049 tokens, more than the 2048"):
        pack([100, 2049], PackShapes(2048))


def test_empty_sequences_are_left_out_and_an_empty_batch_has_one_empty_row():
    packing = pack([0, 4, 0], PackShapes(16))
    assert packing.rows == ((1,),) and tuple(packing.places([0, 4, 0])[0]) == (-1, -1)
    assert pack([0, 0], PackShapes(16)).rows == ((),)
