"""The main job, shortened to tiny settings, end to end; and its exported model in transformers."""
import json

import numpy as np
import pytest
import torch
import transformers

from rstar2_jax import chat
from rstar2_jax.config import ConfigError, load_config
from rstar2_jax.data.datasets import load_problems
from rstar2_jax.model import load_hf
from rstar2_jax.sampler import generate
from rstar2_jax.toy import TOY_FORMAT
from rstar2_jax.toy.demo import DemoConfig, run_demo
from rstar2_jax.train.metrics import read_metrics


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    cfg = DemoConfig.smoke(str(tmp_path_factory.mktemp("demo")))
    return cfg, run_demo(cfg, progress=False)


def test_short_main_job_runs_end_to_end(demo):
    cfg, summary = demo
    out = cfg.out
    for report in (summary.sft, summary.rl):
        assert report.problems == 4 and report.samples_per_problem == 2
        assert set(report.pass_at) == {1, 2} and 0.0 <= report.pass_at[1] <= report.pass_at[2] <= 1.0
        assert report.mean_response_tokens > 0
    assert summary.gain == pytest.approx(summary.rl.pass_at[1] - summary.sft.pass_at[1])
    assert {"sft", "eval_sft", "rl", "eval_rl", "report", "total"} <= summary.seconds.keys()
    assert [r["step"] for r in read_metrics(f"{out}/rl")] == [1, 2]
    for name in ("eval_sft", "eval_rl"):
        records = [json.loads(line) for line in open(f"{out}/{name}.jsonl")]
        assert len(records) == 4 * 2 and {"question", "answer", "reward", "tool_calls"} <= records[0].keys()
    saved = json.loads(open(f"{out}/summary.json").read())
    assert saved["pass1_gain"] == pytest.approx(summary.gain)
    assert open(f"{out}/curves.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "avg pass@1" in summary.table() and "RL gain" in summary.table()


def test_exported_model_greedy_generates_like_transformers(demo):
    cfg, _ = demo
    model_dir = f"{cfg.out}/rl_model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    config, params = load_hf(model_dir)
    prompts = [chat.encode_prompt(tokenizer, p.question, TOY_FORMAT)
               for p in load_problems(f"{cfg.out}/data/test.jsonl")[:2]]
    new_tokens = 24
    ours = generate(params, config, prompts, new_tokens, temperature=0.0)

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, generation in zip(prompts, ours):
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, do_sample=False)
        np.testing.assert_array_equal(theirs[0, len(prompt):].numpy(), generation.tokens)


def test_config_keeps_tool_rendering_consistent():
    with pytest.raises(ConfigError, match="tool output as the SFT demonstrations did"):
        load_config(DemoConfig, overrides=["rollout.show_tool_time=true"])
    with pytest.raises(ConfigError, match="eval_problems"):
        load_config(DemoConfig, overrides=["eval_problems=100000"])
