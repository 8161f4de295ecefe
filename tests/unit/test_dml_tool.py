"""Dataset splits and conf validation (before anything starts)."""
import json

import numpy as np
import pytest

from controller.confs.confs import load_dataset, load_structure, structure_confs
from controller.confs.datasets import load_digits, split_dirichlet, split_iid, write_shards
from controller.model.topology import load_links
from worker.api.errors import ConfigError


def test_iid_split_covers_everything_once():
    parts = split_iid(103, 8, np.random.default_rng(0))
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(103)) and max(map(len, parts)) - min(map(len, parts)) <= 1


def test_dirichlet_is_seeded_skewed_and_complete():
    labels = np.repeat(np.arange(10), 100)
    a = split_dirichlet(labels, 5, 0.1, np.random.default_rng(1))
    b = split_dirichlet(labels, 5, 0.1, np.random.default_rng(1))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert sorted(np.concatenate(a).tolist()) == list(range(1000))
    dominant = [np.bincount(labels[p], minlength=10).max() / len(p) for p in a]
    assert max(dominant) > 0.3  # low alpha: some node is dominated by a few labels
    with pytest.raises(ConfigError):
        split_dirichlet(labels, 5, 0.0, np.random.default_rng(1))


def test_shards_and_manifest(tmp_path):
    manifest = write_shards(load_digits(), ["a", "b", "c"], str(tmp_path), seed=3)
    assert manifest["n_features"] == 64 and manifest["n_classes"] == 10 and manifest["input_shape"] == [8, 8, 1]
    total = sum(s["train_samples"] for s in manifest["shards"].values())
    assert total == len(load_digits().x_train)
    with np.load(tmp_path / "a.npz", allow_pickle=False) as f:
        assert f["x_train"].shape[1:] == (8, 8, 1) and f["x_train"].max() <= 1.0
    assert json.loads((tmp_path / "manifest.json").read_text())["shards"]["b"]["sha256"]


def _files(tmp_path, structure, links=None):
    (tmp_path / "links.json").write_text(json.dumps(links or {"n1": [{"dest": "n2", "bw": "1mbit"}],
                                                              "n2": [{"dest": "n1", "bw": "1mbit"}]}))
    (tmp_path / "s.json").write_text(json.dumps(structure))
    return load_links(str(tmp_path / "links.json")), str(tmp_path / "s.json")


def test_structure_confs_connect_out_neighbours(tmp_path):
    topo, path = _files(tmp_path, {"sync": 3, "node_list": [{"name": "n1", "epoch": 2}, {"name": "n2"}]})
    confs = structure_confs(load_structure(path, topo), topo, {"n1": "10.0.0.2", "n2": "10.0.0.3"})
    assert confs["n1"]["connect"] == {"n2": "10.0.0.3:4444"} and confs["n1"]["epoch"] == 2
    assert confs["n2"]["epoch"] == 1 and confs["n2"]["sync"] == 3 and confs["n2"]["role"] == "gossip"
    assert confs["n1"]["wait_policy"] == "adaptive" and confs["n1"]["wait_s"] == 10.0


def test_each_gossip_node_is_told_who_sends_to_it(tmp_path):
    links = {"n1": [{"dest": "n2", "bw": "1mbit"}, {"dest": "n3", "bw": "1mbit"}],
             "n2": [{"dest": "n3", "bw": "1mbit"}], "n3": []}
    topo, path = _files(tmp_path, {"sync": 3, "wait_policy": "fixed",
                                   "node_list": [{"name": "n1"}, {"name": "n2"}, {"name": "n3"}]}, links)
    confs = structure_confs(load_structure(path, topo), topo, {"n1": "10.0.0.2", "n2": "10.0.0.3", "n3": "10.0.0.4"})
    assert {n: c["senders"] for n, c in confs.items()} == {"n1": [], "n2": ["n1"], "n3": ["n1", "n2"]}
    assert confs["n3"]["wait_policy"] == "fixed"


@pytest.mark.parametrize("structure,problem", [
    ({"node_list": [{"name": "n1"}]}, "'sync'"),
    ({"sync": 0, "node_list": [{"name": "n1"}]}, "'sync'"),
    ({"sync": True, "node_list": [{"name": "n1"}]}, "'sync'"),
    ({"sync": 2, "node_list": [{"name": "n9"}]}, "'n9'"),
    ({"sync": 2, "node_list": [{"name": "n1"}, {"name": "n1"}]}, "twice"),
    ({"sync": 2, "node_list": [{"epoch": 1}]}, "'name'"),
    ({"sync": 2, "node_list": ["n1"]}, "node_list[0]"),
    ({"sync": 2, "node_list": []}, "no node"),
    ({"sync": 2, "model": {"kind": "jax"}, "node_list": [{"name": "n1"}]}, "jax"),
    ({"sync": 2, "wait_policy": "eager", "node_list": [{"name": "n1"}]}, "'wait_policy'"),
])
def test_bad_structures(tmp_path, structure, problem):
    topo, path = _files(tmp_path, structure)
    with pytest.raises(ConfigError) as err:
        load_structure(path, topo)
    assert "s.json" in str(err.value) and problem in str(err.value)


@pytest.mark.parametrize("dataset,problem", [({"dataset": "cifar"}, "'dataset'"), ({"split": "random"}, "'split'"),
                                             ({"batch_size": 0}, "'batch_size'"), ({"seed": "1"}, "'seed'")])
def test_bad_datasets(tmp_path, dataset, problem):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(dataset))
    with pytest.raises(ConfigError, match=problem):
        load_dataset(str(path))


def _idx(path, array):
    import gzip
    import struct as st

    data = bytes([0, 0, 8, array.ndim]) + st.pack(f">{array.ndim}I", *array.shape) + array.astype(np.uint8).tobytes()
    with gzip.open(path, "wb") as f:
        f.write(data)


def test_mnist_like_from_idx_and_npz(tmp_path):
    from controller.confs.datasets import load_mnist_like

    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (6, 28, 28)), rng.integers(0, 10, 6)
    for stem, arr in (("train-images-idx3-ubyte", images), ("train-labels-idx1-ubyte", labels),
                      ("t10k-images-idx3-ubyte", images[:2]), ("t10k-labels-idx1-ubyte", labels[:2])):
        _idx(tmp_path / f"{stem}.gz", arr)
    d = load_mnist_like("mnist", str(tmp_path))
    assert d.x_train.shape == (6, 28, 28, 1) and d.x_train.max() <= 1.0 and list(d.y_train) == list(labels)
    np.testing.assert_allclose(d.x_train[..., 0], images / 255.0, rtol=1e-6)
    assert d.x_test.shape == (2, 28, 28, 1)

    other = tmp_path / "npz"
    other.mkdir()
    np.savez(other / "fashion_mnist.npz", x_train=images, y_train=labels, x_test=images[:1], y_test=labels[:1])
    assert load_mnist_like("fashion_mnist", str(other)).x_test.shape == (1, 28, 28, 1)

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x09\x01" + b"\x00" * 8)
    with pytest.raises(ConfigError):
        load_mnist_like("mnist", str(tmp_path / "bad"))


def test_digits_read_from_the_packaged_file_equal_scikit_learns():
    """The digits are read from scikit-learn's own data file without importing it (a second at
    every run's start): the same pixels and labels as ``sklearn.datasets.load_digits``."""
    import numpy as np
    from sklearn.datasets import load_digits as sk_digits

    from controller.confs.datasets import digits_arrays

    pixels, labels = digits_arrays()
    reference = sk_digits()
    assert np.array_equal(pixels, reference.data) and np.array_equal(labels, reference.target)
