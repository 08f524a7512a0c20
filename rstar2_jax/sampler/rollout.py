"""Agentic rollouts: multi-turn sampling with Python tool calls and continuous batching.

The host loop around the `Engine`:

1. Free rows are filled from the queue of (prompt, sample) pairs while the KV cache's page pool
   has room. A prompt is prefilled once and its pages are shared by the rows of its samples,
   whenever those rows free up.
2. The device decodes all active rows and hands control back as soon as any row ends a turn.
3. A turn that ends with a `<tool_call>` pauses its row; the call goes to the executor
   asynchronously (`submit` returns a future) and the other rows keep decoding.
4. When a call's result is back, its rendered text is tokenized, appended to the trajectory with
   loss mask 0, prefilled into the row's cache (only those tokens) and the row resumes.
5. A turn without a tool call, the turn limit or the token budget ends the trajectory and frees
   the row for the next queued sample.

With ``tool_session`` on, a trajectory's calls go to its own tool session (`rstar2_jax.sandbox.
session`): each call sees the variables its earlier calls defined, and nothing of any other
trajectory. The session is opened at the trajectory's first call and closed when the trajectory
ends, whatever ends it. It holds nothing in the sandbox between calls, so a row the engine
preempts costs the pool nothing, and its seed comes from the trajectory's sequence number, so
the same params, prompts and seed give the same tool outputs too.

Token ids are the record: generated ids are appended as sampled, tool tokens as encoded, and the
trajectory is never decoded and re-tokenized (text is decoded only to parse a turn).

Partial rollouts: new weights can reach a rollout in flight (`AgentSampler.update_weights`, from
any thread, e.g. the trainer's). They are taken before the next decode call and every row
continues under them: on the keys and values already cached under the old weights
(``rollout.on_weight_update=keep``, PipelineRL's choice) or on its whole context prefilled again
under the new ones (``recompute``, AReaL's). A row waiting on its tool call keeps waiting; its
result is appended when it lands, as always. Each token records the policy version that sampled
it (`Trajectory.versions`) and its log-prob under those weights.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import logging
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax import chat
from rstar2_jax.model import ModelConfig, forward_cached
from rstar2_jax.sampler.engine import STAGE_ROWS, Engine, program_bound
from rstar2_jax.sampler.memory import MemoryPlan, check_plan, device_budget, plan_memory
from rstar2_jax.sampler.feeder import PromptFeeder
from rstar2_jax.sampler.sampling import SamplingParams
from rstar2_jax.sampler.settings import RolloutLimits, RolloutSettings
from rstar2_jax.sampler.weights import WeightUpdates
from rstar2_jax.sandbox import Session, render_result
from rstar2_jax.sandbox.result import STATUSES

log = logging.getLogger(__name__)


# What a tool call can end as: an ExecResult status, or MALFORMED (the call could not be parsed).
MALFORMED = "malformed"
TOOL_STATUSES = (*STATUSES, MALFORMED)


@dataclasses.dataclass(frozen=True)
class ToolCallRecord:
    """One tool call of a trajectory and what the model was shown."""

    code: str
    stdin: str
    status: str  # one of TOOL_STATUSES
    response_text: str
    turn: int

    @property
    def is_error(self) -> bool:
        """Counts for RoC's p_err: execution error, timeout, malformed call, any failure."""
        return self.status != "ok"


@dataclasses.dataclass
class Trajectory:
    """A finished rollout.

    `response_ids`, `loss_mask` and `logprobs` are aligned `[response_len]`: 1 / the sampler's
    log-prob for model tokens, 0 / 0.0 for tool-response and scaffold tokens.
    `turn_spans` are the `[start, end)` ranges of the model's turns in `response_ids`.
    `finish_reason`: "answer" (final turn has an `<answer>` block), "no_tool_call" (final turn
    has neither an answer nor a tool call), "max_turns", or "budget" (truncated: the token
    budget ran out while generating or a tool response would not fit).
    `versions`, aligned with `response_ids`: the policy version of the weights that sampled each
    model token (the version the rollout started with, unless new weights arrived during it);
    a tool response's tokens carry the version being served when they were appended.
    """

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turn_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    turn_texts: list[str] = dataclasses.field(default_factory=list)
    tool_calls: list[ToolCallRecord] = dataclasses.field(default_factory=list)
    num_answer_blocks: int = 0
    finish_reason: str = ""
    versions: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    @property
    def num_tool_calls(self) -> int:
        return len(self.tool_calls)

    @property
    def num_tool_errors(self) -> int:
        return sum(c.is_error for c in self.tool_calls)

    @property
    def response_text(self) -> str:
        """The model's own text (tool outputs excluded): what the reward reads."""
        return "\n".join(self.turn_texts)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "budget"

    def record(self) -> dict:
        """The trajectory as JSON-serialisable values, which `from_record` turns back into it
        (what hosts send each other)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> Trajectory:
        return cls(**{**record, "turn_spans": [tuple(span) for span in record["turn_spans"]],
                      "tool_calls": [ToolCallRecord(**call) for call in record["tool_calls"]]})


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    wall_s: float
    tool_wait_s: float  # time the device sat idle because every live row waited on a tool
    generated_tokens: int
    tool_calls: int
    decode_steps: int = 0  # model steps the decode calls ran (each for every running row)
    preemptions: int = 0  # rows whose pages were taken back (recomputed later): the pool is tight
    weight_updates: int = 0  # new weights taken during the rollout

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / max(self.wall_s, 1e-9)

    @property
    def tool_wait_fraction(self) -> float:
        return self.tool_wait_s / max(self.wall_s, 1e-9)


@dataclasses.dataclass
class _Row:
    traj: Trajectory
    sequence: int  # the trajectory's sequence number (its sampling key, its session's seed)
    turn_start: int = 0
    future: concurrent.futures.Future | None = None
    call: chat.ToolCall | None = None
    ready_text: str | None = None  # a response that needs no execution (malformed call)
    session: Session | None = None  # with tool_session, opened at the first call


def session_seed(seed: int, sequence: int) -> int:
    """The tool session seed of sequence ``sequence`` of a rollout call with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{sequence}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _cast(params, dtype):
    """``params`` with every floating array in ``dtype`` (the same arrays if they already are)."""
    if all(x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(params)):
        return params
    return _cast_tree(params, dtype)


@functools.partial(jax.jit, static_argnums=1)
def _cast_tree(params, dtype):
    # One program for the whole tree (eager, a cast would be one per array shape).
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        params)


class RolloutStopped(Exception):
    """`AgentSampler.rollout` ended early because its ``stop`` event was set."""


class AgentSampler:
    """Runs agentic rollouts for batches of prompts; compiled once, reused across RL steps.

    Args:
      config: model config.
      tokenizer: a Hugging Face tokenizer with the chat markup tokens.
      executor: runs tool calls; needs `submit(code, stdin) -> Future[ExecResult]` and, with
        ``settings.tool_session``, `session(seed) -> Session` (a `SandboxPool`).
      settings: decode slots and tool-output rendering (its pool fields are the runtime's).
      limits: turns and tokens per trajectory.
      sampling: token selection (the paper trains at temperature 1.0, evaluates at 0.6).
      forward_fn: the cached forward (the model's by default; tests pass a scripted policy).
      fmt: the chat format: the tool's name and how tool responses are laid out.
    """

    def __init__(self, config: ModelConfig, tokenizer, executor, settings: RolloutSettings,
                 limits: RolloutLimits, sampling: SamplingParams, forward_fn=forward_cached,
                 fmt: chat.ChatFormat = chat.ChatFormat()):
        if settings.tool_session and not callable(getattr(executor, "session", None)):
            raise ValueError(f"rollout.tool_session needs an executor with session(seed); "
                             f"{type(executor).__name__} has none")
        self.config = config
        self.fmt = fmt
        self.tokenizer = tokenizer
        self.executor = executor
        self.settings = settings
        self.limits = limits
        self.sampling = sampling
        self.forward_fn = forward_fn
        self.im_end = tokenizer.convert_tokens_to_ids(chat.IM_END)
        stops = {self.im_end}
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
        self.stop_tokens = tuple(sorted(stops))
        self.plan: MemoryPlan | None = None  # made by the first rollout
        self._engine: Engine | None = None  # the latest rollout's (its pool closed)
        # New weights for the rollout in flight, taken before each decode call.
        self.weight_updates = WeightUpdates()

    def update_weights(self, params, version: int) -> None:
        """Hands the rollout in flight ``params`` as policy ``version``; safe from any thread.

        They are cast to the serving dtype and served from the next decode call on (a call in
        progress finishes under the weights it started with), then rows go on as
        ``settings.on_weight_update`` says. Only the newest of several posts in between is
        served, and only if newer than the version being served. A post when no rollout is in
        flight reaches the next rollout's first decode call, unless that one starts with a
        version at least as new. The caller must not donate or change ``params`` afterwards.
        Refused (ValueError) under ``on_weight_update="finish"``.
        """
        if self.settings.on_weight_update == "finish":
            raise ValueError("rollout.on_weight_update=finish: rollouts finish on the weights "
                             "they started with; set keep or recompute to take new weights")
        self.weight_updates.post(params, version)

    def programs(self) -> dict[str, int]:
        """The most programs this sampler's rollouts compile, by JAX's names
        (`rstar2_jax.sampler.engine.program_bound`, and the cast to the serving dtype)."""
        max_len = self.limits.max_prompt_tokens + self.limits.max_response_tokens
        return program_bound(max_len, self.settings.page_size) | {"jit(_cast_tree)": 1}

    def _take_weight_update(self, engine: Engine) -> bool:
        """Serves the newest weights posted, if newer than the engine's; returns whether."""
        update = self.weight_updates.take(newer_than=engine.version)
        if update is None:
            return False
        serving = self.settings.serving_config(self.config)
        engine.set_params(_cast(update.params, serving.jnp_dtype), update.version,
                          recompute=self.settings.on_weight_update == "recompute")
        return True

    def _open_engine(self, params, version: int) -> Engine:
        """An engine serving ``params`` cast to the serving dtype, its page pool sized by the
        memory plan (made on the first call, which stops with a ConfigError if the budget
        cannot hold it). Each rollout call opens its own and closes it at the end, so that the
        pool does not take the trainer's memory between rollouts."""
        serving = self.settings.serving_config(self.config)
        params = _cast(params, serving.jnp_dtype)
        max_len = self.limits.max_prompt_tokens + self.limits.max_response_tokens
        settings = self.settings
        if self.plan is None:
            plan = plan_memory(
                serving, params, num_slots=settings.num_slots, num_rows=settings.rows,
                max_len=max_len, max_prompt_len=self.limits.max_prompt_tokens,
                stage_rows=STAGE_ROWS, page_size=settings.page_size,
                budget=device_budget(settings.memory_budget_gib, settings.memory_fraction, params))
            log.info("%s", plan.summary())
            check_plan(plan)
            self.plan = plan
        self._engine = Engine(
            params, serving, num_slots=settings.num_slots, num_rows=settings.rows,
            max_len=max_len, max_prompt_len=self.limits.max_prompt_tokens,
            sampling=self.sampling, stop_tokens=self.stop_tokens, chunk=settings.chunk,
            page_size=settings.page_size, num_pages=self.plan.num_pages, stage_rows=STAGE_ROWS,
            forward_fn=self.forward_fn, version=version,
        )
        return self._engine

    def rollout(self, params, prompts: list[list[int]], samples_per_prompt: int = 1,
                on_finish: Callable[[Trajectory], None] | None = None, seed: int = 0,
                first_sequence: int = 0, claim: Callable[[], int | None] | None = None,
                version: int = 0, stop: threading.Event | None = None,
                ) -> tuple[list[Trajectory], RolloutStats]:
        """Samples `samples_per_prompt` trajectories per prompt.

        `on_finish` is called with each trajectory as soon as it finishes (e.g. to start scoring
        it while the other rows are still decoding). Trajectory `p * samples_per_prompt + s`
        draws from its own key derived from `seed` (key `first_sequence + p * samples_per_prompt
        + s`), so the samples do not depend on slot scheduling or tool timing: the same params,
        prompts and seed give the same tokens, and a share of a batch, started at its offset,
        gives the tokens its rows get in the whole batch.

        With ``claim``, only the prompts it hands out are sampled, each as a row frees up
        (`PromptFeeder`): `rstar2_jax.parallel.hosts.claims` shares a step's prompts among hosts that way.
        A claimed prompt's samples are the ones the whole batch gives it.

        ``params`` are policy ``version``: each token's entry of `Trajectory.versions`. Weights
        posted with `update_weights` during the call are served from the next decode call on.

        ``stop``, set from another thread, ends the call before its next decode call or tool
        wait with `RolloutStopped` (the trajectories in flight are dropped; tool calls already
        running finish in the sandbox, unread): the asynchronous RL loop's sampler thread
        stops this way when the trainer stops.

        Returns the trajectories ordered by (prompt, sample) and timing statistics. Every tool
        session the call opened is closed when it returns or raises.
        """
        for i, p in enumerate(prompts):
            if not 1 <= len(p) <= self.limits.max_prompt_tokens:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; must be 1..{self.limits.max_prompt_tokens}")
        engine = self._open_engine(params, version)
        try:
            return self._rollout(engine, prompts, samples_per_prompt, on_finish, seed,
                                 first_sequence, claim, stop)
        finally:
            engine.close()

    def _rollout(self, engine: Engine, prompts, samples_per_prompt, on_finish, seed,
                 first_sequence, claim, stop) -> tuple[list[Trajectory], RolloutStats]:
        feeder = PromptFeeder(engine, prompts, samples_per_prompt,
                              [self.limits.max_response_tokens] * len(prompts), seed,
                              first_sequence, claim)
        start = time.perf_counter()
        tool_wait = 0.0
        generated = 0
        updates = 0
        rows: list[_Row | None] = [None] * engine.num_rows
        done: list[Trajectory] = []
        finished: list[Trajectory] = []  # finished in this iteration, not yet reported

        try:
            while not feeder.done or any(r is not None for r in rows):
                if stop is not None and stop.is_set():
                    raise RolloutStopped(f"stopped with {len(done)} trajectories finished")
                for i, p, s in feeder.fill([i for i, r in enumerate(rows) if r is None]):
                    rows[i] = _Row(Trajectory(p, s, list(prompts[p])),
                                   sequence=first_sequence + p * samples_per_prompt + s)
                if engine.active.any():
                    updates += self._take_weight_update(engine)
                    out = engine.decode(min_stops=1)
                    generated += int(out.count.sum())
                    for i in np.flatnonzero(out.count):
                        row, n = rows[i], int(out.count[i])
                        row.traj.response_ids += out.tokens[i, :n].tolist()
                        row.traj.logprobs += out.logprobs[i, :n].tolist()
                        row.traj.loss_mask += [1] * n
                        row.traj.versions += [engine.version] * n
                        if out.stopped[i] and self._end_turn(row, seed):
                            self._finish(engine, rows, i, finished)
                elif any(r is not None and r.future is not None for r in rows):
                    t0 = time.perf_counter()
                    concurrent.futures.wait([r.future for r in rows if r and r.future],
                                            return_when=concurrent.futures.FIRST_COMPLETED)
                    tool_wait += time.perf_counter() - t0
                self._resume_ready(engine, rows, finished)
                for traj in finished:
                    if on_finish is not None:
                        on_finish(traj)
                    done.append(traj)
                finished.clear()
        finally:
            for row in rows:
                if row is not None and row.session is not None:
                    row.session.close()

        done.sort(key=lambda t: (t.prompt_index, t.sample_index))
        stats = RolloutStats(
            wall_s=time.perf_counter() - start, tool_wait_s=tool_wait,
            generated_tokens=generated, tool_calls=sum(t.num_tool_calls for t in done),
            decode_steps=engine.decode_steps, preemptions=engine.preemptions,
            weight_updates=updates)
        return done, stats

    @staticmethod
    def _finish(engine: Engine, rows: list[_Row | None], i: int, finished: list) -> None:
        """Ends row ``i``'s trajectory: closes its tool session and frees the row."""
        row = rows[i]
        if row.session is not None:
            row.session.close()
        finished.append(row.traj)
        rows[i] = None
        engine.release([i])

    def _end_turn(self, row: _Row, seed: int) -> bool:
        """Handles a row that stopped; returns True when its trajectory is finished."""
        traj = row.traj
        span = (row.turn_start, len(traj.response_ids))
        traj.turn_spans.append(span)
        text = self.tokenizer.decode(traj.response_ids[span[0]:span[1]],
                                     skip_special_tokens=False)
        traj.turn_texts.append(text)
        answers = chat.count_answer_blocks(text)
        traj.num_answer_blocks += answers
        if traj.response_ids[-1] not in self.stop_tokens:
            traj.finish_reason = "budget"
            return True
        call = chat.parse_tool_call(text, self.fmt.tool_name)
        if call is None:
            traj.finish_reason = "answer" if answers else "no_tool_call"
            return True
        if traj.num_turns >= self.limits.max_turns:
            traj.finish_reason = "max_turns"
            return True
        row.call = call
        if call.error is not None:
            row.ready_text = chat.malformed_call_response(call)
        elif self.settings.tool_session:
            if row.session is None:
                row.session = self.executor.session(seed=session_seed(seed, row.sequence))
            row.future = row.session.submit(call.code, call.stdin)
        else:
            row.future = self.executor.submit(call.code, call.stdin)
        return False

    def _resume_ready(self, engine: Engine, rows: list[_Row | None], done: list) -> None:
        resume = {}
        for i, row in enumerate(rows):
            if row is None or (row.ready_text is None and
                               (row.future is None or not row.future.done())):
                continue
            call = row.call
            if row.ready_text is not None:
                status, text = MALFORMED, row.ready_text
            else:
                result = row.future.result()
                status = result.status
                text = render_result(result, max_chars=self.settings.tool_response_chars,
                                     show_time=self.settings.show_tool_time)
            traj = row.traj
            traj.tool_calls.append(
                ToolCallRecord(call.code, call.stdin, status, text, turn=traj.num_turns - 1))
            row.future, row.call, row.ready_text = None, None, None
            tool_ids = chat.encode_tool_response(self.tokenizer, text, self.fmt)
            room = self.limits.max_response_tokens - len(traj.response_ids) - len(tool_ids)
            if room < 1:
                # The response would not fit: end cleanly on the model's last turn.
                traj.finish_reason = "budget"
                self._finish(engine, rows, i, done)
                continue
            pending = traj.response_ids[-1]
            traj.response_ids.extend(tool_ids)
            traj.loss_mask.extend([0] * len(tool_ids))
            traj.logprobs.extend([0.0] * len(tool_ids))
            traj.versions.extend([engine.version] * len(tool_ids))
            row.turn_start = len(traj.response_ids)
            resume[i] = ([pending] + tool_ids[:-1], tool_ids[-1], room)
        engine.resume(resume)
