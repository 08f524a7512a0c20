"""Starting queued (prompt, sample) pairs in free engine rows, one prefill per prompt."""
from __future__ import annotations

import collections
from typing import Callable, Iterator

from rstar2_jax.sampler.engine import Engine, StagedPrompt, sequence_keys


class PromptFeeder:
    """Queues `samples` samples of every prompt and starts them in the rows that free up.

    A prompt is prefilled once (staged) when its first sample starts; each of its samples shares
    its pages as rows free up, and the staged pages are released once all of them have started.
    A sample starts only while the page pool has room for it beside the next decode call of the
    rows already running, so that admitting it does not preempt them. Sample s of prompt p draws
    from key `first_sequence + p * samples + s` of `seed` (see `sequence_keys`), whichever row
    and call it starts in.

    Prompts are taken one at a time, when a row is free and no sample is left queued: in order,
    or in the order ``claim`` hands them out (`rstar2_jax.parallel.hosts.claims`: hosts draw the step's
    prompts from a shared queue as their rows free up). A prompt's keys do not depend on when or
    by whom it was taken, so any claim order draws the same samples.

    Args:
      engine: the rows to fill.
      prompts: token-id lists (the last token of each becomes its rows' pending token).
      samples: samples per prompt.
      budgets: tokens each sample of each prompt may generate, one per prompt.
      seed: PRNG seed of the samples' keys.
      first_sequence: key index of the first prompt's first sample (a share of a larger batch
        passes its offset in that batch, so its samples draw what they would draw there).
      claim: called for the next prompt index to take (into ``prompts``); None when there is
        none left. Without it, every prompt in order.
    """

    def __init__(self, engine: Engine, prompts: list[list[int]], samples: int,
                 budgets: list[int], seed: int, first_sequence: int = 0,
                 claim: Callable[[], int | None] | None = None):
        self.engine, self.prompts, self.samples, self.budgets = engine, prompts, samples, budgets
        self.keys = sequence_keys(seed, len(prompts) * samples, first_sequence)
        self.claim = claim if claim is not None else in_order(len(prompts))
        self.queue: collections.deque[tuple[int, int]] = collections.deque()
        self.unstarted: collections.Counter[int] = collections.Counter()
        self.staged: dict[int, StagedPrompt] = {}
        self.claimed_all = False

    @property
    def done(self) -> bool:
        """Whether every sample this feeder will start has started."""
        return self.claimed_all and not self.queue

    def _next(self) -> tuple[int, int] | None:
        """The next queued (prompt, sample), taking a prompt if none is queued."""
        if not self.queue and not self.claimed_all:
            p = self.claim()
            if p is None:
                self.claimed_all = True
            else:
                if not 0 <= p < len(self.prompts) or p in self.unstarted:
                    raise ValueError(f"claimed prompt {p} twice or out of 0..{len(self.prompts) - 1}")
                self.queue.extend((p, s) for s in range(self.samples))
                self.unstarted[p] = self.samples
        return self.queue[0] if self.queue else None

    def fill(self, free: list[int]) -> list[tuple[int, int, int]]:
        """Starts queued samples in the `free` rows; returns `(row, prompt, sample)` of each."""
        free = list(free)
        started = []
        while free and self._next() is not None:
            batch = self._start_some(free)
            if not batch:
                break
            started += batch
        engine = self.engine
        if self.queue and free and not started and not engine.active.any() \
                and not any(engine.tables):
            raise RuntimeError(f"the page pool ({engine.num_pages} pages) cannot start a row")
        return started

    def _start_some(self, free: list[int]) -> list[tuple[int, int, int]]:
        """One prefill of newly staged prompts and the admission of the samples it serves
        (takes their rows out of `free`)."""
        engine = self.engine
        spare = engine.spare_pages()
        new: list[int] = []  # prompts to stage
        starting = []
        while free and self._next() is not None:
            p, _ = self.queue[0]
            n = len(self.prompts[p]) - 1
            # The row's own pages for its first decode call: all but the prompt's full pages.
            need = engine.pages_ahead(n, self.budgets[p]) - n // engine.page_size
            staged = p in self.staged or p in new
            if not staged:
                if len(self.staged) + len(new) >= engine.stage_rows:
                    break
                need += engine.pages_for(n)
            if need > spare:
                break
            spare -= need
            if not staged:
                new.append(p)
            starting.append((free.pop(0), *self.queue.popleft()))
        for p, prompt in zip(new, engine.stage_prompts([self.prompts[p] for p in new])):
            self.staged[p] = prompt
        engine.admit([(self.staged[p], row, self.budgets[p], self.keys[p * self.samples + s])
                      for row, p, s in starting])
        for _, p, _ in starting:
            self.unstarted[p] -= 1
            if self.unstarted[p] == 0:
                engine.unstage(self.staged.pop(p))
        return starting


def in_order(count: int) -> Callable[[], int | None]:
    """Claims 0, 1, ..., count - 1, then None."""
    indices: Iterator[int] = iter(range(count))
    return lambda: next(indices, None)
