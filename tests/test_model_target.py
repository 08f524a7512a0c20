"""Kernels are chosen for the device a program is compiled for (`rstar2_jax.model.target`), not
for the process's backend: compiled for an NVIDIA GPU from this CPU-only process, with a
stand-in device as a deviceless topology gives one, the programs take the GPU kernels."""
import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2_jax.model import KVCache, ModelConfig, forward_cached, init_params, target, token_logprobs
from rstar2_jax.model import cache as kv
from rstar2_jax.model import transformer
from rstar2_jax.sampler import RolloutSettings
from rstar2_jax.train.configs import PrecisionConfig

CONFIG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     tie_embeddings=True, max_position_embeddings=256, dtype="bfloat16")
S = jax.ShapeDtypeStruct
PARAMS = jax.eval_shape(functools.partial(init_params, CONFIG), jax.random.key(0))


class _Client:
    def __init__(self, version):
        self.platform_version = version


class StandInDevice:
    """A device as JAX describes one: `platform`, `device_kind`, its client's platform version
    and, on NVIDIA GPUs, the compute capability (no such device exists in this process)."""

    def __init__(self, platform, kind, version="", capability=None):
        self.platform, self.device_kind, self.client = platform, kind, _Client(version)
        if capability is not None:
            self.compute_capability = capability


H100 = StandInDevice("gpu", "NVIDIA H100 80GB HBM3", "cuda 12090", "9.0")
A100 = StandInDevice("gpu", "NVIDIA A100-SXM4-80GB", "cuda 12090", "8.0")
MI300X = StandInDevice("gpu", "AMD Instinct MI300X", "rocm 7.0")


@pytest.mark.parametrize("device, want", [
    (H100, target.Target("cuda", 9.0)),
    (A100, target.Target("cuda", 8.0)),
    (MI300X, target.Target("rocm")),
    (StandInDevice("cuda", "NVIDIA H100 80GB HBM3", capability="9.0"), target.Target("cuda", 9.0)),
    (StandInDevice("rocm", "AMD Instinct MI300X"), target.Target("rocm")),
    (StandInDevice("tpu", "TPU v6 lite"), target.Target("tpu")),
])
def test_a_device_is_described_by_its_platform_and_compute_capability(device, want):
    assert target.describe(device) == want


def test_outside_any_target_the_process_default_device_is_the_target():
    assert target.current() == target.Target("cpu")
    with jax.default_device(jax.devices()[3]):
        assert target.current() == target.Target("cpu")


@pytest.fixture
def recorded(monkeypatch):
    """The kernels a trace reaches, each replaced by a stand-in that records its name (the cuDNN
    ones cannot be traced without cuDNN); the agreement checks fail the test if they run."""
    calls = []

    def record(name, out):
        def kernel(*args, **kwargs):
            calls.append(name)
            return out(*args, **kwargs)
        return kernel

    monkeypatch.setattr(kv, "cudnn_attend_pages", record("cudnn paged", lambda q, *_: q))
    monkeypatch.setattr(kv, "attend_pages", record("page by page", lambda q, *_, **__: q))
    monkeypatch.setattr(kv, "pallas_attend_pages", record("pallas paged", lambda q, *_: q))
    monkeypatch.setattr(transformer, "_cudnn_causal", record("cudnn causal", lambda q, *_: q))
    monkeypatch.setattr(transformer, "_packed_attention",
                        record("block skipping", lambda q, *_: q))

    def no_check(*_):
        raise AssertionError("a compile-only target ran a kernel check")

    monkeypatch.setattr(kv, "_pages_agree", no_check)
    monkeypatch.setattr(transformer, "_cudnn_packed_agrees", no_check)
    return calls


def _trace_decode_step():
    pools = jax.eval_shape(lambda: tuple(kv.as_bits(p) for p in kv.empty_pages(CONFIG, 16, 8)))
    cache = KVCache(k=pools[0], v=pools[1], block_table=S((2, 4), jnp.int32),
                    lengths=S((2,), jnp.int32), dtype=CONFIG.jnp_dtype)
    forward_cached.trace(PARAMS, CONFIG, S((2, 1), jnp.int32), cache)
    return pools[0].dtype


def _trace_packed_logprobs():
    tokens = S((2, 256), jnp.int32)
    token_logprobs.trace(PARAMS, CONFIG, tokens, tokens, segment_lengths=S((2, 4), jnp.int32))


def test_a_deviceless_nvidia_compile_takes_the_gpu_kernels(recorded):
    with target.compiling_for(H100, compile_only=True) as where:
        assert where == target.Target("cuda", 9.0, compile_only=True)
        assert _trace_decode_step() == jnp.bfloat16  # the pools as floats, not their bits
        _trace_packed_logprobs()
        assert PrecisionConfig().compute_dtype == "bfloat16"
        assert RolloutSettings().serving_config(dataclasses.replace(CONFIG, dtype="float32")).dtype == "bfloat16"
    assert recorded == ["cudnn paged", "cudnn causal"]


def test_the_same_programs_compiled_for_this_cpu_take_the_cpu_kernels(recorded):
    # Traced after (and so beside) the GPU compile above in the same process: the target is
    # part of jit's cache key, so no GPU trace is reused here.
    with target.compiling_for(H100, compile_only=True):
        _trace_decode_step()
    recorded.clear()
    assert _trace_decode_step() == jnp.uint16  # 16-bit pools as their bits on CPU
    assert recorded == ["page by page"]
    with target.compiling_for(jax.devices()[1]):
        _trace_packed_logprobs()  # rows of 256 tokens on CPU: scored whole, no kernel
        assert PrecisionConfig().compute_dtype == "float32"
    assert recorded == ["page by page"]


def test_packed_rows_take_the_block_kernel_before_hopper_and_on_rocm(recorded):
    """Packed rows need cuDNN on Hopper or later; an A100's decode steps still read their pages
    by cuDNN's paged kernel, an MI300X's by the Pallas one."""
    for device in (A100, MI300X):
        with target.compiling_for(device, compile_only=True):
            _trace_decode_step()
            _trace_packed_logprobs()
    # The A100's decode step is cuDNN's, the MI300X's the Pallas kernel.
    assert recorded == ["cudnn paged", "block skipping", "pallas paged", "block skipping"]


def test_a_device_this_process_cannot_run_on_needs_compile_only():
    with pytest.raises(ValueError, match="compile_only=True"):
        with target.compiling_for(H100):
            pass


def test_the_trainers_mesh_and_the_samplers_params_name_the_target():
    from rstar2_jax.parallel.sharding import make_mesh

    mesh = make_mesh(devices=jax.devices()[4:6])
    with target.compiling_for_mesh(mesh) as where:
        assert jax.config.jax_default_device is jax.devices()[4]
        assert where == target.current() == target.Target("cpu")
    params = jax.device_put(np.zeros(3), jax.devices()[5])
    with target.compiling_for_arrays({"w": params}):
        assert jax.config.jax_default_device is jax.devices()[5]


def test_a_train_step_for_a_compile_only_target_is_made_without_running_there():
    # The optimizer state's shardings come from a state of placeholders that optax builds
    # eagerly: on a device this process cannot run on, that would fail.
    from rstar2_jax.parallel.sharding import make_mesh, param_specs
    from rstar2_jax.train.configs import OptimizerConfig
    from rstar2_jax.train.optim import make_optimizer
    from rstar2_jax.train.step import state_shardings

    mesh = make_mesh(devices=jax.devices()[:2])
    optimizer = make_optimizer(OptimizerConfig(), total_steps=10)
    with target.compiling_for(H100, compile_only=True):
        shardings = state_shardings(optimizer, PARAMS, mesh, param_specs(CONFIG, mesh))
    assert shardings.params["embed"].mesh is mesh


def _primitives(jaxpr, counts):
    """What the program runs, counted through every sub-program: primitives by name, Pallas
    kernels by theirs, and loops that hold an online softmax (the block kernel's forward)."""
    from jax.extend.core import jaxprs_in_params

    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name if eqn.primitive.name != "pallas_call" else str(eqn.params["name"])] += 1
        for sub in jaxprs_in_params(eqn.params):
            inner = _primitives(sub, collections.Counter())
            if eqn.primitive.name == "while" and inner["reduce_max"]:
                counts["online softmax loop"] += 1
            counts.update(inner)
    return counts


@pytest.mark.parametrize("device, forward", [
    (H100, "dot_product_attention_fwd_wrapper"),  # cuDNN's packed kernel
    (StandInDevice("tpu", "TPU v6 lite"), "splash_mha_fwd_segmented_residuals"),
    (MI300X, "online softmax loop"),  # the block kernel's forward
])
def test_without_remat_the_backward_reuses_the_attention_kernels_forward(monkeypatch, device, forward):
    """The layer loop's body runs the kernel's forward once in the gradient; with remat (each
    layer rerun whole) once more in the backward. Rows of 1,024 tokens: the block kernel's on
    the MI300X (and on CPU, where shorter rows are scored whole)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    # JAX's cuDNN wrapper asks the process (no GPU here) for cuDNN and the compute capability.
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: float(capability) <= 9.0)
    monkeypatch.setattr(cudnn, "is_cuda_compute_capability_equal", lambda capability: float(capability) == 9.0)
    forwards = {}
    for remat in (False, True):
        def loss(params, tokens, segment_lengths):
            return token_logprobs(params, CONFIG, tokens, tokens, segment_lengths=segment_lengths,
                                  remat=remat).sum()

        with target.compiling_for(device, compile_only=True):
            jaxpr = jax.make_jaxpr(jax.grad(loss))(PARAMS, S((2, 1024), jnp.int32), S((2, 4), jnp.int32)).jaxpr
        forwards[remat] = _primitives(jaxpr, collections.Counter())[forward]
    assert forwards == {False: 1, True: 2}
