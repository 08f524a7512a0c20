"""What an agentic rollout may do: the sampler's settings (`RolloutSettings`: decode slots,
tool-output rendering, the tool sandbox's limits and the pools, serving dtype, weight updates)
and a job's limits on each trajectory (`RolloutLimits`).
Each is checked when it is made, so a bad value fails at configuration, not mid-run."""
from __future__ import annotations

import dataclasses


from rstar2_jax.model import ModelConfig, target
from rstar2_jax.sandbox import SandboxConfig
from rstar2_jax.sandbox.config import check_num_workers, default_num_workers, pool_memory_bytes


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """How agentic rollouts run, whatever the job (a job config's ``rollout`` section).

    num_slots: rows decoded together (the decode batch).
    num_rows: trajectories in flight at once (default: twice ``num_slots``). A row waiting on
      its tool call keeps its KV cache pages but gives its slot to another row, so that slots
      do not sit idle during tool calls; rows beyond the slots wait for one, oldest first.
    chunk: decode steps per device call at most.
    tool_response_chars: the tool output shown to the model is cut to this many characters
      (the middle is cut; head and tail kept, see `render_result`).
    show_tool_time: include the execution time line in tool responses.
      These two shape the text the model reads; they must match what its SFT data showed it.
    tool_session: a trajectory's tool calls share state, as cells of a notebook (False: every
      call is a fresh program, rStar2's training tool). See `rstar2_jax.sandbox.session`.
    sandbox_workers: sandbox worker processes (None: one per core).
    sandbox: the tool sandbox's limits (``rollout.sandbox.*``: `rstar2_jax.sandbox.SandboxConfig`,
      docs/sandbox.md): ``timeout_s`` per call (with ``tool_session``, the replay of the
      trajectory's earlier calls included; rStar2 used 4 s), memory, processes, output, ...
    verifier_workers: answer-checking processes.
    verifier_timeout_s: limit of one answer check; a check that runs over scores 0.
    serving_dtype: dtype of the params and KV cache the sampler serves, cast from the trainer's
      params once per rollout call: "auto" (bfloat16 on GPU and TPU, on CPU the dtype the model
      computes in: a training job's ``precision.compute``), "float32" or "bfloat16". Part of the
      precision policy (docs/accelerators.md#precision).
    memory_budget_gib: device memory the rollout engine may use; None: ``memory_fraction`` of
      the device's free memory where the backend reports it (GPU, TPU), no check on CPU.
      `rstar2_jax.sampler.memory` plans it before the first rollout.
    memory_fraction: see ``memory_budget_gib``.
    page_size: tokens per page of the KV cache's pool; the pool is sized from the memory budget
      (see `rstar2_jax.sampler.memory`).
    on_weight_update: what rows in flight do when the trainer has new weights during a rollout:
      "finish" (the default) finishes every rollout on the weights it started with (the RL loop
      under ``rl.max_staleness`` > 0 posts no weights mid-rollout; a run is reproducible);
      otherwise the loop posts each update's weights (`AgentSampler.update_weights`) and "keep"
      continues on the keys and values cached under the
      old weights (PipelineRL's choice: no extra compute; a token sampled after the update
      attends to an old-weight prefix, and its log-prob is the one under that mix); "recompute"
      prefills each row's whole context (prompt and response so far, tool outputs included)
      again under the new weights before its next token (AReaL's choice: every later token is
      exactly the new policy's, at the cost of one prefill of every context in flight per
      update; the rows of a prompt's samples no longer share its pages after it, so a tight
      pool may preempt more). Either way, a row the pool preempts is prefilled again under the
      weights current then. Without ``rl.max_staleness`` > 0, no weights arrive during a rollout.
    """

    num_slots: int = 64
    num_rows: int | None = None
    chunk: int = 64
    tool_response_chars: int = 1024
    show_tool_time: bool = True
    tool_session: bool = False
    sandbox_workers: int | None = None
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    verifier_workers: int = 1
    verifier_timeout_s: float = 4.0
    serving_dtype: str = "auto"
    memory_budget_gib: float | None = None
    memory_fraction: float = 0.9
    page_size: int = 32
    on_weight_update: str = "finish"

    def __post_init__(self):
        _check(self.num_slots >= 1, f"rollout.num_slots must be >= 1, got {self.num_slots}")
        _check(self.num_rows is None or self.num_rows >= self.num_slots,
               f"rollout.num_rows must be >= rollout.num_slots, got {self.num_rows}")
        _check(self.chunk >= 1, f"rollout.chunk must be >= 1, got {self.chunk}")
        _check(self.tool_response_chars >= 64,
               f"rollout.tool_response_chars must be >= 64, got {self.tool_response_chars}")
        _check(self.sandbox_workers is None or self.sandbox_workers >= 1,
               f"rollout.sandbox_workers must be >= 1, got {self.sandbox_workers}")
        try:
            check_num_workers(self.sandbox_workers or default_num_workers())
        except ValueError as e:
            raise ValueError(f"rollout.sandbox_workers={self.sandbox_workers}: {e}") from None
        try:
            pool_memory_bytes(self.sandbox, self.sandbox_workers or default_num_workers())
        except ValueError as e:
            raise ValueError(f"rollout.sandbox: {e}") from None
        _check(self.verifier_workers >= 1,
               f"rollout.verifier_workers must be >= 1, got {self.verifier_workers}")
        _check(0 < self.verifier_timeout_s < float("inf"),
               f"rollout.verifier_timeout_s must be finite and > 0, got {self.verifier_timeout_s}")
        _check(self.serving_dtype in ("auto", "float32", "bfloat16"),
               f"rollout.serving_dtype must be auto, float32 or bfloat16, got {self.serving_dtype!r}")
        _check(self.memory_budget_gib is None or self.memory_budget_gib > 0,
               f"rollout.memory_budget_gib must be > 0, got {self.memory_budget_gib}")
        _check(0 < self.memory_fraction <= 1,
               f"rollout.memory_fraction must be in (0, 1], got {self.memory_fraction}")
        _check(self.page_size >= 1, f"rollout.page_size must be >= 1, got {self.page_size}")
        _check(self.on_weight_update in ("finish", "keep", "recompute"),
               f"rollout.on_weight_update must be finish, keep or recompute, got "
               f"{self.on_weight_update!r}")

    @property
    def rows(self) -> int:
        """Trajectories in flight (``num_rows``, or its default)."""
        return self.num_rows or 2 * self.num_slots

    def serving_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` in the dtype the sampler serves (see ``serving_dtype``)."""
        dtype = self.serving_dtype
        if dtype == "auto":
            dtype = "bfloat16" if target.current().accelerator else config.dtype
        return dataclasses.replace(config, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class RolloutLimits:
    """A job's limits on each trajectory (from its stage or evaluation config).

    max_turns: model turns per trajectory (a turn ends at `<|im_end|>`); the paper uses 10
      (15 in stage 3, 30 at evaluation).
    max_response_tokens: budget for everything after the prompt, model and tool tokens alike.
    max_prompt_tokens: longest prompt accepted.
    """

    max_turns: int
    max_response_tokens: int
    max_prompt_tokens: int

    def __post_init__(self):
        _check(min(self.max_turns, self.max_response_tokens, self.max_prompt_tokens) >= 1,
               f"rollout limits must be >= 1, got {self}")
