"""The device a program is compiled for, which the kernel choices read.

Which kernels a program uses depends on where it will run: cuDNN's flash and paged attention on
an NVIDIA GPU (packed rows from compute capability 9.0), 16-bit KV pools held as their bits and
decode steps attended page by page on CPU, bfloat16 compute by default on accelerators. That is
the device JAX compiles for, not the process's default backend: a trainer or sampler may run on
a mesh of other devices, and a compile-only tool compiles for an H100, an MI300X or a TPU from a
CPU-only machine (devices of a deviceless topology, `jax.experimental.topologies`).

`compiling_for(device)` states it: it enters `jax.default_device(device)`, which is part of
jit's cache key (a program traced for one target is never reused for another), and the kernel
choices read it back (`current`). The trainer and the sampler compile under their mesh's first
device; outside any, the target is JAX's default device (`jax.default_device` if set, else the
process's first device). Some kernels are checked once against a reference by running them
(`model.cache._pages_agree`, `model.transformer._cudnn_packed_agrees`); a compile-only
target (`compile_only=True`, required for a device this process cannot run on) skips the checks
and takes the kernel a run on that device would take when they pass.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Target:
    """What the kernel choices need to know of a device.

    platform            "cpu", "cuda" (NVIDIA), "rocm" (AMD), "tpu", or another PJRT
                        platform's name
    compute_capability  NVIDIA's, e.g. 9.0 for Hopper; None elsewhere
    compile_only        the program is compiled, never run, in this process: the kernels'
                        run-time agreement checks are skipped (see the module docstring)
    """

    platform: str
    compute_capability: float | None = None
    compile_only: bool = False

    @property
    def accelerator(self) -> bool:
        return self.platform != "cpu"


def describe(device, compile_only: bool = False) -> Target:
    """The `Target` of a JAX device: one of this process's, a deviceless topology's, or any
    object with the same attributes (``platform``; ``compute_capability`` on NVIDIA GPUs; for a
    ``gpu`` platform, ``client.platform_version`` or ``device_kind`` naming the vendor)."""
    platform = device.platform.lower()
    if platform == "gpu":  # JAX names CUDA and ROCm devices alike (a deviceless topology's too)
        client = getattr(device, "client", None)
        version = f"{getattr(client, 'platform_version', '')} {device.device_kind}".lower()
        platform = "rocm" if "rocm" in version or "amd" in version else "cuda"
    capability = getattr(device, "compute_capability", None) if platform == "cuda" else None
    return Target(platform, None if capability is None else float(capability), compile_only)


# `compiling_for`'s device and target, while it is active.
_CURRENT: contextvars.ContextVar[tuple[object, Target] | None] = contextvars.ContextVar(
    "target", default=None)


def current() -> Target:
    """The target of the program being traced: `compiling_for`'s, else JAX's default device's
    (a `jax.default_device` entered inside `compiling_for` wins, as it does for JAX)."""
    device = jax.config.jax_default_device
    active = _CURRENT.get()
    if active is not None and device is active[0]:
        return active[1]
    if device is None or isinstance(device, str):
        device = jax.devices(device)[0]
    return describe(device)


@contextlib.contextmanager
def compiling_for(device, *, compile_only: bool = False, mesh=None):
    """Programs traced inside compile for ``device`` (and run there by default: this is
    `jax.default_device`) with the kernels `describe(device)` calls for; yields the `Target`.
    With ``mesh`` (a `jax.sharding.Mesh` of ``device``'s kind) of several devices, they are
    traced under its abstract mesh (`jax.sharding.use_abstract_mesh`): the kernels XLA does not
    partition (the TPU ones, `tpu_attention`) split their work over it.

    ``compile_only``: nothing will run on ``device`` from this process (a deviceless topology's
    device); the kernels' agreement checks are skipped. A device that is not one of this
    process's needs it: ValueError otherwise, before anything is traced, rather than checks that
    fail and silently choose other kernels.
    """
    if not compile_only and not _runnable(device):
        raise ValueError(f"{device} ({getattr(device, 'device_kind', type(device).__name__)}) is "
                         "not a device of this process: compile for it with compile_only=True")
    target = describe(device, compile_only)
    token = _CURRENT.set((device, target))
    several = mesh is not None and mesh.size > 1
    try:
        with (jax.default_device(device),
              jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if several
              else contextlib.nullcontext()):
            yield target
    finally:
        _CURRENT.reset(token)


def compiling_for_mesh(mesh):
    """`compiling_for` the first of this process's devices of ``mesh`` (a
    `jax.sharding.Mesh`: the devices of a mesh are of one kind), under the mesh."""
    return compiling_for(mesh.local_devices[0], mesh=mesh)


def compiling_for_arrays(tree):
    """`compiling_for` the first of this process's devices that hold the first JAX array of
    ``tree`` (e.g. the params a sampler serves), under its mesh if it has one; JAX's default
    device (no change) for a tree of no JAX array."""
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    if not arrays:
        return contextlib.nullcontext(current())
    return compiling_for(min(arrays[0].sharding.addressable_devices, key=lambda d: d.id),
                         mesh=getattr(arrays[0].sharding, "mesh", None))


def _runnable(device) -> bool:
    try:
        return device in jax.devices(device.platform)
    except RuntimeError:  # no backend of that platform in this process
        return False
