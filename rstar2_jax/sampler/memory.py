"""The rollout engine's device memory, planned before the first rollout.

The engine keeps keys and values in a pool of pages (see `rstar2_jax.sampler.engine`): a row
holds the pages its tokens fill, so the pool does not need `num_rows x max_len` tokens. One
token of one row takes ``2 (k, v) x layers x kv_heads x head_dim x bytes`` (Qwen3-0.6B in
float32: 224 KiB; in bfloat16: 112 KiB). `plan_memory` adds up what does not depend on the pool
(the serving params, the decode and prefill steps' temporaries) and gives the pool the rest of a
budget (the device's free memory times ``rollout.memory_fraction`` on an accelerator, or
``rollout.memory_budget_gib`` when set), capped at what every slot at full length needs. The pool
must hold at least one row at full length and the staged prompts, so that the oldest row can
always finish; rows beyond what it holds are preempted and resumed. A budget too small for that
stops before the first rollout with the numbers and the settings to change, instead of running
out of memory inside a jitted decode step minutes later. On CPU the device's memory is the
host's: its available memory is the budget. `preflight` makes the same check before a job
starts anything, against a whole device (``rollout.num_slots=10**9``, a response budget of
10**12 tokens: settings no device can run).

The estimate is an upper bound by construction: it counts the params plus one layer's weights
(the decode step's loop over the stacked layers may copy the layer it runs, as XLA:CPU does),
and for every slot the gathered keys and values of one layer at the widest block table, the
attention scores and the logits and top-k/top-p temporaries.
"""
from __future__ import annotations

import dataclasses
import math

import jax

from rstar2_jax.errors import ConfigError
from rstar2_jax.model import ModelConfig, param_shapes
from rstar2_jax.sampler.engine import (
    PREFILL_ROWS,
    PREFILL_WIDTH,
    STAGE_ROWS,
    bucket,
    least_pages,
    table_width,
)

GIB = 1 << 30


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The engine's page pool and its bytes at their largest, and the budget they must fit.

    params: the serving params (bytes).
    layer_params: one layer's share of them (bytes).
    dtype: the serving dtype (params and cache).
    kv_per_token: keys and values of one token of one row, all layers (bytes).
    page_size: tokens per page.
    num_slots, num_rows, max_len, max_prompt_len, stage_rows: the engine's shape.
    per_slot_temporaries: a decode step's temporaries per slot (bytes).
    prefill_temporaries: one prefill call's temporaries (bytes).
    budget: bytes the engine may use, or None (no limit known: CPU without a budget).
    """

    params: int
    layer_params: int
    dtype: str
    kv_per_token: int
    page_size: int
    num_slots: int
    num_rows: int
    max_len: int
    max_prompt_len: int
    stage_rows: int
    per_slot_temporaries: int
    prefill_temporaries: int
    budget: int | None

    @property
    def page_bytes(self) -> int:
        return self.kv_per_token * self.page_size

    @property
    def pages_per_row(self) -> int:
        return -(-self.max_len // self.page_size)

    @property
    def stage_pages(self) -> int:
        """Pages of the prompts staged at once."""
        return self.stage_rows * -(-self.max_prompt_len // self.page_size)

    @property
    def full_pages(self) -> int:
        """A pool that never preempts: every row at full length, and the staged prompts."""
        return self.num_rows * self.pages_per_row + self.stage_pages

    @property
    def least_pages(self) -> int:
        """The smallest pool the engine accepts (`engine.least_pages`)."""
        return least_pages(max_len=self.max_len, max_prompt_len=self.max_prompt_len,
                           stage_rows=self.stage_rows, page_size=self.page_size)

    def fixed(self, num_slots: int | None = None) -> int:
        """Bytes besides the pool with ``num_slots`` slots (default: the plan's)."""
        slots = self.num_slots if num_slots is None else num_slots
        return (self.params + self.layer_params + slots * self.per_slot_temporaries
                + self.prefill_temporaries)

    @property
    def num_pages(self) -> int:
        """The pool: what the budget leaves after ``fixed()``, at most ``full_pages``."""
        if self.budget is None:
            return self.full_pages
        return min(self.full_pages, max(self.budget - self.fixed(), 0) // self.page_bytes)

    @property
    def pool(self) -> int:
        return self.num_pages * self.page_bytes

    def peak(self) -> int:
        """Upper bound of the engine's bytes."""
        return self.fixed() + self.pool

    @property
    def fits(self) -> bool:
        return self.num_pages >= self.least_pages

    def max_slots(self) -> int:
        """The most slots whose temporaries leave room for the smallest pool (0 if none)."""
        if self.budget is None:
            return self.num_slots
        room = self.budget - self.fixed(0) - self.least_pages * self.page_bytes
        return max(room // self.per_slot_temporaries, 0)

    def summary(self) -> str:
        budget = "no limit known" if self.budget is None else f"budget {_size(self.budget)}"
        if self.num_pages >= self.full_pages:
            holds = f"all {self.num_rows} rows at the full {self.max_len} tokens"
        else:
            rows = max(self.num_pages - self.stage_pages, 0) // self.pages_per_row
            holds = (f"{rows} of {self.num_rows} rows at the full {self.max_len} tokens at "
                     f"once; rows beyond what it holds are preempted and resumed")
        return (f"rollout memory plan ({self.dtype}): page pool {self.num_pages} pages x "
                f"{self.page_size} tokens x {_size(self.kv_per_token)} per token = "
                f"{_size(self.pool)} (holds {holds}), params {_size(self.params)}, peak at most "
                f"{_size(self.peak())}; {budget}")


def plan_memory(config: ModelConfig, params, *, num_slots: int, num_rows: int, max_len: int,
                max_prompt_len: int, stage_rows: int, page_size: int,
                budget: int | None) -> MemoryPlan:
    """The plan of an engine serving ``params`` (in ``config.dtype``); see the module
    docstring. ``budget`` in bytes, or None."""
    itemsize = jax.numpy.dtype(config.jnp_dtype).itemsize
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
    # The widest block table a step reads, in positions.
    positions = table_width(-(-max_len // page_size), page_size) * page_size
    gathered = positions * kv_per_token // config.num_layers  # one layer's keys and values
    scores = positions * 8 * config.num_heads  # float32 scores and probabilities of a query
    # float32 logits, log-softmax and the sorted copy top-k/top-p sampling makes, plus indices.
    logits = 4 * config.vocab_size * 4
    per_slot = gathered + scores + logits
    width = min(bucket(max_len), PREFILL_WIDTH)
    activations = 4 * (config.hidden_size + config.intermediate_size) * 4  # per token, float32
    prefill = PREFILL_ROWS * (gathered + width * (scores + activations) + logits)
    params_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    layers_bytes = sum(math.prod(x.shape) * x.dtype.itemsize
                       for x in jax.tree.leaves(params.get("layers", {})))
    return MemoryPlan(params_bytes, layers_bytes // config.num_layers, config.dtype, kv_per_token,
                      page_size, num_slots, num_rows, max_len, max_prompt_len, stage_rows,
                      per_slot, prefill, budget)


def device_budget(budget_gib: float | None, fraction: float, params) -> int | None:
    """Bytes the rollout engine may use: ``budget_gib`` when set; else ``fraction`` of the free
    memory of the device that holds the first of the served ``params`` (a rollout device, when
    the run keeps some) on a backend that reports it (GPU, TPU), of the host's available memory
    on CPU; else None."""
    if budget_gib is not None:
        return int(budget_gib * GIB)
    placed = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array)]
    device = min(placed[0].devices(), key=lambda d: d.id) if placed else jax.local_devices()[0]
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    if device.platform == "cpu":
        return int(fraction * _host_memory("MemAvailable"))
    return None


def _host_memory(field: str) -> int:
    """Bytes of ``field`` ("MemTotal", "MemAvailable") of /proc/meminfo."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(f"{field}:"))


def preflight(config: ModelConfig, settings, limits) -> MemoryPlan:
    """The plan of the engine a job will open (``settings``: its `RolloutSettings`, ``limits``:
    its `RolloutLimits`, ``config``: the model as the job computes in it), checked before the
    job starts anything against ``rollout.memory_budget_gib``, else the whole memory of a device
    (of the host on CPU): ConfigError (`check_plan`) when not even that can hold it. The check
    before the first rollout, against the memory then free, still follows."""
    serving = settings.serving_config(config)
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, serving.jnp_dtype),
                          param_shapes(serving), is_leaf=lambda x: isinstance(x, tuple))
    if settings.memory_budget_gib is not None:
        budget = int(settings.memory_budget_gib * GIB)
    else:
        stats = jax.local_devices()[0].memory_stats()
        budget = stats["bytes_limit"] if stats and "bytes_limit" in stats else _host_memory("MemTotal")
    plan = plan_memory(serving, params, num_slots=settings.num_slots, num_rows=settings.rows,
                       max_len=limits.max_prompt_tokens + limits.max_response_tokens,
                       max_prompt_len=limits.max_prompt_tokens, stage_rows=STAGE_ROWS,
                       page_size=settings.page_size, budget=budget)
    check_plan(plan)
    return plan


def check_plan(plan: MemoryPlan) -> None:
    """Raises ConfigError naming the numbers and the settings to change when the budget cannot
    hold the smallest pool beside the rest."""
    if plan.fits:
        return
    least_pool = plan.least_pages * plan.page_bytes
    fits = plan.max_slots()
    if fits:
        advice = f"set rollout.num_slots={fits} or fewer"
    else:
        advice = "no slot count fits: lower the longest response (stage.max_response_tokens)"
        if plan.dtype != "bfloat16":
            advice += " or serve in bfloat16 (rollout.serving_dtype=bfloat16)"
    raise ConfigError(
        f"the rollout engine needs at least {_size(plan.fixed() + least_pool)} but may use "
        f"{_size(plan.budget)}: {plan.dtype} params {_size(plan.params)} (and one layer's copy, "
        f"{_size(plan.layer_params)}), temporaries "
        f"{_size(plan.fixed() - plan.params - plan.layer_params)} "
        f"for {plan.num_slots} slots, and the smallest page pool, {plan.least_pages} pages of "
        f"{plan.page_size} tokens x {_size(plan.kv_per_token)} = {_size(least_pool)} (one row "
        f"of {plan.max_len} tokens and {plan.stage_rows} staged prompts); {advice}, or raise "
        f"rollout.memory_fraction / rollout.memory_budget_gib")
