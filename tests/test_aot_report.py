"""experiments/benchmarks/aot_report.py on this machine's CPU: the RL update it compiles is the
trainer's, in fixed-shape micro-batches, and its figures are those of the step's micro-batches."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "benchmarks"


@pytest.fixture(scope="module")
def aot_report():
    sys.path.insert(0, str(BENCH))
    try:
        import aot_report
        yield aot_report
    finally:
        sys.path.remove(str(BENCH))


def test_update_runs_the_trainers_gradient_program_once_per_micro_batch(aot_report, tmp_path):
    from bench_packed_update import PRESETS, sample_lengths
    from bench_train_step import matmul_params
    from rstar2_jax.train.packing import PackShapes, micro_batches

    sequences, scale, rows = 12, 0.02, 2
    out = tmp_path / "aot.json"
    aot_report.main(["--target", "cpu", "--model", "toy", "--layers", "1", "--programs",
                     "update", "old-logprobs", "--sequences", str(sequences), "--length-scale",
                     str(scale), "--micro-batch-rows", str(rows), "--json", str(out),
                     "--hlo", str(tmp_path / "hlo" / "update")])
    update, old = json.loads(out.read_text())
    # --hlo makes its folder and writes each compiled program there, by target, name and part.
    assert sorted(p.name for p in (tmp_path / "hlo" / "update").iterdir()) == [
        "cpu_old-logprobs.hlo", "cpu_update.hlo", "cpu_update_1.hlo"]
    assert (tmp_path / "hlo" / "update" / "cpu_update.hlo").read_text().startswith("HloModule")
    gradient, optimizer = update["parts"]

    # The step's micro-batches, counted with the trainer's packing on the same lengths.
    preset = PRESETS["stage1-early"]
    lengths = sample_lengths(preset, sequences, scale, np.random.default_rng(0))[0]
    shapes = PackShapes(int(preset.budget * scale))
    expected = len(micro_batches(lengths.tolist(), shapes, rows, rows * shapes.segments))
    assert expected > 1
    assert gradient["runs"] == old["runs"] == expected
    assert optimizer["runs"] == 1  # one mini-batch

    # The step's FLOPs: the gradient program's once per micro-batch, plus the optimizer update.
    assert gradient["flops"] == pytest.approx(gradient["flops_per_run"] * expected)
    assert update["flops"] == pytest.approx(gradient["flops"] + optimizer["flops"])
    # Set against the model's count on the real tokens, and at least the forward and backward of
    # every matmul on every token the micro-batches compute (padding too).
    config = dataclasses.replace(aot_report.MODELS["toy"], num_layers=1)
    assert update["model_flops"] >= 6 * matmul_params(config) * lengths.sum()
    assert update["model_flops"] < update["computed_flops"] <= update["flops"] < 2 * update["computed_flops"]
    assert old["computed_flops"] <= old["flops"] < 2 * old["computed_flops"]
    assert update["flops"] > 2 * old["flops"]  # a backward on top of the forward

    # Memory: the step's peak is its largest program's, with what the run holds beside it.
    assert update["peak_bytes"] == max(p["program_peak_bytes"] + p["beside_bytes"]
                                       for p in update["parts"])
    assert update["peak_bytes"] >= update["base_bytes"]
