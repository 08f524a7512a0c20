"""The targets `aot_report.py` compiles for: the devices of deviceless GPU and TPU topologies (or
this machine's CPU), and what a trace for them must be told.

A GPU is described by a target-config file of this folder (`h100.txtpb`, `mi300x.txtpb`:
trimmed copies of XLA's target descriptions); a TPU slice by its generation and shape. The ROCm
plugin registers only where it finds an AMD GPU (it compiles without one; its shared libraries
are the stand-ins of `rocm_stubs/build.sh`).
"""
from __future__ import annotations

import contextlib
import functools
import re
from pathlib import Path

import jax

from rstar2_jax.model import target

AOT = Path(__file__).parent


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
def cudnn_asks_the_target(where: target.Target):
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
