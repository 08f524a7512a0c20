"""The named algorithms, each through the seam (select -> advantages -> loss) against closed
forms, and the registry a config resolves ``rl.algorithm`` with."""
import dataclasses
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2_jax.algorithms import (
    ALGORITHMS,
    CISPO,
    DAPO,
    DR_GRPO,
    DR_GRPO_NORM,
    GMPO,
    GPG,
    GRPO,
    GRPO_ROC,
    GRPO_ROC_RELEASED,
    GSPO,
    REINFORCE_PP_BASELINE,
    RLOO,
    SAPO,
    Algorithm,
    Rollouts,
    aggregate,
    cispo_loss,
    gmpo_loss,
    gpg_loss,
    gspo_loss,
    algorithm_spec,
    resolve_algorithm,
    sapo_loss,
)


def rollouts(rewards, truncated=None):
    """Clean two-turn rollouts (one tool call, one answer) with these rewards `[questions, n]`."""
    return Rollouts.from_rewards(rewards, lengths=10, tool_calls=1, turns=2,
                                 truncated=False if truncated is None else truncated)


def run(algorithm, r, group_size):
    selection = algorithm.select(jax.random.key(0), r, group_size)
    return selection, np.asarray(algorithm.advantages(r.take(selection.index)))


def on_policy_loss(algorithm, advantages, lengths):
    """The loss (sum / count) with logp = old_logp, one row per rollout of the given length."""
    mask = np.arange(max(lengths))[None, :] < np.asarray(lengths)[:, None]
    logp = jnp.full(mask.shape, -1.0)
    loss_sum, count, _ = algorithm.loss(logp, logp, jnp.asarray(advantages, jnp.float32), mask)
    return float(loss_sum) / float(count)


REWARDS = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]]  # question 1 has equal rewards


def test_grpo_keeps_every_rollout_of_mixed_groups_with_std_normalised_advantages():
    selection, adv = run(GRPO, rollouts(REWARDS), group_size=2)  # group_size is not used
    np.testing.assert_array_equal(selection.index, [[0, 1, 2, 3], [8, 9, 10, 11]])
    assert selection.trains.all()
    # [1, 0, 0, 0]: mean 1/4, sample std 1/2; [0, 1, 1, 0]: mean 1/2, sample std sqrt(1/3).
    np.testing.assert_allclose(adv[0], [1.5, -0.5, -0.5, -0.5], rtol=1e-5)
    np.testing.assert_allclose(adv[1], np.array([-1, 1, 1, -1]) * 0.5 / np.sqrt(1 / 3), rtol=1e-5)
    # Token mean on policy: -sum_i A_i |o_i| / sum_i |o_i|.
    lengths = [1, 2, 3, 4]
    expected = -np.dot(adv[0], lengths) / sum(lengths)
    assert on_policy_loss(GRPO, adv[0], lengths) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("algorithm", [GRPO_ROC, GRPO_ROC_RELEASED], ids=["paper", "released"])
def test_grpo_roc_keeps_g_of_2g_and_normalises_over_the_kept_group(algorithm):
    # 7 correct and 1 wrong of 2G = 8: both rules keep the wrong one and 3 correct; over the kept
    # [1, 1, 1, 0], mean 3/4 and sample std 1/2, so A = +1/2 and -3/2.
    selection, adv = run(algorithm, rollouts([[1, 1, 1, 1, 1, 1, 1, 0], [0] * 8]), group_size=4)
    assert selection.index.shape == (1, 4) and 7 in selection.index[0]
    expected = np.where(selection.index[0] == 7, -1.5, 0.5)
    np.testing.assert_allclose(adv[0], expected, rtol=1e-5)
    assert algorithm.loss is GRPO.loss  # the clipped token mean


def test_dr_grpo_centres_without_std_and_sums_tokens_per_sequence():
    selection, adv = run(DR_GRPO, rollouts(REWARDS), group_size=4)
    np.testing.assert_allclose(adv, [[0.75, -0.25, -0.25, -0.25], [-0.5, 0.5, 0.5, -0.5]], rtol=1e-6)
    # 1/G sum_i sum_t (-A_i) on policy: no 1/|o_i|, so a long rollout weighs more.
    lengths = [1, 2, 3, 4]
    expected = -np.dot(adv[0], lengths) / 4
    assert on_policy_loss(DR_GRPO, adv[0], lengths) == pytest.approx(expected, rel=1e-6)


def test_gspo_uses_grpo_advantages_and_the_sequence_level_loss():
    _, adv = run(GSPO, rollouts(REWARDS), group_size=4)
    np.testing.assert_allclose(adv, run(GRPO, rollouts(REWARDS), 4)[1], rtol=1e-6)
    assert GSPO.loss is gspo_loss
    # On policy every s_i = 1: the loss is the mean over sequences of -A_i, whatever the lengths.
    assert on_policy_loss(GSPO, adv[0], [1, 2, 3, 4]) == pytest.approx(-np.mean(adv[0]), abs=1e-6)


def test_dapo_masks_truncated_rollouts_but_keeps_them_in_the_group_statistics():
    truncated = np.zeros((3, 4), bool)
    truncated[2, 0] = True  # a wrong, truncated rollout of question 2
    selection, adv = run(DAPO, rollouts(REWARDS, truncated), group_size=4)
    np.testing.assert_array_equal(selection.index, [[0, 1, 2, 3], [8, 9, 10, 11]])
    np.testing.assert_array_equal(selection.trains, [[1, 1, 1, 1], [0, 1, 1, 1]])
    # Question 2's advantages are those of all four rewards [0, 1, 1, 0], the truncated included.
    np.testing.assert_allclose(adv[1], np.array([-1, 1, 1, -1]) * 0.5 / np.sqrt(1 / 3), rtol=1e-5)
    assert DAPO.loss is GRPO.loss  # token-level, Clip-Higher 0.2 / 0.28


def test_dr_grpo_norm_divides_token_sums_by_the_row_length():
    selection, adv = run(DR_GRPO_NORM, rollouts(REWARDS), group_size=4)
    np.testing.assert_allclose(adv, run(DR_GRPO, rollouts(REWARDS), 4)[1])
    # Rows padded to 4 positions: mean over sequences of (-A_i |o_i| / 4).
    lengths = [1, 2, 3, 4]
    expected = -np.dot(adv[0], lengths) / 4 / 4
    assert on_policy_loss(DR_GRPO_NORM, adv[0], lengths) == pytest.approx(expected, rel=1e-6)


def test_rloo_leaves_one_out_and_sums_tokens_per_sequence():
    selection, adv = run(RLOO, rollouts(REWARDS), group_size=4)
    np.testing.assert_array_equal(selection.index, [[0, 1, 2, 3], [8, 9, 10, 11]])
    np.testing.assert_allclose(adv[0], [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)
    # REINFORCE on each sequence's log-probability: token sums, mean over sequences.
    lengths = [1, 2, 3, 4]
    assert on_policy_loss(RLOO, adv[0], lengths) == pytest.approx(-np.dot(adv[0], lengths) / 4, rel=1e-6)


def test_reinforce_pp_baseline_keeps_every_group_and_whitens_over_tokens():
    selection, adv = run(REINFORCE_PP_BASELINE, rollouts(REWARDS), group_size=4)
    np.testing.assert_array_equal(selection.index, np.arange(12).reshape(3, 4))  # equal group kept
    assert selection.trains.all()
    # Equal lengths (10 tokens): whitening over the 120 tokens is over rollouts, each 10 times.
    # (The equal-reward group gets -mu / std, 0 here where mu is 0; unequal lengths make it
    # nonzero: test_algorithms_advantages.)
    centred = np.array(REWARDS, float) - np.mean(REWARDS, axis=1, keepdims=True)
    expected = (centred - centred.mean()) / np.sqrt(centred.var(ddof=0) * 120 / 119 + 1e-8)
    np.testing.assert_allclose(adv, expected, rtol=1e-5)
    assert REINFORCE_PP_BASELINE.loss is GRPO.loss


def test_gpg_keeps_every_group_and_scales_by_alpha():
    selection, adv = run(GPG, rollouts(REWARDS), group_size=4)
    assert selection.index.shape == (3, 4)
    centred = np.array(REWARDS, float) - np.mean(REWARDS, axis=1, keepdims=True)
    np.testing.assert_allclose(adv, centred * 12 / 8, rtol=1e-6)
    assert GPG.loss is gpg_loss


@pytest.mark.parametrize("algorithm, loss", [(CISPO, cispo_loss), (GMPO, gmpo_loss), (SAPO, sapo_loss)])
def test_cispo_gmpo_and_sapo_use_grpo_advantages(algorithm, loss):
    selection, adv = run(algorithm, rollouts(REWARDS), group_size=4)
    grpo_selection, grpo_adv = run(GRPO, rollouts(REWARDS), group_size=4)
    np.testing.assert_array_equal(selection.index, grpo_selection.index)
    np.testing.assert_allclose(adv, grpo_adv, rtol=1e-6)
    assert algorithm.loss is loss


def test_every_named_algorithm_resolves_to_itself():
    assert set(ALGORITHMS) == {"grpo", "grpo_roc", "grpo_roc_released", "dr_grpo", "gspo", "dapo",
                               "dr_grpo_norm", "rloo", "reinforce_plus_plus_baseline", "cispo", "gpg",
                               "gmpo", "sapo"}
    for name, algorithm in ALGORITHMS.items():
        assert resolve_algorithm(name) is algorithm


def test_an_import_path_resolves_user_code(tmp_path, monkeypatch):
    (tmp_path / "my_algorithms.py").write_text(textwrap.dedent("""
        import dataclasses
        from rstar2_jax.algorithms import GRPO_ROC

        def centred(kept):
            return kept.rewards - kept.rewards.mean(axis=-1, keepdims=True)

        MINE = dataclasses.replace(GRPO_ROC, advantages=centred)
        NOT_ONE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    mine = resolve_algorithm("my_algorithms:MINE")
    assert isinstance(mine, Algorithm) and mine.select is GRPO_ROC.select
    # ... and back: the name a run records for an algorithm it was given by value.
    assert algorithm_spec(mine) == "my_algorithms:MINE"
    assert algorithm_spec(GRPO_ROC_RELEASED) == "grpo_roc_released"
    assert algorithm_spec(dataclasses.replace(mine, loss=gspo_loss)) is None  # nothing names it
    for spec, message in [("nope", "unknown algorithm 'nope'.*grpo_roc"),
                          ("no_such_module_xyz:X", "cannot import module 'no_such_module_xyz'"),
                          ("my_algorithms:OTHER", "has no 'OTHER'"),
                          ("my_algorithms:NOT_ONE", "is a int, not an")]:
        with pytest.raises(ValueError, match=message):
            resolve_algorithm(spec)
    sys.modules.pop("my_algorithms", None)


def test_a_variant_is_a_frozen_value():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GRPO.loss = gspo_loss  # type: ignore[misc]


def test_rollouts_from_rewards_describe_clean_rollouts_unless_told_otherwise():
    r = Rollouts.from_rewards([[1, 0], [0, 0]], tool_calls=[[2, 0], [1, 1]], truncated=True)
    assert r.rewards.dtype == np.float32 and all(np.shape(field) == (2, 2) for field in r)
    np.testing.assert_array_equal(r.tool_calls, [[2, 0], [1, 1]])
    assert r.truncated.all() and (r.tool_errors == 0).all() and (r.tool_error_mentions == 0).all()
    assert (r.lengths == 1).all() and (r.turns == 1).all()
    assert (r.answer_blocks == 1).all() and (r.answer_tags == 2).all()
    with pytest.raises(TypeError, match=r"no field\(s\) \['reward'\]"):
        Rollouts.from_rewards([[1.0]], reward=1)


def test_a_per_token_term_added_to_a_sequence_mean_loss_with_aggregate():
    # Rows of 1 and 3 loss tokens, a per-token term of 1 on the first row's token and 2 on each
    # of the second's: under seq-mean-token-mean the mean is (1 / 1 + 6 / 3) / 2 = 1.5.
    mask = jnp.array([[True, False, False], [True, True, True]])
    term = jnp.where(mask, jnp.array([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]]), 0.0)
    loss_sum, count, total = aggregate(term, mask, "seq-mean-token-mean")
    assert float(loss_sum) / int(count) == pytest.approx(1.5) and int(count) == 2
    assert float(total(jnp.ones_like(term))) / int(count) == pytest.approx(1.0)
