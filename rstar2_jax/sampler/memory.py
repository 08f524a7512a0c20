"""The rollout engine's device memory, planned before the first rollout.

The engine holds every slot's keys and values contiguously, so its cache grows to
``num_slots x max_len`` tokens when one row reaches the longest response. Per token and slot
that is ``2 (k, v) x layers x kv_heads x head_dim x bytes`` (Qwen3-0.6B in float32: 224 KiB;
in bfloat16: 112 KiB), so 256 slots at 2,048 tokens need 112 GiB in float32. `plan_memory`
adds it up with the serving params and the decode step's temporaries and checks the total
against a budget: the device's free memory times ``rollout.memory_fraction`` on an accelerator,
or ``rollout.memory_budget_gib`` when set. A configuration over budget stops before the first
rollout with the numbers and the settings that would make it fit, instead of running out of
memory inside a jitted decode step minutes later.

The estimate is an upper bound by construction: it counts the params twice (the decode step
unstacks the layer weights into a temporary copy) and the full cache twice (growing the cache
copies it into a larger one), and the logits and top-k/top-p temporaries of every slot.
"""
from __future__ import annotations

import dataclasses
import math

import jax

from rstar2_jax.errors import ConfigError
from rstar2_jax.model import ModelConfig

GIB = 1 << 30


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes of one engine at its largest, and the budget they must fit.

    params: the serving params (bytes).
    kv_per_token: keys and values of one token in one slot, all layers (bytes).
    num_slots, max_len, stage_rows, max_prompt_len: the engine's shape.
    per_slot_temporaries: logits and sampling temporaries of one slot in a decode step (bytes).
    budget: bytes the engine may use, or None (no limit known: CPU without a budget).
    """

    params: int
    kv_per_token: int
    num_slots: int
    max_len: int
    stage_rows: int
    max_prompt_len: int
    per_slot_temporaries: int
    budget: int | None

    @property
    def cache(self) -> int:
        """The slots' cache at full length."""
        return self.kv_per_token * self.num_slots * self.max_len

    @property
    def stage(self) -> int:
        """The staging cache that prefills prompts."""
        return self.kv_per_token * self.stage_rows * self.max_prompt_len

    def peak(self, num_slots: int | None = None) -> int:
        """Upper bound of the engine's bytes with ``num_slots`` slots (default: the plan's)."""
        slots = self.num_slots if num_slots is None else num_slots
        cache = self.kv_per_token * slots * self.max_len
        return 2 * self.params + 2 * cache + self.stage + slots * self.per_slot_temporaries

    def max_slots(self) -> int:
        """The most slots whose peak fits the budget (0 if none)."""
        if self.budget is None:
            return self.num_slots
        fixed = self.peak(0)
        per_slot = self.peak(1) - fixed
        return max((self.budget - fixed) // per_slot, 0)

    def summary(self) -> str:
        budget = "no limit known" if self.budget is None else f"budget {_size(self.budget)}"
        return (f"rollout memory plan: {self.num_slots} slots x {self.max_len} tokens x "
                f"{_size(self.kv_per_token)} per token = cache {_size(self.cache)}, "
                f"params {_size(self.params)}, peak at most {_size(self.peak())}; {budget}")


def plan_memory(config: ModelConfig, params, *, num_slots: int, max_len: int,
                max_prompt_len: int, stage_rows: int, budget: int | None) -> MemoryPlan:
    """The plan of an engine serving ``params`` (in ``config.dtype``); see the module
    docstring. ``budget`` in bytes, or None."""
    itemsize = jax.numpy.dtype(config.jnp_dtype).itemsize
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
    # float32 logits, log-softmax and the sorted copy top-k/top-p sampling makes, plus indices.
    per_slot = 4 * config.vocab_size * 4
    params_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    return MemoryPlan(params_bytes, kv_per_token, num_slots, max_len, stage_rows, max_prompt_len,
                      per_slot, budget)


def device_budget(budget_gib: float | None, fraction: float) -> int | None:
    """Bytes the rollout engine may use: ``budget_gib`` when set; else ``fraction`` of the
    first local device's free memory on a backend that reports it (GPU, TPU); else None."""
    if budget_gib is not None:
        return int(budget_gib * GIB)
    stats = jax.local_devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))


def check_plan(plan: MemoryPlan) -> None:
    """Raises ConfigError naming the numbers and the settings to change when the plan's peak
    is over its budget."""
    if plan.budget is None or plan.peak() <= plan.budget:
        return
    fits = plan.max_slots()
    advice = (f"set rollout.num_slots={fits} or fewer" if fits else
              "no slot count fits: lower the longest response (stage.max_response_tokens) or "
              "serve in bfloat16 (rollout.serving_dtype=bfloat16)")
    raise ConfigError(
        f"the rollout engine needs up to {_size(plan.peak())} but may use "
        f"{_size(plan.budget)} ({plan.summary()}); {advice}, or raise "
        f"rollout.memory_fraction / rollout.memory_budget_gib")
