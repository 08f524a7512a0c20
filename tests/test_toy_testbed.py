"""The testbed runner: a tiny grid (2 arms x 2 seeds x 2 RL steps) end to end, resumed; its
summary statistics and config on made-up results."""
import dataclasses
import json
import math
import os
from pathlib import Path

import pytest

from rstar2_jax.config import ConfigError, load_config
from rstar2_jax.toy import testbed
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
    changed = dataclasses.replace(cfg, demo=dataclasses.replace(cfg.demo, rl_steps=3))
    with pytest.raises(ValueError, match="rl_steps"):
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


def test_config_loads_with_overrides_and_rejects_bad_arms(tmp_path):
    cfg = load_config(Config, overrides=[
        f"out={tmp_path}", "seeds=[3,4]", "arms.dr.algorithm=dr_grpo", "arms.dr.oversample=1",
        "arms.mine.algorithm=rstar2_jax.algorithms:GSPO", "demo.rl_steps=5",
        "arms.tis.rollout_correction.weights=token", "arms.tis.rollout_correction.weight_cap=3"])
    assert list(cfg.arms) == ["grpo_roc", "grpo_tool", "grpo_2g", "dr", "mine", "tis"]
    correction = cfg.arm_config(3, "tis").rl.rollout_correction
    assert (correction.weights, correction.weight_cap) == ("token", 3.0)
    assert cfg.arm_config(3, "dr").rl.rollout_correction.weights == "none"
    assert cfg.arm_config(4, "dr").rl.rollouts_per_question == cfg.demo.rl.group_size
    assert cfg.arm_config(4, "grpo_2g").rl.rollouts_per_question == 2 * cfg.demo.rl.group_size
    assert cfg.arm_config(4, "mine").out == os.path.join(str(tmp_path), "seed4")
    with pytest.raises(ConfigError, match="no_such_algo"):
        load_config(Config, overrides=["arms.x.algorithm=no_such_algo"])
    with pytest.raises(ValueError, match="arm names"):
        Config(arms={"../x": Arm()})
    with pytest.raises(ValueError, match="seeds"):
        Config(seeds=[1, 1])
