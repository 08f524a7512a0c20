"""Starting queued (prompt, sample) pairs in free engine slots, one prefill per prompt."""
from __future__ import annotations

import collections

from rstar2_jax.sampler.engine import Engine, sequence_keys


class PromptFeeder:
    """Queues `samples` samples of every prompt and starts them in the slots that free up.

    A prompt is prefilled once, into a staging row, when its first sample starts; the staged row
    is copied into the slot of each of its samples as slots free up, and the staging row is
    reused once all of them have started. Sample s of prompt p draws from key
    `first_sequence + p * samples + s` of `seed` (see `sequence_keys`), whichever slot and call
    it starts in.

    Args:
      engine: the slots to fill.
      prompts: token-id lists (the last token of each becomes its rows' pending token).
      samples: samples per prompt.
      budget: tokens each sample may generate.
      seed: PRNG seed of the samples' keys.
      first_sequence: key index of the first prompt's first sample (a share of a larger batch
        passes its offset in that batch, so its samples draw what they would draw there).
    """

    def __init__(self, engine: Engine, prompts: list[list[int]], samples: int, budget: int,
                 seed: int, first_sequence: int = 0):
        self.engine, self.prompts, self.samples, self.budget = engine, prompts, samples, budget
        self.keys = sequence_keys(seed, len(prompts) * samples, first_sequence)
        self.queue = collections.deque((p, s) for p in range(len(prompts)) for s in range(samples))
        self.unstarted = collections.Counter(p for p, _ in self.queue)
        self.staged: dict[int, int] = {}  # prompt -> staging row

    def fill(self, free: list[int]) -> list[tuple[int, int, int]]:
        """Starts queued samples in the `free` slots; returns `(slot, prompt, sample)` of each."""
        free = list(free)
        started = []
        while self.queue and free:
            batch = self._start_some(free)
            if not batch:
                break
            started += batch
        return started

    def _start_some(self, free: list[int]) -> list[tuple[int, int, int]]:
        """One prefill of newly staged prompts and the admission of the samples it serves."""
        engine = self.engine
        busy = set(self.staged.values())
        new: dict[int, int] = {}  # prompt -> staging row, prefilled in one call below
        starting = []
        while free and self.queue:
            p, s = self.queue[0]
            if p not in self.staged:
                spare = next((r for r in range(engine.stage_rows) if r not in busy), None)
                if spare is None:
                    break
                self.staged[p] = new[p] = spare
                busy.add(spare)
            self.queue.popleft()
            starting.append((self.staged[p], free.pop(0), p, s))
            self.unstarted[p] -= 1
        engine.stage_prompts(list(new.values()), [self.prompts[p] for p in new])
        engine.admit([(row, slot, self.prompts[p][-1], self.budget, self.keys[p * self.samples + s])
                      for row, slot, p, s in starting])
        # A staging row is released only after admit() has copied it.
        for p in [p for p in self.staged if self.unstarted[p] == 0]:
            del self.staged[p]
        return [(slot, p, s) for _, slot, p, s in starting]
