"""Packing sequences into rows: whole sequences only, within the row budget and the segment
slots, shapes from a set fixed before the run, groups kept apart, and little padding."""
import numpy as np
import pytest

from rstar2_jax.train.packing import PackShapes, first_fit_decreasing, micro_batches, pack, row_bucket


def test_segment_slots_default_to_one_per_64_tokens_as_a_power_of_two_at_most_32():
    assert PackShapes(2048).segments == 32 and PackShapes(336).segments == 8
    assert PackShapes(2049).segments == 32 and PackShapes(10240).segments == 32  # at most 32
    assert PackShapes(64).segments == 1 and PackShapes(65).segments == 2
    assert PackShapes(100, segments=3).segments == 3
    with pytest.raises(ValueError, match="positive"):
        PackShapes(100, segments=0)


def test_the_shape_set_is_the_row_buckets_times_the_multiple():
    shapes = PackShapes(384, row_multiple=2)
    counts = shapes.row_counts(40, groups=2)  # 20 a group, 10 rows of 2 at most
    assert counts == [4 * n for n in range(1, 11)]
    assert "10 shapes" in shapes.describe(40, groups=2) and "384" in shapes.describe(40, 2)
    rng = np.random.default_rng(1)
    for _ in range(50):  # every batch takes one of them
        lengths = rng.integers(1, 385, rng.integers(1, 41)).tolist()
        packing = pack(lengths, shapes, groups=2)
        assert len(packing.rows) in counts and packing.row_tokens == 384


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
    # Two slots a bin: the third short sequence opens a bin although the first has room.
    assert first_fit_decreasing([1, 1, 1], 10, slots=2) == [[0, 1], [2]]


def test_pack_fills_rows_whole_within_the_slots_and_keeps_groups_apart():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 1500, 37).tolist()
    shapes = PackShapes(2048, segments=4, row_multiple=2)
    packing = pack(lengths, shapes, groups=3)
    rows = len(packing.rows)
    assert rows % 6 == 0 and packing.row_tokens == 2048 and packing.segments == 4
    placed = sorted(i for row in packing.rows for i in row)
    assert placed == list(range(37))  # each sequence once, whole
    for r, row in enumerate(packing.rows):
        assert sum(lengths[i] for i in row) <= packing.row_tokens
        assert len(row) <= 4
        assert all(i % 3 == r % 3 for i in row)  # row r holds group r % 3's sequences
    # The fewest rows first-fit decreasing needs, bucketed.
    per_group = max(len(first_fit_decreasing(lengths[g::3], 2048, 4)) for g in range(3))
    assert rows == row_bucket(-(-per_group // 2)) * 2 * 3
    # Many sequences leave little padding: the last rows' free tails and the bucket's rows.
    many = rng.integers(1, 1500, 200).tolist()
    big = pack(many, PackShapes(2048))
    assert 1 - sum(many) / (len(big.rows) * 2048) < 0.1

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


def test_micro_batches_have_one_shape_and_hold_every_sequence_once():
    rng = np.random.default_rng(4)
    shapes = PackShapes(384, segments=4)
    for n in (0, 1, 7, 40, 120):
        lengths = rng.integers(0, 385, n).tolist()
        batches = micro_batches(lengths, shapes, rows=3, sequences=8)
        assert batches and all(len(b.rows) == 3 and b.row_tokens == 384 for b in batches)
        placed = [i for b in batches for row in b.rows for i in row]
        assert sorted(placed) == [i for i, x in enumerate(lengths) if x]
        for b in batches:
            assert sum(map(len, b.rows)) <= 8
            assert all(len(row) <= 4 and sum(lengths[i] for i in row) <= 384 for row in b.rows)
        # No more micro-batches than the rows or the sequences need, one at most over each.
        rows = len(first_fit_decreasing(lengths, 384, 4))
        assert len(batches) <= max(1, -(-rows // 3) + -(-len(placed) // 8))
    with pytest.raises(ValueError, match="385 tokens"):
        micro_batches([385], shapes, rows=3, sequences=8)
    with pytest.raises(ValueError, match="cannot hold a row"):
        micro_batches([5], shapes, rows=3, sequences=3)
