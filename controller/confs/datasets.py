"""Datasets and how they are split across nodes.

Loaders: scikit-learn's bundled ``digits`` (the embedded default: no download),
and MNIST / Fashion-MNIST from local IDX files or an ``.npz`` under dataset/.
Splits: IID or Dirichlet(alpha) over labels, seeded. EdgeTB's per-node format
instead cuts the data into equal 1-based shards and gives each node windows of
consecutive shards (``Shards``, ``edgetb_sources``, ``write_windows``; EdgeTB's own
``images_<i>.npy`` / ``labels_<i>.npy`` files are used as they are). Shards are
written as ``dataset/<name>/<node>.npz`` (``x_train, y_train, x_test, y_test``, no
pickle) with a ``manifest.json`` describing them, and the global test set as
``dataset/<name>/global_test.npz`` (``x``, ``y``).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from worker.api.errors import ConfigError

SHARD_VERSION = 1


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def n_features(self) -> int:
        return int(np.prod(self.x_train.shape[1:]))

    @property
    def n_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (pixels 0-16, labels): read from the file the package ships
    (``datasets/data/digits.csv.gz``, one image and its label per row) without importing
    scikit-learn, which costs about a second; through scikit-learn when the file is not there."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz") \
        if spec and spec.origin else ""
    if os.path.isfile(path):
        rows = np.loadtxt(path, delimiter=",")
        return rows[:, :-1], rows[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sk_digits

    data = sk_digits()
    return data.data, data.target.astype(np.int64)


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's 8x8 digits (1,797 images, shipped with the package), scaled to [0, 1]."""
    pixels, y = digits_arrays()
    x = (pixels / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return Dataset("digits", x[train], y[train], x[test], y[test])


def _read_idx(path: str) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[:2] != b"\0\0" or data[2] != 8:
        raise ConfigError(f"{path}: not an IDX file of unsigned bytes")
    ndim = data[3]
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise ConfigError(f"{path}: {body.size} values, header says {dims}")
    return body.reshape(dims)


def _find(directory: str, stem: str) -> str:
    for name in (stem, stem + ".gz"):
        if os.path.exists(os.path.join(directory, name)):
            return os.path.join(directory, name)
    raise ConfigError(f"{directory}: missing {stem}[.gz]")


def load_mnist_like(name: str, directory: str) -> Dataset:
    """MNIST or Fashion-MNIST from ``directory``: ``<name>.npz`` (x_train, y_train, x_test,
    y_test) or the four IDX files (train-images-idx3-ubyte[.gz], ...)."""
    npz = os.path.join(directory, f"{name}.npz")
    if os.path.exists(npz):
        with np.load(npz, allow_pickle=False) as f:
            parts = [f[k] for k in ("x_train", "y_train", "x_test", "y_test")]
    else:
        parts = [_read_idx(_find(directory, stem)) for stem in (
            "train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")]
    x_train, y_train, x_test, y_test = parts
    scale = lambda a: (a.reshape(len(a), -1) / 255.0).astype(np.float32)  # noqa: E731
    return Dataset(name, scale(x_train), y_train.astype(np.int64), scale(x_test), y_test.astype(np.int64))


def load(name: str, directory: str = "dataset") -> Dataset:
    if name == "digits":
        return load_digits()
    if name in ("mnist", "fashion_mnist", "fashion-mnist"):
        return load_mnist_like(name.replace("-", "_"), os.path.join(directory, name.replace("-", "_")))
    raise ConfigError(f"unknown dataset {name!r}: use digits, mnist or fashion_mnist")


def split_iid(n_samples: int, n_parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle and cut into ``n_parts`` nearly equal parts."""
    return [np.sort(p) for p in np.array_split(rng.permutation(n_samples), n_parts)]


def split_dirichlet(labels: np.ndarray, n_parts: int, alpha: float, rng: np.random.Generator,
                    min_size: int = 2) -> list[np.ndarray]:
    """Per class, share its samples among parts by Dirichlet(alpha) proportions; redraw
    until every part has at least ``min_size`` samples (lower alpha = more skewed)."""
    if alpha <= 0:
        raise ConfigError(f"dirichlet alpha must be > 0, got {alpha}")
    for _ in range(100):
        parts: list[list[int]] = [[] for _ in range(n_parts)]
        for cls in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == cls))
            cuts = (np.cumsum(rng.dirichlet([alpha] * n_parts)) * len(idx)).astype(int)[:-1]
            for part, chunk in zip(parts, np.split(idx, cuts)):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
    raise ConfigError(f"could not give each of {n_parts} nodes {min_size} samples with alpha={alpha}")


def write_shards(dataset: Dataset, nodes: Sequence[str], out_dir: str, split: str = "iid",
                 alpha: float = 0.5, seed: int = 0, test_split: str = "iid",
                 sizes: Optional[dict[str, int]] = None) -> dict:
    """Split train (by ``split``) and test (IID) sets over ``nodes``; write shards and manifest."""
    rng = np.random.default_rng(seed)
    if split == "iid":
        train_parts = split_iid(len(dataset.x_train), len(nodes), rng)
    elif split == "dirichlet":
        train_parts = split_dirichlet(dataset.y_train, len(nodes), alpha, rng)
    else:
        raise ConfigError(f"unknown split {split!r}: use iid or dirichlet")
    test_parts = split_iid(len(dataset.x_test), len(nodes), rng)
    os.makedirs(out_dir, exist_ok=True)
    shards = {}
    for node, tr, te in zip(nodes, train_parts, test_parts):
        if sizes and node in sizes:
            tr = tr[: sizes[node]]
        path = os.path.join(out_dir, f"{node}.npz")
        np.savez(path, x_train=dataset.x_train[tr], y_train=dataset.y_train[tr],
                 x_test=dataset.x_test[te], y_test=dataset.y_test[te])
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        shards[node] = {"file": f"{node}.npz", "train_samples": int(len(tr)), "test_samples": int(len(te)),
                        "labels": np.bincount(dataset.y_train[tr], minlength=dataset.n_classes).tolist(),
                        "sha256": digest}
    manifest = {"version": SHARD_VERSION, "dataset": dataset.name, "split": split, "alpha": alpha if split == "dirichlet" else None,
                "seed": seed, "n_features": dataset.n_features, "n_classes": dataset.n_classes, "shards": shards}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def load_shard(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    with np.load(path, allow_pickle=False) as f:
        return f["x_train"], f["y_train"], f["x_test"], f["y_test"]


# EdgeTB's per-node format: consecutive 1-based shards ------------------------------------------
def _as_features(images: np.ndarray) -> np.ndarray:
    """Images as float32 rows: integers (EdgeTB's uint8 pixels) scaled to [0, 1]."""
    rows = images.reshape(len(images), -1)
    if np.issubdtype(rows.dtype, np.integer):
        return (rows / 255.0).astype(np.float32)
    return rows.astype(np.float32)


def _as_labels(labels: np.ndarray) -> np.ndarray:
    """Integer class labels (one-hot rows become their index)."""
    if labels.ndim == 2:
        labels = labels.argmax(axis=1)
    return labels.reshape(-1).astype(np.int64)


class Shards:
    """A sequence of shards numbered from 1 (EdgeTB's ``*_start_index``)."""

    description = ""

    def count(self) -> int:
        raise NotImplementedError

    def shard(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def take(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Shards ``start .. start + length - 1`` concatenated."""
        parts = [self.shard(i) for i in range(start, start + length)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


class ArrayShards(Shards):
    """Arrays cut into equal shards of ``shard_size`` samples, in order; the remainder is unused."""

    def __init__(self, x: np.ndarray, y: np.ndarray, shard_size: int, what: str) -> None:
        self.x, self.y, self.size = x, y, shard_size
        self.description = f"{what}: {len(x)} samples, {self.count()} shards of {shard_size}"

    def count(self) -> int:
        return len(self.x) // self.size

    def shard(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        lo = (index - 1) * self.size
        return self.x[lo:lo + self.size], self.y[lo:lo + self.size]


class FileShards(Shards):
    """EdgeTB's shard files ``images_<i>.npy`` / ``labels_<i>.npy`` (i = 1, 2, ...) of a directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        n = 0
        while os.path.exists(self._path("images", n + 1)) and os.path.exists(self._path("labels", n + 1)):
            n += 1
        self.n = n
        self.description = f"{directory}: {n} shard files"

    def _path(self, kind: str, index: int) -> str:
        return os.path.join(self.directory, f"{kind}_{index}.npy")

    @staticmethod
    def present(directory: str) -> bool:
        return os.path.exists(os.path.join(directory, "images_1.npy"))

    def count(self) -> int:
        return self.n

    def shard(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        try:
            images = np.load(self._path("images", index), allow_pickle=False)
            labels = np.load(self._path("labels", index), allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self.directory}: shard {index}: cannot read: {e}") from None
        if len(images) != len(labels):
            raise ConfigError(f"{self.directory}: shard {index}: {len(images)} images but {len(labels)} labels")
        return _as_features(images), _as_labels(labels)

    def n_classes(self) -> int:
        return max(int(self.shard(i)[1].max(initial=0)) for i in range(1, self.n + 1)) + 1 if self.n else 0


def edgetb_sources(name: str, directory: str, shard_size: int) -> tuple[Shards, Shards, int]:
    """(train shards, test shards, number of classes) for ``name``.

    EdgeTB's own shard files are used as they are when present: ``<directory>/<name>/train_data/``
    and ``test_data/`` (EdgeTB's layout), else ``<directory>/<name>/`` for both. Otherwise the
    dataset is loaded and its train and test splits cut into shards of ``shard_size``.
    """
    base = os.path.join(directory, name)
    train_dir, test_dir = os.path.join(base, "train_data"), os.path.join(base, "test_data")
    if FileShards.present(train_dir):
        train = FileShards(train_dir)
        test = FileShards(test_dir) if FileShards.present(test_dir) else train
    elif FileShards.present(base):
        train = test = FileShards(base)
    else:
        dataset = load(name, directory)
        return (ArrayShards(dataset.x_train, dataset.y_train, shard_size, f"{name} train split"),
                ArrayShards(dataset.x_test, dataset.y_test, shard_size, f"{name} test split"),
                dataset.n_classes)
    n_classes = max(train.n_classes(), test.n_classes() if test is not train else 0)
    return train, test, n_classes


def write_windows(train: Shards, test: Shards, windows: dict[str, dict[str, int]], out_dir: str,
                  n_classes: int, name: str, shard_size: int) -> dict:
    """Write ``<node>.npz`` from each node's train and test windows (checked beforehand); manifest too."""
    os.makedirs(out_dir, exist_ok=True)
    shards = {}
    for node, w in windows.items():
        x_tr, y_tr = train.take(w["train_start_index"], w["train_len"])
        x_te, y_te = test.take(w["test_start_index"], w["test_len"])
        path = os.path.join(out_dir, f"{node}.npz")
        np.savez(path, x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)
        shards[node] = {"file": f"{node}.npz", "train_samples": int(len(y_tr)), "test_samples": int(len(y_te)),
                        "labels": np.bincount(y_tr, minlength=n_classes).tolist(), "windows": w}
    manifest = {"version": SHARD_VERSION, "dataset": name, "format": "edgetb", "shard_size": shard_size,
                "train": train.description, "test": test.description, "n_classes": n_classes, "shards": shards}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


GLOBAL_TEST_FILE = "global_test.npz"


def write_global_test(x: np.ndarray, y: np.ndarray, out_dir: str) -> str:
    """Write the global test set ``global_test.npz`` (``x``, ``y``; no pickle); returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, GLOBAL_TEST_FILE)
    np.savez(path, x=np.asarray(x, dtype=np.float32), y=np.asarray(y, dtype=np.int64))
    return path
