"""Evaluation on the global test set: per round on the node, and of the final models after the run."""
import json
import os
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file
from sklearn.datasets import load_digits

from controller.results import evaluate
from dml_app.models.global_test import load_global_test
from dml_app.models.make import make_model
from dml_app.models.numpy.mlp import NumpyMLP
from dml_app.roles.base import Context, Role, RoundRecord
from dml_app.roles.etree import ETreeRole
from dml_app.runtime.events import EventLog, read_events
from dml_app.wire import weights as wire

RUN = "20260101-000000-abcd"
MODEL_CONF = {"kind": "numpy", "hidden": [32], "learning_rate": 0.01, "seed": 3}


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return x[:1200], y[:1200], x[1200:1500], y[1200:1500]  # train, and a global set of 300


def _trained(digits, epochs=3):
    model = make_model(MODEL_CONF, 64, 10)
    model.train(digits[0], digits[1], epochs=epochs)
    return model


def _workdir(tmp_path, digits, nodes):
    """An experiment dir with a global set and each node's final weights (node -> bytes)."""
    os.makedirs(tmp_path / "dataset", exist_ok=True)
    np.savez(tmp_path / "dataset" / "global_test.npz", x=digits[2], y=digits[3])
    for node, body in nodes.items():
        d = tmp_path / "dml_file" / "node" / node
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{RUN}.weights").write_bytes(body)
    run_dir = tmp_path / "dml_file" / "log" / RUN
    run_dir.mkdir(parents=True, exist_ok=True)
    structure = {n: {"role": "gossip", "model": MODEL_CONF} for n in nodes}
    dconfs = {n: {"n_classes": 10, "global_test": "dataset/global_test.npz"} for n in nodes}
    return str(run_dir), structure, dconfs


def test_final_models_evaluated_on_the_global_set_and_saved_as_safetensors(tmp_path, digits):
    model = _trained(digits)
    loss, accuracy = model.evaluate(digits[2], digits[3])
    assert accuracy > 0.85  # a real model, trained a little
    run_dir, structure, dconfs = _workdir(tmp_path, digits, {"n1": wire.encode(model.get_weights(), {"from": "n1"})})
    out = evaluate.final_models(str(tmp_path), run_dir, RUN, structure, dconfs)
    assert out["n1"]["error"] is None
    assert out["n1"]["global_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert out["n1"]["global_loss"] == pytest.approx(loss, abs=1e-5)
    path = out["n1"]["model"]
    assert path == os.path.join(run_dir, "models", "n1.safetensors")
    tensors = load_file(path)  # the ecosystem's own loader
    assert sorted(tensors) == ["layers.0.bias", "layers.0.kernel", "layers.1.bias", "layers.1.kernel"]
    assert tensors["layers.0.kernel"].shape == (64, 32) and tensors["layers.1.bias"].dtype == np.float32
    arrays, meta = evaluate.load_safetensors(path)  # round trip: same arrays, same order
    assert len(arrays) == len(model.get_weights()) and all(np.array_equal(a, b) for a, b in zip(arrays,
                                                                                             model.get_weights()))
    assert meta["node"] == "n1" and meta["run_id"] == RUN and json.loads(meta["sizes"]) == [64, 32, 10]
    again = make_model(json.loads(meta["model"]), 64, 10)
    again.set_weights(arrays)
    assert again.evaluate(digits[2], digits[3]) == (loss, accuracy)


def test_bad_weight_files_are_refused_one_node_at_a_time(tmp_path, digits):
    good = wire.encode(_trained(digits, 1).get_weights())
    other_shape = wire.encode(NumpyMLP([64, 16, 10]).get_weights())
    nan = _trained(digits, 1).get_weights()
    nan[1][0] = np.nan
    bodies = {"good": good, "truncated": good[:-10], "garbage": b"\x00\x00\x00\x05hello world",
              "header_lies": b"\xff" * 8 + b"{}", "shape": other_shape, "nan": wire.encode(nan)}
    run_dir, structure, dconfs = _workdir(tmp_path, digits, bodies)
    structure["missing"] = structure["good"]
    # a link a node planted towards a file it should not make the controller read
    link_dir = tmp_path / "dml_file" / "node" / "linked"
    link_dir.mkdir(parents=True)
    os.symlink(tmp_path / "dml_file" / "node" / "good" / f"{RUN}.weights", link_dir / f"{RUN}.weights")
    structure["linked"] = structure["good"]
    os.symlink(tmp_path / "dml_file" / "node" / "good", tmp_path / "dml_file" / "node" / "dirlink")
    structure["dirlink"] = structure["good"]  # a linked directory on the way is not followed either
    out = evaluate.final_models(str(tmp_path), run_dir, RUN, structure, dconfs, max_bytes=len(good))
    assert out["good"]["error"] is None and out["good"]["global_accuracy"] > 0.5
    for node, words in {"truncated": "runs past the end", "garbage": "not a valid weights file",
                        "header_lies": "does not fit", "shape": "do not fit the model", "nan": "NaN",
                        "missing": "no final weights", "linked": "symbolic link", "dirlink": "symbolic link"}.items():
        assert words in (out[node]["error"] or ""), (node, out[node])
        assert out[node]["model"] is None and out[node]["global_accuracy"] is None
    assert sorted(os.listdir(os.path.join(run_dir, "models"))) == ["good.safetensors"]
    small = evaluate.final_models(str(tmp_path), run_dir, RUN, {"good": structure["good"]}, dconfs,
                                  max_bytes=len(good) - 1)
    assert "more than the" in small["good"]["error"]


def test_without_a_global_set_models_are_saved_and_accuracy_is_null(tmp_path, digits):
    run_dir, structure, dconfs = _workdir(tmp_path, digits, {"n1": wire.encode(_trained(digits, 1).get_weights())})
    out = evaluate.final_models(str(tmp_path), run_dir, RUN, structure, {"n1": {"n_classes": 10}})
    assert out["n1"]["global_accuracy"] is None and out["n1"]["error"] is None and os.path.exists(out["n1"]["model"])


def test_global_set_outside_the_workdir_is_refused(tmp_path, digits):
    run_dir, structure, dconfs = _workdir(tmp_path, digits, {"n1": wire.encode(_trained(digits, 1).get_weights())})
    out = evaluate.final_models(str(tmp_path), run_dir, RUN, structure,
                                {"n1": {"n_classes": 10, "global_test": "../../etc/passwd"}})
    assert "outside the experiment directory" in out["n1"]["error"]


def test_load_global_test_refuses_what_does_not_fit(tmp_path, digits):
    def npz(name, **arrays):
        np.savez(tmp_path / name, **arrays)
        return str(tmp_path / name)

    x, y = load_global_test(npz("ok.npz", x=digits[2].reshape(-1, 8, 8), y=digits[3]), 64, 10)
    assert x.shape == (300, 64) and x.dtype == np.float32 and y.dtype == np.int64
    cases = {"no_y.npz": dict(x=digits[2]), "features.npz": dict(x=digits[2][:, :10], y=digits[3]),
             "labels.npz": dict(x=digits[2], y=digits[3] + 5), "counts.npz": dict(x=digits[2], y=digits[3][:5]),
             "objects.npz": dict(x=np.array([{"a": 1}] * 3, dtype=object), y=np.zeros(3, dtype=np.int64))}
    words = {"no_y.npz": "needs arrays x and y", "features.npz": r"samples of shape \(10,\)", "labels.npz": "labels",
             "counts.npz": "the same count", "objects.npz": "cannot be read"}
    for name, arrays in cases.items():
        with pytest.raises(ValueError, match=words[name]):
            load_global_test(npz(name, **arrays), 64, 10)
    (tmp_path / "not.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="cannot be read"):
        load_global_test(str(tmp_path / "not.npz"), 64, 10)


def test_round_events_carry_global_accuracy(tmp_path, digits):
    model = _trained(digits, 2)
    events = EventLog(str(tmp_path / "n1.jsonl"), RUN, "n1")
    lines = []
    data = (digits[0][:100], digits[1][:100], digits[0][100:130], digits[1][100:130])
    ctx = Context("n1", model, data, {"sync": 2}, {}, events, lambda msg, **f: lines.append((msg, f)),
                  global_test=(digits[2], digits[3]))
    role = Role(ctx)
    loss, accuracy = role.evaluate()
    role.record_round(RoundRecord(1, 0.0, {"loss": 0.5, "train_s": 0.1}, loss, accuracy, 0.0, 0))
    ctx.global_test = None  # a node without a global set: nulls
    role.record_round(RoundRecord(2, 0.0, {"loss": 0.5, "train_s": 0.1}, *role.evaluate(), 0.0, 0))
    first, second = [e for e in read_events(events.path) if e["type"] == "round"]
    g_loss, g_acc = model.evaluate(digits[2], digits[3])
    assert first["global_accuracy"] == g_acc and first["global_loss"] == g_loss and first["accuracy"] == accuracy
    assert second["global_accuracy"] is None and second["global_loss"] is None
    assert "global accuracy" in lines[0][0] and lines[0][1]["global_accuracy"] == g_acc
    assert lines[0][1]["layer"] is None and lines[0][1]["round"] == 1 and lines[0][1]["bytes_sent"] == 0
    ctx.conf = {"sync": 2, "positions": [{"layer": 2, "parent": None, "children": ["n1"], "sync": 2}]}
    role = ETreeRole(ctx)
    role.round_events = 2
    for _ in range(2):  # E-tree: progress counts rounds per layer (the event keeps the node's counter)
        role.record_round(RoundRecord(role.round_events + 1, 0.0, {"loss": 0.5, "train_s": 0.1}, *role.evaluate(),
                                      0.0, 0, {"layer": 2}))
    assert lines[-1][0].startswith("layer 2 round 2:") and lines[-1][1]["round"] == 2 and lines[-1][1]["layer"] == 2
    assert [e["round"] for e in read_events(events.path) if e.get("layer") == 2] == [3, 4]


def test_the_wire_format_is_safetensors_both_ways(digits):
    from safetensors.numpy import load, save

    model = _trained(digits, 1)
    arrays = model.get_weights()
    body = wire.encode(arrays, {"from": "n1", "round": 4, "samples": 180})
    tensors = load(body)  # the package reads what nodes send
    assert sorted(tensors) == ["0000", "0001", "0002", "0003"]
    assert all(np.array_equal(tensors[f"{i:04d}"], a) for i, a in enumerate(arrays))
    # and nodes read what the package writes (with the format's metadata)
    written = save({f"{i:04d}": a for i, a in enumerate(arrays)},
                   metadata={"format": "edgetb-weights", "version": "2", "meta": json.dumps({"from": "n2"})})
    back, meta = wire.decode(written)
    assert meta == {"from": "n2"} and len(back) == len(arrays)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, back))
    # a safetensors file of another program is refused (no edgetb metadata), never half-read
    with pytest.raises(wire.WeightsFormatError, match="version"):
        wire.decode(save({"weight": arrays[0]}))


def test_encode_makes_one_copy_and_keeps_arrays_intact():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    body = wire.encode([a, a.T, np.array(1.5)])  # a transposed view is sent in C order
    back, _ = wire.decode(body)
    assert np.array_equal(back[1], a.T) and back[2].shape == () and back[2] == 1.5
    back[0][0, 0] = 99  # decoded arrays are the receiver's own
    assert a[0, 0] == 0 and wire.decode(body)[0][0][0, 0] == 0


def test_a_deep_weights_header_is_that_nodes_error(tmp_path, digits):
    """A header of 5,000 ``[`` used to raise RecursionError out of final_models: no model was
    written for any node."""
    header = b"[" * 5000
    run_dir, structure, dconfs = _workdir(tmp_path, digits, {
        "good": wire.encode(_trained(digits, 1).get_weights()), "deep": struct.pack("<Q", len(header)) + header})
    out = evaluate.final_models(str(tmp_path), run_dir, RUN, structure, dconfs)
    assert out["good"]["error"] is None and out["good"]["model"]
    assert "nested deeper than" in out["deep"]["error"] and out["deep"]["model"] is None
