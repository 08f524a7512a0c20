"""Packing sequences into training rows: several whole sequences per row, up to a token budget.

A packed batch is `[rows, row_tokens]` with each row's sequences laid end to end from its start
and the rest of the row padding; `segment_lengths` `[rows, segments]` (0 for an unused slot)
tells the model where they are (`rstar2_jax.model.packed_attention.packed_segments`: each
sequence attends only to itself, its positions start at 0). No sequence is split across rows.

A run's packed batches take few shapes, fixed before it starts (`PackShapes`), so the update
compiles once per shape it meets, as a padded batch compiles once per row bucket: the row length
is the longest sequence allowed, the segment slots per row are fixed (a row holds at most that
many sequences), and only the row count varies, from eighth-octave buckets (1 to 16, 18, 20,
..., 32, 36, 40, ...: at most 12.5% above the rows needed) times the row multiple. Sequences go
to rows first-fit decreasing.

The RL update packs into micro-batches of one shape for the whole run instead
(`micro_batches`): a fixed number of rows and of sequences each, and as many micro-batches as
a step's sequences fill, so that it compiles nothing per step whatever the step keeps.

Groups: sequence i goes to group i % groups and every row holds sequences of one group; row r is
group r % groups's. A train step that takes rows j, j + n, ... as its mini- or micro-batch
(n dividing ``groups``) then trains on the same sequences as with one sequence per row.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from rstar2_jax.parallel import hosts

# Segment slots per row, by default: one per this many tokens of the row, at most
# `_MOST_SEGMENTS`. A row of shorter sequences than that on average is closed when its slots are
# full.
_TOKENS_PER_SEGMENT_SLOT = 64
# cuDNN's packed attention keeps softmax statistics per slot, [rows x (slots + 1), heads,
# tokens] float32 a layer, and the update keeps them for the backward (`rstar2_jax.model.
# transformer`): at 32 slots they are half the size of attention's output; at the 256 slots of
# one per 64 tokens of a 10,240-token row, 14 GB for Qwen3-0.6B at 3 rows. A stage-1 row holds
# about 8 rollouts, and 32 slots packed the compiled H100 update's 256 rollouts into as few rows
# as 256 slots did (docs/accelerators.md).
_MOST_SEGMENTS = 32


@dataclasses.dataclass(frozen=True)
class PackShapes:
    """The shapes a run's packed batches take: `[rows, max_tokens]` tokens and `[rows,
    segments]` segment lengths, rows one of `row_counts`.

    max_tokens: the row length, the longest sequence allowed (a longer one is an error, before
      any work).
    segments: the most sequences a row holds (its segment slots); by default one per 64 tokens
      of the row, rounded up to a power of two, at most 32.
    row_multiple: rows per group are a row bucket times this (data-parallel devices).
    """

    max_tokens: int
    segments: int | None = None
    row_multiple: int = 1

    def __post_init__(self):
        if self.segments is None:
            slots = -(-self.max_tokens // _TOKENS_PER_SEGMENT_SLOT)
            object.__setattr__(self, "segments", min(1 << max(slots - 1, 0).bit_length(), _MOST_SEGMENTS))
        if min(self.max_tokens, self.segments, self.row_multiple) < 1:
            raise ValueError(f"PackShapes needs positive sizes, got {self}")

    def row_counts(self, sequences: int, groups: int = 1) -> list[int]:
        """Every row count a batch of up to ``sequences`` sequences in ``groups`` groups can
        take, fewest first: the shapes the update may compile."""
        per_group = -(-sequences // groups)
        most = row_bucket(-(-per_group // self.row_multiple))
        return sorted({row_bucket(n) * self.row_multiple * groups for n in range(1, most + 1)})

    def describe(self, sequences: int, groups: int = 1) -> str:
        """One line for the run's log: the shapes a packed batch of up to ``sequences``
        sequences can take."""
        counts = self.row_counts(sequences, groups)
        shown = counts if len(counts) <= 6 else [*counts[:3], "...", *counts[-2:]]
        return (f"packed rows: {len(counts)} shapes, [rows, tokens] = [{'|'.join(map(str, shown))}, "
                f"{self.max_tokens}], up to {self.segments} sequences per row")


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each sequence goes: ``rows[r]`` lists the sequences of row r in order (indices
    into the packed lengths); a row may be empty (all padding). ``row_tokens`` is the row
    length, ``segments`` the segment slots per row (at least the most sequences in a row)."""

    rows: tuple[tuple[int, ...], ...]
    row_tokens: int
    segments: int

    def segment_lengths(self, lengths: Sequence[int]) -> np.ndarray:
        """int32 `[rows, segments]`: the lengths of each row's sequences, 0-filled."""
        out = np.zeros((len(self.rows), self.segments), np.int32)
        for r, row in enumerate(self.rows):
            out[r, :len(row)] = [lengths[i] for i in row]
        return out

    def places(self, lengths: Sequence[int]) -> np.ndarray:
        """int64 `[sequences, 2]`: (row, first token) of each sequence; (-1, -1) for a sequence
        left out (length 0)."""
        out = np.full((len(lengths), 2), -1, np.int64)
        for r, row in enumerate(self.rows):
            start = 0
            for i in row:
                out[i] = (r, start)
                start += lengths[i]
        return out


def row_bucket(n: int) -> int:
    """The smallest of 1 to 16, 18, 20, ..., 32, 36, 40, ... (eight per octave from 8 on) that
    is at least n >= 1."""
    if n <= 8:
        return n
    step = 1 << (n.bit_length() - 4)  # n is in [8 * step, 16 * step)
    return -(-n // step) * step


def first_fit_decreasing(lengths: Sequence[int], capacity: int,
                         slots: int | None = None) -> list[list[int]]:
    """Bins (lists of indices into ``lengths``, longest first) of at most ``capacity`` tokens
    and ``slots`` sequences: each sequence, longest first, goes to the first bin with room.
    Empty sequences are left out."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if n == 0:
            continue
        if n > capacity:
            raise ValueError(f"a sequence of {n} tokens does not fit a row of {capacity}")
        for b, free in enumerate(room):
            if n <= free and (slots is None or len(bins[b]) < slots):
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def pack_across_processes(lengths: Sequence[int], shapes: PackShapes, groups: int = 1) -> Packing:
    """`pack` of this process's sequences, with as many rows as the most any process needs (a
    global batch has one shape); `pack` itself on one process."""
    packing = pack(lengths, shapes, groups)
    if jax.process_count() == 1:
        return packing
    rows = int(hosts.gather(np.array([len(packing.rows)]), channel="train").max())
    return dataclasses.replace(packing, rows=packing.rows + ((),) * (rows - len(packing.rows)))


def pack(lengths: Sequence[int], shapes: PackShapes, groups: int = 1) -> Packing:
    """The packing of sequences of ``lengths`` tokens (0: left out of the rows) into rows of
    ``shapes`` (module docstring), sequence i in group i % ``groups``. Raises ValueError for a
    sequence longer than ``shapes.max_tokens``."""
    lengths = [int(n) for n in lengths]
    longest = max(lengths, default=0)
    if longest > shapes.max_tokens:
        raise ValueError(f"a sequence has {longest} tokens, more than the {shapes.max_tokens} a "
                         "packed row may hold")
    members = [list(range(g, len(lengths), groups)) for g in range(groups)]
    bins = [[[members[g][i] for i in b] for b in first_fit_decreasing(
        [lengths[i] for i in members[g]], shapes.max_tokens, shapes.segments)]
        for g in range(groups)]
    per_group = max(1, max(len(b) for b in bins))
    per_group = row_bucket(-(-per_group // shapes.row_multiple)) * shapes.row_multiple
    rows = [()] * (per_group * groups)
    for g, group_bins in enumerate(bins):
        for local, b in enumerate(group_bins):
            rows[local * groups + g] = tuple(b)
    return Packing(tuple(rows), shapes.max_tokens, shapes.segments)


def micro_batches(lengths: Sequence[int], shapes: PackShapes, rows: int,
                  sequences: int) -> list[Packing]:
    """The sequences of ``lengths`` tokens (0: left out) packed into micro-batches of one shape,
    as many as they need: each a `Packing` of exactly ``rows`` rows of ``shapes``, holding at most
    ``sequences`` sequences (at least ``shapes.segments``). Sequences go to rows first-fit
    decreasing, rows to micro-batches in that order; a micro-batch closes when its rows or its
    sequences are full. At least one micro-batch, empty when no sequence is. Raises ValueError
    for a sequence longer than ``shapes.max_tokens``."""
    if sequences < shapes.segments:
        raise ValueError(f"micro-batches of {sequences} sequences cannot hold a row of "
                         f"{shapes.segments}")
    lengths = [int(n) for n in lengths]
    if max(lengths, default=0) > shapes.max_tokens:
        raise ValueError(f"a sequence has {max(lengths)} tokens, more than the {shapes.max_tokens} "
                         "a packed row may hold")
    batches: list[list[tuple[int, ...]]] = [[]]
    for row in first_fit_decreasing(lengths, shapes.max_tokens, shapes.segments):
        if len(batches[-1]) == rows or sum(map(len, batches[-1])) + len(row) > sequences:
            batches.append([])
        batches[-1].append(tuple(row))
    return [Packing(tuple(b) + ((),) * (rows - len(b)), shapes.max_tokens, shapes.segments)
            for b in batches]


def pack_tokens(tokens: np.ndarray, lengths: Sequence[int], packing: Packing, pad_id: int) -> np.ndarray:
    """int32 `[rows, row_tokens]`: the first ``lengths[i]`` tokens of each row i of ``tokens``
    `[sequences, seq]` where ``packing`` places them, ``pad_id`` elsewhere."""
    out = np.full((len(packing.rows), packing.row_tokens), pad_id, np.int32)
    for i, (row, start) in enumerate(packing.places(lengths)):
        if row >= 0:
            out[row, start:start + lengths[i]] = tokens[i, :lengths[i]]
    return out


def gather_index(packing: Packing, lengths: Sequence[int], seq: int, groups: int = 1,
                 first_row: int = 0, order: Sequence[int] | None = None) -> np.ndarray:
    """int32 `[sequences, seq - 1]`: where the train step finds sequence i's per-target values
    (position t predicting token t + 1) among its micro-batch's packed ones `[rows, row_tokens
    - 1]` flattened. The step's micro-batch (or mini-batch, or row chunk) takes every
    ``groups``-th row, so row r is its micro-batch's row ``first_row + r // groups``
    (``first_row``: this process's first, when several feed one batch). ``order``: the
    sequences to index, one output row each in that order (default: all of ``lengths``).
    Positions past a sequence's end, and sequences left out, point at 0: their values are
    garbage, masked as one sequence per row masks them."""
    width = packing.row_tokens - 1
    places = packing.places(lengths)
    order = range(len(lengths)) if order is None else order
    out = np.zeros((len(order), seq - 1), np.int32)
    for k, i in enumerate(order):
        row, start = places[i]
        if row >= 0:
            n = lengths[i] - 1
            out[k, :n] = (first_row + row // groups) * width + start + np.arange(n)
    return out
