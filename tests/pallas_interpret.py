"""Running the Pallas TPU kernels the model uses on CPU, in Pallas' interpret modes.

Splash attention runs under JAX's HLO interpreter (`splash_interpret`). Ragged paged attention
needs the TPU interpreter (its DMAs, semaphores and strided loads), which in JAX 0.10.2 lacks
two things the kernel relies on, added here for the duration of `ragged_interpret` only (the
kernel itself runs unchanged):

- a load through a reshaped or bitcast view of a scratch buffer (the kernel reshapes its page
  buffer to [tokens x heads, head dim] and, for bfloat16, reads it as uint32 words): the
  interpreter's `get` takes only index transforms. Here the buffer is read up to the first
  view and the views and indices after it are applied to that copy; a bitcast to a wider
  dtype packs consecutive rows of the second-minor axis into one word, low bits first (the
  TPU's sublane packing, which the kernel's unpacking `b << 16` / `b & 0xFFFF0000` assumes);
- a masked store to a window whose first axis is longer than a later one: the interpreter's
  bounds check masks the first axis by every axis' extent and reports an out-of-bounds store.
  Here a masked store is done as a read, `where(mask, new, old)` and an unmasked store.
"""
from __future__ import annotations

import contextlib

import numpy as np
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _tpu_interpreter
from jax._src.pallas.mosaic.interpret import utils as _interpreter_utils
from jax._src.state import types as _state
from jax.experimental.pallas import tpu as pltpu

_VIEWS = (_state.ReshapeTransform, _state.BitcastTransform)


def _apply(x: np.ndarray, transform) -> np.ndarray:
    if isinstance(transform, _state.ReshapeTransform):
        return x.reshape(transform.shape)
    if isinstance(transform, _state.BitcastTransform):
        wide = np.dtype(transform.dtype)
        pack, rest = divmod(wide.itemsize, x.dtype.itemsize)
        assert pack >= 1 and not rest and x.ndim >= 2, (x.shape, x.dtype, wide)
        bits = x.view(f"uint{8 * x.dtype.itemsize}").astype(np.uint64)
        bits = bits.reshape(*x.shape[:-2], x.shape[-2] // pack, pack, x.shape[-1])
        words = sum(bits[..., i, :] << np.uint64(8 * x.dtype.itemsize * i) for i in range(pack))
        return words.astype(f"uint{8 * wide.itemsize}").view(wide)
    return x[_interpreter_utils.to_range([transform])]


def _patched(get, swap):
    def get_through_views(token, device_id, local_core_id, memory_space, buffer_id, transforms,
                          *args, **kwargs):
        views = [i for i, t in enumerate(transforms) if isinstance(t, _VIEWS)]
        if not views:
            return get(token, device_id, local_core_id, memory_space, buffer_id, transforms,
                       *args, **kwargs)
        token, x = get(token, device_id, local_core_id, memory_space, buffer_id,
                       tuple(transforms[:views[0]]), *args, **kwargs)
        for transform in transforms[views[0]:]:
            x = _apply(x, transform)
        return token, np.ascontiguousarray(x)

    def swap_masked_by_where(token, device_id, local_core_id, memory_space, buffer_id,
                             transforms, val, mask, *args, **kwargs):
        if mask is None:
            return swap(token, device_id, local_core_id, memory_space, buffer_id, transforms,
                        val, mask, *args, **kwargs)
        token, old = get_through_views(token, device_id, local_core_id, memory_space, buffer_id,
                                       transforms)
        mask, val = np.asarray(mask), np.asarray(val)
        token, _ = swap(token, device_id, local_core_id, memory_space, buffer_id, transforms,
                        np.where(mask, val, old), None, *args, **kwargs)
        return token, np.where(mask, old, val)

    # The interpreter's DMAs call the undecorated functions.
    get_through_views.__wrapped__ = get.__wrapped__
    swap_masked_by_where.__wrapped__ = swap.__wrapped__
    return get_through_views, swap_masked_by_where


@contextlib.contextmanager
def ragged_interpret():
    """Pallas TPU kernels traced inside run in the TPU interpreter, with the two additions
    above (for ragged paged attention)."""
    get, swap = _tpu_interpreter.get, _tpu_interpreter.swap
    _tpu_interpreter.get, _tpu_interpreter.swap = _patched(get, swap)
    try:
        with pltpu.force_tpu_interpret_mode():
            yield
    finally:
        _tpu_interpreter.get, _tpu_interpreter.swap = get, swap


def splash_interpret():
    """Pallas TPU kernels traced inside run in JAX's HLO interpreter (splash attention; the
    TPU interpreter of JAX 0.10.2 fails on its batched grid)."""
    return pltpu.force_tpu_interpret_mode(True)
