"""GRPO-RoC against plain GRPO on the toy task: same SFT policy, seed and rollout budget.

    python experiments/toy/compare_roc.py [out=runs/demo] [rl_steps=40] [key=value ...]

Both runs sample 2G rollouts per question from the same SFT policy (``<out>/sft_model``, trained
first if missing, exactly as the main job does). GRPO-RoC (the paper's rule) trains on the G it
keeps; plain GRPO trains on all 2G. The script then evaluates both final policies on the
held-out problems and writes

    <out>/compare_roc.png          the four training curves, both runs
    <out>/compare_roc_errors.png   tool-call error ratio among positive rollouts (paper Fig. 4)
    <out>/compare_roc.json         final held-out figures of both runs

The paper's finding is that RoC drives the error ratio among positives down while plain GRPO
lets it plateau. With the main job's ``out`` its RoC run (``<out>/rl``) is reused.
"""
import dataclasses
import json
import sys
from pathlib import Path

from rstar2_jax.config import load_config
from rstar2_jax.toy.demo import DemoConfig, Evaluator, train_rl_policy, train_sft_policy
from rstar2_jax.plots import RL_PANELS, plot_curves
from rstar2_jax.rewards import VerifierPool
from rstar2_jax.sandbox import SandboxPool
from rstar2_jax.train.metrics import read_metrics

# run name -> (legend label, rl.roc_rule); "rl" is the main job's own run.
RUNS = {"rl": ("GRPO-RoC (paper rule)", "paper"), "rl_grpo": ("GRPO (all 2G kept)", "none")}


def main(overrides: list[str]) -> None:
    cfg = load_config(DemoConfig, overrides=overrides)
    out = Path(cfg.out)
    curves, finals = {}, {}
    with SandboxPool(num_workers=cfg.rollout.sandbox_workers, timeout_s=cfg.rollout.tool_timeout_s) \
            as sandbox, VerifierPool(num_workers=cfg.rollout.verifier_workers) as verifier:
        if not (out / "sft_model").is_dir():
            train_sft_policy(cfg, sandbox)
        evaluator = Evaluator(cfg, sandbox, verifier)
        finals["sft"] = dataclasses.asdict(evaluator(out / "sft_model", out / "eval_sft.jsonl"))
        for name, (label, rule) in RUNS.items():
            run_cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, roc_rule=rule))
            model = train_rl_policy(run_cfg, name)
            report = evaluator(model, out / f"eval_{name}.jsonl")
            finals[name] = dataclasses.asdict(report)
            curves[label] = read_metrics(out / name)
            print(f"{label}: {report.summary()}", flush=True)
    plot_curves(curves, out / "compare_roc.png")
    plot_curves(curves, out / "compare_roc_errors.png",
                panels=[p for p in RL_PANELS if p[0] == "tools/error_ratio_positives"])
    (out / "compare_roc.json").write_text(json.dumps(finals, indent=2) + "\n")

    print(f"\n{'':<24}{'avg pass@1':>12}{'tool err':>10}{'err ratio +, last 5 steps':>28}")
    print(f"{'after SFT':<24}{100 * finals['sft']['pass_at'][1]:>11.1f}%"
          f"{100 * finals['sft']['tool_error_rate']:>9.1f}%")
    for name, (label, _) in RUNS.items():
        last = [r["tools/error_ratio_positives"] for r in curves[label][-5:]]
        print(f"{label:<24}{100 * finals[name]['pass_at'][1]:>11.1f}%"
              f"{100 * finals[name]['tool_error_rate']:>9.1f}%{100 * sum(last) / len(last):>27.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
