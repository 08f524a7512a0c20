"""Config loading: YAML + overrides into frozen dataclasses, with errors that name the key."""
import dataclasses

import pytest

from rstar2_jax import chat
from rstar2_jax.config import ConfigError, config_from_dict, config_to_dict, load_config
from rstar2_jax.train.configs import OptimizerConfig, RLJobConfig, SFTConfig

REQUIRED_RL = ["model.path=/ckpt", "run_dir=/run", "stage.name=s1", "stage.steps=3",
               "stage.dataset=/d.jsonl"]


def test_paper_defaults():
    cfg = load_config(RLJobConfig, overrides=REQUIRED_RL)
    assert cfg.optimizer == OptimizerConfig(lr=1e-6, schedule="constant", warmup_steps=20,
                                            weight_decay=0.01, grad_clip=1.0)
    assert (cfg.rl.algorithm, cfg.rl.temperature) == ("grpo_roc", 1.0)
    assert (cfg.rl.rollouts_per_question, cfg.rl.group_size) == (32, 16)
    assert cfg.rl.questions_per_step == 512


def test_yaml_then_overrides_in_order(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("optimizer:\n  lr: 3.0e-6\n  schedule: cosine\nrl:\n  group_size: 8\n")
    cfg = load_config(RLJobConfig, path, REQUIRED_RL + ["rl.group_size=4", "rl.group_size=2",
                                                        "rl.rollouts_per_question=4"])
    assert cfg.optimizer.lr == 3e-6 and cfg.optimizer.schedule == "cosine"
    assert cfg.rl.group_size == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rl.group_size = 3  # type: ignore[misc]


def test_several_yaml_files_apply_in_order(tmp_path):
    first, second = tmp_path / "env.yaml", tmp_path / "arms.yaml"
    first.write_text("optimizer:\n  lr: 3.0e-6\nrl:\n  group_size: 8\n")
    second.write_text("rl:\n  group_size: 4\n  max_staleness: 2\n")
    cfg = load_config(RLJobConfig, [first, second], REQUIRED_RL)
    assert (cfg.optimizer.lr, cfg.rl.group_size, cfg.rl.max_staleness) == (3e-6, 4, 2)
    assert load_config(RLJobConfig, [second, first], REQUIRED_RL).rl.group_size == 8
    second.write_text("rl:\n  clip_low: 0.1\n")
    with pytest.raises(ConfigError, match=r"rl\.clip_low.*arms\.yaml"):
        load_config(RLJobConfig, [first, second], REQUIRED_RL)
    with pytest.raises(ConfigError, match="nowhere.yaml.*does not exist"):
        load_config(RLJobConfig, [first, tmp_path / "nowhere.yaml"], REQUIRED_RL)


@pytest.mark.parametrize("override, named", [
    ("optimizer.lrr=1e-5", "optimizer.lrr"),
    ("rl.mini_batches=two", "rl.mini_batches"),
    ("optimizer.schedule=linear", "optimizer.schedule"),
    ("optimizer.lr=-1", "optimizer.lr"),
    ("rl.group_size=64", "rl.group_size"),
    ("rl.algorithm=grpo-roc", "rl.algorithm: unknown algorithm 'grpo-roc'"),
    ("rl.algorithm=no_such_module_xyz:ALG", "rl.algorithm: cannot import module 'no_such_module_xyz'"),
    ("rl.algorithm=rstar2_jax.algorithms:NOPE", "rl.algorithm: module 'rstar2_jax.algorithms' has no 'NOPE'"),
    ("rollout.tool_response_chars=10", "rollout.tool_response_chars"),
    ("rollout.sandbox_workers=0", "rollout.sandbox_workers"),
    ("rollout.verifier_timeout_s=0", "rollout.verifier_timeout_s"),
    ("rollout.verifier_timeout_s=inf", "rollout.verifier_timeout_s"),
    ("rollout.verifier_timeout_s=nan", "rollout.verifier_timeout_s"),
    ("nonsense", "nonsense"),
])
def test_bad_override_names_the_key(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(RLJobConfig, overrides=REQUIRED_RL + [override])


def test_bad_yaml_key_names_key_and_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("rl:\n  clip_low: 0.1\n")
    with pytest.raises(ConfigError, match=r"rl\.clip_low.*job\.yaml"):
        load_config(RLJobConfig, path, REQUIRED_RL)


def test_chat_format_is_a_registered_name():
    with pytest.raises(ConfigError, match=r"model\.chat_format must be one of .*rstar2.*'qwen'"):
        load_config(RLJobConfig, overrides=REQUIRED_RL + ["model.chat_format=qwen"])
    terse = chat.ChatFormat(system_prompt="Be brief.", user_template="Q: {question}")
    chat.register_format("test_terse", terse)
    chat.register_format("test_terse", terse)  # a module imported twice registers again
    cfg = load_config(RLJobConfig, overrides=REQUIRED_RL + ["model.chat_format=test_terse"])
    assert chat.get_format(cfg.model.chat_format) == terse
    with pytest.raises(ValueError, match="already registered"):
        chat.register_format("test_terse", chat.ChatFormat())
    with pytest.raises(ValueError, match="unknown chat format 'qwen'; registered: .*rstar2"):
        chat.get_format("qwen")


def test_missing_required_keys_are_listed():
    with pytest.raises(ConfigError, match=r"data.*model\.path.*run_dir"):
        load_config(SFTConfig)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(SFTConfig, "/nonexistent/sft.yaml")


def test_micro_batch_must_divide_batch():
    with pytest.raises(ConfigError, match="micro_batch_size"):
        load_config(SFTConfig, overrides=["model.path=/m", "data=/d", "run_dir=/r",
                                          "batch_size=8", "micro_batch_size=3"])


def test_dict_round_trip():
    cfg = load_config(RLJobConfig, overrides=REQUIRED_RL + ["hard_subset.source=/a",
                                                            "hard_subset.output=/b"])
    assert config_from_dict(RLJobConfig, config_to_dict(cfg)) == cfg
    assert cfg.hard_subset is not None and cfg.hard_subset.samples == 8


# --- one rule for every number (issue 51, item 4) ------------------------------------------------

def _numbers(config, prefix=""):
    """(dotted key, value, field) of every number in a loaded config."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            yield from _numbers(value, f"{prefix}{f.name}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield prefix + f.name, value, f


def _jobs():
    from rstar2_jax.toy.demo import DemoConfig
    from rstar2_jax.train.configs import EvalConfig
    from rstar2_jax.rl.scale_plan import ScalePlanConfig

    return [(RLJobConfig, REQUIRED_RL), (SFTConfig, ["model.path=/m", "data=/d", "run_dir=/r"]),
            (EvalConfig, ["model.path=/m", "dataset=/d", "output=/o"]), (DemoConfig, []),
            (ScalePlanConfig, [])]


@pytest.mark.parametrize("schema, required", _jobs(), ids=lambda x: getattr(x, "__name__", ""))
def test_every_number_of_every_job_is_finite_and_not_negative(schema, required):
    """`optimizer.lr=inf`, `rl.temperature=inf`, `rl.entropy_coef=inf`, `optimizer.weight_decay=inf`
    and `seed=-1` were accepted and trained NaN or died in numpy (the checks were one-sided).
    Infinity is accepted only where it means something (the field's metadata says what)."""
    numbers = list(_numbers(load_config(schema, overrides=required)))
    assert numbers
    for key, value, f in numbers:
        last = key.rpartition(".")[2]
        with pytest.raises(ConfigError, match=last):
            load_config(schema, overrides=required + [f"{key}=-1"])
        if isinstance(value, float):
            for bad in (["nan"] if "infinity" in f.metadata else ["inf", "1e308", "nan"]):
                with pytest.raises(ConfigError, match=last):
                    load_config(schema, overrides=required + [f"{key}={bad}"])
        else:
            with pytest.raises(ConfigError, match=last):
                load_config(schema, overrides=required + [f"{key}={2**63}"])


def test_infinity_is_accepted_where_it_has_a_meaning():
    config = load_config(RLJobConfig, overrides=REQUIRED_RL + [
        "optimizer.grad_clip=inf", "rl.rollout_correction.weights=token",
        "rl.rollout_correction.weight_cap=inf", "rl.rollout_correction.mask=token",
        "rl.rollout_correction.mask_high=inf"])
    assert config.optimizer.grad_clip == config.rl.rollout_correction.weight_cap == float("inf")
    assert config.rl.rollout_correction.mask_high == float("inf")


@pytest.mark.parametrize("override, message", [
    ("seed=-1", "config key 'seed': must be a number >= 0, got -1"),
    ("optimizer.lr=inf", "config key 'optimizer.lr': must be finite in float32 (at most 3.4e38), got inf"),
    ("optimizer.lr=1e308", "config key 'optimizer.lr': must be finite in float32"),
    ("optimizer.eps=0", "optimizer.eps must be > 0"),
    ("optimizer.eps=-1", "optimizer.eps"),
    ("optimizer.grad_clip=nan", "config key 'optimizer.grad_clip': must be a number >= 0, got nan"),
    ("rl.rollout_correction.weight_cap=-inf", "config key 'rl.rollout_correction.weight_cap': must be a number >= 0"),
])
def test_the_settings_that_ruined_a_run_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(RLJobConfig, overrides=REQUIRED_RL + [override])
    assert message in str(e.value) and "\n" not in str(e.value)
