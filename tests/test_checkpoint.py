"""Checkpoints: exact round trip, keep-last-K, corruption fallback, refusal of another run's
checkpoints and of a read that fails for no proven reason, the policy versions of an
asynchronous RL run (export: test_export.py)."""
import dataclasses
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2_jax.model import ModelConfig, init_params
from rstar2_jax.parallel.roles import ServingCopy
from rstar2_jax.parallel.sharding import make_mesh, param_specs, shard_params
from rstar2_jax.errors import UserError
from rstar2_jax.train.checkpoint import (
    Checkpointer,
    CheckpointReadError,
    CorruptCheckpointError,
    RunFingerprint,
    RunMismatchError,
    _fingerprints,
)
from rstar2_jax.train.configs import CheckpointConfig, OptimizerConfig
from rstar2_jax.train.optim import make_optimizer
from rstar2_jax.train.step import TrainState, init_train_state

# orbax leaves an un-awaited read coroutine behind when a damaged file fails to decode; it is
# garbage-collected (and reported) during whichever test runs next.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

MODEL = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=16, intermediate_size=32,
                    num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True)


def _state(seed, step, model=MODEL):
    opt = make_optimizer(OptimizerConfig(lr=1e-3), total_steps=10)
    params = init_params(model, jax.random.key(seed))
    state = init_train_state(params, opt, step=step)
    # A non-trivial optimizer state, so that restoring the wrong one would show.
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = jax.jit(opt.update)(grads, state.opt_state, params)
    return TrainState(params, opt_state, state.step)


def _save(ckpt, seed, step, position=None):
    ckpt.save(_state(seed, step), rng=jax.random.key(100 + step),
              data_position=position or {"epoch": 0, "index": step},
              job_config={"seed": seed, "model": {"path": "models/small"}}, model_config=MODEL,
              job="SFTConfig")


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_exact_and_keeps_last_k(tmp_path):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(every=2, keep=2))
    assert ckpt.due(4) and not ckpt.due(3)
    for step in (2, 4, 6):
        _save(ckpt, seed=step, step=step, position={"epoch": 1, "index": step * 10})
    ckpt.wait()
    assert ckpt.steps() == [4, 6]
    restored = ckpt.restore_latest(_state(0, 0))
    _assert_same(restored.state, _state(6, 6))
    assert int(restored.state.step) == 6
    assert restored.data_position == {"epoch": 1, "index": 60}
    assert restored.job_config == {"seed": 6, "model": {"path": "models/small"}}
    assert restored.model_config == MODEL
    np.testing.assert_array_equal(jax.random.key_data(restored.rng),
                                  jax.random.key_data(jax.random.key(106)))
    ckpt.close()


def test_params_only_keeps_the_given_optimizer_state(tmp_path):
    ckpt = Checkpointer(tmp_path)
    _save(ckpt, seed=1, step=5)
    fresh = _state(0, 0)
    restored = ckpt.restore_latest(fresh, params_only=True)
    _assert_same(restored.state.params, _state(1, 5).params)
    _assert_same(restored.state.opt_state, fresh.opt_state)
    assert int(restored.state.step) == 5
    ckpt.close()


def _largest_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["flip_bit", "truncate", "delete_meta", "garbage_meta"])
def test_damaged_latest_falls_back_to_previous(tmp_path, caplog, damage):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep=3))
    _save(ckpt, seed=1, step=1)
    _save(ckpt, seed=2, step=2)
    ckpt.wait()
    victim = _largest_file(tmp_path / "2")
    data = bytearray(victim.read_bytes())
    if damage == "flip_bit":
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 3]))
    elif damage == "delete_meta":
        (tmp_path / "2" / "meta" / "metadata").unlink()
    else:
        (tmp_path / "2" / "meta" / "metadata").write_text('{"step": 2, "fingerpr')
    with caplog.at_level(logging.WARNING):
        restored = Checkpointer(tmp_path).restore_latest(_state(0, 0))
    assert int(restored.state.step) == 1
    _assert_same(restored.state, _state(1, 1))
    assert "checkpoint step 2" in caplog.text and "falling back to step 1" in caplog.text
    assert (tmp_path / "corrupt-2").exists() and Checkpointer(tmp_path).steps() == [1]


def test_no_checkpoint_returns_none(tmp_path):
    assert Checkpointer(tmp_path).restore_latest(_state(0, 0)) is None


def _listing(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*")}


def test_a_checkpoint_of_another_model_or_job_is_refused_and_left_alone(tmp_path):
    ckpt = Checkpointer(tmp_path)
    _save(ckpt, seed=1, step=1)
    _save(ckpt, seed=2, step=2)
    ckpt.wait()
    before = _listing(tmp_path)
    wider = dataclasses.replace(MODEL, hidden_size=24)
    with pytest.raises(RunMismatchError, match=r"step 2 .* another model: hidden_size=16 "
                                               r"\(model.path=models/small\), and this job's "
                                               r"model.path=models/wide has hidden_size=24"):
        Checkpointer(tmp_path).restore_latest(_state(0, 0, wider),
                                              expect=RunFingerprint("SFTConfig", wider, "models/wide"))
    with pytest.raises(RunMismatchError, match=r"another kind of job \(SFTConfig, this job is "
                                               r"RLJobConfig\)"):
        Checkpointer(tmp_path).restore_latest(_state(0, 0),
                                              expect=RunFingerprint("RLJobConfig", MODEL, "models/small"))
    assert _listing(tmp_path) == before
    # The same model in another dtype is the same run (CheckpointDtypeError speaks for the dtype).
    same = RunFingerprint("SFTConfig", dataclasses.replace(MODEL, dtype="bfloat16"), "elsewhere")
    assert int(Checkpointer(tmp_path).restore_latest(_state(0, 0), expect=same).state.step) == 2


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), MemoryError(),
                                   ValueError("UNAVAILABLE: the filesystem went away")])
def test_a_read_that_fails_for_no_proven_reason_stops_and_moves_nothing(tmp_path, monkeypatch, error):
    ckpt = Checkpointer(tmp_path)
    _save(ckpt, seed=1, step=1)
    _save(ckpt, seed=2, step=2)
    ckpt.wait()
    before = _listing(tmp_path)
    reader = Checkpointer(tmp_path)
    restore = reader._manager.restore

    def failing(step, args):
        if "params" in args.keys():
            raise error
        return restore(step, args=args)

    monkeypatch.setattr(reader._manager, "restore", failing)
    with pytest.raises(CheckpointReadError, match=r"cannot read checkpoint step 2 .* nothing was "
                                                  r"moved or changed") as e:
        reader.restore_latest(_state(0, 0))
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    assert _listing(tmp_path) == before


def test_when_every_checkpoint_is_damaged_the_run_does_not_start_over(tmp_path):
    ckpt = Checkpointer(tmp_path)
    _save(ckpt, seed=1, step=1)
    ckpt.wait()
    (tmp_path / "1" / "meta" / "metadata").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"every checkpoint in .* is damaged \(steps "
                                                     r"\[1\], moved to corrupt-<step>\)"):
        Checkpointer(tmp_path).restore_latest(_state(0, 0))
    assert os.listdir(tmp_path) == ["corrupt-1"]


def _versions_saved(tmp_path, rollout: int):
    """Checkpoint 3 of a run on 4 training devices (fsdp) with ``rollout`` rollout devices beside
    them (0: none), holding the sampler's bfloat16 copies of versions 1 and 2 as an asynchronous
    run's does; returns (the copies, the params the state was made from, the train mesh)."""
    devices = jax.devices()
    train = make_mesh(fsdp=4, tp=1, devices=devices[:4])
    serving = make_mesh(fsdp=1, tp=rollout, devices=devices[4:4 + rollout]) if rollout else None
    copy = ServingCopy(MODEL, train, serving, jnp.bfloat16)
    copies = {v: copy(shard_params(init_params(MODEL, jax.random.key(v)), MODEL, train))
              for v in (1, 2)}
    state = _state(3, 3)
    state = state._replace(params=shard_params(state.params, MODEL, train))
    ckpt = Checkpointer(tmp_path)
    ckpt.save(state, rng=jax.random.key(0), data_position=None, job_config={}, model_config=MODEL,
              versions={v: copy.as_params(c) for v, c in copies.items()})
    ckpt.wait()
    return copy, copies, state


@pytest.mark.parametrize("rollout", [0, 4])
def test_the_policy_versions_of_an_asynchronous_run_come_back_exactly_to_the_sampler(tmp_path, rollout):
    # With rollout devices the copies live there; the checkpoint holds them laid out as the
    # params (each host writing its shards), and the sampler's copy made again from what is
    # read back is the copy that was saved, bit for bit, on the sampler's devices.
    copy, copies, state = _versions_saved(tmp_path, rollout)
    restored = Checkpointer(tmp_path).restore_latest(state, read_versions=True)
    assert sorted(restored.versions) == [1, 2]
    for v, saved in copies.items():
        back = restored.versions[v]
        assert {x.dtype for x in jax.tree.leaves(back)} == {jnp.dtype(jnp.bfloat16)}
        assert jax.tree.map(lambda x: x.sharding, back) == jax.tree.map(lambda x: x.sharding,
                                                                         state.params)
        served = copy(back)
        assert jax.tree.map(lambda x: x.sharding, served) == jax.tree.map(lambda x: x.sharding, saved)
        _assert_same(served, saved)
    assert {d.id for x in jax.tree.leaves(served) for d in x.devices()} == (
        set(range(4, 4 + rollout)) if rollout else {0, 1, 2, 3})
    _assert_same(restored.state, state)
    # Without read_versions (a previous stage's checkpoint, an export) they are not read.
    assert Checkpointer(tmp_path).restore_latest(state).versions == {}


def test_a_checkpoint_without_policy_versions_is_the_synchronous_layout(tmp_path):
    ckpt = Checkpointer(tmp_path)
    _save(ckpt, seed=1, step=1)
    ckpt.wait()
    assert sorted(p.name for p in (tmp_path / "1").iterdir() if p.is_dir()) == [
        "meta", "opt_state", "params"]
    meta = ckpt.read_meta(1)
    assert "versions" not in meta and sorted(meta["fingerprints"]) == ["opt_state", "params"]
    assert ckpt.restore_latest(_state(0, 0), read_versions=True).versions == {}


def test_saving_other_policy_versions_compiles_no_new_fingerprint_program(tmp_path):
    # Each save of a k > 0 run holds other version numbers ({"3": params}, then {"4": params}):
    # as tree keys they would make a new program every save, an unbounded compile set.
    ckpt = Checkpointer(tmp_path)
    ckpt.save(_state(3, 3), rng=jax.random.key(0), data_position=None, job_config={},
              model_config=MODEL, versions={2: _state(9, 0).params})
    ckpt.wait()
    programs = _fingerprints._cache_size()
    for step in (4, 5):
        ckpt.save(_state(step, step), rng=jax.random.key(0), data_position=None, job_config={},
                  model_config=MODEL, versions={step - 1: _state(9, 0).params})
        ckpt.wait()
    assert _fingerprints._cache_size() == programs
    assert sorted(ckpt.read_meta(5)["fingerprints"]["versions"])[0].startswith("['4']")


def test_damaged_policy_versions_are_damage_like_any_other(tmp_path, caplog):
    # A flipped bit in a saved version fails its fingerprint: the checkpoint is quarantined and
    # the previous one read, as for the params.
    ckpt = Checkpointer(tmp_path)
    _save(ckpt, seed=4, step=4)
    ckpt.wait()
    ckpt.save(_state(5, 5), rng=jax.random.key(0), data_position=None, job_config={},
              model_config=MODEL, versions={4: _state(9, 0).params})
    ckpt.wait()
    victim = max((p for p in (tmp_path / "5" / "versions").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        restored = Checkpointer(tmp_path).restore_latest(_state(0, 0), read_versions=True)
    assert int(restored.state.step) == 4 and restored.versions == {}
    assert "checkpoint step 5" in caplog.text and (tmp_path / "corrupt-5").exists()
