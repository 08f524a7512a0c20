"""Generic train step: exact token mean over micro-batches; sharded == single-device update."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from rstar2_jax.train.configs import OptimizerConfig
from rstar2_jax.train.optim import make_optimizer
from rstar2_jax.train.step import accumulate_gradients, init_train_state, make_train_step, metric_reduction

V, E = 16, 8


def _params(key):
    k1, k2 = jax.random.split(key)
    return {"embed": jax.random.normal(k1, (V, E)), "out": jax.random.normal(k2, (E, V)) * 0.3}


SPECS = {"embed": P("fsdp", "tp"), "out": P("tp", "fsdp")}


def _masked_ce(params, batch):
    """A bigram LM: per-token cross-entropy, summed over loss-mask tokens."""
    logits = params["embed"][batch["tokens"]] @ params["out"]
    logp = jax.nn.log_softmax(logits)
    token_logp = jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    mask = batch["mask"].astype(jnp.float32)
    metrics = {"logp_sum": (token_logp * mask).sum(), "logit_max": logits.max(), "logit_min": logits.min()}
    return -(token_logp * mask).sum(), mask.sum(), metrics


def _batch(key, rows=16, seq=6):
    k1, k2, k3 = jax.random.split(key, 3)
    # Very different token counts per row: a mean of per-micro-batch means would be wrong.
    lengths = jax.random.randint(k3, (rows, 1), 0, seq + 1)
    return {"tokens": jax.random.randint(k1, (rows, seq), 0, V),
            "targets": jax.random.randint(k2, (rows, seq), 0, V),
            "mask": (jnp.arange(seq)[None] < lengths).astype(jnp.int32)}


def test_micro_batches_give_the_global_token_mean_gradient():
    params, batch = _params(jax.random.key(0)), _batch(jax.random.key(1))

    def global_mean(p):
        loss_sum, count, _ = _masked_ce(p, batch)
        return loss_sum / count

    expected = jax.grad(global_mean)(params)
    for micro in (1, 4, 16):
        sums, loss_sum, count, metrics = accumulate_gradients(_masked_ce, params, batch, micro)
        assert float(count) == float(batch["mask"].sum())
        grads = jax.tree.map(lambda g: g / count, sums)
        np.testing.assert_allclose(float(metrics["logp_sum"]), -float(loss_sum), rtol=1e-6)
        # "_max" metrics are maxima over micro-batches, not sums.
        full_max = (params["embed"][batch["tokens"]] @ params["out"]).max()
        np.testing.assert_allclose(float(metrics["logit_max"]), float(full_max), rtol=1e-6)
        # and "_min" ones minima (they were summed like any other name).
        full_min = (params["embed"][batch["tokens"]] @ params["out"]).min()
        np.testing.assert_allclose(float(metrics["logit_min"]), float(full_min), rtol=1e-6)
        for name in params:
            np.testing.assert_allclose(grads[name], expected[name], rtol=1e-5, atol=1e-6)


def test_bad_batches_are_rejected():
    params, batch = _params(jax.random.key(0)), _batch(jax.random.key(1), rows=6)
    with pytest.raises(ValueError, match="does not split into 4"):
        accumulate_gradients(_masked_ce, params, batch, 4)
    # Arrays of different row counts (a packed batch's rows and sequences) each split alike.
    with pytest.raises(ValueError, match=r"\[3, 6\] rows does not split into 2"):
        accumulate_gradients(_masked_ce, params, batch | {"mask": batch["mask"][:3]}, 2)


def _run(steps, micro_batches, mesh=None):
    opt = make_optimizer(OptimizerConfig(lr=1e-2, warmup_steps=1), total_steps=steps)
    params = _params(jax.random.key(0))
    kwargs = dict(mesh=mesh, param_specs=SPECS if mesh else None)
    state = init_train_state(params, opt, **kwargs)
    step = make_train_step(_masked_ce, opt, micro_batches=micro_batches, params=params, **kwargs)
    history = []
    for i in range(steps):
        state, metrics = step(state, _batch(jax.random.key(10 + i)))
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def test_sharded_step_matches_single_device():
    assert len(jax.devices()) >= 8, "conftest should provide 8 CPU devices"
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    single, single_hist = _run(3, micro_batches=1)
    sharded, sharded_hist = _run(3, micro_batches=2, mesh=mesh)
    assert sharded.params["embed"].sharding.spec == P("fsdp", "tp")
    assert int(sharded.step) == int(single.step) == 3
    for name in single.params:
        np.testing.assert_allclose(np.asarray(sharded.params[name]), np.asarray(single.params[name]),
                                   atol=1e-5, rtol=0)
    for a, b in zip(single_hist, sharded_hist):
        assert a.keys() == b.keys() >= {"loss", "tokens", "grad_norm", "lr", "logp_sum"}
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    # The update did something: params moved and the lr followed the schedule.
    assert not np.allclose(np.asarray(single.params["out"]), np.asarray(_params(jax.random.key(0))["out"]))
    assert single_hist[0]["lr"] == pytest.approx(1e-2)


def test_maxima_and_minima_are_not_divided_by_the_token_count():
    params, batch = _params(jax.random.key(0)), _batch(jax.random.key(10))
    _, (metrics,) = _run(1, micro_batches=4)
    logits = params["embed"][batch["tokens"]] @ params["out"]
    assert metrics["logit_max"] == pytest.approx(float(logits.max()), rel=1e-6)
    assert metrics["logit_min"] == pytest.approx(float(logits.min()), rel=1e-6)
    assert [metric_reduction(n) for n in ("ratio_max", "ratio_min", "entropy", "min_len")] == [
        "max", "min", "mean", "mean"]


def _weighted_ce(params, batch):
    """`_masked_ce` with each row's tokens weighted by ``batch["weight"]`` [rows] (as SFT weighs
    digits): a large enough weight overflows the float32 sums."""
    logits = params["embed"][batch["tokens"]] @ params["out"]
    token_logp = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
    weight = batch["mask"] * batch["weight"][:, None]
    return -(token_logp * weight).sum(), weight.sum(), {}


def test_a_batch_that_overflows_skips_the_whole_update_on_every_device():
    """Issue 51: a non-finite loss or gradient went through the clip and AdamW into every
    weight. One row of one micro-batch, on one device, overflows: the update is skipped on all
    of them, optimizer state included, and the next finite batch trains as if it had never
    been."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    opt = make_optimizer(OptimizerConfig(lr=1e-2, warmup_steps=2), total_steps=10)
    params = _params(jax.random.key(0))
    step = make_train_step(_weighted_ce, opt, micro_batches=2, mesh=mesh, param_specs=SPECS,
                           params=params)
    good = _batch(jax.random.key(1)) | {"weight": jnp.ones(16)}
    bad = good | {"weight": jnp.ones(16).at[5].set(1e38)}
    assert int(good["mask"][5].sum()) > 1  # row 5 has tokens to weigh: micro-batch 1, fsdp shard 1

    def fresh():
        return init_train_state(jax.tree.map(jnp.copy, params), opt, mesh=mesh, param_specs=SPECS)

    before = jax.device_get(fresh())
    skipped, metrics = step(fresh(), bad)
    assert float(metrics["update/skipped_nonfinite"]) == 1.0
    assert not np.isfinite(float(metrics["loss"]))
    for a, b in zip(jax.tree.leaves(jax.device_get(skipped.params)) + jax.tree.leaves(jax.device_get(skipped.opt_state)),
                    jax.tree.leaves(before.params) + jax.tree.leaves(before.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(skipped.step) == 1

    after_skip, metrics = step(skipped, good)
    direct, direct_metrics = step(fresh(), good)
    assert float(metrics["update/skipped_nonfinite"]) == 0.0
    assert float(metrics["lr"]) == float(direct_metrics["lr"]) == pytest.approx(5e-3)  # warmup's first
    for a, b in zip(jax.tree.leaves(after_skip.params), jax.tree.leaves(direct.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(direct.params["out"]), np.asarray(params["out"]))
