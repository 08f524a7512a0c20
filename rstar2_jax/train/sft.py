"""Supervised fine-tuning: next-token cross-entropy on the tokens the model should generate.

Data is JSONL, one conversation per line in the standard chat layout, encoded by
:class:`rstar2_jax.train.sft_data.Conversations` (agent trajectories exactly as the sampler
builds them, general chat with the tokenizer's chat template); the loss mask is 1 on assistant
tokens only, so prompts and tool outputs are attended to but never trained on. Batches are
packed (`pack_batch`: several conversations per row, each attending only to itself, rows of
``seq_len`` tokens; ``SFTConfig.packed``) or right-padded to ``seq_len``, one
conversation per row (`pad_batch`); both give the same loss and gradients.

Across processes, each process encodes and feeds only its rows of each batch
(`rstar2_jax.parallel.sharding.process_rows`); the batch order depends only on the seed and the step.

The loss is the token mean over the whole batch of ``-log p(token)`` at loss-mask positions,
weighted by ``token_weights`` when the config gives digits another weight
(``SFTConfig.digit_loss_weight``).
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax import chat
from rstar2_jax.errors import ConfigError, DataError
from rstar2_jax.model import ModelConfig, target, token_logprobs
from rstar2_jax.parallel.sharding import place_batch, process_fsdp_shards, process_rows
from rstar2_jax.tokenizer import open_tokenizer
from rstar2_jax.train.configs import SFTConfig
from rstar2_jax.train.metrics import PhaseTimer
from rstar2_jax.train.packing import PackShapes, Packing, pack_across_processes
from rstar2_jax.train.run import start_run
from rstar2_jax.train.sft_data import Conversations
from rstar2_jax.train.step import TrainState, make_train_step

log = logging.getLogger(__name__)


def pad_batch(examples: Sequence[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> dict:
    """Right-padded int32 arrays [rows, seq_len]: tokens, attention_mask, loss_mask."""
    rows = len(examples)
    batch = {"tokens": np.full((rows, seq_len), pad_id, np.int32),
             "attention_mask": np.zeros((rows, seq_len), np.int32),
             "loss_mask": np.zeros((rows, seq_len), np.int32)}
    for row, (ids, mask) in enumerate(examples):
        batch["tokens"][row, :len(ids)] = ids
        batch["attention_mask"][row, :len(ids)] = 1
        batch["loss_mask"][row, :len(ids)] = mask
    return batch


def pack_batch(examples: Sequence[tuple[list[int], list[int]]], packing: Packing,
               pad_id: int) -> dict:
    """Packed int32 arrays (`rstar2_jax.train.packing`): tokens, loss_mask [rows, row_tokens]
    and segment_lengths [rows, segments]. The loss mask is 0 on each conversation's first
    token, which the row's previous token would otherwise predict across the boundary (one per
    row never predicts it either)."""
    lengths = [len(ids) for ids, _ in examples]
    rows = len(packing.rows)
    batch = {"tokens": np.full((rows, packing.row_tokens), pad_id, np.int32),
             "loss_mask": np.zeros((rows, packing.row_tokens), np.int32),
             "segment_lengths": packing.segment_lengths(lengths)}
    for i, (row, start) in enumerate(packing.places(lengths)):
        ids, mask = examples[i]
        batch["tokens"][row, start:start + len(ids)] = ids
        batch["loss_mask"][row, start + 1:start + len(ids)] = mask[1:]
    return batch


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The example order of an epoch: a permutation that depends only on (seed, epoch), so a
    resumed run sees exactly the batches the uninterrupted one would have."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def sft_loss(params: dict, batch: dict, *, model_config: ModelConfig, remat: bool = False,
             token_weights: jax.Array | None = None):
    """``(loss_sum, token_count, {})`` of next-token prediction at loss-mask positions.

    batch: tokens, attention_mask, loss_mask, each [rows, seq], right-padded (`pad_batch`): the
    model attends by row lengths (`token_logprobs`' fused path); or tokens, loss_mask [rows,
    seq] and segment_lengths [rows, segments] of packed rows (`pack_batch`). Position t predicts
    token t + 1, which counts when loss_mask[t + 1] is 1. ``token_weights`` (float32 [vocab], default all 1)
    weighs each target by its token id; ``token_count`` is then the sum of the weights.
    """
    tokens = batch["tokens"]
    targets = tokens[:, 1:]
    if "segment_lengths" in batch:
        layout = {"segment_lengths": batch["segment_lengths"]}
    else:
        layout = {"lengths": jnp.sum(batch["attention_mask"][:, :-1], axis=1, dtype=jnp.int32)}
    logp = token_logprobs(params, model_config, tokens[:, :-1], targets, remat=remat, **layout)
    mask = batch["loss_mask"][:, 1:].astype(bool)
    weight = jnp.ones(targets.shape, jnp.float32) if token_weights is None else token_weights[targets]
    weight = jnp.where(mask, weight, 0.0)
    return -jnp.sum(jnp.where(mask, weight * logp, 0.0)), jnp.sum(weight), {}


def digit_weights(tokenizer, weight: float) -> np.ndarray:
    """float32 [vocab]: ``weight`` for the tokens whose text is digits only, 1 for the others."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return np.array([weight if t.isdigit() else 1.0 for t in texts], np.float32)


def run_sft(config: SFTConfig, *, on_step: Callable[[int, dict], None] | None = None,
            progress: bool = True, examples: Conversations | None = None) -> TrainState:
    """Trains for ``config.epochs`` epochs (resuming from ``run_dir`` if it has a checkpoint).

    ``on_step(step, metrics)`` is called after each step is logged (and checkpointed if due).
    ``examples``: ``config.data`` already encoded with this tokenizer and chat format, none
    longer than ``config.seq_len`` (a job that measured the data first passes it, so that the
    file is encoded once); by default the file is encoded here. Returns the final train state.
    """
    fmt = chat.get_format(config.model.chat_format)
    tokenizer = open_tokenizer(config.model.path, config.model.tokenizer_path, fmt)
    if examples is None:
        examples = Conversations(config.data, tokenizer, fmt, config.seq_len,
                                 process_index=jax.process_index(), process_count=jax.process_count())
    elif examples.path != config.data:
        raise ValueError(f"examples encode {examples.path}, not config.data={config.data}")
    steps_per_epoch = len(examples) // config.batch_size
    if steps_per_epoch == 0:
        raise DataError(f"{config.data} has {len(examples)} conversations, fewer than "
                        f"batch_size={config.batch_size}")
    run = start_run(run_dir=config.run_dir, model=config.model, optimizer=config.optimizer,
                    total_steps=config.epochs * steps_per_epoch, job_config=config, seed=config.seed,
                    mesh=config.mesh, checkpoint=config.checkpoint, precision=config.precision,
                    progress=progress)
    micro_batch_size = config.micro_batch_size or config.batch_size
    fsdp = run.mesh.shape["fsdp"]
    if micro_batch_size % fsdp:
        raise ConfigError(f"micro_batch_size={micro_batch_size} rows cannot be split over "
                          f"fsdp={fsdp} devices")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    weights = None if config.digit_loss_weight == 1.0 else jnp.asarray(
        digit_weights(tokenizer, config.digit_loss_weight))
    loss = functools.partial(sft_loss, model_config=run.compute_config, remat=config.remat,
                             token_weights=weights)
    micro_batches = config.batch_size // micro_batch_size
    train_step = make_train_step(loss, run.optimizer, micro_batches=micro_batches,
                                 mesh=run.mesh, param_specs=run.param_specs, params=run.state.params)
    mine = process_rows(config.batch_size, run.mesh)  # of each global batch
    shapes = PackShapes(config.seq_len, row_multiple=micro_batches * process_fsdp_shards(run.mesh))
    if config.packed:
        log.info("SFT %s", shapes.describe(len(range(config.batch_size)[mine])))
    count_tokens = jax.jit(jnp.sum)
    timer = PhaseTimer()
    try:
        for step in range(run.step, run.end_step):
            epoch, index = divmod(step, steps_per_epoch)
            with timer("data"):
                order = epoch_order(len(examples), config.seed, epoch)
                rows = order[index * config.batch_size:(index + 1) * config.batch_size][mine]
                chosen = [examples[i] for i in rows]
                if config.packed:
                    packing = pack_across_processes([len(ids) for ids, _ in chosen], shapes)
                    batch = place_batch(pack_batch(chosen, packing, pad_id), run.mesh)
                    real_tokens = int(count_tokens(batch["segment_lengths"]))  # of all processes
                else:
                    batch = place_batch(pad_batch(chosen, config.seq_len, pad_id), run.mesh)
                    real_tokens = int(count_tokens(batch["attention_mask"]))
            start = time.perf_counter()
            with timer("update"), target.compiling_for_mesh(run.mesh):
                state, metrics = train_step(run.state, batch)
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            metrics |= timer.split() | {
                "epoch": epoch, "perf/tokens_per_s": real_tokens / (time.perf_counter() - start)}
            run.finish_step(state, metrics, rng=run.rng,
                            data_position={"epoch": epoch, "batch": index + 1})
            if on_step is not None:
                on_step(run.step, metrics)
        return run.state
    finally:
        run.close()
