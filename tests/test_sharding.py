"""Sharded forward on 8 fake CPU devices matches one device, and params are split as specified."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers_hf import tiny_random_model
from rstar2_jax.parallel import sharding
from rstar2_jax.model import forward, forward_cached, init_cache

# hidden, intermediate, vocab and (for tp=2) heads and kv heads divide every mesh axis used here.
DIVISIBLE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                 head_dim=16)


def _batch(vocab, batch=8, seq=12):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    mask = np.ones((batch, seq), np.int32)
    mask[::3, :4] = 0  # some left padding
    return jnp.asarray(tokens), jnp.asarray(mask)


def _expected_shard_shape(shape, spec, mesh):
    """The per-device block of an array of `shape` split by `spec` on `mesh`."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    return tuple(d // mesh.shape[a] if a else d for d, a in zip(shape, spec))


def test_make_mesh():
    assert jax.device_count() == 8
    assert dict(sharding.make_mesh(fsdp=4, tp=2).shape) == {"fsdp": 4, "tp": 2}
    assert dict(sharding.make_mesh(tp=2).shape) == {"fsdp": 4, "tp": 2}
    assert dict(sharding.make_mesh(fsdp=2).shape) == {"fsdp": 2, "tp": 1}
    with pytest.raises(ValueError, match="needs 9 devices"):
        sharding.make_mesh(fsdp=3, tp=3)
    with pytest.raises(ValueError, match="does not divide"):
        sharding.make_mesh(tp=3)


def test_megatron_layout_of_the_specs():
    config, _ = tiny_random_model("qwen2", **DIVISIBLE)
    specs = sharding.param_specs(config)
    layers = specs["layers"]
    # Column-parallel inputs split heads / intermediate over tp; row-parallel outputs split them on
    # their input side; every large matrix also splits its hidden axis over fsdp.
    assert layers["q"] == layers["k"] == layers["v"] == P(None, "fsdp", "tp", None)
    assert layers["q_bias"] == P(None, "tp", None)
    assert layers["o"] == P(None, "tp", None, "fsdp")
    assert layers["gate"] == layers["up"] == P(None, "fsdp", "tp")
    assert layers["down"] == P(None, "tp", "fsdp")
    assert specs["embed"] == P("tp", "fsdp") and specs["lm_head"] == P("fsdp", "tp")
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(
        tiny_random_model("qwen2", **DIVISIBLE)[1])


@pytest.mark.parametrize("fsdp, tp", [(4, 2), (8, 1), (1, 1)])
def test_sharded_forward_matches_single_device(fsdp, tp):
    config, params = tiny_random_model("qwen3", **DIVISIBLE)
    tokens, mask = _batch(config.vocab_size)
    mesh = sharding.make_mesh(fsdp=fsdp, tp=tp)
    expected = np.asarray(forward(params, config, tokens, mask))

    sharded = sharding.shard_params(params, config, mesh)
    logits = sharding.sharded_forward(config, mesh)(sharded, tokens, mask)

    assert np.abs(np.asarray(logits) - expected).max() <= 1e-5
    assert logits.sharding.spec == P("fsdp", None, "tp")
    specs = sharding.param_specs(config, mesh)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for (path, array), spec in zip(jax.tree_util.tree_flatten_with_path(sharded)[0], flat_specs):
        assert array.sharding == NamedSharding(mesh, spec), jax.tree_util.keystr(path)
        for shard in array.addressable_shards:
            assert shard.data.shape == _expected_shard_shape(array.shape, spec, mesh), jax.tree_util.keystr(path)
    # A real split, not a replicated copy: the fsdp-sharded q holds 1/(fsdp*tp) of the weight.
    q = sharded["layers"]["q"]
    assert q.addressable_shards[0].data.size * fsdp * tp == q.size


def test_non_divisible_dims_are_replicated_and_still_correct():
    # 2 kv heads and 102 vocab entries on tp=4: kv heads and vocab cannot be split, q heads can.
    config, params = tiny_random_model("qwen2", **(DIVISIBLE | dict(vocab_size=102)))
    mesh = sharding.make_mesh(fsdp=2, tp=4)
    specs = sharding.param_specs(config, mesh)
    assert specs["layers"]["k"] == P(None, "fsdp", None, None)
    assert specs["layers"]["q"] == P(None, "fsdp", "tp", None)
    assert specs["embed"] == P(None, "fsdp")
    tokens, mask = _batch(config.vocab_size)

    logits = sharding.sharded_forward(config, mesh)(sharding.shard_params(params, config, mesh), tokens, mask)

    assert logits.sharding.spec == P("fsdp", None, None)
    assert np.abs(np.asarray(logits) - np.asarray(forward(params, config, tokens, mask))).max() <= 1e-5


def test_sharded_cache_decoding_matches_single_device():
    config, params = tiny_random_model("qwen3", **DIVISIBLE)
    mesh = sharding.make_mesh(fsdp=4, tp=2)
    tokens, _ = _batch(config.vocab_size)
    cache = init_cache(config, batch=8, max_len=16)
    specs = sharding.cache_specs(config, mesh, batch=8)
    assert specs.k == P(None, "fsdp", "tp", None, None)
    assert specs.lengths == P("fsdp")

    expected, _ = forward_cached(params, config, tokens, cache)
    logits, new_cache = forward_cached(sharding.shard_params(params, config, mesh), config, tokens,
                                       jax.device_put(cache, sharding.named_shardings(mesh, specs)))

    assert np.abs(np.asarray(logits) - np.asarray(expected)).max() <= 1e-5
    np.testing.assert_array_equal(new_cache.lengths, np.full(8, 12))
