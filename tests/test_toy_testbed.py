"""The testbed runner: a tiny grid (2 arms x 2 seeds x 2 RL steps) end to end, resumed; its
summary statistics and config on made-up results; the failure split of held-out calls; the data
of the session environment."""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rstar2_jax import chat
from rstar2_jax.config import ConfigError, load_config
from rstar2_jax.sandbox import SandboxPool, render_result
from rstar2_jax.toy import testbed
from rstar2_jax.toy.build import build_toy_data
from rstar2_jax.toy.failures import (failure_kind, first_call_outcomes, is_slip, outcome_shares, positive_failures,
                                    sample_outcome)
from rstar2_jax.toy.problems import DEFAULT_KINDS
from rstar2_jax.toy.sft_data import load_demos
from rstar2_jax.toy.testbed import (
    ERROR_RATIO,
    TRACKED,
    Arm,
    metrics_table,
    result_path,
    run_testbed,
    spread,
    summarize,
    summary_markdown,
    window_mean,
)

Config = testbed.TestbedConfig  # imported under another name: pytest collects Test* classes

PNG = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).parents[1]
SESSIONS_CONFIG = REPO / "experiments" / "toy" / "testbed_sessions.yaml"
STALENESS_CONFIG = SESSIONS_CONFIG.with_name("testbed_staleness.yaml")


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    cfg = Config.smoke(str(tmp_path_factory.mktemp("testbed")))
    return cfg, run_testbed(cfg, progress=False)


def test_tiny_grid_writes_per_run_metrics_summary_and_plots(grid):
    cfg, summary = grid
    assert list(cfg.arms) == ["grpo_roc", "grpo_tool"] and cfg.seeds == [0, 1]
    for seed in cfg.seeds:
        sft = json.loads(result_path(cfg.out, "sft", seed).read_text())
        assert set(sft["eval"]["pass_at"]) == {"1", "2"}
        for arm in cfg.arms:
            run = json.loads(result_path(cfg.out, arm, seed).read_text())
            assert (run["arm"], run["seed"]) == (arm, seed)
            assert [r["step"] for r in run["metrics"]] == [1, 2]
            assert all(set(TRACKED) <= set(r) for r in run["metrics"])
            assert run["settings"]["rl"]["rollouts_per_question"] == (
                {"grpo_roc": 2, "grpo_tool": 1}[arm] * cfg.demo.rl.group_size)
    assert set(summary["arms"]) == {"sft", "grpo_roc", "grpo_tool"}
    for name, row in summary["arms"].items():
        assert row["seeds"] == [0, 1]
        assert row["pass@1"]["min"] <= row["pass@1"]["mean"] <= row["pass@1"]["max"]
        assert ("error_ratio_positives_last" in row) == (name != "sft")
    assert json.loads((Path(cfg.out) / "summary.json").read_text()) == summary
    table = (Path(cfg.out) / "summary.md").read_text()
    for label in ("after SFT", "GRPO-RoC (2G sampled, G kept)", "GRPO with tool (G sampled, all kept)"):
        assert f"| {label} | 2 |" in table
    for name in ("curves.png", "error_ratio_positives.png"):
        assert (Path(cfg.out) / name).read_bytes()[:8] == PNG
    # Held-out calls keep what the model read, which the failure split classifies.
    samples = [json.loads(line) for line in testbed.samples_path(cfg, "grpo_roc", 0).read_text().splitlines()]
    assert all({"status", "response"} <= set(c) for s in samples for c in s["tool_calls"])
    for row in summary["arms"].values():
        assert set(row["heldout_failures"]) == {"avoidable", "built_in", "other", "positives_with_avoidable"}
        assert set(row["heldout_first_calls"]) == {"slipped", "correct_after_slip", "correct_after_clean"}
    assert summary["paired"]["reference"] == "grpo_roc" and list(summary["paired"]["arms"]) == ["grpo_tool"]
    assert "Paired by seed: GRPO-RoC (2G sampled, G kept) minus each arm." in table


def test_a_step_without_positives_is_missing_not_zero(grid):
    cfg, summary = grid
    runs = [json.loads(result_path(cfg.out, arm, seed).read_text())
            for arm in cfg.arms for seed in cfg.seeds]
    steps = [r for run in runs for r in run["metrics"]]
    # The smoke policies (two SFT epochs of a tiny model) solve next to nothing.
    without = [r for r in steps if r["rollouts/positives"] == 0]
    assert without, "the tiny grid was expected to have a step without a positive rollout"
    assert all(r[ERROR_RATIO] is None for r in without)
    for arm in cfg.arms:
        measured = [window_mean(run["metrics"], ERROR_RATIO, last=cfg.window)
                    for run in runs if run["arm"] == arm]
        assert summary["arms"][arm]["error_ratio_positives_last"]["values"] == measured


def test_rerun_reads_finished_runs_back_and_other_settings_are_an_error(grid):
    cfg, summary = grid
    files = sorted(Path(cfg.out).glob("results/*/*.json"))
    stamps = [f.stat().st_mtime_ns for f in files]
    assert run_testbed(cfg, progress=False) == summary
    assert [f.stat().st_mtime_ns for f in files] == stamps
    changed = dataclasses.replace(cfg, demo=dataclasses.replace(
        cfg.demo, stage=dataclasses.replace(cfg.demo.stage, steps=3)))
    with pytest.raises(ValueError, match=r"differing: stage\.steps\)"):
        run_testbed(changed, progress=False)
    # Results saved before DemoConfig held the job configs (sft_epochs, rl_steps, max_turns, ...)
    # read back under the new names, and still differ where the settings do.
    for name in ("sft", next(iter(cfg.arms))):
        path = Path(cfg.out) / "results" / name / f"seed{cfg.seeds[0]}.json"
        result = json.loads(path.read_text())
        saved = result["settings"]
        sft, stage = saved.pop("sft"), saved.pop("stage")
        saved |= {f"sft_{key}": sft[key] for key in ("epochs", "batch_size", "digit_loss_weight", "optimizer")}
        saved |= {key: stage[key] for key in ("max_turns", "max_response_tokens")}
        if name != "sft":
            saved |= {"sft_packed": sft["packed"], "rl_steps": stage["steps"]}
        path.write_text(json.dumps(result))
    assert run_testbed(cfg, progress=False) == summary
    with pytest.raises(ValueError, match=r"differing: stage\.steps\)"):
        run_testbed(changed, progress=False)
    # A result written before an option existed reads back while the option keeps its default.
    path = Path(cfg.out) / "results" / "sft" / f"seed{cfg.seeds[0]}.json"
    result = json.loads(path.read_text())
    del result["settings"]["rollout"]["serving_dtype"]
    path.write_text(json.dumps(result))
    assert run_testbed(cfg, progress=False) == summary
    bf16 = dataclasses.replace(cfg, demo=dataclasses.replace(
        cfg.demo, rollout=dataclasses.replace(cfg.demo.rollout, serving_dtype="bfloat16")))
    with pytest.raises(ValueError, match=r"differing: rollout\.serving_dtype"):
        run_testbed(bf16, progress=False)


def _run(arm, seed, error_ratios, pass1=0.5):
    metrics = [{"step": i + 1, ERROR_RATIO: v} for i, v in enumerate(error_ratios)]
    return {"arm": arm, "seed": seed, "seconds": {"train": 10.0, "eval": 1.0}, "metrics": metrics,
            "eval": {"pass_at": {"1": pass1, "8": 0.9}, "mean_response_tokens": 100.0,
                     "tool_calls_per_sample": 1.0, "tool_error_rate": 0.1}}


def test_window_means_skip_missing_steps_and_spread_is_min_max():
    records = [{ERROR_RATIO: 0.4}, {ERROR_RATIO: None}, {}, {ERROR_RATIO: 0.2}, {ERROR_RATIO: math.nan}]
    assert window_mean(records, ERROR_RATIO, first=2) == 0.4
    assert window_mean(records, ERROR_RATIO, last=3) == 0.2
    assert window_mean(records[1:3], ERROR_RATIO, first=2) is None
    assert spread([0.1, None, 0.4]) == {"mean": 0.25, "min": 0.1, "max": 0.4, "seeds": 2,
                                       "values": [0.1, None, 0.4]}
    assert spread([None])["mean"] is None


def test_summary_marks_missing_and_partial_seeds():
    cfg = Config(out="unused", seeds=[0, 1], window=2)
    results = {"grpo_roc": [_run("grpo_roc", 0, [0.5, 0.1, 0.0]), _run("grpo_roc", 1, [None, None, None])],
               "grpo_tool": [_run("grpo_tool", 0, [None, None]), _run("grpo_tool", 1, [None])]}
    summary = summarize(cfg, results)
    roc = summary["arms"]["grpo_roc"]
    assert roc["error_ratio_positives_first"] == spread([0.3, None])
    assert roc["error_ratio_positives_last"] == spread([0.05, None])
    table = summary_markdown(summary)
    assert "30.0% [30.0, 30.0] (1/2 seeds)" in table
    assert "| GRPO with tool (G sampled, all kept) | 2 | 50.0% [50.0, 50.0] | 90.0% [90.0, 90.0] | missing | missing |" in table


def test_metrics_table_averages_steps_then_spreads_over_seeds(grid):
    cfg, summary = grid
    table = metrics_table(cfg, ["reward/mean", "response/length_mean", "rollout_correction/weight_mean"])
    lines = table.splitlines()
    assert lines[0] == ("| arm | seeds | held-out pass@1 gain (points) | reward/mean | response/length_mean | "
                        "rollout_correction/weight_mean |")
    row = next(line for line in lines if line.startswith("| GRPO-RoC (2G sampled, G kept) | 2 |"))
    cells = [c.strip() for c in row.split("|")[3:-1]]
    runs = [json.loads(result_path(cfg.out, "grpo_roc", s).read_text()) for s in cfg.seeds]
    sft = [json.loads(result_path(cfg.out, "sft", s).read_text())["eval"]["pass_at"]["1"] for s in cfg.seeds]
    gains = [100 * (r["eval"]["pass_at"]["1"] - p) for r, p in zip(runs, sft)]
    assert cells[0] == f"{sum(gains) / 2:.3g} [{min(gains):.3g}, {max(gains):.3g}]"
    for cell, key in zip(cells[1:3], ["reward/mean", "response/length_mean"]):
        means = [sum(m[key] for m in r["metrics"]) / len(r["metrics"]) for r in runs]
        assert cell == f"{sum(means) / 2:.3g} [{min(means):.3g}, {max(means):.3g}]"
    assert cells[3] == "n/a"  # no rollout correction: no step logged it


def test_failure_kinds_of_real_tool_responses():
    codes = {"pritn(1)": "avoidable", "print(gcd(4, 6))": "avoidable", "a = 3\nprint(pow(a * 2, -1, 9))": "built_in",
             "print(1/0)": "other", "print(1": "other", "print(2)": None}
    with SandboxPool(num_workers=1, timeout_s=30.0) as pool:
        results = pool.run_batch(list(codes))
    for (code, kind), result in zip(codes.items(), results):
        call = {"code": code, "status": result.status, "response": render_result(result, show_time=False)}
        assert failure_kind(call) == kind, (code, call)
    assert failure_kind({"status": "malformed", "response": "Tool call failure\nreason: ..."}) == "other"


def _sample(reward, *calls):
    return {"reward": reward, "tool_calls": [{"code": "pritn(ans)", "status": status, "response": response}
                                             for status, response in calls]}


OK = ("ok", "Tool call success\nstdout: 1")
NAME = ("error", 'Tool call failure\nstderr: Traceback (most recent call last):\n  File "<tool_code>", line 1, '
        "in <module>\n    pritn(ans)\nNameError: name 'pritn' is not defined")
BUILT_IN = ("error", "Tool call failure\nstderr: ...\nValueError: base is not invertible for the given modulus")
TIMEOUT = ("timeout", "Tool call failure\nreason: timeout")


def test_positive_failures_count_the_correct_answers_calls_by_kind():
    records = [_sample(1, NAME, OK), _sample(1, OK), _sample(1, BUILT_IN, OK), _sample(0, NAME, NAME, TIMEOUT),
               _sample(1, TIMEOUT, NAME, OK)]
    split = positive_failures(records)
    assert split == {"avoidable": 2 / 8, "built_in": 1 / 8, "other": 1 / 8, "calls": 8, "positives": 4,
                     "positives_with_avoidable": 2 / 4}
    assert positive_failures([_sample(0, NAME), _sample(1)]) is None  # no correct answer called a tool
    assert positive_failures([{"reward": 1, "tool_calls": [{"status": "ok"}]}]) is None  # before `response`
    outcomes = first_call_outcomes(records + [_sample(0), _sample(0, OK)])
    assert outcomes == {"samples": 6, "slipped": 2 / 6, "correct_after_slip": 1 / 2, "correct_after_clean": 1 / 2}
    assert first_call_outcomes([_sample(1, OK)])["correct_after_slip"] is None


def test_a_slip_fails_on_its_calls_last_line():
    codes = {"ans = 6 * 7\npritn(ans)": True, "ans = 6 * 7\nprint(answer)": True,
             "ans = primepi(7)\nprint(ans)": False, "ans = 6 * 7\nprint(1/0)": False}
    with SandboxPool(num_workers=1, timeout_s=30.0) as pool:
        results = pool.run_batch(list(codes))
    for (code, slip), result in zip(codes.items(), results):
        call = {"code": code, "status": result.status, "response": render_result(result, show_time=False)}
        assert is_slip(call) == slip, call


def test_summary_splits_heldout_failures_and_pairs_arms_by_seed(tmp_path):
    cfg = Config(out=str(tmp_path), seeds=[0, 1], window=1)
    heldout = {("sft", 0): [_sample(1, NAME, OK), _sample(1, OK)], ("sft", 1): [_sample(1, OK)],
               ("grpo_roc", 0): [_sample(1, OK), _sample(1, OK)], ("grpo_roc", 1): [_sample(1, OK), _sample(0, NAME)],
               ("grpo_tool", 0): [_sample(1, NAME, OK), _sample(1, OK)], ("grpo_tool", 1): [_sample(1, NAME, OK)]}
    for (arm, seed), records in heldout.items():
        path = testbed.samples_path(cfg, arm, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    results = {"sft": [_run("sft", s, []) for s in (0, 1)],
               "grpo_roc": [_run("grpo_roc", 0, [0.2], pass1=0.6), _run("grpo_roc", 1, [0.1], pass1=0.5)],
               "grpo_tool": [_run("grpo_tool", 0, [0.3], pass1=0.5), _run("grpo_tool", 1, [None], pass1=0.55)]}
    summary = summarize(cfg, results)
    assert summary["arms"]["sft"]["heldout_failures"]["avoidable"] == spread([1 / 3, 0.0])
    assert summary["arms"]["grpo_tool"]["heldout_failures"]["positives_with_avoidable"] == spread([0.5, 1.0])
    assert summary["arms"]["grpo_roc"]["heldout_first_calls"]["slipped"] == spread([0.0, 0.5])
    assert summary["arms"]["grpo_roc"]["heldout_first_calls"]["correct_after_slip"] == spread([None, 0.0])
    paired = summary["paired"]
    assert paired["reference"] == "grpo_roc" and list(paired["arms"]) == ["grpo_tool"]
    deltas = paired["arms"]["grpo_tool"]
    assert deltas["seeds"] == [0, 1]
    assert deltas["pass@1"] == pytest.approx([0.1, -0.05])
    assert deltas["error_ratio_positives_last"] == pytest.approx([-0.1, None])
    assert deltas["heldout_avoidable"] == pytest.approx([-1 / 3, -0.5])
    table = summary_markdown(summary)
    assert "| after SFT | 16.7% [0.0, 33.3] |" in table
    assert "| GRPO-RoC (2G sampled, G kept) | 0.0% [0.0, 0.0] | 0.0% [0.0, 0.0] | 0.0% [0.0, 0.0] | 0.0% [0.0, 0.0] " \
           "| 25.0% [0.0, 50.0] | 0.0% [0.0, 0.0] (1/2 seeds) | 100.0% [100.0, 100.0] |" in table
    assert "| vs GRPO with tool (G sampled, all kept) | avg pass@1, points | +10.0 | -5.0 | +2.5 |" in table
    assert "last 1 steps, points | -10.0 | - | -10.0 |" in table


def test_the_default_grid_is_stateless_and_the_session_environment_is_one_file_away():
    """The default grid keeps its measured environment (stateless tool, mod_inverse); the
    session environment is experiments/toy/testbed_sessions.yaml, sessions in the
    demonstrations and in RL alike."""
    default = Config().demo
    assert not default.data.tool_session and not default.rollout.tool_session
    assert default.data.kinds == list(testbed.TESTBED_KINDS)
    cfg = load_config(Config, SESSIONS_CONFIG)
    assert cfg.demo.data.tool_session and cfg.demo.rollout.tool_session
    # The five kinds it was measured on: the main job's mix before it dropped gcd_lcm.
    assert cfg.demo.data.kinds == [*DEFAULT_KINDS[:3], "gcd_lcm", DEFAULT_KINDS[3]]
    assert cfg.out == "runs/testbed_sessions"
    assert dataclasses.replace(cfg.demo, data=default.data, rollout=default.rollout) == default


def test_the_session_environment_builds_slips_whose_fix_reuses_the_session(tmp_path):
    """The data the session environment's config builds (tiny sizes): some demonstrations'
    first call fails for an avoidable reason (a misspelt name on its last line) after computing
    ``ans`` from the question's numbers; the fix, ``print(ans)``, copies no number and works only
    on the state the failed call left in the session."""
    cfg = load_config(Config, SESSIONS_CONFIG, [f"out={tmp_path}"])
    data = dataclasses.replace(cfg.demo.data, n_train=60, n_test=4, n_sft=60, vocab_size=400)
    with SandboxPool(num_workers=2, timeout_s=30.0) as pool:
        build_toy_data(tmp_path / "data", data, pool)
        demos = load_demos(tmp_path / "data" / "sft.jsonl")
        problems = {p["question"]: p for p in map(json.loads, (tmp_path / "data" / "train.jsonl").open())}
        assert {d.style for d in demos} == {"tool", "typo", "misspelt_name", "no_tool"}
        slipped = [d for d in demos if d.style in ("typo", "misspelt_name")]
        for demo in slipped:
            question = demo.messages[0]["content"]
            first, fix = (chat.parse_tool_call(m["content"]).code for m in demo.messages[1:5:2])
            responses = [m["content"] for m in demo.messages[2::2]]
            assert is_slip({"code": first, "status": "error", "response": responses[0]}), responses[0]
            numbers = re.findall(r"\d{3,}", question)
            assert all(n in first for n in numbers) and not any(n in fix for n in numbers)
            assert responses[1] == f"Tool call success\nstdout: {problems[question]['answer']}"
            with pool.session() as fresh:  # the fix alone has nothing to print
                assert "NameError: name 'ans' is not defined" in fresh.run(fix).stderr
    assert len(slipped) >= 10  # about a third of 60 demonstrations


def test_config_loads_with_overrides_and_rejects_bad_arms(tmp_path):
    cfg = load_config(Config, overrides=[
        f"out={tmp_path}", "seeds=[3,4]", "arms.dr.algorithm=dr_grpo", "arms.dr.oversample=1",
        "arms.mine.algorithm=rstar2_jax.algorithms:GSPO", "demo.stage.steps=5",
        "arms.tis.rollout_correction.weights=token", "arms.tis.rollout_correction.weight_cap=3",
        "arms.tis.max_staleness=2"])
    assert list(cfg.arms) == ["grpo_roc", "grpo_tool", "grpo_2g", "dr", "mine", "tis"]
    correction = cfg.arm_config(3, "tis").rl.rollout_correction
    assert (correction.weights, correction.weight_cap) == ("token", 3.0)
    assert cfg.arm_config(3, "dr").rl.rollout_correction.weights == "none"
    assert (cfg.arm_config(3, "tis").rl.max_staleness, cfg.arm_config(3, "dr").rl.max_staleness) == (2, 0)
    assert cfg.arm_config(4, "dr").rl.rollouts_per_question == cfg.demo.rl.group_size
    assert cfg.arm_config(4, "grpo_2g").rl.rollouts_per_question == 2 * cfg.demo.rl.group_size
    assert cfg.arm_config(4, "mine").out == os.path.join(str(tmp_path), "seed4")
    with pytest.raises(ConfigError, match="no_such_algo"):
        load_config(Config, overrides=["arms.x.algorithm=no_such_algo"])
    with pytest.raises(ValueError, match="arm names"):
        Config(arms={"../x": Arm()})
    with pytest.raises(ValueError, match="seeds"):
        Config(seeds=[1, 1])
    with pytest.raises(ValueError, match="max_staleness"):
        Arm(max_staleness=-1)
    with pytest.raises(ValueError, match="mini_batches"):
        Arm(mini_batches=0)
    with pytest.raises(ValueError, match="lr must be > 0"):
        Arm(lr=0.0)


def test_an_arm_sets_its_mini_batches_and_learning_rate_or_keeps_the_demos(tmp_path):
    cfg = load_config(Config, overrides=[f"out={tmp_path}", "demo.rl.mini_batches=2",
                                         "arms.mb.mini_batches=4", "arms.mb.lr=2.5e-4"])
    mb, roc = cfg.arm_config(0, "mb"), cfg.arm_config(0, "grpo_roc")
    assert (mb.rl.mini_batches, mb.rl_optimizer.lr) == (4, 2.5e-4)
    assert (roc.rl.mini_batches, roc.rl_optimizer.lr) == (2, cfg.demo.rl_optimizer.lr)
    assert mb.rl_optimizer.warmup_steps == cfg.demo.rl_optimizer.warmup_steps


def _script():
    """experiments/toy/testbed.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("testbed_script", SESSIONS_CONFIG.with_name("testbed.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_script_takes_overrides_after_only(tmp_path):
    script = _script()
    for argv in (["--only", "grpo_roc,grpo_2g", f"out={tmp_path}", "seeds=[4]"],
                 [f"out={tmp_path}", "--only", "grpo_roc,grpo_2g", "seeds=[4]"]):
        cfg = script.parse(argv)
        assert (cfg.out, cfg.seeds, list(cfg.arms)) == (str(tmp_path), [4], ["grpo_roc", "grpo_2g"])
    with pytest.raises(SystemExit):
        script.parse(["--only", "nope", f"out={tmp_path}"])


def test_the_staleness_arms_join_either_environments_grid():
    """experiments/toy/testbed_staleness.yaml adds GRPO-RoC at k = 0, 1, 2, 4 without and with
    token TIS to the grid of the environment named before it, its SFT policies and its out."""
    only = "grpo_roc,k0_tis,k1,k1_tis,k2,k2_tis,k4,k4_tis,k2_areal,k2_icepop,k2_m2po,k2_icepop_lr,k2_icepop_mb4,k4_icepop_mb4,k2_tis_lr"
    for files, out in (([STALENESS_CONFIG], Config().out),
                       ([SESSIONS_CONFIG, STALENESS_CONFIG], "runs/testbed_sessions")):
        cfg = _script().parse([arg for f in files for arg in ("--config", str(f))] + ["--only", only])
        assert cfg.out == out and cfg.demo == load_config(Config, files[:-1] or None).demo
        runs = {name: cfg.arm_config(0, name).rl for name in only.split(",")}
        assert {name: (rl.algorithm, rl.rollouts_per_question, rl.max_staleness,
                       rl.rollout_correction.weights) for name, rl in runs.items()} == {
            name: ("grpo_roc", 2 * cfg.demo.rl.group_size, int(name[1]) if name[0] == "k" else 0,
                   "none" if name in ("grpo_roc", "k1", "k2", "k4") else "token") for name in runs}
        rules = {name: runs[name].rollout_correction for name in ("k2_tis", "k2_areal", "k2_icepop", "k2_m2po")}
        assert {name: (c.weight_rule, c.weight_cap, c.weight_floor, c.m2_threshold) for name, c in rules.items()} == {
            "k2_tis": ("tis", 2.0, 0.5, 0.04), "k2_areal": ("areal", 5.0, 0.5, 0.04),
            "k2_icepop": ("icepop", 5.0, 0.5, 0.04), "k2_m2po": ("m2po", 2.0, 0.5, 0.04)}
        variants = {name: cfg.arm_config(0, name)
                    for name in ("k2_icepop", "k2_icepop_lr", "k2_icepop_mb4", "k4_icepop_mb4", "k2_tis_lr")}
        assert {name: (c.rl.rollout_correction, c.rl.max_staleness, c.rl.mini_batches, c.rl_optimizer.lr)
                for name, c in variants.items()} == {
            "k2_icepop": (rules["k2_icepop"], 2, 1, 1e-3), "k2_icepop_lr": (rules["k2_icepop"], 2, 1, 2.5e-4),
            "k2_icepop_mb4": (rules["k2_icepop"], 2, 4, 2.5e-4), "k4_icepop_mb4": (rules["k2_icepop"], 4, 4, 2.5e-4),
            "k2_tis_lr": (rules["k2_tis"], 2, 1, 2.5e-4)}


def _answered(question, boxed, *calls, reward=0.0, finish="answer"):
    return {"problem": 0, "question": question, "reward": reward, "finish_reason": finish,
            "response_text": f"It printed it.</reason>\n<answer>\\boxed{{{boxed}}}</answer>",
            "tool_calls": [{"code": code, "status": status, "response": response} for code, status, response in calls]}


def test_sample_outcome_tells_why_a_held_out_answer_is_wrong():
    q = "What is 10433 * 984415 mod 9696?"
    ran = lambda code, out: (code, "ok", f"Tool call success\nstdout: {out}")
    cases = {
        "right": _answered(q, "2827", ran("print(10433 * 984415 % 9696)", "2827"), reward=1.0),
        "unfinished": _answered(q, "", ran("print(10433 * 984415 % 9696)", "2827"), finish="budget"),
        "no_tool": _answered(q, "17"),
        "failed_call": _answered(q, "17", ("pritn(1)", "error", NAME[1]), ("print(2)", "timeout", TIMEOUT[1])),
        # One digit dropped: 10433 -> 1043.
        "miscopied": _answered(q, "5", ran("print(1043 * 984415 % 9696)", "5")),
        # The program is right and ran (after a failing call), the answer is not what it printed.
        "misread": _answered(q, "2872", ("pritn(1)", "error", NAME[1]), ran("print(10433 * 984415 % 9696)", "2827")),
        "other_program": _answered(q, "1", ran("print(10433 * 984415 // 9696)", "1")),
    }
    for outcome, record in cases.items():
        assert sample_outcome(record) == outcome, outcome
    repeated = _answered("What is gcd(12, 12) + lcm(5, 7)?", "47", ran("print(gcd(12, 5) + lcm(5, 7))", "36"))
    assert sample_outcome(repeated) == "miscopied"  # 12 twice in the question, once in the program


def test_outcome_shares_split_by_kind_and_the_script_tabulates_a_run(tmp_path):
    q = "What is 10433 * 984415 mod 9696?"
    right = _answered(q, "2827", ("print(10433 * 984415 % 9696)", "ok", "Tool call success\nstdout: 2827"), reward=1.0)
    head = _answered(q, "17")
    records = [right, head, dict(head, problem=1), dict(head, problem=1)]
    shares = outcome_shares(records, kinds=["mod_product", "gcd_lcm"])
    assert shares["all"]["right"] == 0.25 and shares["all"]["no_tool"] == 0.75
    assert shares["mod_product"]["right"] == 0.5 and shares["gcd_lcm"]["no_tool"] == 1.0
    assert all(abs(sum(s.values()) - 1) < 1e-12 for s in shares.values())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "test.jsonl").write_text(
        "".join(json.dumps({"kind": k}) + "\n" for k in ["mod_product", "gcd_lcm"]))
    for name, rows in {"eval_rl": records, "eval_sft": [head] * 4}.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(REPO / "experiments/toy/heldout_errors.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith("| run, policy | right | unfinished | no_tool |")
    sft_row, rl_row = (line.split(" | ") for line in out[2:])
    assert sft_row[0].endswith(" sft") and sft_row[1:4] == ["0.0", "0.0", "100.0"]
    assert rl_row[0].endswith(" rl") and rl_row[1:4] == ["25.0", "0.0", "75.0"]
    assert rl_row[-2:] == ["0", "50 |"]  # right per kind, in name order: gcd_lcm, mod_product
