"""`Run.finish_step`'s count of steps in a row whose update was skipped for a non-finite loss or
gradient, and the stop at ``optimizer.max_nonfinite_steps`` (the SFT job end to end:
test_train_sft.py)."""
import jax.numpy as jnp
import pytest

from rstar2_jax.errors import NonFiniteError, UserError
from rstar2_jax.train.run import Run
from rstar2_jax.train.step import TrainState


class _NeverDue:
    def due(self, step):
        return False


def _run(limit):
    return Run(run_dir="runs/x", mesh=None, model_config=None, compute_config=None, param_specs=None,
               optimizer=None, state=None, rng=None, data_position=None, start_step=0, end_step=100,
               checkpointer=_NeverDue(), logger=None, job_config={}, job="SFTConfig",
               save_signal=None, max_nonfinite_steps=limit)


def _finish(run, step, metrics):
    run.finish_step(TrainState(None, None, jnp.asarray(step)), metrics, rng=None, data_position=None)


def test_only_steps_in_a_row_with_a_skipped_update_stop_the_run():
    run = _run(limit=3)
    # 1 and 2 skipped, 3 trained (the count starts over), 4 and 5 skipped, 6 kept no rollout
    # (an RL step without an update: it neither adds nor resets), 7 skipped: three in a row.
    for step, skipped in [(1, 1.0), (2, 1.0), (3, 0.0), (4, 1.0), (5, 2.0)]:
        _finish(run, step, {"loss": 0.1, "update/skipped_nonfinite": skipped})
    _finish(run, 6, {"groups/kept": 0.0})
    assert run.nonfinite_steps == 2
    with pytest.raises(NonFiniteError, match=r"^steps 4-7 of runs/x: the loss or gradient was not "
                                             r"finite .* in 3 steps in a row") as e:
        _finish(run, 7, {"loss": float("nan"), "update/skipped_nonfinite": 1.0})
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
