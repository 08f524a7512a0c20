"""Asynchronous RL (``rl.max_staleness`` = k): the pipelined loop at k = 0 is the synchronous
loop; at k > 0 each step's rollouts come from the policy k updates back (version stamps, the
bound, the staleness metrics), the same whether the trainer or the sampler is the slow side;
a failure on either side ends the run with its error, a SIGTERM with the checkpoint kept, and
the same command resumes the run that never stopped."""
import logging
import os
import signal
import threading
import time

import jax
import numpy as np
import pytest

from rl_setup import copied_rl_setup, rl_overrides
from rstar2_jax.cli import main
from rstar2_jax.config import load_config
from rstar2_jax.errors import ConfigError
from rstar2_jax.model import load_hf
from rstar2_jax.sampler import AgentSampler
from rstar2_jax.sampler.engine import Engine
from rstar2_jax.rl import loop as rl
from rstar2_jax.train.checkpoint import Checkpointer, restore_params
from rstar2_jax.train.configs import RLJobConfig
from rstar2_jax.train.metrics import read_metrics
from rstar2_jax.rl.loop import run_rl
from rstar2_jax.rl.step import RLStep
from rstar2_jax.rl.update import RLUpdate

STEPS = 4


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    return copied_rl_setup(tmp_path_factory, "rl_async")


def _config(d, run, staleness, steps=STEPS, *overrides):
    return load_config(RLJobConfig, overrides=rl_overrides(
        d, run, steps, "rl.mini_batches=2", "mesh.fsdp=1", f"rl.max_staleness={staleness}",
        *overrides))


def _same_params(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_the_pipelined_loop_at_staleness_0_is_the_synchronous_loop(sft_model, monkeypatch):
    d = sft_model
    synchronous = run_rl(_config(d, "sync", 0, 3), progress=False)
    # The sampler thread, its own copy of each version, the hand-over: at k = 0 the sampler
    # waits for each update, and the run must be the synchronous one bit for bit.
    monkeypatch.setattr(rl, "_synchronous",
                        lambda loop, run, on_step: rl._pipelined(loop, run, on_step, lag=0))
    pipelined = run_rl(_config(d, "pipelined", 0, 3), progress=False)
    assert _same_params(synchronous.params, pipelined.params)
    for a, b in zip(read_metrics(d / "sync"), read_metrics(d / "pipelined"), strict=True):
        assert a.keys() == b.keys()
        # The sampler's own log-probs vary in the last bits with its slot schedule (tool timing),
        # so the sampler/trainer gap is equal only nearly; nothing trained depends on them here.
        exact = {k for k in a if not k.startswith(("time/", "perf/", "logprob_mismatch/"))}
        assert {k: a[k] for k in exact} == {k: b[k] for k in exact}
        gap = {k for k in a if k.startswith("logprob_mismatch/")}
        assert {k: a[k] for k in gap} == pytest.approx({k: b[k] for k in gap}, rel=1e-3, abs=1e-7)
        assert a["staleness/mean"] == a["staleness/max"] == 0.0


class Recorder:
    """Wraps `RLStep.rollout` / `RLStep.train` to record, at each rollout's start, the version
    it samples with and how many updates the trainer had finished, and the versions stamped on
    each step's trained tokens; ``slow`` ("trainer" or "sampler") holds one side back."""

    def __init__(self, monkeypatch, staleness: int, slow: str):
        self.k, self.slow = staleness, slow
        self.updates_done = 0
        self.rollouts = {}  # step -> (version, updates done when it started)
        self.versions = {}  # step -> StepRollouts.versions of its trained rollouts
        self.held = []  # params versions the pipeline holds after each publish
        self.sampler_ahead = threading.Event()
        rollout, train, publish = RLStep.rollout, RLStep.train, rl._Pipeline.publish

        def slow_rollout(loop, params, step, rng, version, **kwargs):
            self.rollouts[step] = version, self.updates_done
            if self.slow == "sampler":
                time.sleep(0.5)
            out = rollout(loop, params, step, rng, version, **kwargs)
            self.versions[step] = out.versions
            if step == self.k:
                self.sampler_ahead.set()
            return out

        def slow_train(loop, state, rollouts):
            if self.slow == "trainer" and rollouts.step == 0:
                # The trainer's first update waits until the sampler has rolled out step k,
                # k steps ahead, which it can only do without waiting for any update. (The
                # timeout only turns a broken pipeline's deadlock into a failure.)
                assert self.sampler_ahead.wait(timeout=600)
            if self.slow == "trainer":
                time.sleep(0.5)
            out = train(loop, state, rollouts)
            self.updates_done += 1
            return out

        def counted_publish(pipe, version, params):
            publish(pipe, version, params)
            self.held.append(len(pipe._params))

        monkeypatch.setattr(RLStep, "rollout", slow_rollout)
        monkeypatch.setattr(RLStep, "train", slow_train)
        monkeypatch.setattr(rl._Pipeline, "publish", counted_publish)


@pytest.fixture(scope="module")
def slow_runs(sft_model):
    """Two runs at k = 2, one with a slow trainer, one with a slow sampler."""
    k, out = 2, {}
    for slow in ("trainer", "sampler"):
        with pytest.MonkeyPatch.context() as monkeypatch:
            recorder = Recorder(monkeypatch, k, slow)
            state = run_rl(_config(sft_model, f"slow_{slow}", k), progress=False)
        out[slow] = recorder, state, read_metrics(sft_model / f"slow_{slow}")
    return k, out


@pytest.mark.parametrize("slow", ["trainer", "sampler"])
def test_rollouts_are_k_updates_behind_and_stamped_with_their_version(slow_runs, slow):
    k, runs = slow_runs
    recorder, _, metrics = runs[slow]
    assert sorted(recorder.rollouts) == list(range(STEPS))
    for step, (version, done) in recorder.rollouts.items():
        assert version == max(0, step - k)
        assert done >= version  # the version existed: the sampler is never more than k ahead
        count, total, oldest = recorder.versions[step].T  # per trained rollout
        assert count.size > 0 and np.all(count > 0)
        np.testing.assert_array_equal(oldest, version)
        np.testing.assert_array_equal(total, count * version)  # every token by that version
    if slow == "trainer":
        assert recorder.rollouts[k][1] == 0  # step k rolled out before any update
    assert max(recorder.held) <= k + 1
    for r in metrics:
        lag = min(k, r["step"] - 1)
        assert r["staleness/mean"] == r["staleness/max"] == lag
        assert r["time/trainer_wait_s"] >= 0 and r["time/sampler_wait_s"] >= 0


def test_a_fixed_lag_gives_the_same_run_whichever_side_is_slow(slow_runs):
    _, runs = slow_runs
    assert _same_params(runs["trainer"][1].params, runs["sampler"][1].params)
    for a, b in zip(runs["trainer"][2], runs["sampler"][2], strict=True):
        assert a["loss"] == b["loss"] and a["reward/mean"] == b["reward/mean"]


def test_a_failing_sampler_ends_the_run_with_its_error(sft_model, monkeypatch):
    rollout = RLStep.rollout

    def failing(loop, params, step, rng, version, **kwargs):
        if step == 2:
            raise RuntimeError("the sandbox went away")
        return rollout(loop, params, step, rng, version, **kwargs)

    monkeypatch.setattr(RLStep, "rollout", failing)
    with pytest.raises(RuntimeError, match="the sandbox went away") as e:
        run_rl(_config(sft_model, "sampler_fails", 1), progress=False)
    assert any("RL sampler thread, rolling out step 3" in n for n in e.value.__notes__)
    assert [r["step"] for r in read_metrics(sft_model / "sampler_fails")] == [1, 2]
    assert not [t for t in threading.enumerate() if t.name == "rl-sampler"]


def test_a_failing_trainer_stops_the_rollout_in_flight(sft_model, monkeypatch):
    # At k = 1 the sampler rolls out step 3 while the trainer trains step 2. The trainer fails
    # (as on an error or a Ctrl-C) during that rollout's first decode call: the rollout ends
    # there, not at the end of the step (minutes at scale), and the run raises the error.
    rollout, train, decode = RLStep.rollout, RLStep.train, Engine.decode
    in_flight, failed = threading.Event(), threading.Event()
    current, calls = {}, []  # the sampler's step and stop event; step 3's decode calls

    def watched_rollout(loop, params, step, rng, version, **kwargs):
        current.update(step=step, stop=kwargs.get("stop"))
        return rollout(loop, params, step, rng, version, **kwargs)

    def watched_decode(engine, *args, **kwargs):
        if current["step"] == 2:
            calls.append(current["step"])
            if len(calls) == 1:  # held until the trainer has failed and asked the sampler to stop
                in_flight.set()
                # (The timeouts only turn a broken pipeline's deadlock into a failure.)
                assert failed.wait(timeout=600)
                assert current["stop"] is None or current["stop"].wait(timeout=600)
        return decode(engine, *args, **kwargs)

    def failing(loop, state, rollouts):
        if rollouts.step == 1:
            assert in_flight.wait(timeout=600)
            failed.set()
            raise FloatingPointError("the loss is NaN")
        return train(loop, state, rollouts)

    monkeypatch.setattr(RLStep, "rollout", watched_rollout)
    monkeypatch.setattr(RLStep, "train", failing)
    monkeypatch.setattr(Engine, "decode", watched_decode)
    with pytest.raises(FloatingPointError, match="the loss is NaN"):
        run_rl(_config(sft_model, "trainer_fails", 1), progress=False)
    assert [r["step"] for r in read_metrics(sft_model / "trainer_fails")] == [1]
    assert calls == [2]  # the held call, and no decode call after the stop
    assert not [t for t in threading.enumerate() if t.name == "rl-sampler"]


def test_staleness_on_several_processes_needs_rollout_devices(sft_model, monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match="rl.max_staleness=1 on several processes needs "
                                          "mesh.rollout_devices > 0"):
        run_rl(_config(sft_model, "processes", 1), progress=False)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("staleness, correction, warned", [
    (1, (), True),
    (1, ("rl.rollout_correction.weights=token",), False),
    (1, ("rl.rollout_correction.mask=token",), False),
    (0, (), False)])
def test_staleness_without_a_correction_is_warned_about(sft_model, monkeypatch, caplog,
                                                         staleness, correction, warned):
    def stop(name):
        raise _Stop  # the checks are done: nothing more of the run is needed

    monkeypatch.setattr(rl, "resolve_algorithm", stop)
    with caplog.at_level(logging.WARNING, logger=rl.__name__), pytest.raises(_Stop):
        run_rl(_config(sft_model, "warned", staleness, STEPS, *correction), progress=False)
    assert ("without rl.rollout_correction" in caplog.text) == warned


def _devices(tree) -> list[int]:
    return sorted({d.id for x in jax.tree.leaves(tree) for d in x.devices()})


@pytest.fixture
def sampled_on(monkeypatch):
    """The devices of the params each step's rollouts are sampled with, in step order."""
    seen = {}
    rollout = RLStep.rollout

    def spy(loop, params, step, rng, version, **kwargs):
        seen[step] = _devices(params)
        return rollout(loop, params, step, rng, version, **kwargs)

    monkeypatch.setattr(RLStep, "rollout", spy)
    return seen


def test_a_rollout_device_moves_the_sampler_and_changes_nothing_else(sft_model, sampled_on):
    # One training and one rollout device run the programs one device runs, on two: the run
    # is the one that shares a device, bit for bit, and each side stayed on its own device.
    d, last = sft_model, len(jax.devices()) - 1
    shared = run_rl(_config(d, "k1_shared", 1, 3), progress=False)
    on_shared = dict(sampled_on)
    start = time.perf_counter()
    split = run_rl(_config(d, "k1_split", 1, 3, "mesh.rollout_devices=1"), progress=False)
    elapsed = time.perf_counter() - start
    assert on_shared == {s: [0] for s in range(3)} and sampled_on == {s: [last] for s in range(3)}
    assert _devices(shared.params) == _devices(split.params) == [0]
    assert _same_params(shared.params, split.params)
    for a, b in zip(read_metrics(d / "k1_shared"), read_metrics(d / "k1_split"), strict=True):
        exact = {k for k in a if not k.startswith(("time/", "perf/", "logprob_mismatch/"))}
        assert {k: a[k] for k in exact} == {k: b[k] for k in exact}
        assert b["time/weight_copy_s"] >= 0
    metrics = read_metrics(d / "k1_split")
    assert all(r["groups/kept"] >= 1 for r in metrics)
    assert 0 < sum(r["time/step_s"] for r in metrics) < elapsed  # the steps' wall times add up


def test_a_tensor_parallel_rollout_mesh_serves_a_synchronous_run(sft_model, sampled_on):
    # Four rollout devices beside four training ones (fsdp 4): every step samples with a fresh
    # copy on the rollout devices alone, and the run trains.
    d, devices = sft_model, len(jax.devices())
    config = load_config(RLJobConfig, overrides=rl_overrides(
        d, "tp_rollout", 2, "mesh.fsdp=4", "mesh.rollout_devices=4"))
    state = run_rl(config, progress=False)
    assert sampled_on == {s: list(range(devices - 4, devices)) for s in range(2)}
    assert _devices(state.params) == list(range(devices - 4))
    _, initial = load_hf(d / "sft_model")
    assert not _same_params(initial, state.params)
    metrics = read_metrics(d / "tp_rollout")
    assert [r["step"] for r in metrics] == [1, 2]
    assert all(r["groups/kept"] >= 1 and r["tokens"] > 0 and r["time/weight_copy_s"] > 0
               for r in metrics)


def test_a_resume_from_a_checkpoint_without_the_versions_warns_and_samples_with_its_params(
        sft_model, monkeypatch, caplog):
    # The last checkpoint of a stage holds no policy versions (no later step samples with
    # them); a longer run resumed from it, at step r, samples steps r .. r + k - 1 with version
    # r (lag 0 .. k - 1), says so in one line, then the lag is k again.
    d, k = sft_model, 2
    run_rl(_config(d, "resumed", k, 2), progress=False)
    assert "versions" not in Checkpointer(d / "resumed" / "checkpoints").read_meta(2)
    recorder = Recorder(monkeypatch, k, slow="none")
    with caplog.at_level(logging.WARNING, logger=rl.__name__):
        run_rl(_config(d, "resumed", k, 5), progress=False)
    assert "checkpoint step 2 holds no copy of policy version(s) 0, 1, which steps 3-4 sample " \
           "with at rl.max_staleness=2" in caplog.text
    assert {s: v for s, (v, _) in recorder.rollouts.items()} == {2: 2, 3: 2, 4: 2}
    assert [(r["step"], r["staleness/max"]) for r in read_metrics(d / "resumed")] == [
        (1, 0), (2, 1), (3, 0), (4, 1), (5, 2)]


def test_partial_rollouts_take_each_update_and_stay_within_the_bound(sft_model, monkeypatch):
    # rollout.on_weight_update=keep: the trainer posts every update's weights to the sampler,
    # so rollouts in flight go on with them; a token is never older than the bound allows and
    # never newer than the updates done.
    posted = []
    post = AgentSampler.update_weights

    def record(sampler, params, version):
        posted.append(version)
        post(sampler, params, version)

    monkeypatch.setattr(AgentSampler, "update_weights", record)
    state = run_rl(_config(sft_model, "partial", 1, STEPS, "rollout.on_weight_update=keep"),
                   progress=False)
    assert posted == list(range(1, STEPS))
    metrics = read_metrics(sft_model / "partial")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert all(0 <= r["staleness/mean"] <= r["staleness/max"] <= 1 for r in metrics)
    assert int(state.step) == STEPS


def test_finish_refuses_weights_mid_rollout():
    from rstar2_jax.sampler.settings import RolloutSettings
    sampler = object.__new__(AgentSampler)  # the check comes before any engine is needed
    sampler.settings = RolloutSettings()
    with pytest.raises(ValueError, match="on_weight_update=finish"):
        sampler.update_weights({}, 1)


@pytest.mark.parametrize("k", [1, 2])
def test_sigterm_during_an_async_step_keeps_the_checkpoint_and_the_command_resumes_the_run(
        sft_model, monkeypatch, capsys, k):
    """Issue 51: SIGTERM takes Ctrl-C's path, and the same command repeats the run that never
    stopped. The signal comes while the trainer trains step 3 of 4 and the sampler rolls out
    further ahead; checkpoints 1 and 2 stay (2's save may still be in flight) and the sampler
    thread ends. Checkpoint 2 holds the policy versions steps 3 .. 2 + k sample with (k = 1:
    version 1; k = 2: versions 0 and 1), so the resumed run samples them again: its staleness
    and final weights are the uninterrupted run's."""
    d = sft_model
    # The first-update guard reads the sampler/trainer gap of rollouts the trained params
    # sampled: the run's first update; a resumed run's updates are all stale.
    checked, update = [], RLUpdate.__call__

    def recorded(self, state, batch, *, check=None):
        checked.append(check is not None)
        return update(self, state, batch, check=check)

    monkeypatch.setattr(RLUpdate, "__call__", recorded)
    uninterrupted = run_rl(_config(d, f"uninterrupted_k{k}", k), progress=False)
    assert checked == [True, False, False, False]
    command = ["rl", *rl_overrides(d, f"terminated_k{k}", STEPS, "rl.mini_batches=2",
                                   "mesh.fsdp=1", f"rl.max_staleness={k}")]
    train = RLStep.train

    def terminated(loop, state, rollouts):
        if rollouts.step == 2:
            # (Without the job's handler the signal would end the test process.)
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "SIGTERM is not handled"
            os.kill(os.getpid(), signal.SIGTERM)
        return train(loop, state, rollouts)

    monkeypatch.setattr(RLStep, "train", terminated)
    assert main(command) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"stopped by SIGTERM; run the same command again to resume from the newest checkpoint "
        f"in {d}/terminated_k{k}")
    assert not [t for t in threading.enumerate() if t.name == "rl-sampler"]
    assert Checkpointer(d / f"terminated_k{k}" / "checkpoints").steps() == [1, 2]
    assert [r["step"] for r in read_metrics(d / f"terminated_k{k}")] == [1, 2]

    monkeypatch.undo()
    monkeypatch.setattr(RLUpdate, "__call__", recorded)
    checked.clear()
    assert main(command) == 0
    assert checked == [False, False]
    resumed = restore_params(d / f"terminated_k{k}" / "checkpoints")
    assert int(resumed.state.step) == STEPS
    for a, b in zip(jax.tree.leaves(uninterrupted.params), jax.tree.leaves(resumed.state.params),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    lags = [(r["step"], r["staleness/max"]) for r in read_metrics(d / f"terminated_k{k}")]
    assert lags == [(s, min(k, s - 1)) for s in range(1, STEPS + 1)]
