"""Optimizer: schedule values in closed form and AdamW + clipping against a numpy reference."""
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2_jax.train.configs import OptimizerConfig
from rstar2_jax.train.optim import current_lr, lr_schedule, make_optimizer


def test_paper_constant_schedule_with_warmup():
    sched = lr_schedule(OptimizerConfig(), total_steps=300)  # lr 1e-6, 20 warmup steps
    assert float(sched(0)) == pytest.approx(1e-6 / 20)
    assert float(sched(9)) == pytest.approx(1e-6 / 2)
    assert float(sched(19)) == pytest.approx(1e-6)
    assert float(sched(299)) == pytest.approx(1e-6)


def test_cosine_schedule():
    cfg = OptimizerConfig(lr=1.0, schedule="cosine", warmup_steps=10, final_lr_ratio=0.1)
    sched = lr_schedule(cfg, total_steps=110)  # 100 decay steps after warmup
    assert float(sched(10)) == pytest.approx(1.0)
    assert float(sched(60)) == pytest.approx(0.1 + 0.9 * 0.5)
    assert float(sched(110)) == pytest.approx(0.1)
    assert float(sched(500)) == pytest.approx(0.1)


def _numpy_adamw(params, grads_seq, lr_seq, clip, wd, b1=0.9, b2=0.999, eps=1e-8):
    p, m, v = params.copy(), np.zeros_like(params), np.zeros_like(params)
    for t, (g, lr) in enumerate(zip(grads_seq, lr_seq), start=1):
        g = g * min(1.0, clip / np.linalg.norm(g))
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        update = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        p = p - lr * (update + wd * p)
    return p


def test_adamw_with_clipping_matches_reference():
    cfg = OptimizerConfig(lr=0.1, warmup_steps=2, weight_decay=0.01, grad_clip=1.0)
    tx = make_optimizer(cfg, total_steps=10)
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    grads = [np.array([3.0, 4.0, 0.0]), np.array([0.1, -0.2, 0.05]), np.array([-5.0, 1.0, 2.0])]
    state = tx.init(params)
    p = params
    lrs = []
    for g in grads:
        updates, state = tx.update({"w": jnp.asarray(g)}, state, p)
        p = {"w": p["w"] + updates["w"]}
        lrs.append(float(current_lr(state)))
    assert lrs == pytest.approx([0.05, 0.1, 0.1])
    expected = _numpy_adamw(np.array([1.0, -2.0, 3.0]), grads, [0.05, 0.1, 0.1], clip=1.0, wd=0.01)
    np.testing.assert_allclose(np.asarray(p["w"]), expected, rtol=1e-5, atol=1e-6)
