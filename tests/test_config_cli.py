"""The command line: config errors name the key and exit 2."""
from pathlib import Path

from rstar2_jax.cli import main

SFT_YAML = Path(__file__).resolve().parents[1] / "experiments" / "paper" / "sft.yaml"


def test_bad_override_exits_2_naming_the_key(capsys):
    assert main(["sft", "--config", str(SFT_YAML), "optimizer.lrr=1e-5"]) == 2
    assert "optimizer.lrr" in capsys.readouterr().err


def test_bad_value_in_scale_plan_names_the_key(capsys):
    assert main(["scale-plan", "model=gpt-5"]) == 2
    assert "'model'" in capsys.readouterr().err


def test_bad_demo_key_exits_2_naming_it(capsys):
    assert main(["demo", "rl_stepz=3"]) == 2
    assert "rl_stepz" in capsys.readouterr().err


def test_a_negative_seed_is_one_line_before_any_work(capsys):
    """Issue 51: `seed=-1` passed the config and the first RL step died in numpy's traceback."""
    assert main(["rl", "model.path=/nowhere", "run_dir=/tmp/x", "stage.name=s", "stage.steps=1",
                 "stage.dataset=/nowhere.jsonl", "seed=-1"]) == 2
    assert capsys.readouterr().err.strip() == "error: config key 'seed': must be a number >= 0, got -1"
