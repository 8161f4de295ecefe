"""The user's own data (an .npz, a data module), CIFAR-10's binary files, and shapes kept from
the source to the shards, the global test set and the manifest."""
from __future__ import annotations

import json
import os
import sys
import types
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest

from controller.confs import datasets
from controller.confs.confs import dataset_confs, load_dataset
from controller.confs.datasets import FileShards, load, load_cifar10, load_digits, read_cifar10_batch
from dml_app.models.samples import unpack
from worker.api.errors import ConfigError

RECORD = 3073


@contextmanager
def loaded(path, allow_pickle: bool = False) -> Iterator[dict]:
    """A shard or global test file's arrays as a node takes them (images scaled back from bytes)."""
    with np.load(path, allow_pickle=allow_pickle) as f:
        yield {k: unpack(f[k]) if k.startswith("x") else f[k] for k in f.files}


def _settings(tmp_path, data: dict) -> dict:
    (tmp_path / "d.json").write_text(json.dumps(data))
    return load_dataset(str(tmp_path / "d.json"))


def _npz(path, **arrays) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


def _images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 5, 4), dtype=np.uint8), rng.integers(0, 3, n)


# the user's .npz -------------------------------------------------------------------------------
def test_npz_images_keep_their_shape_through_shards_and_global_test(tmp_path):
    x, y = _images(30)
    _npz(tmp_path / "data" / "mine.npz", x_train=x[:24], y_train=y[:24], x_test=x[24:], y_test=y[24:])
    confs = dataset_confs(_settings(tmp_path, {"dataset": "data/mine.npz", "global_test_size": 4}), ["a", "b"],
                          str(tmp_path))
    shards = f"dataset/{datasets.source_name('data/mine.npz')}"
    assert shards.startswith("dataset/mine-") and datasets.source_name("other/mine.npz") not in shards
    assert confs["a"]["shard"] == f"{shards}/a.npz" and confs["a"]["n_classes"] == 3
    manifest = json.loads((tmp_path / shards / "manifest.json").read_text())
    assert manifest["input_shape"] == [5, 4, 1] and manifest["n_features"] == 20 and manifest["dataset"].startswith("mine-")
    seen = []
    for node in ("a", "b"):
        with loaded(tmp_path / confs[node]["shard"], allow_pickle=False) as s:
            assert s["x_train"].shape[1:] == (5, 4, 1) and s["x_train"].dtype == np.float32
            assert s["x_test"].shape[1:] == (5, 4, 1)
            for xi, yi in zip(s["x_train"], s["y_train"]):  # each sample is one of the file's, scaled by 1/255
                match = [i for i in range(24) if np.allclose(xi[..., 0], x[i] / 255.0, atol=1e-7)]
                assert match and y[match[0]] == yi
                seen.append(match[0])
    assert sorted(seen) == list(range(24))  # IID: every training sample once
    with loaded(tmp_path / confs["a"]["global_test"], allow_pickle=False) as g:
        assert g["x"].shape == (4, 5, 4, 1)
        np.testing.assert_allclose(g["x"][..., 0], x[24:28] / 255.0, rtol=1e-6)
        np.testing.assert_array_equal(g["y"], y[24:28])


def test_npz_float_features_kept_and_one_hot_labels(tmp_path):
    x = np.arange(40, dtype=np.float64).reshape(10, 4) * 0.5 - 3.0  # feature data: (n, F), not scaled
    y = np.eye(4)[[0, 1, 2, 3, 0, 1, 2, 3, 3, 2]]
    _npz(tmp_path / "f.npz", x_train=x[:8], y_train=y[:8], x_test=x[8:], y_test=y[8:])
    d = load("f.npz", str(tmp_path / "dataset"), str(tmp_path))
    assert d.x_train.dtype == np.float32 and d.x_train.shape == (8, 4) and d.input_shape == [4]
    assert d.x_train[1, 2] == 0.5 * 6 - 3.0 and d.x_test[1, 3] == 0.5 * 39 - 3.0
    assert d.y_train.tolist() == [0, 1, 2, 3, 0, 1, 2, 3] and d.y_test.tolist() == [3, 2]
    assert d.y_train.dtype == np.int64 and d.n_classes == 4


def test_npz_dirichlet_split_of_colour_images(tmp_path):
    rng = np.random.default_rng(2)
    x, y = rng.random((200, 6, 6, 3), dtype=np.float32), np.repeat(np.arange(4), 50)
    _npz(tmp_path / "c.npz", x_train=x[:160], y_train=y[:160], x_test=x[160:], y_test=y[160:])
    confs = dataset_confs(_settings(tmp_path, {"dataset": "c.npz", "split": "dirichlet", "alpha": 0.3}),
                          ["a", "b", "c"], str(tmp_path))
    total = 0
    for node in "abc":
        with loaded(tmp_path / confs[node]["shard"], allow_pickle=False) as s:
            assert s["x_train"].shape[1:] == (6, 6, 3)
            for xi, yi in zip(s["x_train"], s["y_train"]):
                i = int(np.flatnonzero((x[:160] == xi).all(axis=(1, 2, 3)))[0])
                assert y[i] == yi
            total += len(s["y_train"])
    assert total == 160


def test_npz_in_edgetb_windows(tmp_path):
    x, y = _images(50, seed=3)
    _npz(tmp_path / "data" / "e.npz", x_train=x[:40], y_train=y[:40], x_test=x[40:], y_test=y[40:])
    data = {"n1": {"train_len": 1, "train_start_index": 4, "test_len": 2, "test_start_index": 1},
            "_settings": {"dataset": "data/e.npz", "shard_size": 5}}
    confs = dataset_confs(_settings(tmp_path, data), ["n1"], str(tmp_path))
    assert confs["n1"]["shard"] == f"dataset/{datasets.source_name('data/e.npz')}/n1.npz"
    with loaded(tmp_path / confs["n1"]["shard"], allow_pickle=False) as s:
        np.testing.assert_allclose(s["x_train"][..., 0], x[15:20] / 255.0, rtol=1e-6)  # shard 4
        np.testing.assert_array_equal(s["y_test"], y[40:50])
    manifest = json.loads((tmp_path / os.path.dirname(confs["n1"]["shard"]) / "manifest.json").read_text())
    assert manifest["input_shape"] == [5, 4, 1] and manifest["n_features"] == 20


@pytest.mark.parametrize("arrays,words", [
    (lambda x, y: {"x_train": x, "y_train": y}, "missing arrays x_test, y_test"),
    (lambda x, y: {"x_train": x, "y_train": y, "x_test": x}, "missing array y_test"),
    (lambda x, y: {"x_train": x, "y_train": y[:-1], "x_test": x, "y_test": y}, "x_train has 10 samples but y_train 9"),
    (lambda x, y: {"x_train": x.astype(str), "y_train": y, "x_test": x, "y_test": y}, "x_train: expected numbers"),
    (lambda x, y: {"x_train": np.where(np.arange(10)[:, None, None] == 7, np.nan, x / 255.0), "y_train": y,
                   "x_test": x, "y_test": y}, "x_train: NaN or infinite values (or beyond float32), first at sample 7"),
    (lambda x, y: {"x_train": x, "y_train": y, "x_test": np.full((10, 5, 4), np.inf), "y_test": y},
     "x_test: NaN or infinite"),
    (lambda x, y: {"x_train": x, "y_train": np.where(np.arange(10) == 3, -1, y), "x_test": x, "y_test": y},
     "y_train: negative label -1 at sample 3"),
    (lambda x, y: {"x_train": x, "y_train": y, "x_test": x[:, :4, :4], "y_test": y},
     "x_train's samples are of shape (5, 4, 1) but x_test's (4, 4, 1)"),
    (lambda x, y: {"x_train": x, "y_train": y + 0.5, "x_test": x, "y_test": y}, "labels must be whole numbers"),
    (lambda x, y: {"x_train": x, "y_train": np.full((10, 3), 0.5), "x_test": x, "y_test": y}, "one-hot rows"),
])
def test_npz_problems_are_named(tmp_path, arrays, words):
    x, y = _images(10)
    _npz(tmp_path / "bad.npz", **arrays(x, y))
    with pytest.raises(ConfigError) as e:
        dataset_confs(_settings(tmp_path, {"dataset": "bad.npz"}), ["a"], str(tmp_path))
    assert "bad.npz" in e.value.message and words in e.value.message, e.value.message
    assert not (tmp_path / "dataset").exists()  # nothing written


def test_npz_is_never_unpickled(tmp_path):
    x, y = _images(4)
    np.savez(tmp_path / "obj.npz", x_train=np.array([x, "a"], dtype=object), y_train=y, x_test=x, y_test=y)
    with pytest.raises(ConfigError, match="obj.npz: cannot read as .npz.*pickle"):
        load("obj.npz", str(tmp_path / "dataset"), str(tmp_path))


def test_npz_confined_to_the_experiment_directory(tmp_path):
    outside, work = tmp_path / "outside", tmp_path / "exp"
    x, y = _images(6)
    _npz(outside / "o.npz", x_train=x, y_train=y, x_test=x, y_test=y)
    work.mkdir()
    for value, words in (("/etc/o.npz", "absolute path"), ("../outside/o.npz", "'..'"),
                         ("data/../../outside/o.npz", "'..'")):
        with pytest.raises(ConfigError) as e:
            _settings(work, {"dataset": value})
        assert "d.json" in e.value.message and "'dataset'" in e.value.message and words in e.value.message
    os.symlink(outside / "o.npz", work / "link.npz")
    os.symlink(outside, work / "dir")
    for value in ("link.npz", "dir/o.npz"):
        with pytest.raises(ConfigError, match="a symbolic link leads it out of the experiment directory"):
            dataset_confs(_settings(work, {"dataset": value}), ["a"], str(work))
    (work / "dataset").mkdir()  # the same rule for a built-in data set's files
    os.symlink(outside, work / "dataset" / "mnist")
    with pytest.raises(ConfigError, match="a symbolic link leads it out of the experiment directory.*bind-mount"):
        dataset_confs(_settings(work, {"dataset": "mnist"}), ["a"], str(work))
    with pytest.raises(ConfigError, match="'absent.npz': no such file in the experiment directory"):
        dataset_confs(_settings(work, {"dataset": "absent.npz"}), ["a"], str(work))
    os.symlink(work / "real.npz", work / "inside.npz")  # a link that stays inside is fine
    _npz(work / "real.npz", x_train=x, y_train=y, x_test=x, y_test=y)
    assert dataset_confs(_settings(work, {"dataset": "inside.npz"}), ["a"], str(work))["a"]["train_samples"] == 6


# a data module -----------------------------------------------------------------------------------
MODULE_SOURCE = "open('IMPORTED', 'w').write('yes')\ndef load():\n    raise SystemExit\n"


def test_data_module_runs_through_the_loader_never_imported(tmp_path):
    (tmp_path / "my_data.py").write_text(MODULE_SOURCE)
    x, y = _images(12)
    calls = []

    def loader(path: str, function: str):
        calls.append((path, function))
        return x[:9], y[:9], x[9:], y[9:]

    settings = _settings(tmp_path, {"dataset": {"module": "my_data.py"}, "batch_size": 4})
    assert settings["format"] == "settings" and settings["dataset"] == {"module": "my_data.py", "function": "load"}
    confs = dataset_confs(settings, ["a", "b"], str(tmp_path), module_loader=loader)
    assert calls == [(os.path.realpath(tmp_path / "my_data.py"), "load")]
    assert not (tmp_path / "IMPORTED").exists() and "my_data" not in sys.modules
    assert confs["a"]["shard"] == f"dataset/{datasets.source_name({'module': 'my_data.py'})}/a.npz"
    assert confs["a"]["shard"].startswith("dataset/my_data-") and confs["a"]["batch_size"] == 4
    with loaded(tmp_path / confs["b"]["global_test"], allow_pickle=False) as g:
        np.testing.assert_allclose(g["x"][..., 0], x[9:] / 255.0, rtol=1e-6)
        np.testing.assert_array_equal(g["y"], y[9:])

    calls.clear()
    other = _settings(tmp_path, {"dataset": {"module": "my_data.py", "function": "cifar_like"}})
    dataset_confs(other, ["a"], str(tmp_path), module_loader=loader)
    assert calls[0][1] == "cifar_like"


def test_data_module_results_checked_like_an_npz(tmp_path):
    (tmp_path / "m.py").write_text("")
    x, y = _images(5)
    settings = _settings(tmp_path, {"dataset": {"module": "m.py"}})
    for result, words in (((x, y, x), "returned 3 values, expected (x_train, y_train, x_test, y_test)"),
                          ("text", "returned str"),
                          ((x, y, x, -y - 1), "y_test: negative label"),
                          ({"x_train": x, "y_train": y, "x_test": x}, "missing array y_test"),
                          ((x, y[:3], x, y), "x_train has 5 samples but y_train 3")):
        with pytest.raises(ConfigError) as e:
            dataset_confs(settings, ["a"], str(tmp_path), module_loader=lambda p, f, r=result: r)
        assert "data module m.py (load())" in e.value.message and words in e.value.message, e.value.message

    def failing(path, function):
        raise RuntimeError("no such file: /data/raw.csv")

    with pytest.raises(ConfigError, match=r"m.py \(load\(\)\): failed: RuntimeError: no such file"):
        dataset_confs(settings, ["a"], str(tmp_path), module_loader=failing)


def test_data_module_confined_and_checked_before_it_runs(tmp_path):
    def never(path, function):
        raise AssertionError("the loader must not run")

    for value, words in (({"module": "/tmp/m.py"}, "absolute path"), ({"module": "../m.py"}, "'..'"),
                         ({"module": "m.txt"}, "must be a .py file"), ({"module": "m.py", "function": "a b"},
                                                                       "Python function name"),
                         ({"modul": "m.py"}, "did you mean 'module'?"), ({}, "missing field 'module'")):
        with pytest.raises(ConfigError) as e:
            _settings(tmp_path, {"dataset": value})
        assert "d.json" in e.value.message and words in e.value.message, e.value.message
    os.symlink("/etc/hostname", tmp_path / "m.py")
    with pytest.raises(ConfigError, match="data module 'm.py': a symbolic link leads it out of the experiment directory"):
        dataset_confs(_settings(tmp_path, {"dataset": {"module": "m.py"}}), ["a"], str(tmp_path), module_loader=never)


def test_default_loader_is_the_sandbox_one_imported_lazily(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text("")
    x, y = _images(4)
    calls = []
    fake = types.ModuleType("controller.sandbox")
    fake.load_data_module = lambda path, function, workdir: calls.append((path, function, workdir)) or (x, y, x, y)
    monkeypatch.setitem(sys.modules, "controller.sandbox", fake)
    dataset_confs(_settings(tmp_path, {"dataset": {"module": "m.py", "function": "get"}}), ["a"], str(tmp_path))
    assert calls == [(os.path.realpath(tmp_path / "m.py"), "get", str(tmp_path))]  # the experiment directory


def test_data_module_in_edgetb_windows(tmp_path):
    (tmp_path / "m.py").write_text("")
    x, y = _images(40, seed=4)
    data = {"n1": {"train_len": 2, "train_start_index": 2, "test_len": 1, "test_start_index": 1},
            "_settings": {"dataset": {"module": "m.py"}, "shard_size": 10, "global_test_size": 5}}
    confs = dataset_confs(_settings(tmp_path, data), ["n1"], str(tmp_path),
                          module_loader=lambda p, f: (x[:30], y[:30], x[30:], y[30:]))
    with loaded(tmp_path / confs["n1"]["shard"], allow_pickle=False) as s:
        np.testing.assert_allclose(s["x_train"][..., 0], x[10:30] / 255.0, rtol=1e-6)  # shards 2 and 3
        np.testing.assert_array_equal(s["y_test"], y[30:40])


# CIFAR-10's binary version ---------------------------------------------------------------------
def _pixel(k: int, ch: int, r: int, c: int) -> int:
    return (7 * k + 50 * ch + 3 * r + c) % 256


def _cifar_records(labels: list[int], first: int = 0) -> bytes:
    """Records by hand: a label byte, then red, green and blue planes, each 32 rows of 32 bytes."""
    out = bytearray()
    for k, label in enumerate(labels, start=first):
        out.append(label)
        for ch in range(3):
            for r in range(32):
                for c in range(32):
                    out.append(_pixel(k, ch, r, c))
    return bytes(out)


def _write_cifar(directory, per_batch: int = 2, test: int = 3) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    labels = {}
    for i in range(1, 6):
        labels[i] = [(i + j) % 10 for j in range(per_batch)]
        (directory / f"data_batch_{i}.bin").write_bytes(_cifar_records(labels[i], first=100 * i))
    labels["test"] = [9, 0, 4][:test]
    (directory / "test_batch.bin").write_bytes(_cifar_records(labels["test"], first=600))
    return labels


def test_cifar10_pixels_land_where_they_belong(tmp_path):
    _write_cifar(tmp_path / "x", per_batch=1)
    x, y = read_cifar10_batch(str(tmp_path / "x" / "data_batch_3.bin"))
    assert x.shape == (1, 32, 32, 3) and x.dtype == np.float32 and y.tolist() == [3]
    for r, c, ch in ((0, 0, 0), (0, 1, 0), (1, 0, 0), (31, 31, 2), (5, 17, 1), (17, 5, 2)):
        assert x[0, r, c, ch] == np.float32(_pixel(300, ch, r, c) / 255.0), (r, c, ch)
    # by hand: 7 * 300 = 2100 = 52 mod 256; red 52, green 52 + 50, blue 52 + 100 at row 0, column 0
    assert (x[0, 0, 0] * 255).round().tolist() == [52, 102, 152]
    assert round(float(x[0, 2, 3, 1]) * 255) == 52 + 50 + 3 * 2 + 3  # green, row 2, column 3


@pytest.mark.parametrize("inner", ["", "cifar-10-batches-bin"])
def test_cifar10_from_either_layout_in_order(tmp_path, inner):
    labels = _write_cifar(tmp_path / "dataset" / "cifar10" / inner if inner else tmp_path / "dataset" / "cifar10")
    d = load("cifar10", str(tmp_path / "dataset"))
    assert d.name == "cifar10" and d.x_train.shape == (10, 32, 32, 3) and d.x_test.shape == (3, 32, 32, 3)
    assert d.y_train.tolist() == [v for i in range(1, 6) for v in labels[i]] and d.y_test.tolist() == [9, 0, 4]
    assert d.x_train[3, 4, 5, 2] == np.float32(_pixel(201, 2, 4, 5) / 255.0)  # batch 2's second record
    assert d.x_test[2, 31, 0, 0] == np.float32(_pixel(602, 0, 31, 0) / 255.0)


def test_cifar10_named_both_ways_in_both_formats(tmp_path):
    _write_cifar(tmp_path / "dataset" / "cifar10", per_batch=4)
    confs = dataset_confs(_settings(tmp_path, {"dataset": "cifar-10", "global_test_size": 2}), ["a", "b"],
                          str(tmp_path))
    assert confs["a"]["shard"] == "dataset/cifar10/a.npz" and confs["a"]["train_samples"] == 10
    with loaded(tmp_path / "dataset" / "cifar10" / "global_test.npz", allow_pickle=False) as g:
        assert g["x"].shape == (2, 32, 32, 3) and g["x"][1, 0, 1, 0] == np.float32(_pixel(601, 0, 0, 1) / 255.0)
    assert json.loads((tmp_path / "dataset" / "cifar10" / "manifest.json").read_text())["input_shape"] == [32, 32, 3]
    data = {"n1": {"train_len": 2, "train_start_index": 2, "test_len": 1, "test_start_index": 1},
            "_settings": {"dataset": "cifar10", "shard_size": 3, "global_test_size": 2}}
    confs = dataset_confs(_settings(tmp_path, data), ["n1"], str(tmp_path))
    with loaded(tmp_path / confs["n1"]["shard"], allow_pickle=False) as s:  # shards 2, 3: samples 3 .. 8
        assert s["x_train"].shape == (6, 32, 32, 3) and s["y_train"].tolist() == [4, 2, 3, 4, 5, 3]
        assert s["x_train"][0, 9, 8, 1] == np.float32(_pixel(103, 1, 9, 8) / 255.0)  # batch 1's fourth
        assert s["x_train"][1, 9, 8, 1] == np.float32(_pixel(200, 1, 9, 8) / 255.0)  # batch 2's first
    manifest = json.loads((tmp_path / "dataset" / "cifar10" / "manifest.json").read_text())
    assert manifest["input_shape"] == [32, 32, 3] and manifest["n_features"] == 3072


def test_cifar10_refuses_a_partial_record(tmp_path):
    labels = _write_cifar(tmp_path / "dataset" / "cifar10", per_batch=1)
    assert labels
    (tmp_path / "dataset" / "cifar10" / "data_batch_4.bin").write_bytes(_cifar_records([1, 2])[:-1])
    with pytest.raises(ConfigError) as e:
        load_cifar10(str(tmp_path / "dataset" / "cifar10"))
    assert "data_batch_4.bin: 6145 bytes, not a positive multiple of 3073" in e.value.message


def test_absent_data_names_directory_files_and_no_download(tmp_path):
    (tmp_path / "dataset").mkdir()
    with pytest.raises(ConfigError) as e:
        load("cifar10", str(tmp_path / "dataset"))
    m = e.value.message
    assert str(tmp_path / "dataset" / "cifar10") in m and "nothing is downloaded at run time" in m
    assert all(f"data_batch_{i}.bin" in m for i in range(1, 6)) and "test_batch.bin" in m
    _write_cifar(tmp_path / "dataset" / "cifar10")
    os.remove(tmp_path / "dataset" / "cifar10" / "data_batch_2.bin")
    with pytest.raises(ConfigError, match="missing data_batch_2.bin"):
        load("cifar10", str(tmp_path / "dataset"))
    for name in ("mnist", "fashion-mnist"):
        with pytest.raises(ConfigError) as e:
            load(name, str(tmp_path / "dataset"))
        m = e.value.message
        stem = name.replace("-", "_")
        assert str(tmp_path / "dataset" / stem) in m and f"{stem}.npz" in m and "nothing is downloaded" in m
        assert "train-images-idx3-ubyte" in m and "t10k-labels-idx1-ubyte" in m


# shapes kept elsewhere -----------------------------------------------------------------------------
def test_digits_are_8x8_single_channel_images():
    from sklearn.datasets import load_digits as sk_digits

    d = load_digits()
    assert d.x_train.shape == (1438, 8, 8, 1) and d.x_test.shape == (359, 8, 8, 1) and d.input_shape == [8, 8, 1]
    reference = sk_digits()
    ours = np.concatenate([d.x_train, d.x_test]).reshape(-1, 64)
    theirs = (reference.data / 16.0).astype(np.float32)
    np.testing.assert_array_equal(ours[np.lexsort(ours.T)], theirs[np.lexsort(theirs.T)])  # the same samples
    for k in (0, 100, 358):  # each image upright: rows of the picture are rows of the array
        j = int(np.flatnonzero((theirs == d.x_test[k].reshape(64)).all(axis=1))[0])
        np.testing.assert_array_equal(d.x_test[k, :, :, 0], (reference.images[j] / 16.0).astype(np.float32))
        assert reference.target[j] == d.y_test[k]


def test_edgetb_shard_files_keep_their_shape_and_refuse_a_mix(tmp_path):
    d = tmp_path / "S"
    d.mkdir()
    rng = np.random.default_rng(5)
    colour = rng.integers(0, 256, (3, 4, 4, 3), dtype=np.uint8)
    np.save(d / "images_1.npy", colour)
    np.save(d / "labels_1.npy", np.eye(2)[[0, 1, 1]])
    np.save(d / "images_2.npy", rng.integers(0, 256, (3, 4, 4), dtype=np.uint8))
    np.save(d / "labels_2.npy", np.array([1, 0, 1]))
    shards = FileShards(str(d))
    x, y = shards.take(1, 1)
    np.testing.assert_allclose(x, colour / 255.0, rtol=1e-6)
    assert y.tolist() == [0, 1, 1] and shards.shard(2)[0].shape == (3, 4, 4, 1)
    with pytest.raises(ConfigError, match=r"shard 2's samples are of shape \(4, 4, 1\), shard 1's \(4, 4, 3\)"):
        shards.take(1, 2)
