"""Which accelerator the tests run on, for the tests of GPU-only kernels (skipped elsewhere).
Decided here, apart from the library's own checks, so that a wrong library check cannot make
its own tests skip."""
import jax
import jax.extend


def cuda_gpu() -> bool:
    """An NVIDIA GPU (a ROCm GPU is also JAX's "gpu" backend)."""
    return (jax.default_backend() == "gpu"
            and "cuda" in jax.extend.backend.get_backend().platform_version.lower())


def hopper() -> bool:
    """An NVIDIA GPU of compute capability 9.0 (Hopper) or later."""
    return cuda_gpu() and float(jax.devices()[0].compute_capability) >= 9.0
