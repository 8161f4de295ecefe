"""Shards keep images as bytes and nodes get back the very float32 values."""
import numpy as np

from dml_app.models.samples import pack, unpack


def test_images_from_bytes_are_stored_as_bytes_and_come_back_the_same():
    raw = np.random.default_rng(0).integers(0, 256, (50, 28, 28, 1), dtype=np.uint8)
    x = (raw / 255.0).astype(np.float32)  # what the controller makes of uint8 images
    stored = pack(x)
    assert stored.dtype == np.uint8 and np.array_equal(stored, raw) and stored.nbytes * 4 == x.nbytes
    assert unpack(stored).dtype == np.float32 and np.array_equal(unpack(stored), x)


def test_other_samples_are_stored_as_they_are():
    for x in [np.array([[0.5, 0.25]], dtype=np.float32),  # not k/255
              np.array([[2.0]], dtype=np.float32),  # beyond 1
              np.array([[-1 / 255]], dtype=np.float32),
              np.zeros((0, 3), dtype=np.float32)]:
        assert pack(x) is x and unpack(x) is x
    ints = np.array([[1, 2]], dtype=np.int64)
    assert pack(ints) is ints and unpack(ints) is ints
