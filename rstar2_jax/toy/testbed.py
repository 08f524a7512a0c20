"""The testbed: RL algorithms side by side on the toy, over seeds, each from one SFT policy per seed.

    python experiments/toy/testbed.py [out=runs/testbed] [seeds=[0,1,2]] [key=value ...]

Per seed S the main job's SFT phase trains one policy (``<out>/seed<S>/``: data, SFT model and
its held-out evaluation); then every arm trains from that policy with the same settings and
seed, differing only in its algorithm and in how many rollouts it samples per question, and is
evaluated on the same held-out problems. The default arms are the paper's comparison (§5.3,
G = ``demo.rl.group_size``):

    grpo_roc    GRPO-RoC: 2G sampled, G kept by RoC
    grpo_tool   "GRPO with tool": G sampled, all kept (the same G per group in the update)
    grpo_2g     plain GRPO at GRPO-RoC's sampling budget: 2G sampled, all kept

An arm is an `Arm`: an algorithm (a name of ``rstar2_jax.algorithms.ALGORITHMS`` or an import
path ``package.module:object``), the rollouts it samples per question, in units of G, and its
rollout correction; e.g. ``arms.mine.algorithm=my_module:MINE``. Files (``<out>/``)::

    config.yaml                     the grid's settings
    seed<S>/                        the SFT job of seed S; its RL runs in seed<S>/rl/<arm>/
    results/<arm>/seed<S>.json      one finished run: held-out report, per-step metrics, wall time
    results/sft/seed<S>.json        the held-out report of seed S's SFT policy
    summary.md, summary.json        the table: mean and min-max over seeds per arm; the held-out
                                    failed calls by kind (rstar2_jax.toy.failures); the first
                                    arm minus each other arm, seed by seed
    curves.png                      training curves, mean over seeds with min-max bands
    error_ratio_positives.png       the tool-call error ratio among positive rollouts (paper Fig. 4)

A finished run's result file is read back, not repeated (an interrupted RL run resumes from its
checkpoint); a result made with other settings is an error, never silently reused. In per-step
metrics a quantity with nothing to measure (the error ratio among positives in a step without a
positive that called the tool) is null, never 0; window means skip it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from rstar2_jax.algorithms import RolloutCorrection, resolve_algorithm
from rstar2_jax.config import config_to_dict, config_to_yaml
from rstar2_jax.data.datasets import jsonl_rows
from rstar2_jax.plots import RL_PANELS, plot_bands
from rstar2_jax.sampler.runtime import RolloutRuntime
from rstar2_jax.toy.build import ToyDataConfig
from rstar2_jax.toy.demo import DemoConfig, Evaluator, train_rl_policy, train_sft_policy
from rstar2_jax.toy.failures import FIRST_CALL_SHARES, POSITIVE_SHARES, first_call_outcomes, positive_failures
from rstar2_jax.train.metrics import read_metrics

ERROR_RATIO = "tools/error_ratio_positives"
# Per-step metrics every result file carries, null in the steps where they were not measured.
TRACKED = tuple(key for key, _ in RL_PANELS) + ("rollouts/positives",)
# The DemoConfig settings (dotted: one field of a section) that decide the SFT policy of a seed
# and its evaluation.
_SFT_FIELDS = ("data", "model", "sft", "rollout", "stage.max_turns", "stage.max_response_tokens",
               "eval_problems", "eval_samples", "eval_temperature")
# Results saved before DemoConfig held the job configs name their settings so: old -> new key.
_RENAMED = {"sft_epochs": "sft.epochs", "sft_batch_size": "sft.batch_size",
            "sft_digit_loss_weight": "sft.digit_loss_weight", "sft_optimizer": "sft.optimizer",
            "sft_packed": "sft.packed", "rl_steps": "stage.steps", "max_turns": "stage.max_turns",
            "max_response_tokens": "stage.max_response_tokens"}


@dataclass(frozen=True)
class Arm:
    """One arm of the comparison.

    Attributes:
      algorithm: a name of ``rstar2_jax.algorithms.ALGORITHMS`` or ``package.module:object``.
      oversample: rollouts sampled per question, in units of G (``demo.rl.group_size``): 2 for
        GRPO-RoC's 2G, 1 for "GRPO with tool".
      label: the legend and table label (default: the arm's name).
      rollout_correction: the arm's ``rl.rollout_correction`` (off by default), e.g.
        ``arms.tis.rollout_correction.weights=token``.
      max_staleness: the arm's ``rl.max_staleness`` (0, synchronous, by default): its
        rollouts come from the policy that many updates back (docs/algorithms.md,
        "Asynchronous RL").
      mini_batches, lr: the arm's ``rl.mini_batches`` (optimizer updates per step; more than
        one lets the clip act) and RL learning rate; None (the default) keeps ``demo``'s.
    """

    algorithm: str = "grpo_roc"
    oversample: int = 2
    label: str = ""
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    max_staleness: int = 0
    mini_batches: int | None = None
    lr: float | None = None

    def __post_init__(self):
        if self.oversample < 1:
            raise ValueError(f"oversample must be >= 1, got {self.oversample}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.mini_batches is not None and self.mini_batches < 1:
            raise ValueError(f"mini_batches must be >= 1, got {self.mini_batches}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        resolve_algorithm(self.algorithm)  # a ValueError naming it, before anything runs


# Room for the longest demonstrated solution (docs/testbed.md); the main job has 320.
RESPONSE_TOKENS = 512
# The testbed's task mix: a quarter of the problems are mod_inverse, half of which no policy can
# solve without a failing first call (docs/testbed.md).
TESTBED_KINDS = ("mod_product", "digit_sum_power", "gcd_lcm", "mod_inverse")


def testbed_demo() -> DemoConfig:
    """The main job's settings on the testbed's task mix (`TESTBED_KINDS`), with a response
    budget that fits the longest demonstrated solution (a typo, the failing natural program,
    the right one): an err-then-fix rollout cut by the budget would score 0, and the budget, not
    the algorithm, would remove it."""
    demo = DemoConfig(data=ToyDataConfig(n_train=2000, n_test=100, kinds=list(TESTBED_KINDS)))
    return dataclasses.replace(demo, stage=dataclasses.replace(demo.stage, max_response_tokens=RESPONSE_TOKENS))


def paper_arms() -> dict[str, Arm]:
    """GRPO-RoC against "GRPO with tool" and plain GRPO at an equal sampling budget (§5.3)."""
    return {"grpo_roc": Arm("grpo_roc", 2, "GRPO-RoC (2G sampled, G kept)"),
            "grpo_tool": Arm("grpo", 1, "GRPO with tool (G sampled, all kept)"),
            "grpo_2g": Arm("grpo", 2, "GRPO, equal budget (2G sampled, all kept)")}


@dataclass(frozen=True)
class TestbedConfig:
    """The grid: arms x seeds, every run with ``demo``'s settings (its ``out`` and ``seed`` are
    replaced per seed: ``<out>/seed<S>`` and S).

    Attributes:
      out: output directory (see the module docstring).
      seeds: one SFT policy per seed, every arm trained from it with that seed.
      arms: arm name (letters, digits, ``_``, ``-``) -> `Arm`.
      demo: the toy's data, model, SFT, RL, rollout and evaluation settings.
      window: the summary's error ratio among positives is averaged over the first and the last
        ``window`` RL steps.
    """

    out: str = "runs/testbed"
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    arms: dict[str, Arm] = field(default_factory=paper_arms)
    demo: DemoConfig = field(default_factory=testbed_demo)
    window: int = 5

    def __post_init__(self):
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be non-empty and distinct, got {self.seeds}")
        if not self.arms:
            raise ValueError("arms must name at least one arm")
        bad = [name for name in self.arms if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or name == "sft"]
        if bad:
            raise ValueError(f"arm names must be letters, digits, '_' or '-' and not 'sft': {bad}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        for name in self.arms:
            self.arm_config(self.seeds[0], name)  # every arm's RL settings are valid

    @classmethod
    def smoke(cls, out: str) -> TestbedConfig:
        """A tiny grid for tests and notebooks: GRPO-RoC and "GRPO with tool", 2 seeds x 2 RL
        steps of the main job's smoke settings on the testbed's task mix; the policies learn
        next to nothing."""
        demo = DemoConfig.smoke(out)
        demo = dataclasses.replace(demo, data=dataclasses.replace(demo.data, kinds=list(TESTBED_KINDS)))
        # RL samples at the evaluation temperature, so both use one compiled sampler.
        demo = dataclasses.replace(demo, rl=dataclasses.replace(demo.rl, temperature=demo.eval_temperature))
        arms = paper_arms()
        return cls(out=out, seeds=[0, 1], arms={k: arms[k] for k in ("grpo_roc", "grpo_tool")},
                   demo=demo, window=1)

    def seed_config(self, seed: int) -> DemoConfig:
        """The main job's config of seed ``seed``: its SFT policy lives in ``<out>/seed<seed>``."""
        return dataclasses.replace(self.demo, out=str(Path(self.out) / f"seed{seed}"), seed=seed)

    def arm_config(self, seed: int, name: str) -> DemoConfig:
        """``seed_config(seed)`` with arm ``name``'s algorithm, rollouts per question, rollout
        correction, staleness, and its mini-batches and learning rate where it sets them."""
        arm, base = self.arms[name], self.seed_config(seed)
        rl = dataclasses.replace(base.rl, algorithm=arm.algorithm,
                                 rollouts_per_question=arm.oversample * base.rl.group_size,
                                 rollout_correction=arm.rollout_correction,
                                 max_staleness=arm.max_staleness,
                                 mini_batches=arm.mini_batches or base.rl.mini_batches)
        return dataclasses.replace(base, rl=rl, rl_optimizer=dataclasses.replace(
            base.rl_optimizer, lr=arm.lr or base.rl_optimizer.lr))

    def label(self, name: str) -> str:
        return self.arms[name].label or name


def result_path(out: str | Path, arm: str, seed: int) -> Path:
    """The result file of arm ``arm`` (``"sft"``: the SFT policy) and seed ``seed``."""
    return Path(out) / "results" / arm / f"seed{seed}.json"


def samples_path(cfg: TestbedConfig, arm: str, seed: int) -> Path:
    """The held-out samples (one JSON record each) of arm ``arm`` (or ``"sft"``) and ``seed``."""
    return Path(cfg.seed_config(seed).out) / f"eval_{arm}.jsonl"


def _settings(demo: DemoConfig, fields: Sequence[str] | None = None) -> dict:
    """``demo``'s settings but ``out``, as nested dicts; only ``fields`` (a name, or a dotted
    ``section.name``) where given."""
    values = config_to_dict(demo)
    values.pop("out")
    if fields is None:
        return values
    chosen: dict = {}
    for key in fields:
        section, _, name = key.rpartition(".")
        source, target = values, chosen
        for part in filter(None, section.split(".")):
            source, target = source[part], target.setdefault(part, {})
        target[name] = source[name]
    return chosen


def _renamed(saved: dict) -> dict:
    """Settings saved under the old names (`_RENAMED`) under the new ones."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items() if k not in _RENAMED}
    for old, new in _RENAMED.items():
        if old in saved:
            section, name = new.split(".")
            out.setdefault(section, {})[name] = saved[old]
    return out


def _run_settings(cfg: TestbedConfig, name: str, seed: int) -> dict:
    """The settings a result of run ``name`` (an arm or ``"sft"``) and ``seed`` must match."""
    if name == "sft":
        return _settings(cfg.seed_config(seed), _SFT_FIELDS)
    return _settings(cfg.arm_config(seed, name))


def _read_result(path: Path, settings: dict) -> dict | None:
    """The finished result at ``path`` (None when there is none); ValueError when it was made
    with other settings."""
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    changed = sorted(_differences(_renamed(result["settings"]), settings, _settings(DemoConfig())))
    if changed:
        raise ValueError(f"{path} was made with other settings (differing: {', '.join(changed)}); "
                         "use another out directory or delete the result to redo it")
    return result


def _differences(saved: dict, current: dict, defaults: dict, prefix: str = "") -> list[str]:
    """Dotted names of the settings that differ. A setting the saved result does not have
    (the option is newer than the result) matches its default, which keeps the behaviour
    from before the option existed."""
    out = []
    for key in saved.keys() | current.keys():
        default = defaults.get(key) if isinstance(defaults, dict) else None
        if key not in saved and current.get(key) == default:
            continue
        old, new = saved.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            out += _differences(old, new, default, f"{prefix}{key}.")
        elif old != new:
            out.append(f"{prefix}{key}")
    return out


def _write_json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1, allow_nan=False) + "\n")
    tmp.replace(path)  # a killed run never leaves a half-written result that reads as finished


def with_missing(records: Sequence[dict]) -> list[dict]:
    """Per-step records with every `TRACKED` metric present: null where the step did not
    measure it (the RL loop leaves a ratio with nothing to measure out, never logs 0)."""
    return [{key: None for key in TRACKED} | dict(record) for record in records]


def run_testbed(cfg: TestbedConfig, *, progress: bool = True) -> dict:
    """Runs every missing (seed, arm) run of the grid, then writes the summary and the plots;
    returns the summary (``summary.json``)."""
    out = Path(cfg.out)
    load_results(cfg)  # a result made with other settings stops the grid before anything is written
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(config_to_yaml(cfg))
    say = print if progress else (lambda *a, **k: None)
    with RolloutRuntime(cfg.demo.rollout) as runtime:
        for seed in cfg.seeds:
            seed_cfg = cfg.seed_config(seed)
            sft_settings = _run_settings(cfg, "sft", seed)
            evaluator = None
            if _read_result(result_path(out, "sft", seed), sft_settings) is None:
                start = time.perf_counter()
                if not (Path(seed_cfg.out) / "sft_model").is_dir():
                    say(f"seed {seed}: SFT ({seed_cfg.sft.epochs} epochs)", flush=True)
                    train_sft_policy(seed_cfg, runtime.sandbox, progress=progress)
                sft_s = time.perf_counter() - start
                evaluator = Evaluator(seed_cfg, runtime)
                report = evaluator(Path(seed_cfg.out) / "sft_model", samples_path(cfg, "sft", seed))
                _write_json(result_path(out, "sft", seed), {
                    "arm": "sft", "seed": seed, "settings": sft_settings,
                    "eval": dataclasses.asdict(report),
                    "seconds": {"train": sft_s, "eval": time.perf_counter() - start - sft_s}})
                say(f"seed {seed}, after SFT: {report.summary()}", flush=True)
            for name in cfg.arms:
                arm_cfg = cfg.arm_config(seed, name)
                path = result_path(out, name, seed)
                settings = _run_settings(cfg, name, seed)
                if _read_result(path, settings) is not None:
                    continue
                say(f"seed {seed}, {name}: {arm_cfg.stage.steps} RL steps with {arm_cfg.rl.algorithm}, "
                    f"{arm_cfg.rl.rollouts_per_question} rollouts per question", flush=True)
                start = time.perf_counter()
                model = train_rl_policy(arm_cfg, f"rl/{name}", runtime, progress=progress)
                rl_s = time.perf_counter() - start
                evaluator = evaluator or Evaluator(seed_cfg, runtime)
                report = evaluator(model, samples_path(cfg, name, seed))
                _write_json(path, {
                    "arm": name, "seed": seed, "settings": settings,
                    "eval": dataclasses.asdict(report),
                    "seconds": {"train": rl_s, "eval": time.perf_counter() - start - rl_s},
                    "metrics": with_missing(read_metrics(Path(seed_cfg.out) / "rl" / name))})
                say(f"seed {seed}, {name}: {report.summary()}", flush=True)
    return write_report(cfg)


def load_results(cfg: TestbedConfig) -> dict[str, list[dict]]:
    """``{"sft": [...], arm: [...]}``: the finished result of each seed, in ``cfg.seeds`` order;
    a run not finished yet is left out."""
    results = {}
    for name in ("sft", *cfg.arms):
        found = [_read_result(result_path(cfg.out, name, s), _run_settings(cfg, name, s)) for s in cfg.seeds]
        results[name] = [r for r in found if r is not None]
    return results


def window_mean(records: Sequence[dict], key: str, first: int | None = None,
                last: int | None = None) -> float | None:
    """Mean of ``key`` over the first ``first`` or the last ``last`` records, skipping the steps
    where it is missing (null or absent); None when it is missing in all of them."""
    chosen = records[:first] if first is not None else records[-last:]
    values = [r[key] for r in chosen if r.get(key) is not None and math.isfinite(r[key])]
    return sum(values) / len(values) if values else None


def spread(values: Sequence[float | None]) -> dict:
    """Mean, min and max over seeds of the values that are not missing; ``seeds``: how many."""
    present = [v for v in values if v is not None]
    if not present:
        return {"mean": None, "min": None, "max": None, "seeds": 0, "values": list(values)}
    return {"mean": sum(present) / len(present), "min": min(present), "max": max(present),
            "seeds": len(present), "values": list(values)}


def heldout_failures(cfg: TestbedConfig, name: str, seed: int) -> dict:
    """``positives``: `positive_failures`, ``first_calls``: `first_call_outcomes` of the held-out
    samples of run ``name`` and ``seed`` (each None without them)."""
    path = samples_path(cfg, name, seed)
    if not path.is_file():
        return {"positives": None, "first_calls": None}
    records = [row for _, row in jsonl_rows(path, "held-out samples")]
    return {"positives": positive_failures(records), "first_calls": first_call_outcomes(records)}


# What the paired comparison takes from each run (held-out unless it says training).
_PAIRED = ("pass@1", "response_tokens", "error_ratio_positives_last", "heldout_avoidable")


def _failure_spreads(failures: dict, name: str, runs: Sequence[dict], part: str, keys: Sequence[str]) -> dict:
    """``spread`` over ``runs`` of each share in ``keys`` of ``heldout_failures(...)[part]``."""
    found = [failures[name, r["seed"]][part] for r in runs]
    return {key: spread([f and f[key] for f in found]) for key in keys}


def _paired_values(cfg: TestbedConfig, run: dict, failures: dict) -> dict:
    return {"pass@1": run["eval"]["pass_at"]["1"], "response_tokens": run["eval"]["mean_response_tokens"],
            "error_ratio_positives_last": window_mean(run["metrics"], ERROR_RATIO, last=cfg.window),
            "heldout_avoidable": failures["positives"]["avoidable"] if failures["positives"] else None}


def summarize(cfg: TestbedConfig, results: Mapping[str, Sequence[dict]]) -> dict:
    """Per arm (and the SFT policies), over seeds: held-out avg pass@1, pass@k, response tokens,
    tool calls per rollout and tool error rate, the held-out correct answers' failed calls by
    kind (`rstar2_jax.toy.failures`); for RL arms the training error ratio among positives over
    the first and the last ``cfg.window`` steps. ``paired``: the first arm minus each other
    arm, seed by seed (every arm of a seed starts from the same SFT policy)."""
    k = cfg.demo.eval_samples
    rows = {}
    failures = {(name, r["seed"]): heldout_failures(cfg, name, r["seed"])
                for name, runs in results.items() for r in runs}
    for name, runs in results.items():
        row = {"label": "after SFT" if name == "sft" else cfg.label(name),
               "seeds": [r["seed"] for r in runs],
               "pass@1": spread([r["eval"]["pass_at"]["1"] for r in runs]),
               f"pass@{k}": spread([r["eval"]["pass_at"][str(k)] for r in runs]),
               "response_tokens": spread([r["eval"]["mean_response_tokens"] for r in runs]),
               "tool_calls_per_rollout": spread([r["eval"]["tool_calls_per_sample"] for r in runs]),
               "tool_error_rate": spread([r["eval"]["tool_error_rate"] for r in runs]),
               "train_seconds": spread([r["seconds"]["train"] for r in runs]),
               "heldout_failures": _failure_spreads(failures, name, runs, "positives", POSITIVE_SHARES),
               "heldout_first_calls": _failure_spreads(failures, name, runs, "first_calls", FIRST_CALL_SHARES)}
        if name != "sft":
            row["error_ratio_positives_first"] = spread(
                [window_mean(r["metrics"], ERROR_RATIO, first=cfg.window) for r in runs])
            row["error_ratio_positives_last"] = spread(
                [window_mean(r["metrics"], ERROR_RATIO, last=cfg.window) for r in runs])
        rows[name] = row
    seconds = sum(sum(r["seconds"].values()) for runs in results.values() for r in runs)
    arms = [name for name in cfg.arms if results.get(name)]
    paired = {}
    if len(arms) > 1:
        by_seed = {name: {r["seed"]: _paired_values(cfg, r, failures[name, r["seed"]]) for r in results[name]}
                   for name in arms}
        reference = by_seed[arms[0]]
        for name in arms[1:]:
            seeds = [s for s in cfg.seeds if s in reference and s in by_seed[name]]
            paired[name] = {"seeds": seeds} | {
                key: [None if None in (reference[s][key], by_seed[name][s][key])
                      else reference[s][key] - by_seed[name][s][key] for s in seeds] for key in _PAIRED}
    return {"arms": rows, "seeds": list(cfg.seeds), "window": cfg.window, "k": k,
            "spread": "min-max over seeds", "wall_seconds": seconds,
            "paired": {"reference": arms[0] if arms else None, "arms": paired}}


def _cell(s: dict, percent: bool, n_seeds: int) -> str:
    if s["mean"] is None:
        return "missing"
    scale, unit, digits = (100, "%", 1) if percent else (1, "", 2 if s["max"] < 10 else 0)
    text = (f"{scale * s['mean']:.{digits}f}{unit} [{scale * s['min']:.{digits}f}, "
            f"{scale * s['max']:.{digits}f}]")
    return text if s["seeds"] == n_seeds else f"{text} ({s['seeds']}/{n_seeds} seeds)"


def summary_markdown(summary: dict) -> str:
    """The summary as a markdown table: mean [min, max] over seeds."""
    k, w = summary["k"], summary["window"]
    columns = [("pass@1", "avg pass@1", True), (f"pass@{k}", f"pass@{k}", True),
               ("error_ratio_positives_first", f"err. ratio among positives, first {w} steps", True),
               ("error_ratio_positives_last", f"err. ratio among positives, last {w} steps", True),
               ("response_tokens", "response tokens", False),
               ("tool_calls_per_rollout", "tool calls / rollout", False),
               ("tool_error_rate", "tool error rate", True)]
    lines = ["| | seeds | " + " | ".join(title for _, title, _ in columns) + " |",
             "|---" * (len(columns) + 2) + "|"]
    for row in summary["arms"].values():
        n = len(row["seeds"])
        cells = [_cell(row[key], pct, n) if key in row else "n/a" for key, _, pct in columns]
        lines.append(f"| {row['label']} | {n} | " + " | ".join(cells) + " |")
    lines += ["", f"Held-out: avg pass@1 and pass@{k} over {k} samples per problem; response tokens, "
              "tool calls and tool error rate of the held-out samples. Error ratio among positives: "
              f"failed / all tool calls of the correct training rollouts, averaged over the first "
              f"and the last {w} RL steps that have one. Cells: mean [min, max] over seeds; "
              "'missing': no seed measured it; n/a: does not apply (no RL).",
              f"Wall time of all runs: {summary['wall_seconds'] / 60:.1f} min.", "",
              "Held-out correct answers: failed calls of each kind / all their calls "
              "(`rstar2_jax.toy.failures`), and the share of correct answers with an avoidable failure. "
              "Held-out samples that called the tool: the share whose first call slipped (failed for an "
              "avoidable reason), and the share correct after a slipped / a clean first call.", "",
              "| | avoidable | built-in | other | correct answers with an avoidable failure "
              "| first calls that slipped | correct after a slip | correct after a clean first call |",
              "|---|---|---|---|---|---|---|---|"]
    for row in summary["arms"].values():
        n = len(row["seeds"])
        cells = [_cell(row["heldout_failures"][key], True, n) for key in POSITIVE_SHARES]
        cells += [_cell(row["heldout_first_calls"][key], True, n) for key in FIRST_CALL_SHARES]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    paired = summary["paired"]
    if paired["arms"]:
        reference = summary["arms"][paired["reference"]]["label"]
        titles = {"pass@1": ("avg pass@1, points", 100), "response_tokens": ("response tokens", 1),
                  "error_ratio_positives_last":
                      (f"training err. ratio among positives, last {w} steps, points", 100),
                  "heldout_avoidable": ("held-out avoidable failures among correct answers' calls, points", 100)}
        seeds = summary["seeds"]
        lines += ["", f"Paired by seed: {reference} minus each arm.", "",
                  "| | | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
                  "|---" * (len(seeds) + 3) + "|"]
        for name, deltas in paired["arms"].items():
            for key, (title, scale) in titles.items():
                by_seed = dict(zip(deltas["seeds"], deltas[key]))
                cells = [f"{scale * by_seed[s]:+.1f}" if by_seed.get(s) is not None else "-" for s in seeds]
                present = [v for v in deltas[key] if v is not None]
                mean = f"{scale * sum(present) / len(present):+.1f}" if present else "-"
                label = summary["arms"][name]["label"]
                lines.append(f"| vs {label} | {title} | " + " | ".join(cells) + f" | {mean} |")
    return "\n".join(lines) + "\n"


def write_report(cfg: TestbedConfig) -> dict:
    """summary.md, summary.json and the plots from the finished results of ``cfg``'s grid."""
    out = Path(cfg.out)
    results = load_results(cfg)
    summary = summarize(cfg, results)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    (out / "summary.md").write_text(summary_markdown(summary))
    curves = {cfg.label(name): [r["metrics"] for r in results[name]] for name in cfg.arms
              if results[name]}
    if curves:
        plot_bands(curves, out / "curves.png")
        plot_bands(curves, out / "error_ratio_positives.png",
                   panels=[p for p in RL_PANELS if p[0] == ERROR_RATIO])
    return summary


def metrics_table(cfg: TestbedConfig, metrics: Sequence[str]) -> str:
    """A markdown table of the finished runs of ``cfg``: per arm, the held-out avg pass@1 after
    RL minus after SFT of the same seed (points), and each of ``metrics`` averaged over a run's
    RL steps (skipping steps that did not log it); cells mean [min, max] over seeds, "n/a" when
    no seed logged it. ``experiments/toy/testbed_metrics.py`` prints it."""
    results = load_results(cfg)
    sft = {r["seed"]: r["eval"]["pass_at"]["1"] for r in results["sft"]}
    columns = ["held-out pass@1 gain (points)", *metrics]
    lines = ["| arm | seeds | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]

    def cell(s: dict, n: int) -> str:
        if s["mean"] is None:
            return "n/a"
        text = f"{s['mean']:.3g} [{s['min']:.3g}, {s['max']:.3g}]"
        return text if s["seeds"] == n else f"{text} ({s['seeds']}/{n} seeds)"

    for name in cfg.arms:
        runs = [r for r in results[name] if r["seed"] in sft]
        cells = [cell(spread([100 * (r["eval"]["pass_at"]["1"] - sft[r["seed"]]) for r in runs]), len(runs))]
        cells += [cell(spread([window_mean(r["metrics"], key, first=len(r["metrics"])) for r in runs]),
                       len(runs)) for key in metrics]
        lines.append(f"| {cfg.label(name)} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
