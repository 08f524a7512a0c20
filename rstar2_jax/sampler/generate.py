"""Plain batched generation (no tools): a thin loop over the `Engine`."""
from __future__ import annotations

import dataclasses

from rstar2_jax.model import ModelConfig
from rstar2_jax.sampler.engine import Engine, bucket, least_pages
from rstar2_jax.sampler.feeder import PromptFeeder
from rstar2_jax.sampler.sampling import SamplingParams

# A token id no tokenizer produces: lets "no stop tokens" share the stop-token code path.
_NO_STOP = -1


@dataclasses.dataclass(frozen=True)
class Generation:
    """One generated continuation: `tokens` include the stop token when one was produced."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens reached)


def generate(
    params, config: ModelConfig, prompts: list[list[int]], max_new_tokens: int | list[int], *,
    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, stop_tokens=(), seed: int = 0,
    num_slots: int | None = None, chunk: int = 64, page_size: int = 32,
    num_pages: int | None = None,
) -> list[Generation]:
    """Generates a continuation for every prompt.

    Args:
      params, config: the model.
      prompts: token-id lists, any lengths (each >= 1 token).
      max_new_tokens: generation budget of every prompt, or a list of one per prompt.
      temperature, top_p, top_k: see `SamplingParams` (temperature 0 = greedy).
      stop_tokens: ids that end a continuation (kept as its last token).
      seed: PRNG seed; prompt i draws from its own key, so results do not depend on
        `num_slots` or `chunk`.
      num_slots: rows decoded together (default: all prompts, rounded up to a power of two);
        with fewer slots than prompts, finished rows are refilled with the next prompt.
      chunk: decode steps per device call.
      page_size, num_pages: the KV cache's pool (see `Engine`); by default every slot at full
        length plus one page (the copy of a prompt's partial last page), nothing preempted; a
        smaller pool preempts rows and recomputes them later, same tokens.

    Returns:
      one `Generation` per prompt, in order; `logprobs` are the sampler's (see `sample_tokens`).
    """
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    budgets = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
               else list(max_new_tokens))
    if len(budgets) != len(prompts) or min(budgets) < 1:
        raise ValueError(
            f"max_new_tokens must be >= 1, one int or one per prompt; got {max_new_tokens}")
    slots = num_slots or bucket(len(prompts), minimum=1)
    max_prompt_len = bucket(max(len(p) for p in prompts))
    max_len = max_prompt_len + max(budgets)
    if num_pages is None:
        # One sample per prompt: a staged prompt's pages become its row's (only a partial last
        # page is copied), so rows at full length fit without the staging pages and
        # power-of-two row sizes the Engine's default adds for prompts with many samples
        # (at 64 rows of 2,048 + 128 tokens: 4,416 pages instead of 12,288).
        num_pages = max(slots * (-(-max_len // page_size) + 1),
                        least_pages(max_len=max_len, max_prompt_len=max_prompt_len,
                                    stage_rows=slots, page_size=page_size))
    engine = Engine(
        params, config, num_slots=slots, max_len=max_len,
        max_prompt_len=max_prompt_len, sampling=SamplingParams(temperature, top_p, top_k),
        stop_tokens=tuple(stop_tokens) or (_NO_STOP,), chunk=chunk, page_size=page_size,
        num_pages=num_pages,
        stage_rows=slots,  # every prompt of a batch that fits the slots staged at once
    )
    feeder = PromptFeeder(engine, prompts, 1, budgets, seed)
    stop_set = set(stop_tokens)
    owner: list[int | None] = [None] * slots  # prompt index decoded by each slot
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    reasons: list[str] = [""] * len(prompts)
    while not feeder.done or any(o is not None for o in owner):
        for slot, i, _ in feeder.fill([s for s in range(slots) if owner[s] is None]):
            owner[slot] = i
        # Return to the host as soon as a slot frees if prompts are still waiting for one.
        out = engine.decode(min_stops=None if feeder.done else 1)
        for slot in range(slots):
            i = owner[slot]
            n = int(out.count[slot])
            if i is None:
                continue
            tokens[i].extend(int(t) for t in out.tokens[slot, :n])
            logprobs[i].extend(float(x) for x in out.logprobs[slot, :n])
            if out.stopped[slot]:
                reasons[i] = "stop" if tokens[i] and tokens[i][-1] in stop_set else "length"
                owner[slot] = None
                engine.release([slot])
    return [Generation(t, lp, r) for t, lp, r in zip(tokens, logprobs, reasons)]

