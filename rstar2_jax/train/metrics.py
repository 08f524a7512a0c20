"""Per-step metrics: a JSONL file, TensorBoard event files and a progress bar; phase timers.

Resuming a run from the checkpoint at step s drops the records of later steps, which the crashed
process may have logged after saving s, so the files always describe a single history.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Mapping

from tensorboardX import SummaryWriter
from tqdm import tqdm

# Shown next to the progress bar, under a short name, when a run logs them (SFT: loss, grad
# norm, throughput; RL also the reward, the share of questions solved and the groups kept).
PROGRESS_KEYS = {"loss": "loss", "reward/mean": "reward", "reward/question_accuracy": "solved",
                 "groups/kept": "kept_groups", "grad_norm": "grad_norm", "perf/tokens_per_s": "tok/s"}


def progress_fields(record: Mapping[str, float]) -> dict[str, str]:
    """The progress bar's postfix for one step's record: the `PROGRESS_KEYS` it has, the names
    of its non-finite values, and a ``warning`` when its update was skipped (a non-finite loss
    or gradient) or an RL step kept no group (no update)."""
    shown = {label: f"{record[k]:.4g}" for k, label in PROGRESS_KEYS.items() if k in record}
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        shown["non-finite"] = ",".join(bad)
    if record.get("update/skipped_nonfinite"):
        shown["warning"] = "non-finite update skipped"
    if record.get("groups/kept") == 0:
        shown["warning"] = "no group kept, no update"
    return shown


class MetricsLogger:
    """Writes ``{"step": s, **metrics}`` per step to ``<run_dir>/metrics.jsonl`` and TensorBoard
    (``<run_dir>/tensorboard``), and advances a tqdm bar.

    Args:
      run_dir: the run's directory (created if needed).
      start_step: the step the run (re)starts from; records with a larger step are discarded.
      total_steps: the step at which the run ends, for the progress bar.
      progress: draw the progress bar (off in tests and non-interactive logs).
    """

    def __init__(self, run_dir: str | Path, *, start_step: int, total_steps: int,
                 progress: bool = True):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        _truncate_after(self.path, start_step)
        self._file = self.path.open("a")
        # Event file names have one-second resolution; the suffix keeps a quick restart from
        # overwriting the previous writer's file.
        self._tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1,
                                          filename_suffix=f".{time.time_ns()}")
        self._bar = tqdm(total=total_steps, initial=start_step, disable=not progress,
                         dynamic_ncols=True, unit="step")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step} | {k: float(v) for k, v in metrics.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for name, value in record.items():
            if name != "step":
                self._tensorboard.add_scalar(name, value, step)
        self._bar.set_postfix(progress_fields(record), refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        self._file.close()
        self._tensorboard.close()
        self._bar.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl`` in order."""
    with (Path(run_dir) / "metrics.jsonl").open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _truncate_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    # A killed writer can leave a partial last line; it belongs to a step being redone.
    kept = [line for line in lines if line.endswith("\n") and json.loads(line)["step"] <= step]
    if kept != lines:
        # Whole or not at all, should the process be killed meanwhile.
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(kept))
        partial.replace(path)


class PhaseTimer:
    """Wall-clock seconds per phase of a step, e.g. ``with timer("rollout"): ...``.

    ``split()`` returns ``{"time/<phase>": seconds}`` for the phases timed since the last split
    and starts over. Phases may repeat within a step; their times add up.
    """

    def __init__(self):
        self._seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[phase] += time.perf_counter() - start

    def split(self) -> dict[str, float]:
        out = {f"time/{phase}": seconds for phase, seconds in self._seconds.items()}
        self._seconds.clear()
        return out
