"""Two JAX processes of 2 CPU devices each as one run, against one process of 4 devices.

Each process is a fresh interpreter started the way a cluster launcher starts one (the
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables), running the CLI.
"""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from rstar2_jax.cli import main
from rstar2_jax.config import ConfigError, load_config
from rstar2_jax.parallel.distributed import free_port, initialize_from_env
from rstar2_jax.train.checkpoint import Checkpointer
from rl_setup import copied_rl_setup, rl_overrides
from rstar2_jax.train.configs import RLJobConfig, SFTConfig
from rstar2_jax.train.metrics import read_metrics
from rstar2_jax.rl.loop import run_rl
from rstar2_jax.train.sft import run_sft
from sft_setup import write_sft_setup

# The CLI, with the toy chat format registered (a fresh `python -m rstar2_jax` does not know it).
_CLI = "import sys, rstar2_jax.toy; from rstar2_jax.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture(scope="module")
def sft_setup(tmp_path_factory):
    """A tiny random Qwen3 with the toy tokenizer and 8 tool-using conversations."""
    d = tmp_path_factory.mktemp("multiprocess")
    write_sft_setup(d)
    return d


def _sft_args(d, run, epochs=3):
    # 8 conversations / batch 4: 2 steps per epoch. fsdp over the processes, tp within each.
    return ["sft", f"model.path={d}/model", "model.chat_format=toy", f"data={d}/sft.jsonl",
            f"run_dir={d}/{run}", "seq_len=256", "batch_size=4", "micro_batch_size=2",
            f"epochs={epochs}", "optimizer.lr=1e-2", "optimizer.warmup_steps=1", "mesh.fsdp=2",
            "mesh.tp=2", "checkpoint.every=2"]


@pytest.fixture(scope="module")
def rl_setup(tmp_path_factory):
    """A tiny Qwen3 fine-tuned to half guess a task with answers 1 or 2, and its problems."""
    return copied_rl_setup(tmp_path_factory, "multiprocess_rl")


def _rl_args(d, run, steps=2):
    # 4 questions x 8 rollouts per step, 2 questions per process; fsdp over the processes.
    return ["rl", *rl_overrides(d, run, steps, "mesh.fsdp=2", "mesh.tp=2")]


def _start(args, processes=2, devices=2):
    """`processes` CLI processes of one run, each with `devices` CPU devices."""
    address = f"127.0.0.1:{free_port()}"
    children = []
    for index in range(processes):
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=address,
                   JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(index))
        children.append(subprocess.Popen([sys.executable, "-c", _CLI, *args], env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return children


def _finish(children, timeout=600):
    outs = [c.communicate(timeout=timeout) for c in children]
    return [(c.returncode, err) for c, (_, err) in zip(children, outs)]


def _wait_for(predicate, children, timeout=600):
    deadline = time.monotonic() + timeout
    while not predicate():
        if any(c.poll() is not None for c in children):
            raise AssertionError(f"a process ended early: {_finish(children)}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in records]


def _crash_resume_and_compare(d, args, reference, last_step, kill_after):
    """Runs `args` as 2 processes, kills process 1 once the step-`kill_after` checkpoint is
    written (process 0 must stop too, with a message, within 60 s), starts them again to finish,
    and compares metrics and final params with the 1-process `reference` run in `d/one`."""
    run = d / "two"
    children = _start(args)
    _wait_for(lambda: (run / "checkpoints" / str(kill_after)).is_dir(), children)
    children[1].send_signal(signal.SIGKILL)
    start = time.monotonic()
    _, err = children[0].communicate(timeout=120)
    elapsed = time.monotonic() - start
    _finish(children[1:])
    assert children[0].returncode != 0
    assert "another task died" in err, err[-3000:]
    assert elapsed < 60, elapsed

    # Started again, the run resumes from its last checkpoint and finishes.
    results = _finish(_start(args))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]

    # Written once (by process 0), one record per step, the same values as one process's.
    one, two = read_metrics(d / "one"), read_metrics(run)
    assert [r["step"] for r in two] == list(range(1, last_step + 1))
    for a, b in zip(_comparable(one), _comparable(two), strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    checkpoints = Checkpointer(run / "checkpoints")
    restored = checkpoints.restore(last_step, reference)
    checkpoints.close()
    for a, b in zip(jax.tree.leaves(reference.params), jax.tree.leaves(restored.state.params),
                    strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)
    return one


# Minutes of end-to-end processes: the slow tier (`python -m pytest -m slow`), not CI.
@pytest.mark.slow
def test_two_processes_survive_a_crash_and_match_one_process(sft_setup):
    d = sft_setup
    # The reference: one process, 4 of this test process's devices, the same mesh shape.
    reference = run_sft(load_config(SFTConfig, overrides=_sft_args(d, "one")[1:]), progress=False)
    _crash_resume_and_compare(d, _sft_args(d, "two"), reference, last_step=6, kill_after=4)


@pytest.mark.slow
def test_rl_eval_and_hard_subset_across_two_processes_match_one_process(rl_setup):
    # Each process rolls out 2 of the step's 4 questions with its own sandbox and verifier
    # pools; the run equals one process's rolling out all 4, through a crash and a resume.
    d = rl_setup
    reference = run_rl(load_config(RLJobConfig, overrides=_rl_args(d, "one")[1:]), progress=False)
    one = _crash_resume_and_compare(d, _rl_args(d, "two"), reference, last_step=2, kill_after=1)
    assert all(r["groups/kept"] >= 1 and r["tokens"] > 0 for r in one)  # both steps trained

    # Evaluation: 15 problems taken from the shared queue; process 0 writes every
    # record, sample for sample one process's draws. Not always bit for bit: a row resumed after
    # a tool call runs batched with whichever rows' results arrived with it, so float noise can
    # flip a near-tie draw (1 sample of 60 here, once).
    sampling = ["model.chat_format=toy", "max_turns=2", "max_response_tokens=160",
                "max_prompt_tokens=128", "rollout.num_slots=8", "rollout.sandbox_workers=1",
                "temperature=1.0"]
    evaluation = ["eval", f"model.path={d}/sft_model", f"dataset={d}/train.jsonl", "samples=4",
                  "limit=15", *sampling]
    assert main([*evaluation, f"output={d}/eval_one.jsonl"]) == 0
    results = _finish(_start([*evaluation, f"output={d}/eval_two.jsonl"], devices=1))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    one_eval = (d / "eval_one.jsonl").read_text().splitlines()
    assert len(one_eval) == 15 * 4 and 0 < sum(json.loads(x)["reward"] for x in one_eval) < 60
    two_eval = (d / "eval_two.jsonl").read_text().splitlines()
    key = lambda line: (json.loads(line)["problem"], json.loads(line)["sample"])  # noqa: E731
    assert [key(x) for x in two_eval] == [key(x) for x in one_eval]
    assert sum(a == b for a, b in zip(one_eval, two_eval)) >= 0.9 * len(one_eval)

    # The hard subset of the 2-process RL run's policy (restored by each process), 2 processes.
    stage3 = [*_rl_args(d, "stage3")[1:], f"stage.init_from={d}/two",
              f"hard_subset.source={d}/train.jsonl", "hard_subset.samples=4"]
    assert main(["hard-subset", *stage3, f"hard_subset.output={d}/hard_one.jsonl"]) == 0
    results = _finish(_start(["hard-subset", *stage3, f"hard_subset.output={d}/hard_two.jsonl"]))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    hard = (d / "hard_one.jsonl").read_text()
    assert 0 < len(hard.splitlines()) < 16 and (d / "hard_two.jsonl").read_text() == hard


@pytest.mark.slow
@pytest.mark.parametrize("job", ["sft", "rl"])
def test_packed_batches_across_two_processes_train_as_one_padded_process(job, request):
    # Each process packs its own rows; the processes agree on the row count (the most any of
    # them needs), and the run trains as one process's right-padded rows do.
    d = request.getfixturevalue(f"{job}_setup")
    if job == "sft":
        args, config, run, last_step = _sft_args(d, "two_packed", epochs=1), SFTConfig, run_sft, 2
        reference = [*_sft_args(d, "one_padded", epochs=1)[1:], "packed=false"]
        packed = "packed=true"
    else:
        args, config, run, last_step = _rl_args(d, "two_packed"), RLJobConfig, run_rl, 2
        reference = [*_rl_args(d, "one_padded")[1:], "rl.packed=false"]
        packed = "rl.packed=true"
    # Adam's eps: see tests/test_rl_loop.py::test_packed_rl_steps_train_as_padded_ones.
    reference = run(load_config(config, overrides=[*reference, "optimizer.eps=1e-4"]), progress=False)
    results = _finish(_start([*args, packed, "optimizer.eps=1e-4"]))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    assert "packed rows" in results[0][1]
    one, two = read_metrics(d / "one_padded"), read_metrics(d / "two_packed")
    assert [r["step"] for r in two] == list(range(1, last_step + 1))
    for a, b in zip(_comparable(one), _comparable(two), strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    checkpoints = Checkpointer(d / "two_packed" / "checkpoints")
    restored = checkpoints.restore(last_step, reference)
    checkpoints.close()
    for a, b in zip(jax.tree.leaves(reference.params), jax.tree.leaves(restored.state.params),
                    strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)
    if job == "rl":
        assert all(r["groups/kept"] >= 1 and r["tokens"] > 0 for r in one)  # both steps trained


@pytest.mark.slow
def test_asynchronous_rl_across_two_processes_matches_one_process(rl_setup):
    # rl.max_staleness=1 with one rollout device per host: each host's sampler thread rolls out
    # on its own device, from the copy the trainers' all-gather put there, and exchanges through
    # the key-value store while the trainers' collectives run. The run equals one process's with
    # the same training mesh (fsdp 2) and a rollout device of its own.
    d = rl_setup
    extra = ["mesh.tp=1", "mesh.rollout_devices=1", "rl.max_staleness=1"]
    reference = run_rl(load_config(RLJobConfig, overrides=[*_rl_args(d, "async_one", 3)[1:], *extra]),
                       progress=False)
    results = _finish(_start([*_rl_args(d, "async_two", 3), *extra]))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    one, two = read_metrics(d / "async_one"), read_metrics(d / "async_two")
    assert [(r["step"], r["staleness/max"]) for r in two] == [(1, 0), (2, 1), (3, 1)]
    for a, b in zip(_comparable(one), _comparable(two), strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    assert all(r["groups/kept"] >= 1 and r["tokens"] > 0 for r in one)
    checkpoints = Checkpointer(d / "async_two" / "checkpoints")
    restored = checkpoints.restore(3, reference)
    checkpoints.close()
    for a, b in zip(jax.tree.leaves(reference.params), jax.tree.leaves(restored.state.params),
                    strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)


def _start_claims_worker(*args):
    """The 2 processes of tests/claims_worker.py, 1 CPU device each."""
    address = f"127.0.0.1:{free_port()}"
    worker = os.path.join(os.path.dirname(__file__), "claims_worker.py")
    return [subprocess.Popen(
        [sys.executable, worker, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
                 JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2",
                 JAX_PROCESS_ID=str(index)))
        for index in range(2)]


def test_hosts_taking_questions_from_a_shared_queue_sample_the_in_order_step():
    # Process 1 takes one question and waits while process 0 takes the other five: each rolls
    # out what it took, and the step they gather is, token for token and log-prob for log-prob,
    # the one a single process samples in order.
    children = _start_claims_worker()
    outs = [c.communicate(timeout=600) for c in children]
    assert [c.returncode for c in children] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    assert [json.loads(out.splitlines()[-1]) for out, _ in outs] == [[1, 2, 3, 4, 5], [0]]


def test_a_host_dying_after_its_claim_stops_the_other_with_a_message():
    children = _start_claims_worker("die")
    _, err = children[0].communicate(timeout=600)
    children[1].communicate(timeout=60)
    assert children[1].returncode == 3
    assert children[0].returncode != 0
    assert "another task died" in err, err[-3000:]


def test_exchanges_pair_by_channel_and_weights_reach_each_hosts_rollout_device(tmp_path):
    # Two processes of 2 CPU devices, one training and one rollout device each
    # (tests/hosts_worker.py): a sampler thread's and a trainer's exchanges, made in opposite
    # orders, pair up by channel; the trainer's params, sharded over both processes, arrive
    # whole on each host's own rollout device in the serving dtype, and that copy, saved in a
    # checkpoint as an asynchronous run's policy version, comes back to it the same.
    address = f"127.0.0.1:{free_port()}"
    worker = os.path.join(os.path.dirname(__file__), "hosts_worker.py")
    children = [subprocess.Popen(
        [sys.executable, worker, str(tmp_path / "checkpoints")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
                 JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2",
                 JAX_PROCESS_ID=str(index)))
        for index in range(2)]
    outs = [c.communicate(timeout=600) for c in children]
    assert [c.returncode for c in children] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    seen = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    # Round r of a channel: process 0 sent one row of 10r, process 1 two rows of 10r + 1.
    rounds = [[[10 * r] * 2, [10 * r + 1] * 2, [10 * r + 1] * 2] for r in range(3)]
    for s in seen:
        assert s["seen"] == {"rollout": rounds, "train": rounds}
        # Only the channels' last messages stay: the train channel's round 2, the rollout
        # channel's 5 (and 4 while the other process has not deleted its part yet).
        assert s["left"]["train"] == ["2"] and "5" in s["left"]["rollout"]
        assert set(s["left"]["rollout"]) <= {"4", "5"}
        assert s["train_sharded"] and s["same"] and s["dtypes"] == ["bfloat16"]
        assert s["devices"] == s["rollout"] and len(s["rollout"]) == 1
        assert s["version_back"] and s["version_devices"] == s["rollout"]
    assert seen[0]["rollout"] != seen[1]["rollout"]
    assert seen[0]["delivered"] == [{"b": 1}, ["c"]] and seen[1]["delivered"] == ["a", ["c"]]


def test_launcher_runs_n_processes_and_stops_them_on_failure(capfd):
    # The toy demo does not run across processes yet: both processes join the run, then stop
    # with a message, and the launcher reports the failure.
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        rc = main(["launch", "--processes", "2", "demo"])
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert rc == 2
    err = capfd.readouterr().err
    assert "demo does not run across processes yet" in err and "launch: process" in err


@pytest.mark.parametrize("environ, message", [
    ({"JAX_NUM_PROCESSES": "2"}, "JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID not set"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2", "JAX_COORDINATOR_ADDRESS": "h:1"},
     r"JAX_PROCESS_ID=2 is not in 0 \.\. 1"),
    ({"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0", "JAX_COORDINATOR_ADDRESS": "h:1"},
     "must be integers"),
])
def test_bad_environment_is_rejected(environ, message):
    with pytest.raises(ConfigError, match=message):
        initialize_from_env(environ)


def test_one_process_without_the_environment():
    assert initialize_from_env({}) is False
    assert initialize_from_env({"SLURM_NTASKS": "1"}) is False
