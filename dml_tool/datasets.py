"""Datasets and how they are split across nodes.

Loaders: scikit-learn's bundled ``digits`` (the embedded default: no download),
and MNIST / Fashion-MNIST from local IDX files or an ``.npz`` under dataset/.
Splits: IID or Dirichlet(alpha) over labels, seeded. Shards are written as
``dataset/<name>/<node>.npz`` (``x_train, y_train, x_test, y_test``, no pickle)
with a ``manifest.json`` describing them.
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

from worker.errors import ConfigError

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


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's 8x8 digits (1,797 images, shipped with the package), scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sk_digits

    data = sk_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
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
