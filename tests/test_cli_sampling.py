"""The `eval` and `hard-subset` commands end to end on a tiny random policy."""
import json

import jax

from rstar2_jax.cli import main
from rstar2_jax.data.datasets import Problem, load_problems, save_problems
from rstar2_jax.model import ModelConfig, init_params, save_hf
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.toy.tokenizer import build_tokenizer
from rstar2_jax.train.checkpoint import Checkpointer
from rstar2_jax.train.configs import RLJobConfig
from rstar2_jax.config import load_config
from rstar2_jax.train.run import start_run

LIMITS = ["max_turns=2", "max_response_tokens=12", "max_prompt_tokens=96", "rollout.num_slots=4",
          "rollout.sandbox_workers=1"]


def _policy(tmp_path):
    problems = [Problem(f"What is {i} + 1?", str(i + 1)) for i in range(3)]
    save_problems(tmp_path / "problems.jsonl", problems)
    tokenizer = build_tokenizer([TOY_FORMAT.prompt_text(p.question) for p in problems] * 5,
                                vocab_size=300)
    config = ModelConfig(model_type="qwen3", vocab_size=len(tokenizer), hidden_size=16,
                         intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=8, qk_norm=True)
    save_hf(tmp_path / "model", config, init_params(config, jax.random.key(0)))
    tokenizer.save_pretrained(tmp_path / "model")
    return problems


def test_eval_writes_one_line_per_sample(tmp_path, capsys):
    _policy(tmp_path)
    out = tmp_path / "samples.jsonl"
    assert main(["eval", f"model.path={tmp_path}/model", "model.chat_format=toy",
                 f"dataset={tmp_path}/problems.jsonl", f"output={out}", "samples=2",
                 "limit=2", *LIMITS]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted((r["problem"], r["sample"]) for r in lines) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["reward"] == 0.0 for r in lines)  # a random policy never boxes the answer
    assert "2 problems x 2 samples: pass@1 0.0%" in capsys.readouterr().out


def test_hard_subset_keeps_unsolved_problems_of_the_stage_start(tmp_path, capsys):
    problems = _policy(tmp_path)
    overrides = [f"model.path={tmp_path}/model", "model.chat_format=toy",
                 f"run_dir={tmp_path}/stage2", "stage.name=s", "stage.steps=1",
                 f"stage.dataset={tmp_path}/problems.jsonl", "stage.max_turns=2",
                 "stage.max_response_tokens=12", "rl.max_prompt_tokens=96", "mesh.fsdp=1",
                 "rollout.num_slots=4", "rollout.sandbox_workers=1"]
    # A previous stage with one checkpoint: the hard subset samples its policy.
    cfg = load_config(RLJobConfig, overrides=overrides)
    run = start_run(run_dir=cfg.run_dir, model=cfg.model, optimizer=cfg.optimizer, total_steps=1,
                    job_config=cfg, mesh=cfg.mesh, progress=False)
    run.finish_step(run.state._replace(step=run.state.step + 1), {}, rng=run.rng, data_position={})
    run.close()
    assert Checkpointer(tmp_path / "stage2" / "checkpoints").steps() == [1]
    out = tmp_path / "hard.jsonl"
    stage3 = [o.replace("run_dir=", "run_dir=") for o in overrides] + [
        f"stage.init_from={tmp_path}/stage2", f"hard_subset.source={tmp_path}/problems.jsonl",
        f"hard_subset.output={out}", "hard_subset.samples=2"]
    assert main(["hard-subset", *stage3]) == 0
    assert load_problems(out) == problems  # nothing solved 2/2 by a random policy
    assert "kept 3 of 3 problems" in capsys.readouterr().out
