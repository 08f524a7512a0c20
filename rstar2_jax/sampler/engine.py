"""The device side of sampling: rows of sequences over a paged KV cache, decoded in slots.

Every row holds one sequence, in pages of the shared pool (see `rstar2_jax.model.cache`), plus a
*pending* token: the last token chosen for the row but not yet written to the cache. A decode
step feeds each active row its pending token, writes it to the cache and samples the next one.
This one convention serves every way a row changes:

- a new prompt: its first `n-1` tokens are prefilled once per prompt into pages of their own
  (*staged*); each of its samples then starts with the prompt's full pages shared and a copy of
  the partial last one, and the prompt's last token pending;
- decoding: one token per step for every row in a decode slot, inside a jit-compiled
  `while_loop` that stops after `chunk` steps, when no row is active, or once `min_stops` rows
  have stopped (so the host can dispatch tool calls while the other rows keep going on the next
  call). There may be more rows than slots: each call takes the oldest active rows, so a row
  paused for a tool call leaves its slot to another;
- resuming after a tool call: `[pending] + tool_tokens[:-1]` are appended to the row's history
  and `tool_tokens[-1]` becomes pending; the appended tokens are prefilled before the next
  decode. A row never re-prefills its history, unless it was preempted.

Memory: the host owns the block tables and hands out pages as rows grow, `chunk` tokens ahead.
When the pool runs out, the newest rows are *preempted*: their pages go back to the pool and
their token history stays on the host; they are prefilled again (recomputed) when pages free up.
The oldest active row can always run (the pool holds at least one full-length row, see
`rstar2_jax.sampler.memory`), so a batch always finishes. A sequence's tokens do not depend on
preemption: token n of a row is drawn with `fold_in(key, n)` (under one set of weights: a row
preempted after `set_params` is recomputed under the new ones).

New weights (`set_params`) take effect between device calls: rows then either continue on the
keys and values cached under the earlier weights, or have their caches dropped and their whole
history prefilled again under the new ones, as after a preemption (and the staged prompts
prefilled again), before their next token.

Per-row state (history, pages, pending token, budget, key) lives on the host and is passed to
each call, so moving a row between slots costs nothing. Shapes are static: `num_slots`, `chunk`
and the pool are fixed per `Engine`; prefill widths and the block table's width are rounded up
to power-of-two buckets, so nothing recompiles once buckets are warm. The table a decode step
reads follows the longest active row: on an accelerator a decode step attends over every position
of its table, so a table sized for the longest possible response would make every step as slow
as the last step of the longest one (on CPU a step reads pages up to its longest row only).
"""
from __future__ import annotations

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.model import KVCache, ModelConfig, forward_cached, target
from rstar2_jax.model.cache import as_bits, copy_pages, empty_pages
from rstar2_jax.sampler.sampling import SamplingParams, sample_tokens

# Positions the narrowest block table covers.
_MIN_TABLE_TOKENS = 128
# Rows per prefill call (prompts staged together, rows resumed or restored together). Prefill
# calls always take this many rows and the widest block table, so that their programs differ
# only in the tokens' width bucket: a handful of compilations, all met early.
PREFILL_ROWS = 8
# Tokens per row per prefill call at most: a longer prefill (a restored row) takes several,
# which bounds the [rows, heads, tokens, positions] attention scores of one call.
PREFILL_WIDTH = 512
# Prompts that can be staged at once (each holds its pages until all its samples started).
STAGE_ROWS = 8
# Pages copied per `copy_pages` call (admitted rows' partial prompt pages), padded: one program
# per pool, compiled with the first admission rather than for each new number of rows.
COPY_PAGES = 8


def sequence_keys(seed: int, count: int, first: int = 0) -> np.ndarray:
    """Raw PRNG keys `uint32[count, 2]` of sequences first..first+count-1 of a sampling call."""
    return np.asarray(_sequence_keys(seed, np.arange(first, first + count, dtype=np.int32)))


@jax.jit
def _sequence_keys(seed, sequences):
    # One program per count of sequences (eager, each operation would be one).
    return jax.vmap(jax.random.fold_in, (None, 0))(jax.random.PRNGKey(seed), sequences)


def bucket(n: int, minimum: int = 8) -> int:
    """Smallest power of two >= max(n, minimum)."""
    size = minimum
    while size < n:
        size *= 2
    return size


def table_width(pages: int, page_size: int) -> int:
    """Width (pages) of a block table for rows of up to `pages` pages: a power-of-two bucket of
    at least `_MIN_TABLE_TOKENS` positions."""
    return bucket(pages, -(-_MIN_TABLE_TOKENS // page_size))


def program_bound(max_len: int, page_size: int) -> dict[str, int]:
    """The most programs engines for rows of up to ``max_len`` tokens compile (by JAX's names):
    the empty page pool, a prefill per tokens-width bucket (at most `PREFILL_WIDTH`; prefills take the widest block
    table), a decode chunk per block-table width, the page copy, and the sequence keys of one
    count of sequences per sampling call (`sequence_keys`: one, when every call samples as
    many)."""
    widths = {min(bucket(n), PREFILL_WIDTH) for n in range(1, max_len + 1)}
    tables = {table_width(pages, page_size) for pages in range(1, -(-max_len // page_size) + 1)}
    return {"jit(_empty_pool)": 1, "jit(prefill)": len(widths), "jit(decode_chunk)": len(tables),
            "jit(copy_pages)": 1, "jit(_sequence_keys)": 1}


def least_pages(*, max_len: int, max_prompt_len: int, stage_rows: int, page_size: int) -> int:
    """The smallest pool an engine accepts: one row at `max_len` and `stage_rows` staged
    prompts, so that the oldest row can always finish."""
    return -(-max_len // page_size) + stage_rows * -(-max_prompt_len // page_size)


@flax.struct.dataclass
class ChunkOutput:
    """What one decode call produced, per slot (`decode_chunk`) or per row (`Engine.decode`)."""

    tokens: jax.Array  # [n, chunk] int32, valid up to count
    logprobs: jax.Array  # [n, chunk] float32 sampler log-probs of those tokens
    count: jax.Array  # [n] int32 tokens generated by this call
    stopped: jax.Array  # [n] bool: row stopped in this call (stop token or budget)


@functools.partial(jax.jit, static_argnames=("config", "sampling", "chunk", "forward_fn"),
                   donate_argnums=(1,))
def decode_chunk(params, pages, block_table, lengths, pending, active, budget, keys, stop_ids,
                 min_stops, *, config, sampling, chunk, forward_fn):
    """Up to `chunk` decode steps of the `active` rows.

    pages: the pools as `empty_pages` makes them (donated); block_table [slots, W] int32;
    lengths, pending, budget [slots] int32; active [slots] bool; keys [slots, 2] uint32 (see
    `Engine`).
    Returns the updated pools and a `ChunkOutput`.
    """
    num_slots = pending.shape[0]
    rows = jnp.arange(num_slots)
    cache = KVCache.of_pools(pages, block_table, lengths, config.jnp_dtype)
    out = ChunkOutput(
        tokens=jnp.zeros((num_slots, chunk), jnp.int32),
        logprobs=jnp.zeros((num_slots, chunk), jnp.float32),
        count=jnp.zeros((num_slots,), jnp.int32),
        stopped=jnp.zeros((num_slots,), bool),
    )

    def cond(carry):
        step, _, _, active, _, out = carry
        return (step < chunk) & jnp.any(active) & (jnp.sum(out.stopped) < min_stops)

    def body(carry):
        step, cache, pending, live, budget, out = carry
        # Keyed by the position of the token being drawn (cache length after this write).
        step_keys = jax.vmap(jax.random.fold_in)(keys, cache.lengths + 1)
        logits, cache = forward_fn(params, config, pending[:, None], cache,
                                   num_new=live.astype(jnp.int32), last_only=True)
        token, logp = sample_tokens(step_keys, logits, sampling)
        index = jnp.where(live, out.count, chunk)  # out of range -> dropped
        budget = budget - live
        stop = live & (jnp.isin(token, stop_ids) | (budget <= 0))
        out = ChunkOutput(
            tokens=out.tokens.at[rows, index].set(token, mode="drop"),
            logprobs=out.logprobs.at[rows, index].set(logp, mode="drop"),
            count=out.count + live,
            stopped=out.stopped | stop,
        )
        return step + 1, cache, jnp.where(live, token, pending), live & ~stop, budget, out

    _, cache, *_, out = jax.lax.while_loop(
        cond, body, (jnp.int32(0), cache, pending, active, budget, out))
    return cache.pools, out


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _empty_pool(config, num_pages, page_size):
    # One program (eager, the zeros and the casts would be one each).
    return tuple(as_bits(pool) for pool in empty_pages(config, num_pages, page_size))


@functools.partial(jax.jit, static_argnames=("config", "forward_fn"), donate_argnums=(1,))
def prefill(params, pages, block_table, lengths, tokens, num_new, *, config, forward_fn):
    """Writes `tokens` [rows, T] (`num_new` [rows] real) after each row's `lengths` into its
    pages; returns the updated pools."""
    cache = KVCache.of_pools(pages, block_table, lengths, config.jnp_dtype)
    _, cache = forward_fn(params, config, tokens, cache, num_new=num_new, last_only=True)
    return cache.pools


@dataclasses.dataclass
class StagedPrompt:
    """A prompt whose first `n-1` tokens are prefilled into `pages`; `last` is its last token."""

    tokens: list[int]
    last: int
    pages: list[int]


class Engine:
    """Host handle on the rows and the page pool: stages prompts, admits, decodes, resumes.

    Args:
      params, config: the policy (params are read at each device call, never copied).
      num_slots: rows decoded together (the decode batch).
      num_rows: sequences held at once (default `num_slots`): rows beyond the slots wait for one
        (an agentic row waiting on its tool call needs pages but no slot); each decode call runs
        the oldest active rows that fit in the slots and the pool.
      max_len: the most tokens a row may hold (prompt + response, tool tokens included).
      max_prompt_len: longest prompt accepted.
      sampling: token selection settings.
      stop_tokens: ids that end a row's turn (e.g. `<|im_end|>`, eos).
      chunk: decode steps per device call at most.
      page_size: tokens per page.
      num_pages: pages in the pool; default: enough for every row at `max_len` (its pages
        rounded up to a power of two, so that calls with nearby lengths share programs) and
        `stage_rows` staged prompts, so that nothing is ever preempted. At least one row at
        `max_len` plus the staged prompts.
      stage_rows: prompts that can be staged at once (each is shared by its samples' rows).
      forward_fn: the cached forward, `forward_cached` of the model by default; tests pass a
        scripted policy with the same signature.
      version: the policy version of ``params`` (`set_params` replaces both).
    """

    def __init__(
        self, params, config: ModelConfig, *, num_slots: int, max_len: int, max_prompt_len: int,
        sampling: SamplingParams, stop_tokens, chunk: int = 64, num_rows: int | None = None,
        page_size: int = 32, num_pages: int | None = None, stage_rows: int = STAGE_ROWS,
        forward_fn=forward_cached, version: int = 0,
    ):
        if not stop_tokens:
            raise ValueError("stop_tokens must name at least one token id")
        if max_prompt_len > max_len:
            raise ValueError(f"max_prompt_len {max_prompt_len} exceeds max_len {max_len}")
        self.params = params
        self.version = version
        self.config = config
        self.num_slots = num_slots
        self.num_rows = num_rows = num_rows or num_slots
        if num_rows < num_slots:
            raise ValueError(f"num_rows {num_rows} is fewer than num_slots {num_slots}")
        self.max_len = max_len
        self.max_prompt_len = max_prompt_len
        self.stage_rows = stage_rows
        self.chunk = chunk
        self.page_size = page_size
        self.pages_per_row = self.pages_for(max_len)
        least = least_pages(max_len=max_len, max_prompt_len=max_prompt_len,
                            stage_rows=stage_rows, page_size=page_size)
        if num_pages is None:
            stage_pages = least - self.pages_per_row
            num_pages = num_rows * bucket(self.pages_per_row, minimum=1) + stage_pages
        if num_pages < least:
            raise ValueError(f"{num_pages} pages cannot hold one row of {max_len} tokens and "
                             f"{stage_rows} staged prompts ({least} pages of {page_size} tokens)")
        self.num_pages = num_pages
        self.sampling = sampling
        self.forward_fn = forward_fn
        with self._on_params_devices():
            self.stop_ids = np.asarray(sorted(set(stop_tokens)), np.int32)
            self.pages = _empty_pool(config, num_pages, page_size)
        self.prompts_prefilled = 0  # prompt prefills run (each shared by all samples of it)
        self.decode_calls = 0
        self.decode_steps = 0  # model steps run by decode calls (each for all running rows)
        self.preemptions = 0
        self.recomputed_rows = 0  # row caches dropped by `set_params(recompute=True)`
        self.staged: list[StagedPrompt] = []  # staged and not yet released: their pages hold KV
        # Pages: reference counts (a staged prompt's full pages are shared by its samples).
        self.refs = np.zeros((num_pages,), np.int64)
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        # Per row, on the host: the tokens meant to be in its cache, how many are, its pages.
        self.history: list[list[int]] = [[] for _ in range(num_rows)]
        self.written = np.zeros((num_rows,), np.int64)
        self.tables: list[list[int]] = [[] for _ in range(num_rows)]
        self.pending = np.zeros((num_rows,), np.int32)
        self.budget = np.zeros((num_rows,), np.int32)
        self.keys = np.zeros((num_rows, 2), np.uint32)
        self.active = np.zeros((num_rows,), bool)  # the row wants to generate
        self.order = np.zeros((num_rows,), np.int64)  # admission order: the newest yields first
        self._admitted = 0

    def _on_params_devices(self):
        """The device calls compile for the params' devices (and their kernels: `target`)."""
        return target.compiling_for_arrays(self.params)

    def close(self) -> None:
        """Drops the page pool (device memory); the engine cannot be used afterwards."""
        self.pages = None

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # -- pages ------------------------------------------------------------------------------

    def _alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"page pool exhausted: {n} pages wanted, {len(self.free)} free")
        pages = [self.free.pop() for _ in range(n)]
        self.refs[pages] += 1
        return pages

    def _unref(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)

    def pages_ahead(self, tokens: int, budget: int) -> int:
        """Pages a row of `tokens` tokens that may generate `budget` more needs for its next
        decode call (rows get pages one call ahead)."""
        return self.pages_for(tokens + min(self.chunk, budget))

    def _need(self, row: int) -> int:
        return self.pages_ahead(len(self.history[row]), int(self.budget[row]))

    def spare_pages(self) -> int:
        """Free pages not needed by the active rows' next decode call."""
        growth = sum(max(self._need(s) - len(self.tables[s]), 0)
                     for s in np.flatnonzero(self.active))
        return len(self.free) - growth

    def _drop_cache(self, row: int) -> None:
        """Frees the row's pages; its history stays on the host and is prefilled again before
        its next decode."""
        self._unref(self.tables[row])
        self.tables[row] = []
        self.written[row] = 0

    def _evict(self, row: int) -> None:
        self._drop_cache(row)
        self.preemptions += 1

    def set_params(self, params, version: int, recompute: bool) -> None:
        """Serves ``params`` (policy ``version``) from the next device call on.

        With ``recompute``, nothing computed under the earlier params stays in the cache: every
        row's pages are dropped (its whole history, tool tokens included, is prefilled under
        ``params`` before its next token; the prompt pages its samples shared become copies of
        their own) and the staged prompts are prefilled again in place. Otherwise rows continue
        on the keys and values already cached (only what is written from now on is computed
        under ``params``).
        """
        self.params, self.version = params, version
        if not recompute:
            return
        for row in range(self.num_rows):
            if self.tables[row]:
                self._drop_cache(row)
                self.recomputed_rows += 1
        # No row refers to a staged prompt's pages any more: they are rewritten in place.
        self._prefill([(s.pages, 0, s.tokens) for s in self.staged])

    # -- device calls -----------------------------------------------------------------------

    def _table(self, tables: list[list[int]], rows: int, pages: int = 1) -> np.ndarray:
        """Block tables [rows, W] of `tables`, W the bucket of the longest (at least `pages`)."""
        width = table_width(max([pages, *map(len, tables)]), self.page_size)
        out = np.zeros((rows, width), np.int32)
        for i, table in enumerate(tables):
            out[i, : len(table)] = table
        return out

    def _prefill(self, items: list[tuple[list[int], int, list[int]]]) -> None:
        """Writes `tokens` at positions `start..` of the rows with pages `table`, for each
        `(table, start, tokens)`, PREFILL_ROWS rows and PREFILL_WIDTH tokens per call."""
        todo = [(table, start, list(tokens)) for table, start, tokens in items if tokens]
        while todo:
            group, todo = todo[:PREFILL_ROWS], todo[PREFILL_ROWS:]
            width = min(bucket(max(len(t) for _, _, t in group)), PREFILL_WIDTH)
            tokens = np.zeros((PREFILL_ROWS, width), np.int32)
            lengths = np.zeros((PREFILL_ROWS,), np.int32)
            num_new = np.zeros((PREFILL_ROWS,), np.int32)
            for i, (_, start, toks) in enumerate(group):
                n = min(len(toks), width)
                tokens[i, :n], lengths[i], num_new[i] = toks[:n], start, n
            table = self._table([table for table, _, _ in group], PREFILL_ROWS,
                                self.pages_per_row)
            with self._on_params_devices():
                self.pages = prefill(self.params, self.pages, table, lengths, tokens, num_new,
                                     config=self.config, forward_fn=self.forward_fn)
            todo = [(table, start + width, toks[width:])
                    for table, start, toks in group if len(toks) > width] + todo

    def stage_prompts(self, prompts: list[list[int]]) -> list[StagedPrompt]:
        """Prefills `prompt[:-1]` of each prompt into pages of its own (one prefill per prompt;
        the caller checks `spare_pages` first). Release each with `unstage` once its samples
        are admitted."""
        for p in prompts:
            if not 1 <= len(p) <= self.max_prompt_len:
                raise ValueError(f"prompt of {len(p)} tokens; must be 1..{self.max_prompt_len}")
        staged = [StagedPrompt(list(p[:-1]), p[-1], self._alloc(self.pages_for(len(p) - 1)))
                  for p in prompts]
        self._prefill([(s.pages, 0, s.tokens) for s in staged])
        self.prompts_prefilled += len(prompts)
        self.staged += staged
        return staged

    def unstage(self, staged: StagedPrompt) -> None:
        self._unref(staged.pages)
        staged.pages = []
        self.staged = [s for s in self.staged if s is not staged]

    def admit(self, rows: list[tuple[StagedPrompt, int, int, np.ndarray]]) -> None:
        """Starts rows from staged prompts.

        Args:
          rows: `(staged, row, budget, key)` per new row; `budget` is the number of tokens the
            row may generate (prompt + budget <= max_len); `key` (raw `uint32[2]` PRNG key)
            seeds the row's draws.
        """
        src, dst = [], []
        for staged, row, budget, key in rows:
            full, partial = divmod(len(staged.tokens), self.page_size)
            shared = staged.pages[:full]
            self.refs[shared] += 1
            self.tables[row] = shared
            if partial:  # the row writes into its last page: it gets a copy of its own
                self.tables[row] = shared + self._alloc(1)
                src.append(staged.pages[full])
                dst.append(self.tables[row][-1])
            self.history[row] = list(staged.tokens)
            self.written[row] = len(staged.tokens)
            self.pending[row], self.budget[row], self.keys[row] = staged.last, budget, key
            self.active[row] = True
            self.order[row] = self._admitted
            self._admitted += 1
        for i in range(0, len(src), COPY_PAGES):
            pad = COPY_PAGES - len(src[i:i + COPY_PAGES])
            self.pages = copy_pages(
                self.pages, np.asarray(src[i:i + COPY_PAGES] + [0] * pad, np.int32),
                np.asarray(dst[i:i + COPY_PAGES] + [self.num_pages] * pad, np.int32))  # dropped

    def release(self, rows) -> None:
        """Frees rows: their pages go back to the pool."""
        for row in rows:
            self._unref(self.tables[row])
            self.tables[row], self.history[row] = [], []
            self.written[row] = 0
            self.active[row] = False

    def resume(self, rows: dict[int, tuple[list[int], int, int]]) -> None:
        """Appends tokens to paused rows and reactivates them (the tokens are prefilled before
        the next decode).

        Args:
          rows: row -> (tokens to append, next pending token, budget). The tokens start with
            the row's current pending token.
        """
        for row, (tokens, pending, budget) in rows.items():
            self.history[row] += tokens
            self.pending[row], self.budget[row] = pending, budget
            self.active[row] = True

    def _schedule(self) -> np.ndarray:
        """Picks the rows of the next decode call: the oldest active rows, at most `num_slots`,
        each with pages for the call, preempting the newest rows when the pool runs out;
        prefills what their caches lack. Returns their indices, oldest first."""
        runs = []
        waiting = sorted(np.flatnonzero(self.active), key=lambda r: self.order[r])
        for row in waiting[: self.num_slots]:
            missing = self._need(row) - len(self.tables[row])
            while missing > len(self.free):
                victim = self._victim(row, oldest=not runs)
                if victim is None:
                    break
                self._evict(victim)
            if missing > len(self.free):
                if not runs:
                    raise RuntimeError(
                        f"the oldest row needs {missing} more pages and only {len(self.free)} "
                        f"can be freed: the pool of {self.num_pages} pages is too small")
                break  # rows wait in admission order: a newer one may not overtake it
            self.tables[row] += self._alloc(max(missing, 0))
            runs.append(row)
        self._prefill([(self.tables[r], int(self.written[r]), self.history[r][self.written[r]:])
                       for r in runs])
        for r in runs:
            self.written[r] = len(self.history[r])
        return np.asarray(runs, np.int64)

    def _victim(self, row: int, oldest: bool) -> int | None:
        """The newest row holding pages that is newer than `row`; for the oldest active row,
        failing that, the newest paused row holding pages."""
        holders = [r for r in range(self.num_rows) if self.tables[r] and r != row]
        newer = [r for r in holders if self.order[r] > self.order[row]]
        if not newer and oldest:
            newer = [r for r in holders if not self.active[r]]
        return max(newer, key=lambda r: self.order[r], default=None)

    def decode(self, min_stops: int | None = None) -> ChunkOutput:
        """Runs up to `chunk` decode steps of the rows `_schedule` picks; returns the host copy
        of what was generated, per row (`[num_rows, ...]`; rows that did not run generate
        nothing)."""
        runs = self._schedule()
        min_stops = self.num_slots if min_stops is None else min_stops
        self.decode_calls += 1
        n = len(runs)

        def slots(values):  # per-row values of the running rows, padded to the slots
            out = np.zeros((self.num_slots, *values.shape[1:]), values.dtype)
            out[:n] = values[runs]
            return out

        live = np.arange(self.num_slots) < n
        with self._on_params_devices():
            self.pages, out = decode_chunk(
                self.params, self.pages, self._table([self.tables[r] for r in runs], self.num_slots),
                slots(self.written.astype(np.int32)), slots(self.pending), live,
                slots(self.budget), slots(self.keys), self.stop_ids, np.int32(min_stops),
                config=self.config, sampling=self.sampling, chunk=self.chunk,
                forward_fn=self.forward_fn,
            )
        out = jax.device_get(out)
        self.decode_steps += int(out.count.max())
        per_row = ChunkOutput(
            tokens=np.zeros((self.num_rows, self.chunk), np.int32),
            logprobs=np.zeros((self.num_rows, self.chunk), np.float32),
            count=np.zeros((self.num_rows,), np.int32),
            stopped=np.zeros((self.num_rows,), bool))
        for field in ("tokens", "logprobs", "count", "stopped"):
            getattr(per_row, field)[runs] = getattr(out, field)[:n]
        for row in runs[per_row.count[runs] > 0]:
            tokens = per_row.tokens[row, : per_row.count[row]].tolist()
            self.history[row] += [int(self.pending[row])] + tokens[:-1]
            self.pending[row] = tokens[-1]
        self.written += per_row.count
        self.budget -= per_row.count
        self.active &= ~per_row.stopped
        return per_row
