"""Training batches are placed by `place_batch` (make_array_from_process_local_data) on 8 fake
CPU devices: one process holds every row, so the placed arrays are the batch, rows over fsdp."""
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rstar2_jax.parallel import sharding


def _batch(rows):
    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(0, 100, (rows, 5)).astype(np.int32),
            "mask": rng.random((rows, 5)) < 0.5,
            "advantages": rng.normal(size=rows).astype(np.float32)}


@pytest.mark.parametrize("fsdp, tp", [(8, 1), (4, 2), (1, 1)])
def test_placed_batch_is_the_batch_with_rows_over_fsdp(fsdp, tp):
    mesh = sharding.make_mesh(fsdp=fsdp, tp=tp)
    batch = _batch(16)
    placed = sharding.place_batch(batch, mesh)
    expected = NamedSharding(mesh, P("fsdp"))
    for name, x in batch.items():
        assert placed[name].dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(placed[name]), x)
        assert placed[name].sharding.is_equivalent_to(expected, x.ndim)
        # Device at fsdp position i holds rows [i * 16 / fsdp, (i + 1) * 16 / fsdp), all columns.
        per_device = 16 // fsdp
        for shard in placed[name].addressable_shards:
            i = int(np.argwhere(mesh.devices == shard.device)[0][0])
            np.testing.assert_array_equal(np.asarray(shard.data), x[i * per_device:(i + 1) * per_device])


def test_rows_that_do_not_split_over_fsdp_are_rejected():
    with pytest.raises(ValueError, match=r"'tokens' has 12 rows, which do not split over the 8 fsdp"):
        sharding.place_batch(_batch(12), sharding.make_mesh(fsdp=8))
    with pytest.raises(ValueError, match=r"has 6 rows, which do not split over the 4 fsdp"):
        sharding.place_batch(_batch(6), sharding.make_mesh(fsdp=4, tp=2))


def test_one_process_holds_every_row_of_a_global_batch():
    # Across processes `tests/test_multiprocess.py` checks the blocks; here there is one block.
    assert sharding.process_rows(16, sharding.make_mesh(fsdp=4, tp=2)) == slice(0, 16)
    with pytest.raises(ValueError, match=r"12 rows do not split over fsdp=8"):
        sharding.process_rows(12, sharding.make_mesh(fsdp=8))
