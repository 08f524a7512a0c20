"""The precision policy: float32 master weights keep the updates bfloat16 would round away,
bfloat16 compute casts at use inside the differentiated function (float32 gradients, float32
log-probs), every matmul states its precision, and bad settings fail in one line."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_hf import tiny_random_model
from rstar2_jax.cli import main
from rstar2_jax.config import ConfigError, load_config
from rstar2_jax.model import ModelConfig, init_params, token_logprobs
from rstar2_jax.train.checkpoint import CheckpointDtypeError, Checkpointer
from rstar2_jax.train.configs import OptimizerConfig, PrecisionConfig, SFTConfig
from rstar2_jax.train.optim import make_optimizer
from rstar2_jax.train.sft import sft_loss
from rstar2_jax.train.step import TrainState, init_train_state, make_train_step


def test_an_update_of_1e7_of_a_weight_moves_a_float32_master_and_rounds_away_in_bfloat16():
    # Weights in [0.5, 1): AdamW's first update is lr * sign(grad) per weight, here 1e-7 of
    # 0.75 (0.75e-7 to 1.5e-7 of each weight), like lr 1e-6 on weights of about 0.01.
    weights = np.linspace(0.5, 1.0, 1001, endpoint=False, dtype=np.float32)
    optimizer = make_optimizer(OptimizerConfig(lr=0.75e-7, warmup_steps=0, weight_decay=0.0),
                               total_steps=10)

    def one_update(dtype):
        w = jnp.asarray(weights, dtype)
        state = optimizer.init(w)
        assert all(x.dtype == dtype for x in jax.tree.leaves(state) if x.ndim)  # moments too
        updates, _ = optimizer.update(jnp.ones_like(w), state, w)
        return np.asarray(w + updates.astype(dtype), np.float32), np.asarray(w, np.float32)

    moved, before = one_update(jnp.float32)
    assert (moved != before).all()
    np.testing.assert_allclose(before - moved, 0.75e-7, rtol=0.5)
    rounded, before16 = one_update(jnp.bfloat16)
    assert (rounded == before16).all()


def _batch(vocab):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (4, 24)).astype(np.int32)
    lengths = np.array([24, 20, 9, 16])
    real = np.arange(24)[None] < lengths[:, None]
    return {"tokens": tokens, "attention_mask": real.astype(np.int32),
            "loss_mask": real.astype(np.int32)}


def test_bfloat16_compute_gives_float32_gradients_that_track_float32_compute():
    config, params = tiny_random_model("qwen3")  # float32 params
    bf16 = PrecisionConfig(compute="bfloat16").compute_config(config)
    batch = _batch(config.vocab_size)

    def loss(p, model_config):
        loss_sum, count, _ = sft_loss(p, batch, model_config=model_config)
        return loss_sum / count

    grads32 = jax.grad(loss)(params, config)
    grads16 = jax.grad(loss)(params, bf16)
    logp = token_logprobs(params, bf16, batch["tokens"], batch["tokens"], chunk_size=8)
    assert logp.dtype == jnp.float32
    for (path, g16), g32 in zip(jax.tree_util.tree_flatten_with_path(grads16)[0],
                                jax.tree.leaves(grads32), strict=True):
        name = jax.tree_util.keystr(path)
        assert g16.dtype == jnp.float32, name
        cosine = jnp.sum(g16 * g32) / (jnp.linalg.norm(g16) * jnp.linalg.norm(g32))
        assert cosine > 0.99, (name, float(cosine))


def test_a_train_step_under_bfloat16_compute_keeps_float32_params_and_moments():
    config, params = tiny_random_model("qwen2")
    bf16 = PrecisionConfig(compute="bfloat16").compute_config(config)
    optimizer = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0), total_steps=10)
    step = make_train_step(lambda p, b: sft_loss(p, b, model_config=bf16), optimizer,
                           micro_batches=2)
    before = jax.device_get(params)  # the step donates its input state
    state, metrics = step(init_train_state(params, optimizer), _batch(config.vocab_size))
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        assert not jnp.issubdtype(leaf.dtype, jnp.floating) or leaf.dtype == jnp.float32
    changed = jax.tree.map(lambda a, b: bool((np.asarray(a) != b).any()), state.params, before)
    assert all(jax.tree.leaves(changed))


def _dot_precisions(jaxpr) -> set:
    """(operand dtypes, precision) of every dot_general, in nested jaxprs too."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.add((tuple(str(v.aval.dtype) for v in eqn.invars), eqn.params["precision"]))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found |= _dot_precisions(sub)
    return found


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_every_matmul_of_the_training_pass_states_its_precision(compute):
    """float32 compute: every product, backward included, is a HIGHEST one (a true float32
    matmul on a GPU or TPU too, not TF32 or one bfloat16 pass); bfloat16 compute: bfloat16
    operands at the backend's default."""
    config, params = tiny_random_model("qwen3")
    config = PrecisionConfig(compute=compute).compute_config(config)
    batch = _batch(config.vocab_size)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: sft_loss(p, batch, model_config=config)[0]))(params)
    dots = _dot_precisions(jaxpr.jaxpr)
    assert len(dots) >= 1
    if compute == "float32":
        highest = jax.lax.Precision.HIGHEST
        assert dots == {(("float32", "float32"), (highest, highest))}
    else:
        assert {operands for operands, _ in dots} == {("bfloat16", "bfloat16")}
        assert {precision for _, precision in dots} == {None}


def test_precision_settings_are_checked():
    assert PrecisionConfig().compute_dtype == ("bfloat16" if jax.default_backend() in ("gpu", "tpu")
                                               else "float32")
    policy = load_config(SFTConfig, overrides=[
        "model.path=m", "data=d", "run_dir=r", "precision.compute=bfloat16",
        "precision.params=float32", "precision.matmul=high"]).precision
    assert policy == PrecisionConfig(params="float32", compute="bfloat16", matmul="high")
    config = policy.compute_config(tiny_random_model("qwen3")[0])
    assert (config.dtype, config.matmul_precision) == ("bfloat16", "high")
    for bad in ("precision.compute=bf16", "precision.params=float16", "precision.matmul=tf32"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(SFTConfig, overrides=["model.path=m", "data=d", "run_dir=r", bad])
    with pytest.raises(ValueError, match="matmul_precision"):
        ModelConfig(**dataclasses.asdict(config) | {"matmul_precision": "tf32"})


def test_a_bad_dtype_on_the_command_line_is_one_line(tmp_path, capsys):
    status = main(["sft", f"model.path={tmp_path}", f"data={tmp_path}/d.jsonl",
                   f"run_dir={tmp_path}/run", "precision.compute=float16"])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("error: ") and "\n" not in err and "precision.compute" in err
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_in_another_params_dtype_is_refused_not_quarantined(tmp_path):
    config = ModelConfig(model_type="qwen3", vocab_size=32, hidden_size=8, intermediate_size=16,
                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, qk_norm=True)
    optimizer = make_optimizer(OptimizerConfig(), total_steps=10)
    state = init_train_state(init_params(config, jax.random.key(0)), optimizer, step=1)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(state, rng=jax.random.key(0), data_position=None, job_config={}, model_config=config)
    ckpt.wait()
    as_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state.params)
    like = TrainState(as_bf16, optimizer.init(as_bf16), state.step)
    with pytest.raises(CheckpointDtypeError, match="precision.params=float32"):
        ckpt.restore_latest(like)
    assert ckpt.steps() == [1]  # still there, not moved aside as corrupt
    assert ckpt.restore_latest(state) is not None
    ckpt.close()
