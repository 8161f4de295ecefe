"""Node-side pure logic: the weights format (never pickle), the numpy model, path confinement, events."""
import os
import json
import struct

import numpy as np
import pytest

from dml_app import weights
from dml_app.events import EventLog, read_events
from dml_app.http import HttpError
from dml_app.model_numpy import NumpyMLP


def test_weights_round_trip_keeps_dtype_shape_and_meta():
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1.5], dtype=np.float64),
              np.zeros((0, 3), dtype=np.float32), np.array(7, dtype=np.int64)]
    got, meta = weights.decode(weights.encode(arrays, {"from": "n1", "round": 3}))
    assert meta == {"from": "n1", "round": 3}
    for a, b in zip(arrays, got):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


META = {"format": "edgetb-weights", "version": "2", "meta": "{}"}


def _message(tensors: dict, payload: bytes = b"", meta: dict | None = META) -> bytes:
    header = {**({"__metadata__": meta} if meta is not None else {}), **tensors}
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload


def _f32(n: int, start: int = 0) -> dict:
    return {"dtype": "F32", "shape": [n], "data_offsets": [start, start + 4 * n]}


@pytest.mark.parametrize("data,problem", [
    (b"", "shorter"),
    (struct.pack("<Q", 10**9) + b"{}", "does not fit"),
    (_message({}, meta={**META, "version": "1"}), "version"),
    (_message({}, meta=None), "version"),
    (_message({"0000": {"dtype": "O", "shape": [1], "data_offsets": [0, 8]}}, b"x" * 8), "bad spec"),
    (_message({"0000": _f32(1000)}, b"x" * 8), "past the end"),
    (_message({"0000": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}), "not allowed"),
    (_message({"0000": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"x" * 4), "do not hold"),
    (_message({"0000": _f32(2), "0001": _f32(2, 4)}, b"x" * 12), "overlaps"),
    (_message({"0000": _f32(1), "0002": _f32(1, 4)}, b"x" * 8), "named 0000"),
    (_message({}, b"extra"), "unexpected bytes"),
    (_message({}, meta={**META, "meta": "{nope"}), "meta is not"),
    (struct.pack("<Q", 3) + b"abc", "not JSON"),
    (__import__("pickle").dumps([np.zeros(3)]), "header"),
])
def test_weights_reject_malformed_and_pickled_input(data, problem):
    with pytest.raises(weights.WeightsFormatError, match=problem):
        weights.decode(data)


def test_object_arrays_cannot_be_sent():
    with pytest.raises(weights.WeightsFormatError):
        weights.encode([np.array([{"a": 1}], dtype=object)])


def test_mlp_learns_separable_data_and_round_trips_weights():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 5)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    model = NumpyMLP([5, 16, 2], learning_rate=0.02, seed=1)
    before = model.evaluate(x, y)[1]
    model.train(x, y, epochs=20, batch_size=32)
    loss, acc = model.evaluate(x, y)
    assert acc > 0.95 and acc > before
    other = NumpyMLP([5, 16, 2], seed=2)
    other.set_weights(model.get_weights())
    assert other.evaluate(x, y)[1] == acc
    with pytest.raises(ValueError, match="shape"):
        other.set_weights([w.T for w in model.get_weights()])


def test_same_seed_same_start():
    a, b = NumpyMLP([4, 8, 3], seed=5), NumpyMLP([4, 8, 3], seed=5)
    assert all(np.array_equal(p, q) for p, q in zip(a.get_weights(), b.get_weights()))


def test_confined_paths(tmp_path):
    from dml_app.node import confined

    (tmp_path / "dataset").mkdir()
    assert confined(str(tmp_path), "dataset/a.npz") == str(tmp_path / "dataset" / "a.npz")
    for bad in ("../etc/passwd", "/etc/passwd", "dataset/../../x"):
        with pytest.raises(HttpError):
            confined(str(tmp_path), bad)


def test_event_log_lines(tmp_path):
    log = EventLog(str(tmp_path / "e.jsonl"), "run1", "n1")
    log.write("round", round=1, accuracy=0.5)
    log.write("done", rounds=1)
    with open(tmp_path / "e.jsonl", "a") as f:
        f.write('{"torn": ')
    events = read_events(str(tmp_path / "e.jsonl"))
    assert [e["type"] for e in events] == ["round", "done"]
    assert events[0]["run_id"] == "run1" and events[0]["node"] == "n1" and events[0]["v"] == 1


def test_rng_is_seeded_and_well_shaped():
    from dml_app.rand import Rng

    a, b = Rng(7), Rng(7)
    assert np.array_equal(a.standard_normal((3, 4)), b.standard_normal((3, 4)))
    normal = Rng(1).standard_normal(200_000)
    assert abs(normal.mean()) < 0.01 and abs(normal.std() - 1) < 0.01
    uniform = Rng(2).uniform(100_000)
    assert uniform.min() >= 0 and uniform.max() < 1 and abs(uniform.mean() - 0.5) < 0.01
    order = Rng(3).permutation(1000)
    assert sorted(order.tolist()) == list(range(1000)) and order.tolist() != list(range(1000))


def test_node_process_keeps_numpy_random_and_ssl_out():
    """The node's startup imports stay slim (each MiB counts at 500 nodes per host)."""
    import subprocess
    import sys as _sys

    code = ("import runpy, sys; sys.argv = ['dml_app.node', '--help']\n"
            "try:\n    runpy.run_module('dml_app.node', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in ('numpy.random', 'ssl', '_hashlib', 'importlib.metadata') if m in sys.modules))")
    out = subprocess.run([_sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip().splitlines()[-1] == "[]"
