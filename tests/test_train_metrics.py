"""Metrics logger: JSONL + TensorBoard records, truncation on resume; phase timer."""
import struct
import time

import pytest
from tensorboardX.proto import event_pb2

from rstar2_jax.train.metrics import MetricsLogger, PhaseTimer, progress_fields, read_metrics


def _tensorboard_scalars(run_dir):
    """(tag, step, value) of every scalar in the run's event files (TFRecord framing)."""
    out = []
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for v in event.summary.value:
                out.append((v.tag, event.step, v.simple_value))
    return out


def test_log_and_resume_truncates_later_steps(tmp_path):
    logger = MetricsLogger(tmp_path, start_step=0, total_steps=5, progress=False)
    for step in (1, 2, 3):
        logger.log(step, {"loss": step / 10, "time/update": 0.5})
    logger.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss"')  # a record cut short by a crash

    # Resume from the checkpoint at step 2: step 3 and the partial record are redone.
    logger = MetricsLogger(tmp_path, start_step=2, total_steps=5, progress=False)
    logger.log(3, {"loss": 0.33})
    logger.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[2] == {"step": 3, "loss": pytest.approx(0.33)}
    scalars = _tensorboard_scalars(tmp_path)
    assert ("loss", 1, pytest.approx(0.1)) in scalars
    assert ("time/update", 2, pytest.approx(0.5)) in scalars


def test_phase_timer_adds_up_repeated_phases():
    timer = PhaseTimer()
    for _ in range(2):
        with timer("tools"):
            time.sleep(0.01)
    with timer("update"):
        pass
    split = timer.split()
    assert set(split) == {"time/tools", "time/update"}
    assert split["time/tools"] >= 0.02 > split["time/update"]
    assert timer.split() == {}


def test_progress_line_shows_the_rl_reward_and_warns_when_nothing_was_kept():
    # The names the RL loop logs (rl_data.rollout_metrics, the update's loss).
    step = {"loss": 0.25, "reward/mean": 0.125, "reward/question_accuracy": 0.5, "groups/kept": 3.0,
            "time/update_s": 1.0}
    assert progress_fields(step) == {"loss": "0.25", "reward": "0.125", "solved": "0.5", "kept_groups": "3"}
    nothing = progress_fields({"reward/mean": 0.0, "reward/question_accuracy": 0.0, "groups/kept": 0.0})
    assert nothing["kept_groups"] == "0" and nothing["warning"] == "no group kept, no update"
    assert progress_fields({"loss": float("nan")})["non-finite"] == "loss"


def test_progress_line_warns_of_a_skipped_update():
    record = {"loss": float("nan"), "grad_norm": float("inf"), "update/skipped_nonfinite": 1.0}
    assert progress_fields(record) == {"loss": "nan", "grad_norm": "inf", "non-finite": "loss,grad_norm",
                                       "warning": "non-finite update skipped"}
    assert "warning" not in progress_fields({"loss": 0.5, "update/skipped_nonfinite": 0.0})
