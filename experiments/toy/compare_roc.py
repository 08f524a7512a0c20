"""GRPO-RoC against plain GRPO on the toy task: same SFT policy, seed and rollout budget.

    python experiments/toy/compare_roc.py [out=runs/demo] [rl_steps=40] [key=value ...]

Both runs sample 2G rollouts per question from the same SFT policy (``<out>/sft_model``, trained
first if missing, exactly as the main job does). GRPO-RoC (the paper's rule) trains on the G it
keeps; plain GRPO trains on all 2G. The script then evaluates both final policies on the
held-out problems (``rstar2_jax.toy.compare.compare_rl_runs``) and writes

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
from rstar2_jax.plots import RL_PANELS, plot_curves
from rstar2_jax.toy.compare import compare_rl_runs
from rstar2_jax.toy.demo import DemoConfig

# run name -> (legend label, rl.algorithm); "rl" is the main job's own run.
RUNS = {"rl": ("GRPO-RoC (paper rule)", "grpo_roc"), "rl_grpo": ("GRPO (all 2G kept)", "grpo")}


def main(overrides: list[str]) -> None:
    cfg = load_config(DemoConfig, overrides=overrides)
    out = Path(cfg.out)
    reports, metrics = compare_rl_runs(cfg, {
        name: dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, algorithm=algorithm))
        for name, (_, algorithm) in RUNS.items()})
    finals = {name: dataclasses.asdict(report) for name, report in reports.items()}
    curves = {label: metrics[name] for name, (label, _) in RUNS.items()}
    plot_curves(curves, out / "compare_roc.png")
    plot_curves(curves, out / "compare_roc_errors.png",
                panels=[p for p in RL_PANELS if p[0] == "tools/error_ratio_positives"])
    (out / "compare_roc.json").write_text(json.dumps(finals, indent=2) + "\n")

    print(f"\n{'':<24}{'avg pass@1':>12}{'tool err':>10}{'err ratio +, last 5 steps':>28}")
    print(f"{'after SFT':<24}{100 * finals['sft']['pass_at'][1]:>11.1f}%"
          f"{100 * finals['sft']['tool_error_rate']:>9.1f}%")
    for name, (label, _) in RUNS.items():
        # A step without a positive that called the tool logs no error ratio.
        last = [r["tools/error_ratio_positives"] for r in curves[label][-5:]
                if "tools/error_ratio_positives" in r]
        ratio = f"{100 * sum(last) / len(last):.1f}%" if last else "n/a"
        print(f"{label:<24}{100 * finals[name]['pass_at'][1]:>11.1f}%"
              f"{100 * finals[name]['tool_error_rate']:>9.1f}%{ratio:>28}")


if __name__ == "__main__":
    main(sys.argv[1:])
