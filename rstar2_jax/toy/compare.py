"""RL variants of the toy side by side: each from the same SFT policy, seed and evaluation."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from rstar2_jax.algorithms import Algorithm
from rstar2_jax.evaluate import EvalReport
from rstar2_jax.sampler.runtime import RolloutRuntime
from rstar2_jax.toy.demo import DemoConfig, Evaluator, train_rl_policy, train_sft_policy
from rstar2_jax.train.metrics import read_metrics


def compare_rl_runs(cfg: DemoConfig, runs: Mapping[str, DemoConfig | Algorithm], *,
                    progress: bool = True,
                    ) -> tuple[dict[str, EvalReport], dict[str, list[dict]]]:
    """Trains each run from ``<cfg.out>/sft_model`` and evaluates every policy on the held-out
    problems.

    Args:
      cfg: the shared settings: output directory, SFT (run first when ``<out>/sft_model`` is
        missing, exactly as the main job does), rollouts and evaluation.
      runs: run name -> either an `Algorithm`, trained with ``cfg``'s settings, or a config:
        ``cfg`` with other RL settings, its algorithm the one ``rl.algorithm`` names. Run
        ``name`` trains in ``<out>/<name>`` and is evaluated to ``<out>/eval_<name>.jsonl``
        (the main job's own run is ``"rl"``, reused when it is there).
      progress: print each evaluation's summary as it finishes.

    Returns:
      (held-out report per run, ``"sft"`` first; training metrics per run).
    """
    out = Path(cfg.out)
    reports, curves = {}, {}
    with RolloutRuntime(cfg.rollout) as runtime:
        if not (out / "sft_model").is_dir():
            train_sft_policy(cfg, runtime.sandbox, progress=progress)
        evaluator = Evaluator(cfg, runtime)
        reports["sft"] = evaluator(out / "sft_model", out / "eval_sft.jsonl")
        for name, run in runs.items():
            run_cfg, algorithm = (cfg, run) if isinstance(run, Algorithm) else (run, None)
            if run_cfg.out != cfg.out:
                raise ValueError(f"run {name!r} writes to {run_cfg.out}, not the comparison's {cfg.out}")
            model = train_rl_policy(run_cfg, name, runtime, algorithm=algorithm, progress=progress)
            reports[name] = evaluator(model, out / f"eval_{name}.jsonl")
            curves[name] = read_metrics(out / name)
            if progress:
                print(f"{name}: {reports[name].summary()}", flush=True)
    return reports, curves
