"""RL update on a prepared batch: sharded == single device, padding-invariance, metrics, the
rollout correction, the check before the first optimizer step, the entropy bonus, KL penalty
and reference policy (nothing changes while they are off), and packed rows == one rollout per
row for every loss."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2_jax.algorithms import (ALGORITHMS, GRPO_ROC, RolloutCorrection, gspo_loss, policy_loss,
                                   regularized, resolve_algorithm)
from rstar2_jax.compile_cache import CompileCounter
from rstar2_jax.errors import ConfigError
from rstar2_jax.model import ModelConfig, init_params, token_logprobs
from rstar2_jax.parallel.sharding import make_mesh, param_specs, shard_params
from rstar2_jax.train.configs import OptimizerConfig, RLConfig
from rstar2_jax.train.optim import make_optimizer
from rstar2_jax.rl import update as rl_update
from rstar2_jax.train.packing import PackShapes
from rstar2_jax.rl.update import RLUpdate
from rstar2_jax.train.step import init_train_state, make_train_step

MODEL = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
SEQ, PROMPT = 24, 5


def _batch(rows, seed=0, sampler_offset=0.0, seq=SEQ, lengths=None):
    """Rollouts with a 5-token prompt, generated tokens of random length (or of ``lengths``,
    prompt included), right padding to ``seq``. ``sampler_offset``: nats added to the trainer's
    log-probs to make the sampler's, a number or an array ``[rows, seq - 1]``."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, MODEL.vocab_size, (rows, seq)).astype(np.int32)
    if lengths is None:
        lengths = rng.integers(PROMPT + 2, seq + 1, rows)
    positions = np.arange(seq)[None]
    attention = (positions < lengths[:, None]).astype(np.int32)
    loss_mask = attention * (positions >= PROMPT)
    # The sampler's log-probs: the trainer's own, shifted by `sampler_offset` nats.
    params = init_params(MODEL, jax.random.key(0))
    logp = np.asarray(token_logprobs(params, MODEL, tokens[:, :-1], tokens[:, 1:], attention[:, :-1]))
    sampler_logp = np.zeros((rows, seq), np.float32)
    sampler_logp[:, 1:] = logp + sampler_offset
    advantages = rng.normal(size=rows).astype(np.float32)
    return {"tokens": tokens, "attention_mask": attention, "loss_mask": loss_mask.astype(np.int32),
            "advantages": advantages, "sampler_logp": sampler_logp}


def _update(batch, mesh, steps=1, lr=3e-2, loss=None, eps=1e-8, **rl):
    """``steps`` updates with ``loss``, by default the loss of the algorithm ``rl`` names."""
    config = RLConfig(**rl)
    loss = resolve_algorithm(config.algorithm).loss if loss is None else loss
    opt = make_optimizer(OptimizerConfig(lr=lr, warmup_steps=1, eps=eps), total_steps=10)
    specs = param_specs(MODEL, mesh)
    params = shard_params(init_params(MODEL, jax.random.key(0)), MODEL, mesh)
    state = init_train_state(params, opt, mesh=mesh, param_specs=specs)
    update = RLUpdate(MODEL, config, opt, mesh=mesh, param_specs=specs, params=params, loss=loss)
    for _ in range(steps):
        state, metrics = update(state, batch)
    return state, metrics


def test_sharded_matches_single_device_with_padding():
    batch = _batch(14)
    # 1 device: 7 rows per update, no padding. 4 x 2 mesh: padded to 16 rows, 2 micro-batches.
    # Adam moves every weight by about lr whatever its gradient, so a weight whose gradient is
    # at the level of float summation-order noise moves by up to lr in either run: lr 1e-3
    # keeps that under the 1e-5 we compare at (lr 3e-2 gave one such weight of 4096 at 1.6e-5).
    single, m1 = _update(batch, make_mesh(1, 1), lr=1e-3, mini_batches=2)
    sharded, m8 = _update(batch, make_mesh(4, 2), lr=1e-3, mini_batches=2, micro_batch_size=4)
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert m1.keys() == m8.keys()
    for k in m1:
        assert m1[k] == pytest.approx(m8[k], rel=1e-4, abs=1e-6), k
    assert m1["tokens"] == batch["loss_mask"][:, 1:].sum()


@pytest.mark.parametrize("packed", [True, False])
def test_steps_that_keep_other_rollouts_compile_nothing_new(packed):
    # A step's rows: the kept rollouts first, then rows with no loss token; the update's
    # programs are the micro-batch's and the layout's, whatever a step keeps.
    mesh = make_mesh(1, 1)
    config = RLConfig(packed=packed, mini_batches=2, micro_batch_size=2)
    opt = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=1), total_steps=10)
    specs = param_specs(MODEL, mesh)
    params = shard_params(init_params(MODEL, jax.random.key(0)), MODEL, mesh)
    state = init_train_state(params, opt, mesh=mesh, param_specs=specs)
    update = RLUpdate(MODEL, config, opt, mesh=mesh, param_specs=specs, params=params, loss=GRPO_ROC.loss)
    assert sum(update.programs().values()) == 6

    def kept(n, seed):
        batch = _batch(12, seed=seed)
        batch["loss_mask"][n:] = 0
        return batch

    state, _ = update(state, kept(3, 0))
    with CompileCounter() as counter:
        for n, seed in ((12, 1), (1, 2), (7, 3)):
            state, metrics = update(state, kept(n, seed))
            assert metrics["tokens"] == kept(n, seed)["loss_mask"][:, 1:].sum()
    assert counter.stats.compiled + counter.stats.loaded == 0, counter.stats.programs
    assert int(state.step) == 8


def test_metrics_of_one_and_two_mini_batches():
    batch = _batch(8, sampler_offset=-0.1)
    expected = {"loss", "tokens", "grad_norm", "lr", "clip_low_frac", "clip_high_frac", "approx_kl",
                "ratio_mean", "ratio_max", "entropy", "logprob_mismatch/abs", "logprob_mismatch/kl",
                "logprob_mismatch/log_ppl_diff", "logprob_mismatch/log_ppl_abs_diff",
                "logprob_mismatch/ratio_max", "logprob_mismatch/ratio_min", "update/skipped_nonfinite"}
    state, one = _update(batch, make_mesh(1, 1), mini_batches=1)
    assert set(one) == expected and all(np.isfinite(v) for v in one.values())
    # One update from freshly recomputed old log-probs: the ratio is exactly 1.
    assert one["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert one["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert one["clip_low_frac"] == one["clip_high_frac"] == 0.0
    # The sampler was 0.1 nats below the trainer on every generated token.
    assert one["logprob_mismatch/abs"] == pytest.approx(0.1, rel=1e-4)
    assert one["logprob_mismatch/kl"] == pytest.approx(np.exp(0.1) - 0.1 - 1, rel=1e-3)
    assert one["logprob_mismatch/log_ppl_diff"] == pytest.approx(-0.1, rel=1e-4)
    assert one["logprob_mismatch/ratio_max"] == pytest.approx(np.exp(0.1), rel=1e-4)
    assert one["logprob_mismatch/ratio_min"] == pytest.approx(np.exp(0.1), rel=1e-4)
    assert 0 < one["entropy"] <= np.log(MODEL.vocab_size) + 1e-5
    assert int(state.step) == 1

    # The second of two updates sees a moved policy: the ratio leaves 1.
    state, two = _update(batch, make_mesh(1, 1), mini_batches=2)
    assert int(state.step) == 2
    assert two["approx_kl"] > 1e-6 and two["ratio_max"] > 1.0


def test_bad_batches_are_rejected():
    batch = _batch(4)
    with pytest.raises(ValueError, match="advantages must be"):
        _update(batch | {"advantages": batch["advantages"][:2]}, make_mesh(1, 1))
    with pytest.raises(ValueError, match="no generated token"):
        _update(batch | {"loss_mask": np.zeros_like(batch["loss_mask"])}, make_mesh(1, 1))
    with pytest.raises(ValueError, match="padding"):
        _update(batch | {"loss_mask": np.ones_like(batch["loss_mask"])}, make_mesh(1, 1))


@pytest.mark.parametrize("loss, sums_tokens", [
    (functools.partial(policy_loss, loss_agg_mode="seq-mean-token-mean"), False),
    (functools.partial(policy_loss, loss_agg_mode="seq-mean-token-sum"), True),
    (gspo_loss, False),
], ids=["seq-mean-token-mean", "seq-mean-token-sum", "gspo"])
def test_a_sequence_level_loss_logs_its_metrics_over_sequences(loss, sums_tokens):
    # The loss swapped by value. Its count is sequences, and its metric sums are per sequence:
    # on policy the ratio is exactly 1 whatever the count (dividing token sums by a sequence
    # count would log tokens / sequences), and `tokens` is still the step's loss tokens.
    batch = _batch(8)
    _, m = _update(batch, make_mesh(1, 1), loss=loss, micro_batch_size=2)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert m["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert m["clip_low_frac"] == m["clip_high_frac"] == 0.0
    lengths = batch["loss_mask"][:, 1:].sum(axis=1)
    assert m["tokens"] == lengths.sum()
    # On policy the loss is the mean over sequences of -A_i, times the sequence's loss tokens
    # when the loss sums them.
    expected = -np.mean(batch["advantages"] * (lengths if sums_tokens else 1))
    assert m["loss"] == pytest.approx(expected, rel=1e-4)


def test_rollout_correction_weights_and_masks_what_the_loss_receives():
    # The sampler is 0.1 nats above the trainer on even positions and 1.0 below on odd ones:
    # token ratios trainer/sampler exp(-0.1) and e. Token TIS capped at 2 weighs them
    # exp(-0.1) and 2 (the odd ones truncated); a token mask [0.5, 2] drops the odd ones.
    batch = _batch(8)
    positions = np.arange(SEQ - 1)[None, :]
    offsets = np.where(positions % 2 == 0, 0.1, -1.0)
    batch["sampler_logp"][:, 1:] += offsets
    mask = batch["loss_mask"][:, 1:].astype(bool)
    even = mask & (positions % 2 == 0)
    weights = np.broadcast_to(np.where(positions % 2 == 0, np.exp(-0.1), 2.0), mask.shape)
    adv = batch["advantages"][:, None]

    _, m = _update(batch, make_mesh(1, 1), rollout_correction=RolloutCorrection(weights="token"))
    assert m["rollout_correction/weight_mean"] == pytest.approx(weights[mask].mean(), rel=1e-5)
    assert m["rollout_correction/truncated_frac"] == pytest.approx(1 - even.sum() / mask.sum(), rel=1e-6)
    assert "rollout_correction/masked_frac" not in m
    # On policy the token-mean loss is -sum(A w) / tokens.
    expected = -np.sum((adv * weights)[mask]) / mask.sum()
    assert m["loss"] == pytest.approx(expected, rel=1e-4)
    assert m["tokens"] == mask.sum()

    _, m = _update(batch, make_mesh(1, 1), rollout_correction=RolloutCorrection(mask="token"))
    assert m["rollout_correction/masked_frac"] == pytest.approx(1 - even.sum() / mask.sum(), rel=1e-6)
    assert m["loss"] == pytest.approx(-np.sum(np.broadcast_to(adv, mask.shape)[even]) / even.sum(), rel=1e-4)
    assert m["tokens"] == mask.sum()  # the step's loss tokens; masked_frac says how many trained

    # AReaL's cap gives the odd tokens (e > 2) weight 0 and keeps them in the token count; IcePop
    # with the window [0.95, 3] zeroes the even ones (exp(-0.1) = 0.905) and keeps e whole.
    areal = RolloutCorrection(weights="token", weight_rule="areal")
    _, m = _update(batch, make_mesh(1, 1), rollout_correction=areal)
    assert m["rollout_correction/zeroed_frac"] == pytest.approx(1 - even.sum() / mask.sum(), rel=1e-6)
    assert "rollout_correction/truncated_frac" not in m
    assert m["loss"] == pytest.approx(-np.sum(np.broadcast_to(adv * np.exp(-0.1), mask.shape)[even]) / mask.sum(), rel=1e-4)
    icepop = RolloutCorrection(weights="token", weight_rule="icepop", weight_floor=0.95, weight_cap=3.0)
    _, m = _update(batch, make_mesh(1, 1), rollout_correction=icepop)
    assert m["rollout_correction/zeroed_frac"] == pytest.approx(even.sum() / mask.sum(), rel=1e-6)
    assert m["loss"] == pytest.approx(-np.sum(np.broadcast_to(adv * np.e, mask.shape)[mask & ~even]) / mask.sum(),
                                      rel=1e-4)
    assert m["tokens"] == mask.sum()


def test_the_weight_rules_settings_change_nothing_unless_a_rule_is_chosen():
    # Today's behaviour: with the rule at its default (TIS), IcePop's floor and M2PO's threshold
    # do not enter the update, with the correction off or with token TIS.
    batch = _batch(8, sampler_offset=np.where(np.arange(SEQ - 1) % 3 == 0, -0.9, 0.2))
    for weights in ("none", "token"):
        base, base_metrics = _update(batch, make_mesh(1, 1), rollout_correction=RolloutCorrection(weights=weights))
        other = RolloutCorrection(weights=weights, weight_floor=0.9, m2_threshold=1e-4)
        state, metrics = _update(batch, make_mesh(1, 1), rollout_correction=other)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(base.params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert metrics == base_metrics
    assert "rollout_correction/truncated_frac" in base_metrics and "rollout_correction/zeroed_frac" not in base_metrics


def test_a_check_that_raises_stops_the_update_before_any_optimizer_step():
    batch = _batch(4, sampler_offset=-0.3)
    mesh = make_mesh(1, 1)
    seen = []

    def check(stats):
        seen.append(stats)
        raise RuntimeError("stop")

    config = RLConfig()
    opt = make_optimizer(OptimizerConfig(lr=1e-2, warmup_steps=1), total_steps=10)
    specs = param_specs(MODEL, mesh)
    params = shard_params(init_params(MODEL, jax.random.key(0)), MODEL, mesh)
    state = init_train_state(params, opt, mesh=mesh, param_specs=specs)
    update = RLUpdate(MODEL, config, opt, mesh=mesh, param_specs=specs, params=params,
                      loss=GRPO_ROC.loss)
    with pytest.raises(RuntimeError, match="stop"):
        update(state, batch, check=check)
    [stats] = seen
    assert stats["logprob_mismatch/abs"] == pytest.approx(0.3, rel=1e-4)
    assert stats["logprob_mismatch/log_ppl_abs_diff"] == pytest.approx(0.3, rel=1e-4)
    assert int(state.step) == 0  # the state it was given is untouched
    after, _ = update(state, batch, check=lambda stats: None)
    assert int(after.step) == 1


# Rows of 192 tokens: four sequence slots per row (`PackShapes`: one per 64 tokens, rounded up
# to a power of two), so short rollouts share rows. (With `SEQ` = 24 a row has one slot, and
# packing would only drop the rows without a loss token.)
PACKED_SEQ = 192


def _packable_batch(rows, **kwargs):
    """`_batch` of ``rows`` rollouts in rows of `PACKED_SEQ` tokens: rollout 0 has a one-token
    response, rollout 1 fills its row, the others are short enough to share a row."""
    lengths = np.random.default_rng(7).integers(PROMPT + 2, 40, rows)
    lengths[:2] = PROMPT + 1, PACKED_SEQ
    return _batch(rows, seq=PACKED_SEQ, lengths=lengths, **kwargs)


def _assert_packs_the_edge_cases(batch, segment_lengths):
    """Packed rows hold several rollouts, the one-token response among others, and the rollout
    that fills a row alone."""
    rows = [[n for n in row if n] for row in np.asarray(segment_lengths).tolist()]
    assert max(len(row) for row in rows) >= 2, rows
    assert batch["loss_mask"][0].sum() == 1
    assert any(PROMPT + 1 in row and len(row) > 1 for row in rows), rows
    assert [PACKED_SEQ] in rows, rows


def _packed_and_padded(batch):
    """(padded, packed, slots, params): shifted host rows of ``batch`` as the update's loss takes
    them, with the on-policy old log-probs: one rollout per row, and one packed micro-batch of
    as many rows of the batch's length (`PACKED_SEQ`: four segment slots each); ``slots`` takes
    an array of the first layout to the micro-batch's sequence slots, zeros in its empty ones."""
    padded = rl_update._shift(batch)
    [[micro]] = rl_update.micro_batch_rows(batch, PackShapes(batch["tokens"].shape[1]),
                                           len(batch["tokens"]), 1, packed=True)
    index = micro.pop("index")

    def slots(x):
        return jnp.take(jnp.asarray(x), index, axis=0, mode="fill", fill_value=0)

    params = init_params(MODEL, jax.random.key(0))
    old = np.asarray(token_logprobs(params, MODEL, padded["inputs"], padded["targets"],
                                    padded["attention_mask"]))
    per_target = padded | {"old_logp": old - 0.05,
                           "ref_logp": old + 0.3 * np.sin(np.arange(old.size)).reshape(old.shape)}
    packed = {k: jnp.asarray(v) for k, v in micro.items()}
    packed |= {k: slots(v) for k, v in per_target.items() if k not in micro | {"attention_mask": 0}}
    return {k: jnp.asarray(v) for k, v in per_target.items()}, packed, slots, params


MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOSSES = ([(name, algorithm.loss) for name, algorithm in ALGORITHMS.items()]
          + [(mode, functools.partial(policy_loss, loss_agg_mode=mode)) for mode in MODES]
          + [(f"{mode}+entropy+kl", regularized(functools.partial(policy_loss, loss_agg_mode=mode),
                                                 entropy_coef=0.1, kl_coef=0.5, kl_penalty="k3"))
             for mode in MODES])


@pytest.mark.parametrize("name, loss", LOSSES, ids=[name for name, _ in LOSSES])
def test_packed_rows_give_every_loss_the_values_and_gradients_of_one_rollout_per_row(name, loss):
    """Every registry algorithm's loss and every aggregation mode, alone and with the entropy
    bonus (entropy with its gradient) and the KL penalty to reference log-probs: the same loss
    sum, count, metric sums and gradients from packed rows as from one rollout per row, with
    per-rollout and per-token (rollout-correction) advantages."""
    batch = _packable_batch(6)
    batch["loss_mask"][3] = 0  # a rollout with nothing to train on, as padding rows are
    padded, packed, slots, params = _packed_and_padded(batch)
    _assert_packs_the_edge_cases(batch, packed["segment_lengths"])
    assert np.count_nonzero(packed["segment_lengths"]) == 5  # all but the one without loss
    token_advantages = jnp.asarray(np.random.default_rng(1).normal(size=padded["mask"].shape),
                                   jnp.float32)
    for advantages in (padded["advantages"], token_advantages):
        def run(rows, advantages):
            def value(p):
                loss_sum, count, metrics = rl_update.rl_loss(
                    p, rows | {"advantages": advantages}, model_config=MODEL, config=RLConfig(), loss=loss)
                return loss_sum, (count, metrics)
            return jax.value_and_grad(value, has_aux=True)(params)

        (value, (count, metrics)), grads = run(padded, advantages)
        (p_value, (p_count, p_metrics)), p_grads = run(packed, slots(advantages))
        assert int(p_count) == int(count)
        np.testing.assert_allclose(p_value, value, rtol=1e-5, atol=1e-7)
        assert p_metrics.keys() == metrics.keys()
        for k in metrics:
            np.testing.assert_allclose(p_metrics[k], metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
        for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(p_grads)[0],
                                jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def _spy_on_packing(monkeypatch) -> list[dict]:
    """The packed rows of each update from now on: the ``segment_lengths`` of all its
    micro-batches (`rl_update.micro_batch_rows`' results)."""
    seen, micro_batch_rows = [], rl_update.micro_batch_rows

    def spy(*args, **kwargs):
        plan = micro_batch_rows(*args, **kwargs)
        seen.append({"segment_lengths": np.concatenate([mb["segment_lengths"] for mini in plan
                                                        for mb in mini])})
        return plan

    monkeypatch.setattr(rl_update, "micro_batch_rows", spy)
    return seen


@pytest.mark.parametrize("rl", [
    dict(mini_batches=2, micro_batch_size=2, rollout_correction=RolloutCorrection(weights="token")),
    dict(micro_batch_size=2, algorithm="dr_grpo"),
], ids=["mini-micro-correction", "micro-seq-mean"])
def test_a_packed_update_equals_the_padded_one(rl, monkeypatch):
    """The whole update (old log-probs, rollout correction, mini- and micro-batches, optimizer):
    the same metrics and params from packed rows as from one rollout per row."""
    batch = _packable_batch(8, sampler_offset=-0.1)
    mesh = make_mesh(1, 1)
    padded, m = _update(batch, mesh, lr=1e-3, packed=False, **rl)
    packed_rows = _spy_on_packing(monkeypatch)
    packed, p_m = _update(batch, mesh, lr=1e-3, packed=True, **rl)
    _assert_packs_the_edge_cases(batch, packed_rows[0]["segment_lengths"])
    assert p_m.keys() == m.keys()
    for k in m:
        assert p_m[k] == pytest.approx(m[k], rel=1e-4, abs=1e-6), k
    for a, b in zip(jax.tree.leaves(padded.params), jax.tree.leaves(packed.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_a_packed_update_with_a_reference_and_both_terms_equals_the_padded_one(monkeypatch):
    # lr 1e-3, as in the test above: Adam's first step moves a weight whose gradient is at the
    # level of summation-order noise by up to lr (at 3e-2, one weight of 4,096 by 6.9e-5).
    batch = _packable_batch(8)
    rl = dict(entropy_coef=0.1, kl_coef=0.5, kl_penalty="k3", micro_batch_size=2, lr=1e-3)
    padded, m = _reference_update(batch, 0.05, packed=False, **rl)
    packed_rows = _spy_on_packing(monkeypatch)
    packed, p_m = _reference_update(batch, 0.05, packed=True, **rl)
    _assert_packs_the_edge_cases(batch, packed_rows[0]["segment_lengths"])
    assert p_m.keys() == m.keys() and {"entropy_loss", "kl_loss", "ref_kl"} <= m.keys()
    for k in m:
        assert p_m[k] == pytest.approx(m[k], rel=1e-4, abs=1e-6), k
    for a, b in zip(jax.tree.leaves(padded.params), jax.tree.leaves(packed.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_a_batch_that_overflows_skips_every_update_of_the_step():
    """Issue 51: advantages large enough that the loss sums overflow float32: both mini-batch
    updates are skipped and counted, the params stay as they were."""
    batch = _batch(8)
    mesh = make_mesh(1, 1)
    before = jax.device_get(shard_params(init_params(MODEL, jax.random.key(0)), MODEL, mesh))
    state, metrics = _update(batch | {"advantages": np.full(8, 1e38, np.float32)}, mesh,
                             mini_batches=2)
    assert metrics["update/skipped_nonfinite"] == 2.0 and not np.isfinite(metrics["loss"])
    assert int(state.step) == 2
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    _, metrics = _update(batch, mesh, mini_batches=2)
    assert metrics["update/skipped_nonfinite"] == 0.0


def test_mini_batch_metrics_combine_by_the_step_rule():
    from rstar2_jax.rl.update import _combine

    updates = [{"lr": 1.0, "grad_norm": 1.0, "tokens": 1.0, "ratio_max": 1.5, "ratio_min": 0.5, "kl": 4.0,
                "update/skipped_nonfinite": 1.0},
               {"lr": 2.0, "grad_norm": 3.0, "tokens": 3.0, "ratio_max": 1.2, "ratio_min": 0.7, "kl": 0.0,
                "update/skipped_nonfinite": 1.0}]
    assert _combine(updates) == {"lr": 2.0, "grad_norm": 2.0, "ratio_max": 1.5, "ratio_min": 0.5,
                                 "kl": 1.0,  # (4 * 1 + 0 * 3) / 4 tokens
                                 "update/skipped_nonfinite": 2.0}  # counted


# --- the entropy bonus, the KL penalty and the reference ----------------------------------------

def _plain_update(batch, loss, lr=3e-2, eps=1e-8):
    """One update through the loss contract as it was before extra inputs existed: old log-probs
    by one forward, then a train step calling ``loss(logp, old_logp, advantages, mask)``."""
    mesh = make_mesh(1, 1)
    opt = make_optimizer(OptimizerConfig(lr=lr, warmup_steps=1, eps=eps), total_steps=10)
    specs = param_specs(MODEL, mesh)
    params = shard_params(init_params(MODEL, jax.random.key(0)), MODEL, mesh)
    state = init_train_state(params, opt, mesh=mesh, param_specs=specs)
    tokens, attention = batch["tokens"], batch["attention_mask"]
    lengths = attention[:, :-1].sum(axis=1)

    def logprobs(p):
        return token_logprobs(p, MODEL, tokens[:, :-1], tokens[:, 1:], lengths=lengths)

    rows = {"old_logp": logprobs(state.params), "advantages": batch["advantages"],
            "mask": batch["loss_mask"][:, 1:].astype(bool)}

    def loss_fn(p, mb):
        return loss(logprobs(p), mb["old_logp"], mb["advantages"], mb["mask"])

    step = make_train_step(loss_fn, opt, mesh=mesh, param_specs=specs, params=params)
    return step(state, rows)


@pytest.mark.parametrize("name", sorted({a.loss: n for n, a in ALGORITHMS.items()}.values()))
def test_with_both_terms_off_every_algorithm_updates_as_through_the_plain_loss(name):
    batch = _batch(8)
    loss = ALGORITHMS[name].loss
    # Padded rows as the plain path's (packed = padded: the packed tests below, at an lr that
    # keeps Adam from turning float summation noise into a visible step). The two are different
    # programs, so their gradients differ by float summation order; Adam's first step,
    # lr * g / (|g| + eps), turns a gradient at that noise level into a step of up to lr unless
    # eps is far above the noise (seen: one weight of 4,096 off by 2e-5 at eps 1e-8 once XLA
    # fused differently). eps 1e-3 keeps the step a smooth function of the gradient, and of its
    # scale too, which a sign-like step would not see.
    state, metrics = _update(batch, make_mesh(1, 1), algorithm=name, packed=False, eps=1e-3)
    plain_state, plain = _plain_update(batch, loss, eps=1e-3)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(plain_state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    # The train step's `tokens` is the loss's count; the update reports the step's loss tokens.
    plain = {k: v for k, v in jax.device_get(plain).items() if k != "tokens"}
    assert {k for k in metrics if k in plain} == set(plain)  # no metric lost, none added
    assert "entropy_loss" not in metrics and "kl_loss" not in metrics and "ref_kl" not in metrics
    for k in plain:
        assert metrics[k] == pytest.approx(float(plain[k]), rel=1e-5, abs=1e-7), k


def _reference_update(batch, reference, lr=3e-2, **rl):
    """One update with a reference policy: ``reference`` is the init params moved by noise of
    that scale (0: the init itself)."""
    mesh = make_mesh(1, 1)
    config = RLConfig(reference=True, **rl)
    opt = make_optimizer(OptimizerConfig(lr=lr, warmup_steps=1), total_steps=10)
    specs = param_specs(MODEL, mesh)
    init = init_params(MODEL, jax.random.key(0))
    leaves, tree = jax.tree.flatten(init)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    moved = tree.unflatten([x + reference * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])
    params = shard_params(init, MODEL, mesh)
    state = init_train_state(params, opt, mesh=mesh, param_specs=specs)
    update = RLUpdate(MODEL, config, opt, mesh=mesh, param_specs=specs, params=params,
                      loss=resolve_algorithm(config.algorithm).loss,
                      reference=shard_params(moved, MODEL, mesh))
    return update(state, batch)


def test_entropy_bonus_and_kl_penalty_enter_the_update_as_the_loss_aggregates():
    batch = _batch(8)
    _, off = _reference_update(batch, 0.05)
    _, on = _reference_update(batch, 0.05, entropy_coef=0.1, kl_coef=0.5, kl_penalty="k3",
                              micro_batch_size=2)
    # One mini-batch, on policy: the surrogate is -mean(A) over tokens whatever the terms; the
    # terms are the loss forward's token-mean entropy and k3 KL, which are what the old pass saw.
    assert on["entropy_loss"] == pytest.approx(on["entropy"], rel=1e-5)
    assert on["kl_loss"] == pytest.approx(on["ref_kl"], rel=1e-5)
    assert on["ref_kl"] == pytest.approx(off["ref_kl"], rel=1e-6) and on["ref_kl"] > 1e-4
    assert on["loss"] == pytest.approx(off["loss"] - 0.1 * on["entropy"] + 0.5 * on["ref_kl"], rel=1e-5)
    assert "entropy_loss" not in off and "kl_loss" not in off


def test_the_reference_at_the_initial_weights_has_no_kl():
    _, m = _reference_update(_batch(4), 0.0, kl_coef=1.0, kl_penalty="k3")
    assert m["ref_kl"] == pytest.approx(0.0, abs=1e-7) and m["kl_loss"] == pytest.approx(0.0, abs=1e-7)


def test_a_loss_that_takes_ref_logp_needs_a_reference():
    def mine(logp, old_logp, advantages, mask, *, ref_logp):
        return policy_loss(logp, old_logp, advantages, mask)

    with pytest.raises(ConfigError, match="rl.reference=true"):
        _update(_batch(4), make_mesh(1, 1), loss=mine)
    with pytest.raises(ValueError, match="reference"):
        _update(_batch(4), make_mesh(1, 1), reference=True)  # and none given
    with pytest.raises(ConfigError, match="loss_agg_mode"):
        _update(_batch(4), make_mesh(1, 1), entropy_coef=0.1,
                loss=lambda logp, old_logp, advantages, mask: policy_loss(logp, old_logp, advantages, mask))
