"""From scored rollouts to a training batch, through the run's algorithm: per-rollout arrays,
selection, advantages, padding; and the step's rollout metrics.

Host-side glue between the sampler's `Trajectory` records and an `Algorithm` (pure functions of
arrays, `rstar2_jax.algorithms`); nothing here touches the model or knows which algorithm runs.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax import chat
from rstar2_jax.algorithms import Algorithm, Rollouts, loss_inputs, paper_penalty_terms
from rstar2_jax.errors import ConfigError
from rstar2_jax.sampler import Trajectory
from rstar2_jax.sampler.engine import bucket
from rstar2_jax.sampler.rollout import TOOL_STATUSES


@dataclasses.dataclass(frozen=True)
class KeptRollouts:
    """The rollouts that train this step, and their advantages.

    index: `[rows]` indices into the step's trajectories (question-major: question q's rollout
      i is `q * n + i`), group by group.
    advantages: `[rows]` float32, one per trained rollout.
    groups: advantage groups the selection formed (questions it kept).
    """

    index: np.ndarray
    advantages: np.ndarray
    groups: int

    def share(self, start: int, stop: int) -> KeptRollouts:
        """The kept rollouts with indices in ``[start, stop)`` (one host's), indexed from
        ``start``; ``groups`` stays the whole step's."""
        mine = (self.index >= start) & (self.index < stop)
        return KeptRollouts(self.index[mine] - start, self.advantages[mine], self.groups)


def question_batch(num_problems: int, per_step: int, step: int, seed: int) -> np.ndarray:
    """Problem indices of RL step `step` (0-based): consecutive slices of a seeded permutation per
    epoch, so the data position is just the step number."""
    if per_step > num_problems:
        raise ValueError(f"questions_per_step={per_step} exceeds the {num_problems} problems")
    per_epoch = num_problems // per_step
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_problems)
    return order[index * per_step:(index + 1) * per_step]


@dataclasses.dataclass(frozen=True)
class StepRollouts:
    """The sampler's side of one RL step, what the trainer needs of it.

    batch: `make_batch`'s arrays of this process's kept rollouts; None when nothing was kept.
    versions: int64 `[rollouts, 3]`: for each rollout the update trains on (every rollout when
      nothing was kept), its generated tokens' count, the sum of the policy versions that
      sampled them and the oldest of those versions.
    metrics: the step's rollout metrics (`rollout_metrics`, times).
    """

    step: int
    batch: dict | None
    versions: np.ndarray
    metrics: dict


def by_question(trajs: list[Trajectory], n: int) -> dict[int, list[Trajectory]]:
    """This process's trajectories (`score_rollouts`: its questions in order, ``n`` each) by
    question."""
    ran = {trajs[i].prompt_index: trajs[i:i + n] for i in range(0, len(trajs), n)}
    if len(ran) * n != len(trajs) or any(t.prompt_index != q for q, ts in ran.items() for t in ts):
        raise RuntimeError("the sampler returned trajectories out of question order")
    return ran


def rollout_numbers(ran: dict[int, list[Trajectory]], rewards: np.ndarray) -> dict[str, np.ndarray]:
    """Every number the step needs of the rollouts of the questions ``ran`` (question -> its
    trajectories), all but their tokens: ``question`` `[k]`, and `[k, n]` each: the `Rollouts`
    fields, the response lengths (tool output included) and, over each rollout's generated
    tokens, the sum and the oldest of the policy versions that sampled them; and
    ``tool_status`` `[k, n, statuses]` (`tool_status_counts`). ``rewards`` is `[questions, n]`."""
    questions = sorted(ran)
    trajs = [t for q in questions for t in ran[q]]
    shape = (len(questions), rewards.shape[1])
    versions = [np.asarray(t.versions, np.int64)[np.asarray(t.loss_mask, bool)] for t in trajs]
    return rollout_arrays(trajs, rewards[questions].reshape(shape))._asdict() | {
        "question": np.asarray(questions, np.int64),
        "response_length": np.array([len(t.response_ids) for t in trajs], np.int32).reshape(shape),
        "version_sum": np.array([v.sum() for v in versions], np.int64).reshape(shape),
        "version_min": np.array([v.min() for v in versions], np.int64).reshape(shape),
        "tool_status": tool_status_counts(trajs).reshape(*shape, -1)}


def trained_versions(numbers: dict[str, np.ndarray], kept: np.ndarray) -> np.ndarray:
    """`StepRollouts.versions` of the rollouts ``kept`` (flat indices; all of them when empty)
    of the step's `rollout_numbers`."""
    columns = [numbers[k].reshape(-1).astype(np.int64) for k in ("lengths", "version_sum", "version_min")]
    chosen = kept if kept.size else np.arange(columns[0].size)
    return np.stack([c[chosen] for c in columns], axis=1)


def rollout_arrays(trajs: Sequence[Trajectory], rewards: np.ndarray) -> Rollouts:
    """`Rollouts` `[questions, n]` of the step's trajectories (trajectory `q * n + i` is question
    q's i-th) and their rewards `[questions, n]`."""
    if len(trajs) != rewards.size:
        raise ValueError(f"{len(trajs)} trajectories for {rewards.shape[0]} x {rewards.shape[1]} rewards")

    def field(value, dtype):
        return np.array([value(t) for t in trajs], dtype).reshape(rewards.shape)

    def answer_tags(t: Trajectory) -> int:
        return sum(text.count(chat.ANSWER_START) + text.count(chat.ANSWER_END) for text in t.turn_texts)

    return Rollouts(
        rewards=np.asarray(rewards, np.float32),
        lengths=field(lambda t: sum(t.loss_mask), np.int32),
        truncated=field(lambda t: t.truncated, bool),
        tool_calls=field(lambda t: t.num_tool_calls, np.int32),
        tool_errors=field(lambda t: t.num_tool_errors, np.int32),
        tool_error_mentions=field(
            lambda t: sum("error" in c.response_text.lower() for c in t.tool_calls), np.int32),
        answer_blocks=field(lambda t: t.num_answer_blocks, np.int32),
        answer_tags=field(answer_tags, np.int32),
        turns=field(lambda t: max(t.num_turns, 1), np.int32),
    )


def tool_status_counts(trajs: Sequence[Trajectory]) -> np.ndarray:
    """`[len(trajs), len(TOOL_STATUSES)]` int32: each trajectory's tool calls by how they ended."""
    column = {status: i for i, status in enumerate(TOOL_STATUSES)}
    counts = np.zeros((len(trajs), len(TOOL_STATUSES)), np.int32)
    for row, t in enumerate(trajs):
        for call in t.tool_calls:
            counts[row, column[call.status]] += 1
    return counts


def tool_status_metrics(counts: np.ndarray) -> dict[str, float]:
    """``tools/share/<status>``: the share of the step's tool calls that ended with each of
    `TOOL_STATUSES`, from `tool_status_counts` rows `[..., len(TOOL_STATUSES)]`; empty when the
    step made no call. Tells a policy whose calls fail as timeouts (a loaded sandbox) from one
    whose calls fail as malformed or erroring code, which `tools/error_ratio` lumps together."""
    totals = np.asarray(counts).reshape(-1, len(TOOL_STATUSES)).sum(axis=0)
    calls = totals.sum()
    return {f"tools/share/{s}": float(c / calls) for s, c in zip(TOOL_STATUSES, totals)} if calls else {}


def select_rollouts(algorithm: Algorithm, key: jax.Array, rollouts: Rollouts,
                    group_size: int) -> KeptRollouts:
    """Runs the algorithm's selection and advantage estimator and checks what they return.

    Args:
      algorithm: the run's algorithm.
      key: PRNG key for the selection's sampling.
      rollouts: `[questions, n]` rollouts of the step.
      group_size: G, passed to the selection (``rl.group_size``).
    """
    selection = algorithm.select(key, rollouts, group_size)
    index, trains = np.asarray(selection.index), np.asarray(selection.trains)
    if index.ndim != 2 or trains.shape != index.shape or trains.dtype != bool:
        raise ValueError(f"select must return a Selection of [groups, m] int index and bool trains, "
                         f"got shapes {index.shape} and {trains.shape} ({trains.dtype})")
    total = rollouts.rewards.size
    if index.size and (not np.issubdtype(index.dtype, np.integer) or index.min() < 0 or index.max() >= total):
        raise ValueError(f"select returned indices outside the step's {total} rollouts")
    if len(np.unique(index)) != index.size:
        raise ValueError("select returned a rollout twice")
    if index.shape[0] == 0:
        return KeptRollouts(np.zeros((0,), np.int64), np.zeros((0,), np.float32), 0)
    advantages = np.asarray(algorithm.advantages(rollouts.take(index)), np.float32)
    if advantages.shape != index.shape:
        raise ValueError(f"advantages must return one value per kept rollout, {index.shape}, "
                         f"got shape {advantages.shape}")
    if not np.all(np.isfinite(advantages[trains])):
        raise ValueError("advantages returned a non-finite value for a rollout that trains")
    return KeptRollouts(index[trains].astype(np.int64), advantages[trains], index.shape[0])


def check_algorithm(algorithm: Algorithm, rollouts_per_question: int, group_size: int, *,
                    questions: int = 2, token_advantages: bool = False) -> None:
    """Runs the algorithm's three functions on a tiny made-up step (``questions`` questions, the
    last with mixed rewards; one row of loss tokens; made-up values of the per-token inputs the
    loss declares) so that a mistake in them, or a selection that cannot work with these sizes,
    fails before the first rollout. The loss is traced, as the update traces it, not run: the
    check compiles nothing, and with ``questions`` the run's the selection compiles what the
    run will. With ``token_advantages``
    (a rollout correction with importance weights) the loss is also given `[rows, seq]`
    advantages, as the update will, and must return what it returns for the same values as
    `[rows]` (one program). Raises ConfigError for sizes the selection cannot work with or a
    loss that does not take per-token advantages, ValueError for a loss of the wrong form."""
    n = rollouts_per_question
    rewards = np.zeros((questions, n), np.float32)
    rewards[-1, : n // 2 or 1] = 1.0
    rollouts = Rollouts.from_rewards(rewards, lengths=4, tool_calls=1, turns=2)
    try:
        select_rollouts(algorithm, jax.random.key(0), rollouts, group_size)
    except ValueError as e:
        raise ConfigError(f"the algorithm cannot run with rl.rollouts_per_question={n} and "
                         f"rl.group_size={group_size}: {e}") from None
    logp = np.array([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]], np.float32)
    mask = np.array([[1, 1, 0], [0, 0, 0]], bool)
    advantages = np.array([1.0, -1.0], np.float32)
    made_up = {"entropy": np.full(logp.shape, 0.7, np.float32), "ref_logp": logp - 0.1}
    inputs = {name: made_up[name] for name in loss_inputs(algorithm.loss)}

    def loss(advantages):
        return algorithm.loss(logp, logp, advantages, mask, **inputs)

    out = jax.eval_shape(loss, advantages)
    if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[2], dict)
            and np.shape(out[0]) == () and np.shape(out[1]) == ()):
        raise ValueError("the algorithm's loss must return (loss_sum, count, metric_sums): two "
                         "scalars and a dict of scalars")
    if token_advantages:
        # The same advantages repeated on every token must give the same loss.
        try:
            per_row, per_token = jax.device_get(jax.jit(lambda a: (loss(a), loss(
                jnp.broadcast_to(a[:, None], logp.shape))))(advantages))
            same = bool(np.allclose(per_token[0], per_row[0], rtol=1e-5)) and int(per_token[1]) == int(per_row[1])
        except Exception as e:  # a loss that refuses them, whatever it raises
            same, why = False, f" ({type(e).__name__}: {e})"
        else:
            why = f" (loss_sum {per_token[0]} instead of {per_row[0]})"
        if not same:
            raise ConfigError("rl.rollout_correction.weights gives the loss per-token advantages "
                              "[rows, seq], and the algorithm's loss does not take them as it takes "
                              f"[rows] ones{why}")


def check_trained_ids(batch: dict[str, np.ndarray], trajs: Sequence[Trajectory],
                      kept: KeptRollouts, encode_tool_response: Callable[[str], list[int]]) -> None:
    """Checks that the rows the update trains on are exactly what the sampler drew.

    For each kept rollout (row ``r`` of ``batch``, from `make_batch`) and its trajectory: the
    row's tokens are the prompt ids followed by the response ids, then padding; its loss mask
    is 1 exactly on the model's turns (``turn_spans``) and its sampler log-probs are theirs;
    the turns are in order, and what lies between turn k and turn k + 1 is exactly
    ``encode_tool_response`` of the tool output shown after turn k (``tool_calls``), so no
    token of a tool output is trained on and no sampled token is lost or shifted at a turn
    boundary; nothing follows the last turn. Raises ValueError naming the rollout and what
    differs (a bug in the sampler or the batching, never the user's input).
    """
    for row, index in enumerate(kept.index):
        t = trajs[index]
        where = f"rollout {index} (question {t.prompt_index}, sample {t.sample_index})"
        p, n = len(t.prompt_ids), len(t.response_ids)
        tokens, attention = batch["tokens"][row], batch["attention_mask"][row]
        if (not np.array_equal(tokens[:p + n], t.prompt_ids + t.response_ids)
                or not np.all(attention[:p + n] == 1) or np.any(attention[p + n:])):
            raise ValueError(f"{where}: the training row's tokens are not the sampled prompt and "
                             "response followed by padding")
        expected_mask = np.zeros(tokens.shape, np.int32)
        for start, end in t.turn_spans:
            expected_mask[p + start:p + end] = 1
        if not (np.array_equal(batch["loss_mask"][row], expected_mask)
                and np.array_equal(t.loss_mask, expected_mask[p:p + n])):
            raise ValueError(f"{where}: the loss mask is not 1 exactly on the model's turns")
        if not np.array_equal(batch["sampler_logp"][row, p:p + n], np.float32(t.logprobs)):
            raise ValueError(f"{where}: the training row's sampler log-probs are not the trajectory's")
        responses = {call.turn: call.response_text for call in t.tool_calls}
        ends = [0] + [end for _, end in t.turn_spans]
        starts = [start for start, _ in t.turn_spans] + [n]
        for turn, (gap_start, gap_end) in enumerate(zip(ends, starts)):
            gap = t.response_ids[gap_start:gap_end]
            if 0 < turn < len(t.turn_spans):  # between turns: the output of turn - 1's call
                if turn - 1 not in responses:
                    raise ValueError(f"{where}: model turns {turn - 1} and {turn} follow each "
                                     "other without a tool call between them")
                expected = encode_tool_response(responses[turn - 1])
                what = f"the tool output shown after turn {turn - 1}"
            else:
                expected, what = [], "none (before the first turn or after the last)"
            if gap != expected:
                raise ValueError(f"{where}: response positions [{gap_start}, {gap_end}) hold "
                                 f"{len(gap)} tokens, but the tokens there should be {what}")


def make_batch(trajs: Sequence[Trajectory], kept: KeptRollouts, *, pad_id: int,
               seq_len: int, rows: int | None = None) -> dict[str, np.ndarray]:
    """Right-padded training arrays for the kept rollouts.

    Each row is prompt + response, padded to ``seq_len`` tokens: the longest a rollout can be
    (the rollout limits' prompt plus response budget), so every step has the same length. The
    row count is padded up to ``rows`` (default: the next power of two); the RL step passes the
    rollouts of a host's questions, the most it can keep, so that the layout has one shape for
    the run. Padding rows carry no loss token (they add nothing to the loss sums); they attend
    to themselves, because a row with no visible token at all would give NaN logits, and
    NaN * 0 is still NaN in the backward pass.

    Returns `[rows, seq_len]` arrays: tokens, attention_mask, loss_mask (1 on model-generated
    tokens), sampler_logp (the sampler's log-prob of each token, 0 elsewhere), and
    `[rows]` advantages. Raises ValueError for a rollout longer than ``seq_len``.
    """
    chosen = [trajs[i] for i in kept.index]
    if rows is None:
        rows = bucket(len(chosen), minimum=1)
    elif rows < len(chosen):
        raise ValueError(f"rows={rows} cannot hold the {len(chosen)} kept rollouts")
    longest = max((len(t.prompt_ids) + len(t.response_ids) for t in chosen), default=1)
    if longest > seq_len:
        raise ValueError(f"a kept rollout has {longest} tokens, more than seq_len={seq_len} "
                         "(the rollout limits' prompt + response budget)")
    seq = seq_len
    batch = {"tokens": np.full((rows, seq), pad_id, np.int32),
             "attention_mask": np.zeros((rows, seq), np.int32),
             "loss_mask": np.zeros((rows, seq), np.int32),
             "sampler_logp": np.zeros((rows, seq), np.float32),
             "advantages": np.zeros((rows,), np.float32)}
    for row, (t, adv) in enumerate(zip(chosen, kept.advantages)):
        p, end = len(t.prompt_ids), len(t.prompt_ids) + len(t.response_ids)
        batch["tokens"][row, :end] = t.prompt_ids + t.response_ids
        batch["attention_mask"][row, :end] = 1
        batch["loss_mask"][row, p:end] = t.loss_mask
        batch["sampler_logp"][row, p:end] = t.logprobs
        batch["advantages"][row] = adv
    batch["attention_mask"][len(chosen):] = 1
    return batch


def rollout_metrics(rollouts: Rollouts, kept: KeptRollouts,
                    response_lengths: np.ndarray) -> dict[str, float]:
    """Per-step statistics of the sampled and the kept rollouts (paper Fig. 4 and §4.3 curves).
    ``response_lengths``: ``[questions * n]`` tokens after each prompt (tool output included).

    A ratio with nothing to measure is absent from the dict, never 0: the tool-error ratios among
    positives when there is no positive (or no positive called a tool), for example, and the
    advantage statistics of a step that kept nothing.

    ``advantages/{mean,abs_mean,min,max,nonzero_frac}`` are taken over the kept rollouts that
    train, one value per rollout (the estimator's output, before any per-token rollout
    correction), not per loss token: a long rollout counts once.
    """
    flat = rollouts.take(np.arange(rollouts.rewards.size))
    rewards = np.asarray(rollouts.rewards)
    positive = flat.rewards == 1
    kept_positive = np.zeros_like(positive)
    kept_positive[kept.index] = positive[kept.index]
    p_err, p_format = (np.asarray(x) for x in paper_penalty_terms(flat))

    def error_ratio(which: np.ndarray) -> float | None:
        # Failed calls / calls over a set of rollouts (the paper's "tool-call error ratio").
        calls = flat.tool_calls[which].sum()
        return float(flat.tool_errors[which].sum() / calls) if calls else None

    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/question_accuracy": float(rewards.max(axis=1).mean()),  # solved at least once
        "groups/total": float(rewards.shape[0]),
        "groups/kept": float(kept.groups),
        "groups/all_correct": float((rewards.min(axis=1) == 1).mean()),
        "rollouts/kept": float(len(kept.index)),
        "rollouts/positives": float(positive.sum()),
        "rollouts/kept_positives": float(kept_positive.sum()),
        "tools/calls_per_rollout": float(flat.tool_calls.mean()),
        "tools/rollouts_with_error": float((flat.tool_errors > 0).mean()),
        "roc/penalty_mean": float((p_err + p_format).mean()),
        "roc/p_err_mean": float(p_err.mean()),
        "roc/format_penalty_mean": float(p_format.mean()),
        "response/length_mean": float(np.mean(response_lengths)),
        "response/length_max": float(np.max(response_lengths)),
        "response/turns_mean": float(flat.turns.mean()),
        "response/truncated": float(flat.truncated.mean()),
    }
    ratios = {"tools/error_ratio": error_ratio(np.ones_like(positive)),
              "tools/error_ratio_positives": error_ratio(positive),
              "tools/error_ratio_kept_positives": error_ratio(kept_positive)}
    metrics |= {name: value for name, value in ratios.items() if value is not None}
    if len(kept.advantages):
        a = np.asarray(kept.advantages, np.float64)
        metrics |= {"advantages/mean": float(a.mean()), "advantages/abs_mean": float(np.abs(a).mean()),
                    "advantages/min": float(a.min()), "advantages/max": float(a.max()),
                    "advantages/nonzero_frac": float(np.mean(a != 0))}
    return metrics


def step_metrics(rollouts: Rollouts, kept: KeptRollouts, numbers: dict[str, np.ndarray],
                 times: np.ndarray, counts: np.ndarray) -> dict[str, float]:
    """The sampler side's metrics of a step: `rollout_metrics`, `tool_status_metrics` and the
    hosts' totals (`StepExchange.totals`): ``times`` the slowest host's rollout, tool-wait
    and reward-wait seconds, ``counts`` all hosts' generated tokens, preemptions, verifier
    timeouts and verifier errors."""
    rollout_s, tool_wait_s, reward_wait_s = times
    tokens, preemptions, verifier_timeouts, verifier_errors = counts
    return rollout_metrics(rollouts, kept, numbers["response_length"].reshape(-1)) | {
        "time/rollout_s": rollout_s, "time/tool_wait_s": tool_wait_s,
        "time/reward_wait_s": reward_wait_s,
        "perf/rollout_tokens_per_s": tokens / max(rollout_s, 1e-9),
        "rollouts/preemptions": preemptions,
        "reward/verifier_timeouts": verifier_timeouts,
        "reward/verifier_errors": verifier_errors,
    } | tool_status_metrics(numbers["tool_status"])
