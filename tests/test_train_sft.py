"""SFT: masked loss, data handling, a run that is killed and resumed to the same result, and a
resume with another model refused."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2_jax.cli import main
from rstar2_jax.config import load_config
from rstar2_jax.model import init_params, load_hf, save_hf, token_logprobs
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.train import sft
from rstar2_jax.train.checkpoint import Checkpointer, restore_params
from rstar2_jax.train.configs import OptimizerConfig, SFTConfig
from rstar2_jax.train.metrics import read_metrics
from rstar2_jax.train.optim import make_optimizer
from rstar2_jax.train.packing import PackShapes, pack
from rstar2_jax.train.sft import digit_weights, epoch_order, pack_batch, pad_batch, run_sft, sft_loss
from rstar2_jax.train.step import init_train_state, make_train_step
from rstar2_jax.train.sft_data import Conversations
from sft_setup import conversation, write_sft_setup


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random Qwen3 + toy tokenizer checkpoint and 8 tool-using conversations."""
    d = tmp_path_factory.mktemp("sft")
    tokenizer, config = write_sft_setup(d)
    return d, tokenizer, config


def _config(d, run):
    return [f"model.path={d}/model", "model.chat_format=toy", f"data={d}/sft.jsonl",
            f"run_dir={d}/{run}", "seq_len=256", "batch_size=4", "micro_batch_size=2", "epochs=3",
            "optimizer.lr=1e-2", "optimizer.warmup_steps=1", "mesh.fsdp=2", "mesh.tp=2",
            "checkpoint.every=2"]


def test_loss_counts_only_assistant_tokens(setup):
    d, tokenizer, config = setup
    ids, mask = Conversations(str(d / "sft.jsonl"), tokenizer, TOY_FORMAT, 256)[0]
    assert 0 < sum(mask) < len(ids)
    batch = {k: jnp.asarray(v) for k, v in pad_batch([(ids, mask)], 256, pad_id=0).items()}
    params = init_params(config, jax.random.key(1))
    loss_sum, count, _ = sft_loss(params, batch, model_config=config)
    assert float(count) == sum(mask[1:])  # the first token is never a target

    # Changing a prompt/tool token's *target* does not change the loss; an assistant token does.
    def loss_with(position, new_token):
        tokens = batch["tokens"].at[0, position].set(new_token)
        return float(sft_loss(params, batch | {"tokens": tokens}, model_config=config)[0])

    last = len(ids) - 1
    assert mask[last] == 1 and mask[0] == 0
    assert loss_with(last, (ids[last] + 1) % config.vocab_size) != pytest.approx(float(loss_sum))
    # Past the end (padding) nothing counts.
    assert loss_with(last + 1, 5) == pytest.approx(float(loss_sum), rel=1e-6)


def test_digit_weight_weighs_digit_targets_in_the_token_mean(setup):
    d, tokenizer, config = setup
    examples = [Conversations(str(d / "sft.jsonl"), tokenizer, TOY_FORMAT, 256)[i] for i in range(4)]
    batch = {k: jnp.asarray(v) for k, v in pad_batch(examples, 256, pad_id=0).items()}
    weights = digit_weights(tokenizer, 5.0)
    digits = [tokenizer.convert_tokens_to_ids(str(n)) for n in range(10)]
    assert sorted(np.flatnonzero(weights == 5.0)) == sorted(digits)
    assert np.all(np.delete(weights, digits) == 1.0)

    params = init_params(config, jax.random.key(1))
    loss_sum, count, _ = sft_loss(params, batch, model_config=config, token_weights=jnp.asarray(weights))
    # By hand: every assistant target's -log p, digits counted five times.
    logp = np.asarray(token_logprobs(params, config, batch["tokens"][:, :-1], batch["tokens"][:, 1:],
                                     batch["attention_mask"][:, :-1]))
    targets, mask = np.asarray(batch["tokens"][:, 1:]), np.asarray(batch["loss_mask"][:, 1:]) == 1
    w = np.where(np.isin(targets, digits), 5.0, 1.0)[mask]
    assert np.isin(targets[mask], digits).any()
    assert float(count) == pytest.approx(w.sum())
    assert float(loss_sum) == pytest.approx(-(w * logp[mask]).sum(), rel=1e-5)


def test_packed_batches_train_as_one_conversation_per_row(setup):
    """Packed rows (several conversations each) give the padded batch's loss sum, token count
    and gradients, digits weighted or not, and the same train step over two micro-batches."""
    d, tokenizer, config = setup
    examples = [Conversations(str(d / "sft.jsonl"), tokenizer, TOY_FORMAT, 256)[i] for i in range(8)]
    padded = {k: jnp.asarray(v) for k, v in pad_batch(examples, 512, pad_id=0).items()}
    packing = pack([len(ids) for ids, _ in examples], PackShapes(512, row_multiple=2))
    packed = {k: jnp.asarray(v) for k, v in pack_batch(examples, packing, pad_id=0).items()}
    assert packed["tokens"].shape == (4, 512)  # two conversations of ~220 tokens per row
    assert max(len(row) for row in packing.rows) > 1
    params = init_params(config, jax.random.key(1))
    weights = jnp.asarray(digit_weights(tokenizer, 5.0))
    for token_weights in (None, weights):
        def loss(p, batch):
            return sft_loss(p, batch, model_config=config, token_weights=token_weights)

        (value, (count, _)), grads = jax.value_and_grad(lambda p: (lambda r: (r[0], r[1:]))(loss(p, padded)),
                                                        has_aux=True)(params)
        (p_value, (p_count, _)), p_grads = jax.value_and_grad(
            lambda p: (lambda r: (r[0], r[1:]))(loss(p, packed)), has_aux=True)(params)
        assert float(p_count) == float(count)
        np.testing.assert_allclose(p_value, value, rtol=1e-5)
        for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(p_grads)[0],
                                jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))

    # Adam's first update is lr * g / (|g| + eps): with eps 1e-8 a weight whose gradient is at
    # the level of summation-order noise (1e-12 apart between the two layouts) moves lr / eps =
    # 1e6 times that (1.35e-6 on one weight on some CPUs). eps 1e-3 keeps such weights still and
    # leaves every real gradient's update at about lr.
    optimizer = make_optimizer(OptimizerConfig(lr=1e-2, warmup_steps=0, eps=1e-3), total_steps=10)
    step = make_train_step(lambda p, b: sft_loss(p, b, model_config=config), optimizer, micro_batches=2)
    fresh = lambda: init_train_state(jax.tree.map(jnp.copy, params), optimizer)  # noqa: E731 (donated)
    state, metrics = step(fresh(), padded)
    p_state, p_metrics = step(fresh(), packed)
    for name in ("loss", "tokens", "grad_norm"):
        np.testing.assert_allclose(p_metrics[name], metrics[name], rtol=1e-5, err_msg=name)
    for a, b in zip(jax.tree.leaves(p_state.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_bad_data_is_rejected_with_the_line(setup, tmp_path):
    d, tokenizer, _ = setup
    fmt = TOY_FORMAT
    with pytest.raises(ValueError, match="line 1: .* more than seq_len=50"):
        Conversations(str(d / "sft.jsonl"), tokenizer, fmt, 50)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": conversation(0)}) + "\n" + '{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match="line 2: message 0: content must be a string"):
        Conversations(str(bad), tokenizer, fmt, 256)


def test_each_process_checks_its_stripe_and_encodes_the_rest_on_demand(setup, tmp_path):
    d, tokenizer, _ = setup
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"messages": [{"role": "user"}]}\n'
                    + "".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(1, 4)))
    with pytest.raises(ValueError, match="line 1: "):
        Conversations(str(path), tokenizer, TOY_FORMAT, 256, process_index=0, process_count=2)
    # Process 1 of 2 checks lines 2 and 4; line 1 fails only when a step asks for it.
    second = Conversations(str(path), tokenizer, TOY_FORMAT, 256, process_index=1, process_count=2)
    assert len(second) == 4
    assert second[2] == Conversations(str(d / "sft.jsonl"), tokenizer, TOY_FORMAT, 256)[2]
    with pytest.raises(ValueError, match="line 1: "):
        second[0]


def test_epoch_order_is_a_seeded_permutation():
    a, b = epoch_order(10, seed=0, epoch=1), epoch_order(10, seed=0, epoch=2)
    assert sorted(a) == list(range(10)) and not np.array_equal(a, b)
    np.testing.assert_array_equal(a, epoch_order(10, seed=0, epoch=1))


_KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    import rstar2_jax.toy  # registers model.chat_format=toy
    from rstar2_jax.config import load_config
    from rstar2_jax.train.configs import SFTConfig
    from rstar2_jax.train.sft import run_sft

    def crash(step, metrics):
        if step == 4:  # right after the checkpoint at 4 was started (saves are asynchronous)
            os.kill(os.getpid(), signal.SIGKILL)

    run_sft(load_config(SFTConfig, overrides=sys.argv[1:]), on_step=crash, progress=False)
""")


def _comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in records]


@pytest.fixture(scope="module")
def full(setup):
    """The uninterrupted run of `_config`: its final state and metrics."""
    d, _, _ = setup
    # 8 conversations / batch 4 = 2 steps per epoch, 3 epochs: 6 steps.
    state = run_sft(load_config(SFTConfig, overrides=_config(d, "full")), progress=False)
    return state, read_metrics(d / "full")


def _assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=0)


def test_killed_and_resumed_run_matches_uninterrupted(setup, full):
    d, _, _ = setup
    full, full_metrics = full
    assert [r["step"] for r in full_metrics] == [1, 2, 3, 4, 5, 6]
    assert all(np.isfinite(r["loss"]) for r in full_metrics)
    assert full_metrics[-1]["loss"] < full_metrics[0]["loss"]
    assert {"loss", "tokens", "grad_norm", "lr", "perf/tokens_per_s", "time/update"} <= full_metrics[0].keys()

    proc = subprocess.run([sys.executable, "-c", _KILLED_RUN, *_config(d, "resumed")],
                          env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(d / "resumed")] == [1, 2, 3, 4]
    assert Checkpointer(d / "resumed" / "checkpoints").steps()[0] == 2

    resumed = run_sft(load_config(SFTConfig, overrides=_config(d, "resumed")), progress=False)
    assert int(resumed.step) == 6
    _assert_same_params(full.params, resumed.params)
    resumed_metrics = read_metrics(d / "resumed")
    assert [r["step"] for r in resumed_metrics] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(_comparable(full_metrics), _comparable(resumed_metrics)):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)


# Sends this process `signal` as the update of step `at` begins (step 4's save may still be in
# flight then), and runs the CLI job given on the command line.
_SIGNALLED_RUN = textwrap.dedent("""
    import os, signal, sys
    from rstar2_jax import cli
    from rstar2_jax.train import sft

    def signalled(make_train_step, signum, at):
        def make(*args, **kwargs):
            step = make_train_step(*args, **kwargs)

            def run(state, batch):
                if int(state.step) + 1 == at:
                    os.kill(os.getpid(), signum)
                return step(state, batch)
            return run
        return make

    if __name__ == "__main__":
        sft.make_train_step = signalled(sft.make_train_step, signal.Signals[sys.argv[1]], int(sys.argv[2]))
        sys.exit(cli.main(sys.argv[3:]))
""")


def test_sigterm_keeps_the_last_checkpoint_and_the_same_command_resumes_exactly(setup, full):
    """Issue 51: SIGTERM (preemption, `timeout`, `docker stop`) killed the job at once; it takes
    Ctrl-C's path now. Signalled during step 5, with step 4's save just started."""
    d, _, _ = setup
    command = ["sft", *_config(d, "terminated")]
    proc = subprocess.run([sys.executable, "-c", _SIGNALLED_RUN, "SIGTERM", "5", *command],
                          env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"stopped by SIGTERM; run the same command again to resume from the newest checkpoint "
        f"in {d}/terminated")
    assert "Traceback" not in proc.stderr
    assert [r["step"] for r in read_metrics(d / "terminated")] == [1, 2, 3, 4]
    assert Checkpointer(d / "terminated" / "checkpoints").steps() == [2, 4]

    assert main(command) == 0
    _assert_same_params(full[0].params, restore_params(d / "terminated" / "checkpoints").state.params)
    assert [r["step"] for r in read_metrics(d / "terminated")] == [1, 2, 3, 4, 5, 6]


def test_the_save_signal_saves_the_step_in_flight_and_stops(setup, full, monkeypatch, capsys):
    """checkpoint.save_signal=USR1 (SLURM's --signal=USR1@...): signalled during step 3, the
    run finishes step 3, saves it although only every fourth step is due, and stops."""
    d, _, _ = setup
    namespace = {}
    exec(_SIGNALLED_RUN, namespace)
    monkeypatch.setattr(sft, "make_train_step",
                        namespace["signalled"](sft.make_train_step, signal.SIGUSR1, at=3))
    command = ["sft", *_config(d, "usr1"), "checkpoint.every=4", "checkpoint.save_signal=USR1"]
    assert main(command) == 128 + signal.SIGUSR1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"stopped by SIGUSR1; run the same command again to resume from the newest checkpoint "
        f"in {d}/usr1")
    assert Checkpointer(d / "usr1" / "checkpoints").steps() == [3]
    assert [r["step"] for r in read_metrics(d / "usr1")] == [1, 2, 3]
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the run's handler is gone

    monkeypatch.undo()
    assert main(command) == 0
    _assert_same_params(full[0].params, restore_params(d / "usr1" / "checkpoints").state.params)


def test_a_resume_with_another_model_stops_in_one_line_and_changes_nothing(setup, tmp_path, capsys):
    """Issue 51: rerunning a run_dir with model.path at a model of another shape took orbax's
    shape error for damage, moved every checkpoint to corrupt-N, emptied metrics.jsonl and
    started over from the new model."""
    d, tokenizer, config = setup
    run = [f"model.path={d}/model", "model.chat_format=toy", f"data={d}/sft.jsonl",
           f"run_dir={tmp_path}/run", "seq_len=256", "batch_size=4", "epochs=1",
           "optimizer.warmup_steps=0", "mesh.fsdp=1", "checkpoint.every=1"]
    assert main(["sft", *run]) == 0
    capsys.readouterr()
    wider = dataclasses.replace(config, hidden_size=48)
    save_hf(tmp_path / "wide", wider, init_params(wider, jax.random.key(0)))
    tokenizer.save_pretrained(tmp_path / "wide")
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1", "2"]

    assert main(["sft", *run, f"model.path={tmp_path}/wide"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"error: checkpoint step 2 in {tmp_path}/run/checkpoints holds a run of another "
                   f"model: hidden_size=32 (model.path={d}/model), and this job's model.path="
                   f"{tmp_path}/wide has hidden_size=48: point model.path at the model the run was "
                   f"trained from, or give this job a new run_dir")
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before


def test_a_run_whose_updates_stay_non_finite_stops_in_one_line_with_finite_weights(setup, tmp_path, capsys):
    """Issue 51: a NaN or infinite loss went into every weight and the run trained on. Digits
    weighted 1e38 overflow every step's loss: each update is skipped and counted, and the run
    stops after optimizer.max_nonfinite_steps of them."""
    d, _, _ = setup
    command = ["sft", *_config(d, "overflow"), f"run_dir={tmp_path}/run", "digit_loss_weight=1e38",
               "optimizer.max_nonfinite_steps=2"]
    assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: steps 1-2 of {tmp_path}/run: the loss or gradient was not finite")
    records = read_metrics(tmp_path / "run")
    assert [(r["step"], r["update/skipped_nonfinite"]) for r in records] == [(1, 1.0), (2, 1.0)]
    assert not np.isfinite(records[0]["loss"])
    _, initial = load_hf(d / "model")
    _assert_same_params(initial, restore_params(tmp_path / "run" / "checkpoints").state.params)
