"""The project's own programs compiled for an accelerator from any machine (no device needed):
FLOPs, bytes, memory, custom calls, kernel launches and compile time, against what the model
must do.

    python experiments/benchmarks/aot_report.py --target h100 --model qwen3-0.6b      # CUDA venv
    LD_LIBRARY_PATH=$STUBS python experiments/benchmarks/aot_report.py --target mi300x  # ROCm venv
    python experiments/benchmarks/aot_report.py --target cpu --model toy --rows 4 --context 64 \\
        --sequences 4 --length-scale 0.01                                   # this machine's CPU
    python experiments/benchmarks/aot_report.py --target tpu-v6e --mesh 2x2  # TPU venv, 4 chips

Setup (docs/accelerators.md, "Compiling for an accelerator without one"): JAX's CUDA plugin
(`jax[cuda12]`), ROCm plugin (`jax[rocm7-local]`, with the stand-in ROCm libraries of
`aot/rocm_stubs/build.sh`) or TPU runtime (`jax[tpu]`, libtpu) in a virtual environment of its
own, never the project's. JAX then compiles for a device of a deviceless topology described by
a GPU target-config file (`aot/h100.txtpb`, `aot/mi300x.txtpb`) or a TPU generation and slice
(`tpu-v5e`, `tpu-v6e`: ``--mesh`` FSDPxTP chips, 1x1, 2x2 or 4x4); `cpu` compiles for this
machine's CPU. The programs compile for that device's kernels
(`rstar2_jax.model.target.compiling_for`, compile-only: the kernels' run-time checks are
skipped, the kernels a run there takes when they pass), under the mesh (the TPU kernels split
their work over it). libtpu allows one process at a time on a machine (a lock file).

On a mesh of several chips every figure is one chip's (the programs are SPMD: each chip runs
the same one): the update's params, optimizer state and rows split as the trainer splits them
(`parallel.sharding`); decode's params likewise, each row's keys and values split by kv head
over tp, its rows over fsdp (the pool's pages replicated over fsdp: rows share them).

Programs (``--programs``), each exactly as the run compiles it, on random-shaped abstract inputs
(nothing is allocated):

- ``decode``: the sampler's decode chunk (`sampler.engine.decode_chunk`, ``--chunk`` steps of
  ``--rows`` rows, temperature 1), each row holding ``--context`` tokens in a pool of pages one
  chunk ahead; figures per decode step;
- ``prefill``: the sampler's prefill call (8 rows of up to 512 tokens after ``--context``);
- ``update``: the RL train step on a packed batch of stage-1 lengths (``--preset``,
  ``--sequences``, ``--micro-batches``, as `bench_packed_update.py` draws them; AdamW, float32
  master weights, bfloat16 compute, ``--remat``: the layers' rematerialisation policy);
- ``old-logprobs``: the update's pass over the same batch before it (old log-probs, entropies);
- ``serving-copy``: the trainer's float32 params cast to the sampler's bfloat16 copy.

Columns:

- ``flops``: the compiled program's matmul FLOPs (`hlo_bytes.costs`: loops multiplied out; XLA's
  own count takes a scanned loop's body once), plus by hand what a custom call computes (cuDNN's
  attention: the model's attention FLOPs; splash attention: the block pairs its causal mask
  visits, `tpu_attention.splash_flops`), against the ``model`` count: 2 x matmul params per
  token forward (6 x for the update: forward and backward) and causal attention over the real
  tokens (decode: over each row's context). Attention on the block-skipping XLA path of packed
  rows runs in loops of data-dependent length: counted from the kernel's plan
  (`bench_packed_update.block_attention_flops`).
- ``bytes``: the bytes the program moves (`hlo_bytes`), cuDNN's paged attention charged with the
  live keys and values it reads, ragged paged attention with the pages it copies in
  (`tpu_attention.ragged_bytes`; the custom call's operand is the whole pool); against the
  ``least``: decode, every param once (on a mesh: its tp share, whole over fsdp) and each row's
  live keys and values once; prefill, the params and the keys and values it reads and writes;
  the update and the old-log-prob pass, none given (compute-bound).
- ``peak`` / ``temp``: XLA's memory analysis (peak of the program's buffers; temporaries),
  against ``base``: params + page pools (sampler), params + AdamW moments + float32 gradients
  (update), params (old-log-prob pass, serving copy), one chip's share; and the device's memory
  (a TPU's HBM; its compiler refuses a program that does not fit).
- ``launches``: kernels one decode step launches, in all and per layer (`hlo_bytes`; XLA:GPU's
  command buffers may put several into one graph launch).
- ``custom calls``: cuDNN, cuBLAS, Triton / Pallas kernels present (a TPU's Pallas kernels by
  name).
- ``compile``: seconds to lower and compile on this machine.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a deviceless compile needs no GPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import hlo_bytes  # noqa: E402
from bench_decode import MODELS as DECODE_MODELS, kv_bytes_per_token, param_bytes  # noqa: E402
from bench_packed_update import (PRESETS as LENGTH_PRESETS, attention_flops,  # noqa: E402
                                 block_attention_flops, sample_lengths)
from bench_train_step import OPTIMIZER, matmul_params  # noqa: E402
from rstar2_jax.model import ModelConfig, forward_cached, init_params, target  # noqa: E402
from rstar2_jax.model import packed_attention, tpu_attention  # noqa: E402
from rstar2_jax.model.cache import as_bits, empty_pages  # noqa: E402
from rstar2_jax.sampler.engine import (PREFILL_ROWS, PREFILL_WIDTH, bucket, decode_chunk,  # noqa: E402
                                       prefill, table_width)
from rstar2_jax.sampler.sampling import SamplingParams  # noqa: E402
from rstar2_jax.train.configs import PrecisionConfig, RLConfig  # noqa: E402
from rstar2_jax.rl.scale_plan import PRESETS  # noqa: E402

AOT = Path(__file__).parent / "aot"
MODELS = DECODE_MODELS | PRESETS
PROGRAMS = ("decode", "prefill", "update", "old-logprobs", "serving-copy")


# -- targets -------------------------------------------------------------------------------


def _gpu(platform: str, spec: str):
    """The device of a one-GPU deviceless topology from a GPU target-config file."""
    from jax.experimental import topologies

    if platform == "rocm":
        # The ROCm plugin registers only where it finds an AMD GPU; it compiles without one.
        import jax._src.hardware_utils as hardware

        hardware.num_available_amd_gpus = lambda stop_at=None: 1
    return topologies.get_topology_desc(topology_name="", platform=platform, topology="1x1x1",
                                        target_config=(AOT / spec).read_text()).devices[0]


@contextlib.contextmanager
def _cudnn_asks_the_target(where: target.Target):
    """JAX's cuDNN attention asks the process's backend for the GPU's compute capability
    (packed rows need 9.0) while it is traced; compiling for a deviceless GPU, the answer must
    be the target's."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    def at_least(capability):
        return (where.compute_capability or 0.0) >= float(capability)

    def equal(capability):
        return where.compute_capability == float(capability)

    saved = cudnn.check_compute_capability, cudnn.is_cuda_compute_capability_equal
    if where.platform == "cuda":
        cudnn.check_compute_capability, cudnn.is_cuda_compute_capability_equal = at_least, equal
    try:
        yield
    finally:
        cudnn.check_compute_capability, cudnn.is_cuda_compute_capability_equal = saved


def _tpu(generation: str, chips: int) -> list:
    """The chips of a deviceless TPU slice of `chips` chips (1, 4 or 16) of `generation`."""
    from jax.experimental import topologies

    shape = {1: "1x1", 4: "2x2", 16: "4x4"}[chips]
    return topologies.get_topology_desc(
        topology_name=f"{generation}:{shape}", platform="tpu", chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1) if chips == 1 else (2, 2, 1), num_slices=1).devices


def _one(make):
    def devices(count: int) -> list:
        if count != 1:
            raise SystemExit("--mesh: this target is one device")
        return [make()]
    return devices


# name -> (the devices to compile for, given how many; whether this process can run on them)
TARGETS = {
    "cpu": (lambda count: jax.devices("cpu")[:count], True),
    "h100": (_one(functools.partial(_gpu, "cuda", "h100.txtpb")), False),
    "mi300x": (_one(functools.partial(_gpu, "rocm", "mi300x.txtpb")), False),
    "tpu-v5e": (functools.partial(_tpu, "v5e"), False),
    "tpu-v6e": (functools.partial(_tpu, "v6e"), False),
}
# HBM per chip, by the datasheets (no deviceless topology reports it).
TPU_MEMORY = {"tpu-v5e": 16 * 2**30, "tpu-v6e": 32 * 2**30}


def device_memory(name: str) -> int | None:
    """The target's memory in bytes (a TPU's HBM; a GPU's from its target-config file), None
    for the CPU."""
    if name in TPU_MEMORY:
        return TPU_MEMORY[name]
    spec = AOT / f"{name}.txtpb"
    if not spec.exists():
        return None
    return int(re.search(r"device_memory_size: (\d+)", spec.read_text()).group(1))


# -- programs ------------------------------------------------------------------------------


@dataclasses.dataclass
class Program:
    """A jitted function, its abstract arguments, and the model's count of its work."""

    fn: object
    args: tuple
    kwargs: dict
    model_flops: float  # per unit (decode: per step; else per call)
    base_bytes: int  # what it must hold: params (+ page pools, + optimizer state)
    computed_flops: float | None = None  # the model's count on every token computed (padding too)
    least_bytes: float | None = None  # what it must move, per unit
    per: int = 1  # units per call (decode: the chunk's steps, the loop it runs them in)
    attention_fwd: float = 0.0  # forward attention FLOPs per unit, as the model counts them
    passes: int = 1  # attention calls per layer per unit (micro-batches)
    kv_per_layer: int = 0  # live key/value bytes a decode step reads per layer
    ragged_per_layer: int = 0  # bytes one chip's ragged paged attention reads per layer
    ragged_flops_per_layer: float = 0.0  # and the FLOPs it computes (over the keys it reads)
    segments: object = None  # packed rows' segment lengths (block-skipping attention's plan)
    forwards: int = 1  # passes of attention's forward in the program (2: rerun in the backward)
    backwards: int = 0
    fsdp: int = 1  # the mesh's axes: the figures are one chip's
    tp: int = 1
    note: str = ""


def _tree_bytes(tree) -> int:
    """Bytes of one chip's share of a tree of abstract arrays (all of those without sharding)."""
    def share(x):
        sharding = getattr(x, "sharding", None)
        return sharding.shard_shape(x.shape) if sharding is not None else x.shape
    return sum(math.prod(share(x)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _split(mesh, axis: str, size: int) -> str | None:
    """`axis` where the mesh's axis divides `size`, else None (replicated)."""
    return axis if size % mesh.shape[axis] == 0 else None


def _abstract_params(config: ModelConfig, dtype, sharding):
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
                          _abstract_params(config, config.jnp_dtype, None), param_specs(config, mesh),
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
        base_bytes=_tree_bytes(params) + _tree_bytes(pools),
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
    params = _abstract_params(config, config.jnp_dtype, replicated)
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
        base_bytes=_tree_bytes(params) + _tree_bytes(pools),
        least_bytes=param_bytes(config) + rows * (args.context + tokens) * kv,
        attention_fwd=attention, note=f"{rows} rows x {tokens} new tokens after {args.context}")


def _packed_batch(config: ModelConfig, args):
    """Host arrays of an update batch of stage-1 lengths as `RLUpdate` hands its train step
    (packed rows, gathered back per rollout), and the sequences' lengths."""
    from bench_packed_update import batches

    rng = np.random.default_rng(0)
    preset = LENGTH_PRESETS[args.preset]
    lengths, starts, _ = sample_lengths(preset, args.sequences, args.length_scale, rng)
    budget = int(preset.budget * args.length_scale)
    _, packed, _ = batches(preset, lengths, starts, budget, args.micro_batches,
                           config.vocab_size, rng)
    return packed, lengths


def _update_config(config: ModelConfig, args) -> tuple[ModelConfig, PrecisionConfig, RLConfig]:
    policy = PrecisionConfig(params="float32", compute="bfloat16")
    return (dataclasses.replace(config, dtype="float32"), policy,
            RLConfig(remat=args.remat, logprob_chunk=args.logprob_chunk))


def update_program(config: ModelConfig, args, mesh) -> Program:
    from rstar2_jax.parallel.sharding import batch_spec, param_specs
    from rstar2_jax.algorithms import GRPO_ROC
    from rstar2_jax.rl.update import rl_loss
    from rstar2_jax.train.step import TrainState, make_train_step, state_shardings

    master, policy, rl = _update_config(config, args)
    specs = param_specs(master, mesh)
    params = _abstract_params(master, jnp.float32, None)
    shardings = state_shardings(OPTIMIZER, params, mesh, specs)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         TrainState(params, jax.eval_shape(OPTIMIZER.init, params),
                                    jax.ShapeDtypeStruct((), jnp.int32)), shardings)
    packed, lengths = _packed_batch(master, args)
    rows = NamedSharding(mesh, batch_spec())
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows) for k, v in packed.items()}
    loss = functools.partial(rl_loss, model_config=policy.compute_config(master), config=rl,
                             loss=GRPO_ROC.loss)
    step = make_train_step(loss, OPTIMIZER, micro_batches=args.micro_batches, mesh=mesh,
                           param_specs=specs, params=params)
    tokens, computed = int(np.sum(lengths)), packed["inputs"].size
    attention = attention_flops(master, lengths)
    # Attention's forward runs again in the backward under either policy (`run_decoder` saves
    # only the projections' outputs, or nothing with remat).
    return Program(step, (state, batch), {},
                   model_flops=(6 * matmul_params(master) * tokens + attention) / mesh.size,
                   computed_flops=(6 * matmul_params(master) * computed + attention) / mesh.size,
                   base_bytes=_tree_bytes(state) + _tree_bytes(state.params),  # + float32 gradients
                   attention_fwd=attention / 3 / mesh.size, passes=args.micro_batches,
                   segments=packed["segment_lengths"], forwards=2, backwards=1,
                   fsdp=mesh.shape["fsdp"], tp=mesh.shape["tp"],
                   note=f"{args.preset}: {len(lengths)} sequences, {tokens:,} tokens in "
                        f"{packed['inputs'].shape[0]} rows of {packed['inputs'].shape[1] + 1} "
                        f"(padding {1 - tokens / computed:.0%}), {args.micro_batches} "
                        f"micro-batches, remat {args.remat}")


def old_logprobs_program(config: ModelConfig, args, mesh) -> Program:
    from rstar2_jax.parallel.sharding import batch_spec, param_specs
    from rstar2_jax.rl.update import _trainer_logprobs

    master, policy, rl = _update_config(config, args)
    specs = param_specs(master, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                          _abstract_params(master, jnp.float32, None), specs,
                          is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    packed, lengths = _packed_batch(master, args)
    rows = NamedSharding(mesh, batch_spec())
    shifted = {k: jax.ShapeDtypeStruct(packed[k].shape, packed[k].dtype, sharding=rows)
               for k in ("inputs", "targets", "segment_lengths", "gather")}
    fn = jax.jit(functools.partial(_micro_batch_passes, functools.partial(
        _trainer_logprobs, model_config=policy.compute_config(master), config=rl,
        return_entropy=True), chunks=args.micro_batches))
    tokens = int(np.sum(lengths))
    attention = attention_flops(master, lengths) / 3  # the forward alone
    return Program(fn, (params, shifted), {},
                   model_flops=(2 * matmul_params(master) * tokens + attention) / mesh.size,
                   computed_flops=(2 * matmul_params(master) * packed["inputs"].size + attention)
                   / mesh.size,
                   base_bytes=_tree_bytes(params), attention_fwd=attention / mesh.size,
                   passes=args.micro_batches, segments=packed["segment_lengths"],
                   fsdp=mesh.shape["fsdp"], tp=mesh.shape["tp"],
                   note="the update's batch, forward only")


def _micro_batch_passes(logprobs, params, shifted, *, chunks):
    """The update's log-prob passes over the batch's ``chunks`` micro-batches (strided rows, as
    the batch is laid out), in one program: `RLUpdate` runs one program per micro-batch."""
    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // chunks, chunks, *x.shape[1:]), 0, 1)

    return jax.lax.map(lambda rows: logprobs(params, rows), jax.tree.map(split, shifted))


def serving_copy_program(config: ModelConfig, args, mesh) -> Program:
    from rstar2_jax.parallel.roles import ServingCopy

    master = dataclasses.replace(config, dtype="float32")
    params = _abstract_params(master, jnp.float32, NamedSharding(mesh, P()))
    copy = ServingCopy(master, mesh, None, jnp.dtype(jnp.bfloat16))
    size = _tree_bytes(params)
    return Program(copy._cast, (params,), {}, model_flops=0.0, base_bytes=size * 3 // 2,
                   least_bytes=size * 3 / 2, note="float32 -> bfloat16, one device")


# -- reading the compiled program ----------------------------------------------------------


def _pallas_tpu_name(name: str) -> str:
    """A TPU Pallas kernel's name from its custom call's instruction name (`name.N`)."""
    return re.sub(r"\.\d+$", "", name)


def _custom_calls(text: str) -> dict[str, int]:
    """Custom calls (cuDNN, cuBLAS, Pallas on TPU by kernel name) and Triton fusions, by name:
    how many."""
    found = {}
    tpu = [_pallas_tpu_name(n) for n in re.findall(
        r'^\s*(?:ROOT )?%(\S+) = .*custom_call_target="tpu_custom_call"', text, flags=re.M)]
    for name in tpu + [t for t in re.findall(r'custom_call_target="([^"]*)"', text)
                       if t != "tpu_custom_call"] + re.findall(r'"kind":"(__triton[\w]*)"', text):
        found[name] = found.get(name, 0) + 1
    return found


def _attention_call(cost) -> bool:
    """A custom call that is attention: cuDNN's, or a Pallas kernel (Triton on GPUs)."""
    return cost.target.startswith("__cudnn$fmha") or cost.target == "__gpu$xla.gpu.triton"


def _attention_by_hand(costs, program: Program, config: ModelConfig, where: target.Target,
                       dependent) -> tuple[float, str]:
    """FLOPs of the attention the matmul count cannot see, and how they were counted: cuDNN's
    calls (the model's attention per forward call, twice that per backward call), the
    block-skipping kernel's loops (its plan), or a decode step's page loop (the model's)."""
    splash = [c for c in costs if c.target == "tpu_custom_call" and c.name.startswith("splash_mha_")]
    if splash:
        rows, t = program.args[-1]["inputs"].shape  # the whole batch's
        # A call covers one micro-batch's rows (a chip: its share of them, its heads).
        share = program.passes * (program.fsdp if rows % program.fsdp == 0 else 1)
        heads = config.num_heads // (program.tp if config.num_kv_heads % program.tp == 0 else 1)
        kinds = {kind: sum(c.times for c in splash if c.name.startswith(f"splash_mha_{kind}"))
                 for kind in ("fwd", "dq", "dkv")}
        return (sum(n * tpu_attention.splash_flops(program.segments, t, heads, config.head_dim,
                                                   kind) / share for kind, n in kinds.items()),
                "splash attention by the block pairs it computes: " + ", ".join(
                    f"{n} {kind} calls" for kind, n in kinds.items()))
    ragged = [c for c in costs if c.target == "tpu_custom_call"
              and c.name.startswith("ragged_paged_attention")]
    if ragged:
        return (sum(c.times for c in ragged) * program.ragged_flops_per_layer,
                "ragged paged attention by hand: the keys of the pages it reads")
    calls = [c for c in costs if _attention_call(c)]
    if calls:
        forward = sum(c.times for c in calls if "Backward" not in c.target)
        backward = sum(c.times for c in calls if "Backward" in c.target)
        per_call = program.attention_fwd / (config.num_layers * program.passes)
        return ((forward + 2 * backward) * per_call,
                f"attention kernels by hand: {forward / program.per:.0f} forward, "
                f"{backward / program.per:.0f} backward calls")
    if not any(c.flops and dependent(c) for c in costs):
        return 0.0, ""
    if program.segments is not None:
        block = packed_attention._BLOCK
        group = packed_attention._GROUP if where.accelerator else 1
        t = program.args[-1]["inputs"].shape[1]
        with jax.default_device(jax.devices("cpu")[0]):  # the plan is counted on the host
            forward, backward = packed_attention.packed_block_visits(program.segments, t, block,
                                                                     group)
        per_matmul = 2 * block**2 * config.head_dim * config.num_heads * config.num_layers
        return ((forward * 2 * program.forwards + backward * 5 * program.backwards) * per_matmul,
                f"block-skipping attention by its plan: {forward:,} forward, {backward:,} "
                f"backward block pairs, forward x{program.forwards}")
    return program.attention_fwd * program.per, "attention of the page loop by the model's count"


def measure(program: Program, where: target.Target, config: ModelConfig, options: dict,
            show: int = 0, hlo: str | None = None) -> dict:
    """Compiles `program` for the current target and reads the figures (see the module doc)."""
    start = time.perf_counter()
    try:
        compiled = program.fn.lower(*program.args, **program.kwargs).compile(
            compiler_options=options or None)
    except jax.errors.JaxRuntimeError as e:  # a TPU's compiler refuses what exceeds its HBM
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return {"compile_s": round(time.perf_counter() - start, 1), "note": program.note,
                "does_not_fit": str(e).split("\n")[0][:400], "base_bytes": program.base_bytes}
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    if hlo:
        Path(hlo).write_text(text)
    memory = compiled.memory_analysis()
    costs = hlo_bytes.costs(text, unknown_trips=program.per)
    own = 1 if program.per > 1 else 0  # the decode chunk's loop: `per` steps

    def dependent(c):  # in a loop of data-dependent length other than the chunk's own
        return sum(trips is None for _, trips in c.loops) > own

    hand, how = _attention_by_hand(costs, program, config, where, dependent)
    flops = sum(c.flops * c.times for c in costs if not dependent(c)) + hand
    def charged(c):  # bytes per run of the program
        # A paged decode kernel's operands are the whole pools; it reads the live keys and
        # values (and writes its output): cuDNN's or Triton's, or ragged paged attention on a
        # TPU, by the page blocks it copies in.
        if program.kv_per_layer and _attention_call(c):
            return (program.kv_per_layer + c.out) * c.times
        if c.target == "tpu_custom_call" and c.name.startswith("ragged_paged_attention"):
            return (program.ragged_per_layer + c.out) * c.times
        return c.bytes * c.times

    moved = sum(map(charged, costs))
    layer = [c for c in costs if any(trips == config.num_layers for _, trips in c.loops)]
    largest = sorted(costs, key=lambda c: -charged(c))[:show]
    return {
        "compile_s": round(seconds, 1), "note": program.note, "flops_note": how,
        "flops": flops / program.per, "model_flops": program.model_flops,
        "computed_flops": program.computed_flops,
        "bytes": moved / program.per, "least_bytes": program.least_bytes,
        "bytes_note": "data-dependent loops counted once" if any(map(dependent, costs)) else "",
        "peak_bytes": memory.peak_memory_in_bytes, "temp_bytes": memory.temp_size_in_bytes,
        "base_bytes": program.base_bytes,
        "launches_per_step": sum(c.times for c in costs) / program.per if program.per > 1 else None,
        "launches_per_layer": (sum(c.times for c in layer) / program.per / config.num_layers
                               if program.per > 1 else None),
        "custom_calls": _custom_calls(text),
        "largest": [(charged(c) / program.per, c.name, c.source) for c in largest],
    }


def _size(x: float | None, unit: str = "B") -> str:
    if x is None:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def report(name: str, r: dict, memory: int | None) -> str:
    if "does_not_fit" in r:
        return (f"{name}: {r['note']}; compile {r['compile_s']:.1f} s\n  does not fit (base "
                f"{_size(r['base_bytes'])}): {r['does_not_fit']}")
    lines = [f"{name}: {r['note']}; compile {r['compile_s']:.1f} s",
             f"  flops  {_size(r['flops'], 'FLOP')} = {_ratio(r['flops'], r['model_flops'])} the "
             f"model's {_size(r['model_flops'], 'FLOP')}"
             + (f", {_ratio(r['flops'], r['computed_flops'])} its count on every token computed"
                if r["computed_flops"] else "")
             + (f" ({r['flops_note']})" if r['flops_note'] else ""),
             f"  bytes  {_size(r['bytes'])}" + (f" = {_ratio(r['bytes'], r['least_bytes'])} the least "
                                               f"{_size(r['least_bytes'])}" if r['least_bytes'] else "")
             + (f" ({r['bytes_note']})" if r['bytes_note'] else ""),
             f"  memory peak {_size(r['peak_bytes'])} = {_ratio(r['peak_bytes'], r['base_bytes'])} "
             f"the base {_size(r['base_bytes'])}, temp {_size(r['temp_bytes'])}"
             + (f"; {r['peak_bytes'] / memory:.0%} of the device's {_size(memory)}" if memory else "")]
    if r["launches_per_step"] is not None:
        lines.append(f"  launches per step {r['launches_per_step']:.0f} ({r['launches_per_layer']:.0f} "
                     "per layer)")
    lines.append("  custom calls " + (", ".join(f"{k} x{v}" for k, v in sorted(r["custom_calls"].items()))
                                      or "none"))
    lines += [f"    {_size(moved):>10}  {name} ({source})" for moved, name, source in r["largest"]]
    return "\n".join(lines)


def _option(value: str):
    """An XLA option's value as its type: a bool, an int, or the string."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    return int(value) if value.lstrip("-").isdigit() else value


def build(name: str, config: ModelConfig, args, mesh, rows: int | None = None) -> Program:
    if name == "decode":
        return decode_program(config, args, mesh, rows)
    return {"prefill": prefill_program, "update": update_program,
            "old-logprobs": old_logprobs_program,
            "serving-copy": serving_copy_program}[name](config, args, mesh)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="h100")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-0.6b")
    parser.add_argument("--mesh", default="1x1", choices=("1x1", "2x2", "4x4", "1x4", "4x1"),
                        help="FSDPxTP chips (TPU and CPU targets)")
    parser.add_argument("--layers", type=int, help="override the model's depth")
    parser.add_argument("--programs", nargs="+", choices=PROGRAMS, default=list(PROGRAMS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256],
                        help="decode rows (slots)")
    parser.add_argument("--context", type=int, default=2048, help="tokens each row holds")
    parser.add_argument("--chunk", type=int, default=64, help="decode steps per call")
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--preset", choices=sorted(k for k, v in LENGTH_PRESETS.items()
                                                  if v.kind == "rl"), default="stage1-early")
    parser.add_argument("--sequences", type=int, default=16, help="rollouts in the update")
    parser.add_argument("--length-scale", type=float, default=1.0,
                        help="multiplies the preset's lengths and row budget")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--remat", action="store_true", help="rl.remat: rerun each layer whole")
    parser.add_argument("--logprob-chunk", type=int, default=256)
    parser.add_argument("--xla", nargs="*", default=[], metavar="OPTION=VALUE",
                        help="XLA compiler options, e.g. xla_gpu_enable_command_buffer=")
    parser.add_argument("--show", type=int, default=0,
                        help="list this many of each program's largest instructions (bytes)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--hlo", help="write each program's optimized HLO into this folder")
    args = parser.parse_args(argv)

    fsdp, tp = (int(n) for n in args.mesh.split("x"))
    if fsdp * tp > 1 and set(args.programs) - {"decode", "update", "old-logprobs"}:
        parser.error("--mesh: only decode, update and old-logprobs are measured on several chips")
    make_devices, runnable = TARGETS[args.target]
    devices = make_devices(fsdp * tp)
    device = devices[0]
    config = MODELS[args.model]
    config = dataclasses.replace(config, dtype="bfloat16", **(
        {"num_layers": args.layers} if args.layers else {}))
    options = {key: _option(value) for key, value in (o.split("=", 1) for o in args.xla)}
    memory = device_memory(args.target)
    mesh = Mesh(np.array(devices).reshape(fsdp, tp), ("fsdp", "tp"))
    print(f"target {args.target}: {device.device_kind}, mesh fsdp {fsdp} x tp {tp}; jax "
          f"{jax.__version__}; model {args.model}, {config.num_layers} layers"
          + (f"; XLA options {options}" if options else ""), flush=True)
    results = []
    # Abstract params are shaped outside the target: a deviceless device cannot run the PRNG.
    for name in args.programs:
        for rows in (args.rows if name == "decode" else [None]):
            with (target.compiling_for(device, compile_only=not runnable, mesh=mesh) as where,
                  _cudnn_asks_the_target(where)):
                program = build(name, config, args, mesh, rows)
                result = measure(program, where, config if name not in ("update", "old-logprobs")
                                 else dataclasses.replace(config, dtype="float32"), options,
                                 args.show, args.hlo and f"{args.hlo}/{args.target}_{name}"
                                 + (f"_{rows}" if rows else "") + ".hlo")
            label = f"{name}" + (f" {rows} rows" if rows else "")
            print(report(label, result, memory), flush=True)
            results.append({"target": args.target, "mesh": args.mesh, "model": args.model,
                            "layers": config.num_layers,
                            "program": name, "rows": rows, "options": options} | result)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
