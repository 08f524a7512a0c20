"""RoC penalty and selection: closed forms, invariants, the released rule, the 1/penalty law."""
import collections
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from rstar2_jax.algorithms import (
    RULES,
    Rollouts,
    paper_penalty_terms,
    penalty_terms,
    released_penalty_terms,
    roc_penalty,
    roc_select,
    roc_select_batch,
    roc_selection,
)

select = jax.jit(roc_select, static_argnames=("group_size", "mode"))
# Many draws of the paper rule for one group, one key each.
draws = jax.jit(jax.vmap(roc_select, in_axes=(0, None, None, None, None)), static_argnums=(3, 4))


# --- penalty -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "calls, errors, answers, turns, p_err, p_format",
    [
        (0, 0, 1, 1, 0.5, 0.0),  # no tool call: p_err = 0.5; one answer: p_format = 0
        (4, 1, 1, 5, 0.25, 0.0),  # one call in four failed
        (3, 3, 1, 4, 1.0, 0.0),  # every call failed
        (2, 0, 0, 3, 0.0, 1.0),  # clean calls but no answer block
        (2, 2, 0, 3, 1.0, 1.0),  # worst case
        (3, 0, 2, 4, 0.0, 0.25),  # one extra answer block over four turns
        (3, 0, 4, 2, 0.0, 1.0),  # (4 - 1) / 2 capped at 1
        (5, 1, 3, 8, 0.2, 0.25),
    ],
)
def test_penalty_closed_form(calls, errors, answers, turns, p_err, p_format):
    terms = penalty_terms(calls, errors, answers, turns)
    assert [float(x) for x in terms] == pytest.approx([p_err, p_format], rel=1e-6)
    assert float(roc_penalty(calls, errors, answers, turns)) == pytest.approx(p_err + p_format, rel=1e-6)


def test_penalty_is_elementwise_and_jits():
    args = (jnp.array([0, 4, 2]), jnp.array([0, 1, 2]), jnp.array([1, 1, 0]), jnp.array([1, 5, 3]))
    np.testing.assert_allclose(jax.jit(roc_penalty)(*args), [0.5, 0.25, 2.0], rtol=1e-6)


def test_penalties_of_host_arrays_are_numpy_and_equal_the_jax_ones():
    rng = np.random.default_rng(0)
    calls = rng.integers(0, 6, 64)
    r = Rollouts.from_rewards(np.ones(64), tool_calls=calls, tool_errors=rng.integers(0, 7, 64) % (calls + 1),
                              tool_error_mentions=rng.integers(0, 7, 64) % (calls + 1),
                              answer_blocks=rng.integers(0, 4, 64), answer_tags=rng.integers(0, 8, 64),
                              turns=rng.integers(1, 7, 64))
    for terms in (paper_penalty_terms, released_penalty_terms):
        host, device = terms(r), terms(Rollouts(*(jnp.asarray(x) for x in r)))
        for h, d in zip(host, device, strict=True):
            assert isinstance(h, np.ndarray) and h.dtype == np.float32
            np.testing.assert_array_equal(h, np.asarray(d))


@pytest.mark.parametrize(
    "calls, errors, answers, turns, message",
    [(1, 2, 1, 1, "num_tool_errors"), (-1, 0, 1, 1, "num_tool_calls"), (1, 0, -1, 1, "num_answer_blocks"), (1, 0, 1, 0, "num_turns")],
)
def test_penalty_rejects_impossible_counts(calls, errors, answers, turns, message):
    with pytest.raises(ValueError, match=message):
        roc_penalty(calls, errors, answers, turns)


def rollouts(**fields):
    """A `Rollouts` of one shape; unnamed fields are a clean, correct one-turn rollout."""
    shape = np.shape(next(iter(fields.values())))
    defaults = dict(rewards=1.0, lengths=10, truncated=False, tool_calls=0, tool_errors=0,
                    tool_error_mentions=0, answer_blocks=1, answer_tags=2, turns=1)
    return Rollouts(**{k: np.broadcast_to(np.asarray(fields.get(k, v)), shape)
                       for k, v in defaults.items()})


@pytest.mark.parametrize(
    "counts, paper, released",
    [
        # A correct answer with no tool call: the released code does not count the first turn,
        # so p_format = 1 there (p_total 1.5) and 0 in the paper (0.5).
        (dict(), (0.5, 0.0), (0.5, 1.0)),
        # Two turns (one call), one answer: (1 - 1) / 1 in both.
        (dict(tool_calls=1, turns=2), (0.0, 0.0), (0.0, 0.0)),
        # A timeout failed but its response does not say "error": an error in the paper only.
        (dict(tool_calls=2, tool_errors=1, turns=3), (0.5, 0.0), (0.0, 0.0)),
        # A program that printed "error" and succeeded: an error for the released code only.
        (dict(tool_calls=2, tool_error_mentions=1, turns=3), (0.0, 0.0), (0.5, 0.0)),
        # Two answer blocks over three turns: 1/3 in the paper, 1/2 over the two later turns.
        (dict(tool_calls=2, answer_blocks=2, answer_tags=4, turns=3), (0.0, 1 / 3), (0.0, 0.5)),
        # An unpaired tag next to one closed block: the released code gives up (1.0).
        (dict(tool_calls=1, answer_tags=3, turns=2), (0.0, 0.0), (0.0, 1.0)),
        # No answer block: 1 in both.
        (dict(tool_calls=1, answer_blocks=0, answer_tags=0, turns=2), (0.0, 1.0), (0.0, 1.0)),
    ],
)
def test_penalty_counting_paper_and_released(counts, paper, released):
    r = rollouts(rewards=np.ones(1), **counts)
    for terms, expected in ((paper_penalty_terms(r), paper), (released_penalty_terms(r), released)):
        assert [float(t[0]) for t in terms] == pytest.approx(expected, rel=1e-6)
    assert RULES["paper"].penalty_terms is paper_penalty_terms
    assert RULES["released"].penalty_terms is released_penalty_terms


def test_roc_selection_filters_groups_and_uses_each_modes_penalties():
    # Question 0 has equal rewards (dropped). Question 1: 2G = 8 rollouts, 4 correct; positive 0
    # answered without the tool (paper 0.5, released 1.5), positive 1 had a timeout (paper 1.0,
    # released 0.0), positives 2 and 3 are clean two-turn rollouts (0 in both).
    g = 4
    rewards = np.array([[1.0] * 8, [1, 1, 1, 1, 0, 0, 0, 0]])
    calls = np.array([[1] * 8, [0, 1, 1, 1, 1, 1, 1, 1]])
    errors = np.array([[0] * 8, [0, 1, 0, 0, 0, 0, 0, 0]])
    turns = np.array([[2] * 8, [1, 2, 2, 2, 2, 2, 2, 2]])
    r = rollouts(rewards=rewards, tool_calls=calls, tool_errors=errors, turns=turns)
    # Released: 2 negatives, the first two (12, 13); 2 positives of lowest penalty, ties in
    # order: the timeout (9) and 10.
    released = roc_selection(jax.random.key(0), r, g, mode="released")
    np.testing.assert_array_equal(released.index, [[9, 10, 12, 13]])
    assert released.trains.all()
    # Paper: the two zero-penalty positives, then 2 of the 4 negatives at random.
    paper = roc_selection(jax.random.key(0), r, g, mode="paper")
    assert paper.index.shape == (1, g) and paper.trains.all()
    assert {10, 11} <= set(paper.index[0]) and set(paper.index[0]) - {10, 11} <= {12, 13, 14, 15}
    with pytest.raises(ValueError, match="G of the 2G"):
        roc_selection(jax.random.key(0), r, 3)


def random_step(rng, questions, g, equal_share):
    """`[questions, 2G]` rollouts with varied counts, ``equal_share`` of the questions all
    solved or all failed, and the keep mask of the equal-reward filter."""
    shape = (questions, 2 * g)
    solve = rng.random(questions)
    equal = rng.random(questions) < equal_share
    solve[equal] = rng.integers(0, 2, int(equal.sum()))
    calls = rng.integers(0, 4, shape)
    r = rollouts(rewards=(rng.random(shape) < solve[:, None]).astype(np.float32), tool_calls=calls,
                 tool_errors=rng.binomial(calls, 0.3), tool_error_mentions=rng.binomial(calls, 0.3),
                 answer_blocks=rng.integers(1, 3, shape), answer_tags=2 * rng.integers(1, 3, shape),
                 turns=calls + 1)
    return r, np.flatnonzero(r.rewards.max(axis=1) != r.rewards.min(axis=1))


@pytest.mark.parametrize("mode", ["paper", "released"])
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_roc_selection_is_the_batch_rule_on_the_kept_questions(mode, impl):
    # roc_selection computes every question's row in one program and keeps the kept ones; it
    # must select exactly what roc_select_batch selects from the kept questions alone (with
    # "rbg" keys it does the latter).
    rng = np.random.default_rng(0)
    for step in range(12):
        r, keep = random_step(rng, 10, 4, equal_share=step / 12)
        if not keep.size:
            continue
        key = jax.random.key(step, impl=impl)
        penalties = np.asarray(sum(RULES[mode].penalty_terms(r)))
        local = roc_select_batch(key, r.rewards[keep], penalties[keep], 4, mode)
        np.testing.assert_array_equal(roc_selection(key, r, 4, mode).index,
                                      keep[:, None] * 8 + np.asarray(local))


@pytest.mark.parametrize("mode", ["paper", "released"])
def test_roc_selection_compiles_nothing_for_a_new_kept_count(mode):
    # Each step keeps another number of questions; the selection's programs have the step's
    # [questions, 2G] shape only, so after the first step nothing is compiled (before: a vmapped
    # selection per kept count, ~1 s each on a CPU).
    from rstar2_jax.compile_cache import CompileCounter

    rng = np.random.default_rng(1)
    steps = [random_step(rng, 13, 4, equal_share) for equal_share in np.linspace(0.1, 0.9, 6)]
    assert len({keep.size for _, keep in steps}) >= 4
    roc_selection(jax.random.key(0), steps[0][0], 4, mode)
    with CompileCounter() as counter:
        for i, (r, _) in enumerate(steps):
            roc_selection(jax.random.key(i), r, 4, mode)
    assert (counter.stats.compiled, counter.stats.loaded) == (0, 0)


# --- selection: shared invariants ----------------------------------------------------------------

def group_strategy(max_group=8):
    """(G, rewards [2G], penalties [2G]) with ties and zero penalties."""
    return st.sampled_from([4, 5, max_group]).flatmap(
        lambda g: st.tuples(
            st.just(g),
            st.lists(st.sampled_from([0, 1]), min_size=2 * g, max_size=2 * g),
            st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 2.0]), min_size=2 * g, max_size=2 * g),
        )
    )


@settings(max_examples=60, deadline=None)
@given(group_strategy(), st.sampled_from(["paper", "released"]), st.integers(0, 2**31 - 1))
def test_selection_keeps_g_distinct_indices_with_the_right_quotas(group, mode, seed):
    g, rewards, penalties = group
    rewards, penalties = np.array(rewards), np.array(penalties, np.float32)
    kept = np.asarray(select(jax.random.key(seed), rewards, penalties, group_size=g, mode=mode))
    assert kept.shape == (g,) and len(set(kept)) == g
    assert np.all(np.diff(kept) > 0) and kept.min() >= 0 and kept.max() < 2 * g
    num_neg = int(np.sum(rewards == 0))
    kept_neg = int(np.sum(rewards[kept] == 0))
    if mode == "paper":
        assert kept_neg == paper_negative_quota(num_neg, g)
    else:
        assert kept_neg == released_negative_quota(num_neg, g)
    # Within the positives: "paper" keeps zero-penalty ones first, "released" the lowest penalties.
    kept_pos = np.isin(np.arange(2 * g), kept) & (rewards == 1)
    dropped_pos = ~np.isin(np.arange(2 * g), kept) & (rewards == 1)
    if kept_pos.any() and dropped_pos.any():
        if mode == "released":
            assert penalties[kept_pos].max() <= penalties[dropped_pos].min()
        elif np.any(penalties[dropped_pos] == 0):
            assert np.all(penalties[kept_pos] == 0)


def paper_negative_quota(num_neg, g):
    """The paper rule's negative quota, written from its docstring: half the negatives rounded
    down, positives the rest, and at least one of each class that is present."""
    neg = num_neg // 2
    if num_neg > 0 and neg == 0:
        neg = 1
    if num_neg < 2 * g and neg == g:
        neg = g - 1
    return neg


@pytest.mark.parametrize("mode, g", [("paper", 2), ("paper", 3), ("paper", 4), ("paper", 5),
                                     ("paper", 16), ("released", 4), ("released", 5),
                                     ("released", 8), ("released", 16)])
def test_every_split_of_2g_keeps_g_and_both_classes(mode, g):
    """k correct out of 2G for every k = 0..2G: G distinct rollouts are kept, the quota of each
    class is the rule's, and whenever the 2G hold both classes the kept G hold both."""
    rng = np.random.default_rng(g)
    quota = paper_negative_quota if mode == "paper" else released_negative_quota
    for num_pos in range(2 * g + 1):
        rewards = rng.permutation(np.r_[np.ones(num_pos, int), np.zeros(2 * g - num_pos, int)])
        penalties = rng.choice([0.0, 0.25, 0.5, 1.0, 1.5, 2.0], size=2 * g).astype(np.float32)
        kept = np.asarray(select(jax.random.key(num_pos), rewards, penalties, group_size=g, mode=mode))
        assert len(set(kept)) == g, (num_pos, kept)
        kept_neg = int(np.sum(rewards[kept] == 0))
        assert kept_neg == quota(2 * g - num_pos, g), num_pos
        if 0 < num_pos < 2 * g:
            assert 0 < kept_neg < g, f"{num_pos} correct of {2 * g}: kept {kept_neg} wrong of {g}"


def test_paper_rule_keeps_the_only_wrong_rollout():
    # The paper's setting, 31 correct and 1 wrong: floor(1 / 2) = 0 would keep 16 correct
    # rollouts with advantage 0; the wrong one is kept instead.
    rewards = np.r_[np.ones(31, int), 0]
    for seed in range(5):
        kept = np.asarray(select(jax.random.key(seed), rewards, np.ones(32, np.float32), group_size=16))
        assert 31 in kept and len(set(kept)) == 16


def released_negative_quota(num_neg, g):
    """The released rule's negative quota, written from the released code's description."""
    num_pos = 2 * g - num_neg
    neg, pos = round(num_neg / 2), round(num_pos / 2)  # Python round: half to even
    if neg <= min(2, num_neg):
        neg = min(2, num_neg)
        pos = g - neg
    if pos <= min(2, num_pos):
        pos = min(2, num_pos)
        neg = g - pos
    return neg if neg + pos == g else g - pos  # odd G: positives take the rest (our documented choice)


def released_oracle(rewards, penalties, g):
    """The released code's selection, transcribed with Python lists (for even G)."""
    pairs = list(zip(range(len(rewards)), rewards, penalties))
    negatives = [i for i, r, _ in pairs if r <= 0]
    positives = [i for i, _, _ in sorted(((i, r, p) for i, r, p in pairs if r > 0), key=lambda x: x[2])]
    n_neg = released_negative_quota(len(negatives), g)
    return sorted(positives[: g - n_neg] + negatives[:n_neg])


@pytest.mark.parametrize("g", [4, 8, 16])
def test_released_rule_matches_transcription_for_every_split(g):
    rng = np.random.default_rng(g)
    for num_pos in range(2 * g + 1):
        rewards = rng.permutation(np.r_[np.ones(num_pos, int), np.zeros(2 * g - num_pos, int)])
        penalties = rng.choice([0.0, 0.25, 0.5, 1.0, 1.5], size=2 * g).astype(np.float32)
        kept = select(jax.random.key(0), rewards, penalties, group_size=g, mode="released")
        np.testing.assert_array_equal(kept, released_oracle(rewards, penalties, g), err_msg=f"{num_pos=}")


def test_released_rule_examples_from_the_paper_setting():
    # G = 16: 31 correct + 1 wrong keeps 1 negative and 15 positives; 30 + 2 keeps 2 and 14;
    # 17 + 15 has quotas round(7.5) = 8 negatives and round(8.5) = 8 positives.
    for num_neg, expected_neg in [(1, 1), (2, 2), (15, 8), (17, 8), (3, 2), (0, 0), (32, 16)]:
        rewards = np.r_[np.zeros(num_neg, int), np.ones(32 - num_neg, int)]
        kept = select(jax.random.key(0), rewards, np.zeros(32, np.float32), group_size=16, mode="released")
        assert int(np.sum(rewards[np.asarray(kept)] == 0)) == expected_neg, num_neg


def test_released_rule_is_deterministic_and_stable():
    rewards = np.array([1, 0, 1, 1, 0, 0, 1, 1])
    penalties = np.array([0.5, 9.0, 0.5, 0.0, 9.0, 0.0, 0.5, 2.0], np.float32)
    # 3 negatives: quota round(1.5) = 2; 5 positives: lowest penalties 0.0 (index 3) then the
    # first 0.5 (index 0). Negatives: the first two in rollout order whatever their penalties.
    for seed in range(3):
        kept = select(jax.random.key(seed), rewards, penalties, group_size=4, mode="released")
        np.testing.assert_array_equal(kept, [0, 1, 3, 4])


def test_all_positive_and_all_negative_groups_keep_g():
    g = 4
    for mode in ("paper", "released"):
        penalties = np.array([0.5, 2.0, 0.0, 1.0, 0.25, 1.5, 0.75, 0.0], np.float32)
        all_neg = select(jax.random.key(1), np.zeros(2 * g, int), penalties, group_size=g, mode=mode)
        assert len(set(np.asarray(all_neg))) == g
        all_pos = np.asarray(select(jax.random.key(1), np.ones(2 * g, int), penalties, group_size=g, mode=mode))
        assert len(set(all_pos)) == g and {2, 7} <= set(all_pos)  # the zero-penalty ones
    released = select(jax.random.key(1), np.ones(2 * g, int), penalties, group_size=g, mode="released")
    np.testing.assert_array_equal(released, [0, 2, 4, 7])  # penalties 0.5, 0.0, 0.25, 0.0


def test_batch_matches_per_question_calls():
    key = jax.random.key(3)
    rewards = jax.random.bernoulli(jax.random.key(4), 0.5, (6, 8)).astype(jnp.int32)
    penalties = jax.random.uniform(jax.random.key(5), (6, 8), maxval=2.0)
    for mode in ("paper", "released"):
        batch = roc_select_batch(key, rewards, penalties, 4, mode)
        keys = jax.random.split(key, 6)
        for q in range(6):
            np.testing.assert_array_equal(batch[q], select(keys[q], rewards[q], penalties[q], group_size=4, mode=mode))


@pytest.mark.parametrize(
    "rewards, penalties, g, mode, message",
    [
        (np.ones(6), np.ones(6), 4, "paper", "shape"),
        (np.ones(8), np.ones(7), 4, "paper", "shape"),
        (np.full(8, 0.5), np.ones(8), 4, "paper", "binary"),
        (np.ones(8), np.full(8, -0.1), 4, "paper", "penalties"),
        (np.ones(8), np.full(8, np.nan), 4, "paper", "penalties"),
        (np.ones(6), np.ones(6), 3, "released", "group_size >= 4"),
        (np.ones(2), np.ones(2), 1, "paper", "group_size >= 2"),
        (np.ones(8), np.ones(8), 4, "best", "mode"),
    ],
)
def test_selection_rejects_bad_input(rewards, penalties, g, mode, message):
    with pytest.raises(ValueError, match=message):
        roc_select(jax.random.key(0), rewards, penalties, g, mode)
    with pytest.raises(ValueError, match=message):
        roc_select_batch(jax.random.key(0), rewards[None], penalties[None], g, mode)


# --- the paper rule's distribution ---------------------------------------------------------------

def sequential_subset_probabilities(weights, k):
    """Probability of each k-subset when drawing k items one by one without replacement, each draw
    proportional to `weights` among the items left (enumerating every ordered draw)."""
    probs = {}
    for order in itertools.permutations(range(len(weights)), k):
        p, left = 1.0, float(np.sum(weights))
        for i in order:
            p *= weights[i] / left
            left -= weights[i]
        key = tuple(sorted(order))
        probs[key] = probs.get(key, 0.0) + p
    return probs


def chi_square_p_value(samples, probs):
    subsets = sorted(probs)
    counts = collections.Counter(samples)
    observed = np.array([counts[s] for s in subsets])
    assert observed.sum() == len(samples), "a subset outside the support was drawn"
    expected = np.array([probs[s] for s in subsets])
    np.testing.assert_allclose(expected.sum(), 1.0, rtol=1e-9)
    return stats.chisquare(observed, expected / expected.sum() * len(samples)).pvalue


NUM_DRAWS = 20_000


@functools.cache
def paper_draws():
    """G = 5 from 10 rollouts: 6 positives (keep ceil(6/2) = 3) and 4 negatives (keep 2)."""
    rewards = np.array([1, 0, 1, 1, 0, 1, 1, 0, 1, 0])
    penalties = np.array([0.2, 2.0, 0.5, 1.0, 0.0, 1.5, 2.0, 0.3, 0.5, 1.0], np.float32)
    keys = jax.random.split(jax.random.key(2024), NUM_DRAWS)
    return rewards, penalties, np.asarray(draws(keys, rewards, penalties, 5, "paper"))


def test_paper_positives_follow_the_inverse_penalty_law():
    # Chi-square goodness of fit of the kept positive 3-subsets (20 cells) against exact
    # sequential 1/penalty sampling; with a fixed seed the test is deterministic, and a correct
    # sampler falls below p = 1e-3 only one seed in a thousand.
    rewards, penalties, kept = paper_draws()
    positives = np.flatnonzero(rewards == 1)
    probs = sequential_subset_probabilities(1.0 / penalties[positives].astype(np.float64), 3)
    samples = [tuple(np.flatnonzero(np.isin(positives, row))) for row in kept]
    assert chi_square_p_value(samples, probs) > 1e-3


def test_paper_positive_frequencies_are_not_uniform_or_top_k():
    # The same draws distinguish the law from its neighbours: the least-penalised positive
    # (index 0, p = 0.2) is kept more often than the most penalised (index 6, p = 2.0), but the
    # latter is still kept sometimes (not deterministic top-k).
    _, _, kept = paper_draws()
    freq = np.mean(kept[:, :, None] == np.arange(10), axis=(0, 1)) * kept.shape[1]
    assert freq[0] > 0.8 and 0.1 < freq[6] < 0.5


def test_paper_negatives_are_uniform_whatever_their_penalty():
    rewards, _, kept = paper_draws()
    negatives = np.flatnonzero(rewards == 0)
    probs = {s: 1 / 6 for s in itertools.combinations(range(4), 2)}
    samples = [tuple(np.flatnonzero(np.isin(negatives, row))) for row in kept]
    assert chi_square_p_value(samples, probs) > 1e-3


def test_paper_zero_penalty_positives_are_kept_first_and_uniformly():
    # 4 zero-penalty positives and a quota of ceil(6 / 2) = 3: only zero-penalty ones are kept,
    # each 3-subset of them with probability 1/4.
    rewards = np.array([1, 1, 1, 1, 1, 1, 0, 0])
    penalties = np.array([0.0, 0.0, 0.01, 0.0, 0.0, 0.01, 1.0, 1.0], np.float32)
    keys = jax.random.split(jax.random.key(7), 4000)
    kept = np.asarray(draws(keys, rewards, penalties, 4, "paper"))
    zero = np.array([0, 1, 3, 4])
    samples = [tuple(np.flatnonzero(np.isin(zero, row))) for row in kept]
    assert np.all(np.isin(kept, np.r_[zero, 6, 7]))
    assert chi_square_p_value(samples, {s: 1 / 4 for s in itertools.combinations(range(4), 3)}) > 1e-3
