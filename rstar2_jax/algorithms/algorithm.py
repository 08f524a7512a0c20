"""The algorithm of an RL run as one value: selection, advantage estimator and policy loss.

    Algorithm(select=..., advantages=..., loss=...)

Each RL step the trainer calls ``select``, then ``advantages``, then ``loss`` on every
micro-batch of the update; nothing else about the algorithm is written in the trainer:

1. ``select(key, rollouts, group_size) -> Selection``. ``rollouts`` is a `Rollouts` of arrays
   ``[questions, n]`` (n rollouts sampled per question). It returns which rollouts form each
   advantage group and which of them train. Host-side, on concrete arrays (numpy or jax); its
   output size may depend on the values (groups are dropped), so it is not jitted.
2. ``advantages(kept) -> [groups, m]``: ``kept`` is ``rollouts.take(selection.index)``, the same
   record gathered to ``[groups, m]``; one float advantage per kept rollout, broadcast to each
   of its loss tokens.

   Both run on the host once a step, on numpy arrays whose shape changes with what the step
   keeps. The built-in ones compute in numpy there (given jax arrays, in `jax.numpy`:
   `rstar2_jax.algorithms._checks.array_namespace`), so they compile nothing; written in
   `jax.numpy`, each operation would compile once per new shape, i.e. per kept-group count.
3. ``loss(logp, old_logp, advantages, mask) -> (loss_sum, count, metric_sums)`` on one
   micro-batch: ``logp``/``old_logp`` ``[rows, seq]`` (old is a constant), ``advantages`` ``[rows]``,
   ``mask`` ``[rows, seq]`` bool (the model's own tokens). The step's loss is
   ``sum(loss_sum) / sum(count)`` over micro-batches, so ``count`` is what the loss is averaged
   over (tokens, or sequences) and must add up across micro-batches; padding rows (all-False
   mask) must add 0 to both. Each ``metric_sums`` value is a float32 scalar that the train step
   divides by the same total ``count``, except names ending in ``_max`` (maxima) or ``_min``
   (minima; `rstar2_jax.train.step.metric_reduction`). It
   must be jit-able and differentiable in ``logp``.

   A loss that needs more per-token inputs declares them as parameters by name, and the trainer
   passes them as keyword arguments (`LOSS_INPUTS`); a loss that declares none is called with
   the four above, as always:

   - ``entropy`` ``[rows, seq]`` float32: the entropy (nats) of the policy's tempered
     next-token distribution at each position, from the same forward as ``logp`` and
     differentiable like it (an entropy bonus subtracts it).
   - ``ref_logp`` ``[rows, seq]`` float32: the log-probs of the same tokens under the reference
     policy (the stage's initial weights, frozen; a constant). Only a run with
     ``rl.reference=true`` has one; another run refuses the loss before it starts.

   Like ``logp`` they hold garbage where ``mask`` is False.

The entropy bonus and the KL penalty to the reference are also options of any algorithm
(``rl.entropy_coef``, ``rl.kl_coef``: `rstar2_jax.algorithms.regularizers`).

A new estimator is one pure function passed by value, e.g.
``dataclasses.replace(GRPO_ROC, advantages=my_advantages)``; `rstar2_jax.algorithms.variants`
holds the named ones a config can pick (``rl.algorithm``).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, NamedTuple

import jax
import numpy as np


class Rollouts(NamedTuple):
    """What the trainer knows about each sampled rollout, as arrays of one shape ``[questions, n]``
    (or ``[groups, m]`` once gathered by `take`).

    rewards: float32 outcome rewards (1 correct, 0 not; a truncated rollout scores 0).
    lengths: int32 tokens the model generated (its loss tokens; tool output excluded).
    truncated: bool, the token budget ran out before the rollout ended.
    tool_calls: int32 tool calls made, malformed ones included.
    tool_errors: int32 calls that failed: an execution error, a timeout, a malformed call.
    tool_error_mentions: int32 calls whose response text contains "error" in any case (the
      released rStar2 code's test for a failed call; it misses timeouts).
    answer_blocks: int32 closed ``<answer>...</answer>`` blocks in the model's text.
    answer_tags: int32 ``<answer>`` plus ``</answer>`` tags in the model's text (twice
      ``answer_blocks`` when every tag is paired).
    turns: int32 model turns, the first included (>= 1).
    """

    rewards: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray
    tool_calls: np.ndarray
    tool_errors: np.ndarray
    tool_error_mentions: np.ndarray
    answer_blocks: np.ndarray
    answer_tags: np.ndarray
    turns: np.ndarray

    @classmethod
    def from_rewards(cls, rewards, **fields) -> Rollouts:
        """Rollouts of ``rewards`` (any shape, e.g. ``[questions, n]``) that are otherwise alike:
        one model turn of 1 token with its answer block, no tool call, not truncated; each of
        ``fields`` (any other field by name, a value broadcast to the rewards' shape) replaces
        its default. For tests and examples, e.g. of an estimator that reads only the rewards::

            Rollouts.from_rewards([[1, 0, 0, 1]], tool_calls=[[1, 2, 0, 0]])
        """
        rewards = np.asarray(rewards, np.float32)
        unknown = set(fields) - set(cls._fields)
        if unknown or "rewards" in fields:
            raise TypeError(f"Rollouts has no field(s) {sorted(unknown | ({'rewards'} & set(fields)))} "
                            f"to set beside the rewards; its fields are {cls._fields}")
        defaults = {"lengths": (1, np.int32), "truncated": (False, bool), "tool_calls": (0, np.int32),
                    "tool_errors": (0, np.int32), "tool_error_mentions": (0, np.int32),
                    "answer_blocks": (1, np.int32), "answer_tags": (2, np.int32), "turns": (1, np.int32)}
        return cls(rewards, **{name: np.broadcast_to(np.asarray(fields.get(name, value), dtype),
                                                     rewards.shape).copy()
                               for name, (value, dtype) in defaults.items()})

    def take(self, index: np.ndarray) -> Rollouts:
        """Rollouts at ``index`` (any shape) into the flattened ``[questions * n]`` rollouts."""
        index = np.asarray(index)
        return Rollouts(*(np.asarray(field).reshape(-1)[index] for field in self))


class Selection(NamedTuple):
    """The output of a selection.

    index: ``[groups, m]`` int, rollout indices into the flattened ``[questions * n]`` rollouts
      (question q's rollout i is ``q * n + i``); each row is one advantage group.
    trains: ``[groups, m]`` bool, the rollouts whose tokens enter the loss (False: the rollout
      counts in its group's advantage statistics but is not trained on).
    """

    index: np.ndarray
    trains: np.ndarray


SelectFn = Callable[[jax.Array, Rollouts, int], Selection]
AdvantageFn = Callable[[Rollouts], jax.Array]
LossFn = Callable[..., tuple[jax.Array, jax.Array, dict[str, jax.Array]]]

# The per-token inputs a loss may declare beyond (logp, old_logp, advantages, mask).
LOSS_INPUTS = ("entropy", "ref_logp")


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """An RL algorithm as three pure functions (contracts in the module docstring)."""

    select: SelectFn
    advantages: AdvantageFn
    loss: LossFn


def loss_inputs(loss: LossFn) -> tuple[str, ...]:
    """The names of `LOSS_INPUTS` that ``loss`` declares as parameters (through a
    ``functools.partial`` too), in `LOSS_INPUTS` order."""
    try:
        parameters = inspect.signature(loss).parameters
    except (TypeError, ValueError):  # a callable without a signature takes the four only
        return ()
    return tuple(name for name in LOSS_INPUTS if name in parameters)


def group_index(questions: np.ndarray, local: np.ndarray, n: int) -> np.ndarray:
    """``[groups, m]`` flat rollout indices from kept ``questions`` ``[groups]`` and each one's
    rollouts ``local`` ``[groups, m]`` (indices in ``[0, n)``)."""
    return np.asarray(questions, np.int64)[:, None] * n + np.asarray(local, np.int64)
