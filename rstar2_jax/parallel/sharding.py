"""Device mesh and partition specs: FSDP over the `fsdp` axis, Megatron tensor parallelism over `tp`.

Every param is split as its row of the params table says (`rstar2_jax.model.params.PARAMS`):
on one axis by `fsdp` (parameter/optimizer-state memory scales down with the data-parallel
width; XLA all-gathers a layer's weights when it runs) and, where it has heads or an
MLP/vocabulary dimension, on another by `tp` (Megatron tensor parallelism).

Data is split over `fsdp` on the batch axis. A dimension that the axis size does not divide is
replicated instead (e.g. 2 kv heads on tp=4), so any config runs on any mesh, a 1-device mesh
included; only the batch must be divisible by the fsdp size.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from rstar2_jax.model import KVCache, ModelConfig, forward
from rstar2_jax.model.axes import FSDP, TP
from rstar2_jax.model.params import Param, params_tree

# The params table's logical axes (`rstar2_jax.model.params.PARAMS`) as this mesh's axes.
_MESH_AXES = {"fsdp": FSDP, "tp": TP, None: None}


def make_mesh(fsdp: int | None = None, tp: int = 1, devices=None) -> Mesh:
    """A (fsdp, tp) mesh over `devices` (default: all). fsdp=None uses all devices left after tp."""
    devices = list(jax.devices() if devices is None else devices)
    if fsdp is None:
        if len(devices) % tp:
            raise ValueError(f"tp={tp} does not divide the {len(devices)} devices")
        fsdp = len(devices) // tp
    if fsdp < 1 or tp < 1 or fsdp * tp > len(devices):
        raise ValueError(f"a mesh of fsdp={fsdp} x tp={tp} needs {fsdp * tp} devices; "
                         f"{len(devices)} available")
    # Auto axes: shardings propagate through the model's einsums without annotations in it.
    return jax.make_mesh((fsdp, tp), (FSDP, TP), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[:fsdp * tp])


def _fit(axes: tuple, shape: tuple[int, ...], mesh: Mesh | None) -> P:
    """The spec `axes`, with every mesh axis that does not divide its dimension dropped."""
    if mesh is None:
        return P(*axes)
    return P(*(a if a is None or dim % mesh.shape[a] == 0 else None for a, dim in zip(axes, shape)))


def param_specs(config: ModelConfig, mesh: Mesh | None = None) -> dict:
    """PartitionSpecs with the structure of the params. With `mesh`, non-divisible dims replicate."""
    def spec(p: Param) -> P:
        axes = tuple(_MESH_AXES[a] for a in p.axes)
        return _fit((None, *axes) if p.stacked else axes, p.shape(config), mesh)

    return params_tree(config, spec)


def named_shardings(mesh: Mesh, specs):
    """Maps a pytree of PartitionSpecs to NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def shard_params(params: dict, config: ModelConfig, mesh: Mesh) -> dict:
    """Places params on `mesh` as `param_specs` says."""
    return jax.device_put(params, named_shardings(mesh, param_specs(config, mesh)))


def batch_spec() -> P:
    """Spec of per-example data ([batch, ...] tokens, masks, advantages): batch over fsdp."""
    return P(FSDP)


def _process_fsdp_positions(mesh: Mesh) -> list[int]:
    """The fsdp positions that have a device of this process."""
    me = jax.process_index()
    by_fsdp = np.moveaxis(mesh.devices, mesh.axis_names.index(FSDP), 0)
    by_fsdp = by_fsdp.reshape(mesh.shape[FSDP], -1)
    return [i for i, devices in enumerate(by_fsdp) if any(d.process_index == me for d in devices)]


def process_fsdp_shards(mesh: Mesh) -> int:
    """How many fsdp shards of a batch this process's devices hold (`place_batch` takes a
    multiple of this many rows)."""
    return len(_process_fsdp_positions(mesh))


def process_rows(num_rows: int, mesh: Mesh) -> slice:
    """The rows of a global batch of `num_rows` that this process holds, and so feeds to
    `place_batch`: the blocks of the fsdp positions its devices have (with `make_mesh`'s
    host-major order, block `jax.process_index()` of `jax.process_count()`).

    Raises ValueError if `num_rows` does not split over fsdp or this process's positions are
    not contiguous (a mesh that interleaves processes on the fsdp axis).
    """
    fsdp = mesh.shape[FSDP]
    if num_rows % fsdp:
        raise ValueError(f"{num_rows} rows do not split over fsdp={fsdp}")
    positions = _process_fsdp_positions(mesh)
    if positions != list(range(positions[0], positions[-1] + 1)):
        raise ValueError(f"process {jax.process_index()} holds fsdp positions {positions}, which "
                         f"are not contiguous; order the mesh's devices host-major (make_mesh does)")
    per_position = num_rows // fsdp
    return slice(positions[0] * per_position, (positions[-1] + 1) * per_position)


def place_batch(local_rows: dict, mesh: Mesh) -> dict:
    """This process's rows (host arrays [rows, ...]) -> global arrays with rows split over fsdp.

    Each process passes only its own rows, the same number on every process (`process_rows`
    says which of a global batch); the global batch is all processes' rows stacked in the order
    of their devices on the fsdp axis (process order for `make_mesh`), see docs/scale_plan.md.
    On one process the rows are the whole batch.
    """
    sharding = NamedSharding(mesh, batch_spec())
    shards = process_fsdp_shards(mesh)
    for name, x in local_rows.items():
        if x.shape[0] % shards:
            raise ValueError(f"batch field {name!r} has {x.shape[0]} rows, which do not split over "
                             f"the {shards} fsdp shards of process {jax.process_index()}")
    return jax.make_array_from_process_local_data(sharding, local_rows)


def cache_specs(config: ModelConfig, mesh: Mesh, batch: int) -> KVCache:
    """Specs of a contiguous `KVCache` of `batch` rows (`init_cache`: a page per row): rows and
    their pages over fsdp, kv heads over tp (where divisible)."""
    rows = _fit((FSDP,), (batch,), mesh)
    kv_heads = _fit((TP,), (config.num_kv_heads,), mesh)
    kv = P(None, *rows, *kv_heads, None, None)  # [layers, pages, kv_heads, page_size, head_dim]
    return KVCache(k=kv, v=kv, block_table=P(*rows, None), lengths=P(*rows))


def sharded_forward(config: ModelConfig, mesh: Mesh):
    """`forward` jitted for `mesh`: (params, tokens [B, T], attention_mask [B, T]) -> logits [B, T, V].

    Params are expected (and kept) as `param_specs`; tokens and mask split over fsdp on the
    batch axis; logits come out with batch over fsdp and vocab over tp.
    """
    data = NamedSharding(mesh, batch_spec())
    vocab = _fit((TP,), (config.vocab_size,), mesh)
    logits = NamedSharding(mesh, P(FSDP, None, *vocab))

    def run(params, tokens, attention_mask):
        return forward(params, config, tokens, attention_mask)

    return jax.jit(run, in_shardings=(named_shardings(mesh, param_specs(config, mesh)), data, data),
                   out_shardings=logits)
