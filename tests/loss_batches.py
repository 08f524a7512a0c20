"""Random micro-batches for the loss tests: log-probs, advantages and a loss mask."""
import jax


def random_batch(seed, batch=4, seq=6, ratio_spread=0.4):
    """``(logp, old_logp, advantages, mask)``: old log-probs in [-4, -0.1], token log-ratios
    uniform in [-ratio_spread, ratio_spread], normal `[batch]` advantages, a mask with ~70%
    loss tokens and at least one per row."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    old = -jax.random.uniform(k1, (batch, seq), minval=0.1, maxval=4.0)
    logp = old + jax.random.uniform(k2, (batch, seq), minval=-ratio_spread, maxval=ratio_spread)
    adv = jax.random.normal(k3, (batch,))
    mask = jax.random.bernoulli(k4, 0.7, (batch, seq)).at[:, 0].set(True)
    return logp, old, adv, mask
