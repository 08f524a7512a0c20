"""The programs `aot_report.py` compiles, each exactly as a run compiles it, on abstract inputs
(nothing is allocated), with the model's count of their work: the sampler's decode chunk and
prefill call, the serving copy (this module) and the RL update's programs (`aot.update`)."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from bench_decode import kv_bytes_per_token, param_bytes
from bench_train_step import matmul_params
from rstar2_jax.model import ModelConfig, forward_cached, init_params, tpu_attention
from rstar2_jax.model.cache import as_bits, empty_pages
from rstar2_jax.sampler.engine import (PREFILL_ROWS, PREFILL_WIDTH, bucket, decode_chunk, prefill,
                                       table_width)
from rstar2_jax.sampler.sampling import SamplingParams


@dataclasses.dataclass
class Program:
    """A jitted function, its abstract arguments, and the model's count of its work.

    A step may run a program several times (``repeats``: the update's gradient program once per
    micro-batch) and run others beside it (`aot.update`): its figures are one run's, the model's
    counts (``model_flops``, ``computed_flops``, ``attention_fwd``) the whole step's.
    """

    fn: object
    args: tuple
    kwargs: dict
    model_flops: float  # per unit (decode: per step; else per step of the run)
    base_bytes: int  # what it must hold: params (+ page pools, + optimizer state)
    computed_flops: float | None = None  # the model's count on every token computed (padding too)
    least_bytes: float | None = None  # what it must move, per unit
    per: int = 1  # units per call (decode: the chunk's steps, the loop it runs them in)
    repeats: int = 1  # runs a step (the update's micro-batches), each over its share of the step
    beside: int = 0  # bytes the run holds on the device beside this program's own buffers
    attention_fwd: float = 0.0  # forward attention FLOPs per unit of the step, as the model counts them
    kv_per_layer: int = 0  # live key/value bytes a decode step reads per layer
    ragged_per_layer: int = 0  # bytes one chip's ragged paged attention reads per layer
    ragged_flops_per_layer: float = 0.0  # and the FLOPs it computes (over the keys it reads)
    segments: object = None  # packed rows' segment lengths, all runs' (block-skipping attention's plan)
    forwards: int = 1  # passes of attention's forward in the program (2: rerun in the backward)
    backwards: int = 0
    fsdp: int = 1  # the mesh's axes: the figures are one chip's
    tp: int = 1
    note: str = ""
    name: str = ""  # the program's own, where a step runs several


def tree_bytes(tree) -> int:
    """Bytes of one chip's share of a tree of abstract arrays (all of those without sharding)."""
    def share(x):
        sharding = getattr(x, "sharding", None)
        return sharding.shard_shape(x.shape) if sharding is not None else x.shape
    return sum(math.prod(share(x)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _split(mesh, axis: str, size: int) -> str | None:
    """`axis` where the mesh's axis divides `size`, else None (replicated)."""
    return axis if size % mesh.shape[axis] == 0 else None


def abstract_params(config: ModelConfig, dtype, sharding):
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding), shapes)


def _head_params(config: ModelConfig) -> int:
    return config.vocab_size * config.hidden_size


def _layer_params(config: ModelConfig) -> int:
    """Matmul params but the output head's."""
    return matmul_params(config) - _head_params(config)


def _attention_per_token(config: ModelConfig, context: int) -> float:
    """Forward FLOPs of one query token attending to `context` keys, all layers."""
    return 4 * context * config.num_heads * config.head_dim * config.num_layers


def decode_program(config: ModelConfig, args, mesh, rows: int) -> Program:
    from rstar2_jax.parallel.sharding import param_specs

    fsdp, tp = mesh.shape["fsdp"], mesh.shape["tp"]
    by_row = _split(mesh, "fsdp", rows)
    kv_split = _split(mesh, "tp", config.num_kv_heads)

    def spec(shape, dtype, *axes):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*axes)))

    page = args.page_size
    pages = -(-(args.context + args.chunk) // page)  # rows get pages one chunk ahead
    width = table_width(pages, page)
    params = jax.tree.map(lambda x, s: spec(x.shape, config.jnp_dtype, *s),
                          abstract_params(config, config.jnp_dtype, None), param_specs(config, mesh),
                          is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    pools = jax.eval_shape(lambda: tuple(as_bits(p) for p in empty_pages(config, rows * pages, page)))
    # Kv heads over tp: axis 3 of an interleaved pool, axis 2 of a key or value pool.
    heads_axis = 3 if len(pools) == 1 else 2
    pools = tuple(spec(p.shape, p.dtype, *[kv_split if a == heads_axis else None
                                           for a in range(p.ndim)]) for p in pools)
    ints = spec((rows,), jnp.int32, by_row)
    attention = rows * _attention_per_token(config, args.context)
    # One chip's share: its rows over fsdp, their keys and values over tp; every param it needs
    # (whole over fsdp, which gathers them) split over tp.
    local_rows = rows // fsdp if by_row else rows
    kv_share = tp if kv_split else 1
    ragged = ragged_flops = 0
    if len(pools) == 1:
        kv_heads = config.num_kv_heads // kv_share
        itemsize = jnp.dtype(config.jnp_dtype).itemsize
        ragged = tpu_attention.ragged_bytes([args.context + 1] * local_rows, page, width,
                                            kv_heads, config.head_dim, itemsize)
        keys = ragged / (2 * kv_heads * config.head_dim * itemsize)  # over all rows: masked ones too
        ragged_flops = 4 * keys * config.head_dim * config.num_heads // kv_share
    return Program(
        decode_chunk,
        (params, pools, spec((rows, width), jnp.int32, by_row), ints, ints,
         spec((rows,), jnp.bool_, by_row), ints, spec((rows, 2), jnp.uint32, by_row),
         spec((2,), jnp.int32), spec((), jnp.int32)),
        dict(config=config, sampling=SamplingParams(temperature=1.0), chunk=args.chunk,
             forward_fn=forward_cached),
        model_flops=(rows * 2 * matmul_params(config) + attention) / mesh.size,
        base_bytes=tree_bytes(params) + tree_bytes(pools),
        least_bytes=param_bytes(config) / tp
        + local_rows * args.context * kv_bytes_per_token(config) / kv_share,
        per=args.chunk, attention_fwd=attention / mesh.size,
        kv_per_layer=rows * args.context * kv_bytes_per_token(config) // config.num_layers,
        ragged_per_layer=ragged, ragged_flops_per_layer=ragged_flops, fsdp=fsdp, tp=tp,
        note=f"{rows} rows x {args.context} tokens, pool {rows * pages} pages of {page}"
             + (f", {'interleaved' if len(pools) == 1 else 'k and v'} pools" if mesh.size > 1
                or len(pools) == 1 else ""))


def prefill_program(config: ModelConfig, args, mesh) -> Program:
    replicated = NamedSharding(mesh, P())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    tokens = min(bucket(args.context), PREFILL_WIDTH)
    page = args.page_size
    pages = -(-(args.context + tokens) // page)
    width = table_width(pages, page)
    params = abstract_params(config, config.jnp_dtype, replicated)
    pools = jax.eval_shape(lambda: tuple(as_bits(p) for p in empty_pages(
        config, PREFILL_ROWS * pages, page)))
    pools = tuple(spec(p.shape, p.dtype) for p in pools)
    rows = PREFILL_ROWS
    # Each new token attends to the context and the new tokens before it.
    attention = rows * sum(_attention_per_token(config, args.context + t + 1) for t in range(tokens))
    kv = kv_bytes_per_token(config)
    return Program(
        prefill,
        (params, pools, spec((rows, width), jnp.int32), spec((rows,), jnp.int32),
         spec((rows, tokens), jnp.int32), spec((rows,), jnp.int32)),
        dict(config=config, forward_fn=forward_cached),
        # The head runs on each row's last token only (`last_only`).
        model_flops=rows * (tokens * 2 * _layer_params(config) + 2 * _head_params(config))
        + attention,
        base_bytes=tree_bytes(params) + tree_bytes(pools),
        least_bytes=param_bytes(config) + rows * (args.context + tokens) * kv,
        attention_fwd=attention, note=f"{rows} rows x {tokens} new tokens after {args.context}")


def serving_copy_program(config: ModelConfig, args, mesh) -> Program:
    from rstar2_jax.parallel.roles import ServingCopy

    master = dataclasses.replace(config, dtype="float32")
    params = abstract_params(master, jnp.float32, NamedSharding(mesh, P()))
    copy = ServingCopy(master, mesh, None, jnp.dtype(jnp.bfloat16))
    size = tree_bytes(params)
    return Program(copy._cast, (params,), {}, model_flops=0.0, base_bytes=size * 3 // 2,
                   least_bytes=size * 3 / 2, note="float32 -> bfloat16, one device")
