"""Datasets and how they are split across nodes.

Sources (``load``): scikit-learn's bundled ``digits`` (the embedded default: no download);
MNIST / Fashion-MNIST from local IDX files or ``<name>.npz`` under ``dataset/<name>/``;
CIFAR-10 from its official binary files under ``dataset/cifar10/``; the user's own ``.npz``
(``x_train, y_train, x_test, y_test``); and a user's data module, whose ``load()`` returns
those four arrays. A data module is user code: it is never imported here but run through
the ``module_loader`` callable the caller passes (by default
``controller.sandbox.load_data_module``, which runs it as an unprivileged process). Nothing
is downloaded at run time.

Every source's arrays pass the same checks (``checked_arrays``) and keep their per-sample
shape: images are float32 in [0, 1], channels last -- digits (n, 8, 8, 1), MNIST (n, 28, 28, 1),
CIFAR-10 (n, 32, 32, 3) -- and feature data stays (n, F); labels are int64 class indices.

Splits: IID or Dirichlet(alpha) over labels, seeded. EdgeTB's per-node format
instead cuts the data into equal 1-based shards and gives each node windows of
consecutive shards (``Shards``, ``edgetb_sources``, ``write_windows``; EdgeTB's own
``images_<i>.npy`` / ``labels_<i>.npy`` files are used as they are). Shards are
written as ``dataset/<name>/<node>.npz`` (``x_train, y_train, x_test, y_test``, no
pickle) with a ``manifest.json`` describing them (``input_shape`` and ``n_features``, its
product, among others), and the global test set as ``dataset/<name>/global_test.npz``
(``x``, ``y``).
"""
from __future__ import annotations

import difflib
import gzip
import hashlib
import io
import json
import os
import re
import stat
import struct
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from dml_app.models import samples
from worker.api.errors import ConfigError

SHARD_VERSION = 1
ARRAYS = ("x_train", "y_train", "x_test", "y_test")
MAX_CLASSES = 100_000
MNIST_LIKE = ("mnist", "fashion_mnist")
BUILTIN_NAMES = ("digits", "mnist", "fashion_mnist", "fashion-mnist", "cifar10", "cifar-10")
IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
CIFAR10_DIR = "cifar-10-batches-bin"
CIFAR10_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST = "test_batch.bin"
CIFAR10_RECORD_BYTES = 1 + 3 * 32 * 32
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")

ModuleLoader = Callable[[str, str], Any]
"""``module_loader(path, function)``: runs ``function`` of the data module at ``path`` (outside
this process) and returns its ``(x_train, y_train, x_test, y_test)``."""
Source = Union[str, Mapping[str, str]]


@dataclass
class Dataset:
    """A train and a test split; ``x`` float32 of any per-sample shape, ``y`` int64 class indices."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def input_shape(self) -> list[int]:
        return [int(d) for d in self.x_train.shape[1:]]

    @property
    def n_features(self) -> int:
        return int(np.prod(self.x_train.shape[1:]))

    @property
    def n_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


# Checks every source's arrays pass ------------------------------------------------------------
def _array(value: Any, what: str, key: str) -> np.ndarray:
    """``value`` as a numeric numpy array with one entry per sample."""
    try:
        a = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{what}: {key}: not an array of numbers ({e})") from None
    if a.dtype.kind not in "uif":
        raise ConfigError(f"{what}: {key}: expected numbers, got values of type {a.dtype}")
    if a.ndim == 0:
        raise ConfigError(f"{what}: {key}: a single value, expected one entry per sample")
    if len(a) == 0:
        raise ConfigError(f"{what}: {key}: no samples")
    return a


def _first_bad(mask: np.ndarray) -> int:
    """The index of the first sample where ``mask`` (samples first) holds a True."""
    return int(np.flatnonzero(mask.reshape(len(mask), -1).any(axis=1))[0])


def as_features(value: Any, what: str, key: str, scale_integers: bool = False) -> np.ndarray:
    """Samples as float32 keeping their shape: uint8 (any integer with ``scale_integers``)
    scaled by 1/255, other numbers kept; (n,) becomes (n, 1) and (n, H, W) images (n, H, W, 1)."""
    a = _array(value, what, key)
    if a.dtype == np.uint8 or scale_integers and a.dtype.kind in "ui":
        x = (a / 255.0).astype(np.float32)
    else:
        with np.errstate(over="ignore"):
            x = a.astype(np.float32)
    if not np.isfinite(x).all():
        raise ConfigError(f"{what}: {key}: NaN or infinite values (or beyond float32), first at sample "
                          f"{_first_bad(~np.isfinite(x))}")
    if x.ndim == 1:
        return x.reshape(len(x), 1)
    return x[..., np.newaxis] if x.ndim == 3 else x


def as_labels(value: Any, what: str, key: str) -> np.ndarray:
    """Integer class labels as int64: one per sample, or one-hot rows (their index)."""
    a = _array(value, what, key)
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise ConfigError(f"{what}: {key}: NaN or infinite labels, first at sample {_first_bad(~np.isfinite(a))}")
    if a.ndim == 2 and a.shape[1] == 1:
        a = a.reshape(-1)
    if a.ndim == 2:
        bad = ((a != 0) & (a != 1)).any(axis=1) | (a.sum(axis=1) != 1)
        if bad.any():
            raise ConfigError(f"{what}: {key}: one-hot rows must hold a single 1 and zeros, "
                              f"row {int(np.flatnonzero(bad)[0])} does not")
        a = a.argmax(axis=1)
    if a.ndim != 1:
        raise ConfigError(f"{what}: {key}: expected one label per sample (n,) or one-hot rows (n, classes), "
                          f"got shape {a.shape}")
    if a.dtype.kind == "f" and (a != np.round(a)).any():
        raise ConfigError(f"{what}: {key}: labels must be whole numbers, got {a[a != np.round(a)][0].item()!r} "
                          f"at sample {int(np.flatnonzero(a != np.round(a))[0])}")
    if (a < 0).any():
        i = int(np.flatnonzero(a < 0)[0])
        raise ConfigError(f"{what}: {key}: negative label {a[i].item()!r} at sample {i}; labels are classes 0, 1, ...")
    if a.max() >= MAX_CLASSES:
        raise ConfigError(f"{what}: {key}: label {a.max().item()!r}: at most {MAX_CLASSES} classes")
    return a.astype(np.int64)


def checked_arrays(arrays: Mapping[str, Any], what: str, name: str) -> Dataset:
    """A Dataset from ``x_train, y_train, x_test, y_test`` (``what`` names their file in errors):
    each present, numeric and finite, labels whole and >= 0, as many labels as samples, and the
    same per-sample shape in both splits."""
    missing = [k for k in ARRAYS if k not in arrays]
    if missing:
        raise ConfigError(f"{what}: missing array{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                          f"(expected {', '.join(ARRAYS)})")
    x_train, x_test = as_features(arrays["x_train"], what, "x_train"), as_features(arrays["x_test"], what, "x_test")
    y_train, y_test = as_labels(arrays["y_train"], what, "y_train"), as_labels(arrays["y_test"], what, "y_test")
    for x, y, split in ((x_train, y_train, "train"), (x_test, y_test, "test")):
        if len(x) != len(y):
            raise ConfigError(f"{what}: x_{split} has {len(x)} samples but y_{split} {len(y)} labels")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ConfigError(f"{what}: x_train's samples are of shape {x_train.shape[1:]} but x_test's "
                          f"{x_test.shape[1:]}: both splits need the same")
    return Dataset(name, x_train, y_train, x_test, y_test)


def read_npz(path: str, what: str, name: str) -> Dataset:
    """``x_train, y_train, x_test, y_test`` of an .npz (never unpickled), checked."""
    try:
        with np.load(path, allow_pickle=False) as f:
            if not hasattr(f, "files"):
                raise ConfigError(f"{what}: a single array, expected an .npz holding {', '.join(ARRAYS)}")
            missing = [k for k in ARRAYS if k not in f.files]
            if missing:
                raise ConfigError(f"{what}: missing array{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                                  f"(expected {', '.join(ARRAYS)}; the file has {', '.join(f.files) or 'none'})")
            arrays = {k: f[k] for k in ARRAYS}
    except ConfigError:
        raise
    except (OSError, ValueError, EOFError) as e:
        hint = " (object arrays need pickle, which is refused: save numbers)" if "pickle" in str(e) else ""
        raise ConfigError(f"{what}: cannot read as .npz: {e}{hint}") from None
    return checked_arrays(arrays, what, name)


# The experiment's own files ---------------------------------------------------------------------
def relative_path_problem(path: str) -> Optional[str]:
    """Why ``path`` cannot name a file inside the experiment directory (None: it can, as text)."""
    if not path:
        return "an empty path"
    if os.path.isabs(path):
        return "an absolute path; give a path relative to the experiment directory"
    if ".." in path.replace("\\", "/").split("/"):
        return "a path with '..'; it must stay inside the experiment directory"
    if "\0" in path:
        return "a path with a NUL character"
    return None


def confined(workdir: str, path: str, what: str) -> str:
    """The real path of the regular file ``path`` (relative to ``workdir``), refused when absolute,
    with '..', or leading out of ``workdir`` through a symbolic link."""
    problem = relative_path_problem(path)
    if problem:
        raise ConfigError(f"{what} {path!r}: {problem}")
    root = os.path.realpath(workdir)
    real = inside(root, os.path.join(root, path), f"{what} {path!r}")
    if any(os.path.commonpath([os.path.join(root, own), real]) == os.path.join(root, own)
           for own in ("dml_file", "dml_user")):
        raise ConfigError(f"{what} {path!r}: in the testbed's own dml_file/ or dml_user/")
    if not os.path.exists(real):
        raise ConfigError(f"{what} {path!r}: no such file in the experiment directory {root}")
    if not os.path.isfile(real):
        raise ConfigError(f"{what} {path!r}: not a regular file")
    return real


def inside(root: str, path: str, what: str) -> str:
    """The real path of ``path``, refused when a symbolic link leads it out of the experiment
    directory ``root`` (the rule for every data file the controller reads, built-in or the user's)."""
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ConfigError(f"{what}: a symbolic link leads it out of the experiment directory {root} (to {real}); "
                          f"data files are read only inside it: move or copy the data in, or bind-mount its "
                          f"directory there (mount --bind {os.path.dirname(real)} {root}/<dir>)")
    return real


def is_npz(source: Source) -> bool:
    return isinstance(source, str) and source.endswith(".npz")


def is_module(source: Source) -> bool:
    return isinstance(source, Mapping)


def builtin_name(source: Source) -> Optional[str]:
    """The canonical name of a bundled or downloadable dataset (None for other sources)."""
    if not isinstance(source, str):
        return None
    canonical = {"fashion-mnist": "fashion_mnist", "cifar-10": "cifar10"}
    return canonical.get(source, source) if source in BUILTIN_NAMES else None


def source_name(source: Source) -> str:
    """The directory under ``dataset/`` where the shards of ``source`` go: a dataset's name, or
    the stem of the user's .npz or data module (characters other than letters, digits, '_',
    '-' become '_') and a hash of its path."""
    if builtin_name(source):
        return builtin_name(source)  # type: ignore[return-value]
    if is_npz(source) or is_module(source):  # (the path's hash: a/x.npz and b/x.npz, data/cifar10.npz apart)
        path = str(source["module"] if is_module(source) else source)  # type: ignore[index]
        stem = re.sub(r"[^A-Za-z0-9_-]", "_", os.path.splitext(os.path.basename(path))[0])[:48] or "data"
        return f"{stem}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"
    return str(source).replace("-", "_")


def unknown_name_hint(name: str) -> str:
    """``; did you mean 'cifar10'?`` for a name close to a dataset's."""
    close = difflib.get_close_matches(name.lower(), BUILTIN_NAMES, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def load_module_data(workdir: str, module: Mapping[str, str], module_loader: Optional[ModuleLoader]) -> Dataset:
    """The four arrays ``module_loader`` returns for the user's data module, checked like an .npz
    (default loader: ``controller.sandbox.load_data_module``, which runs the module unprivileged)."""
    rel, function = module["module"], module.get("function") or "load"
    path = confined(workdir, rel, "data module")
    what = f"data module {rel} ({function}())"
    if module_loader is None:
        from controller.sandbox import load_data_module

        def module_loader(path: str, function: str) -> Any:  # the sandbox sees the experiment directory
            return load_data_module(path, function, workdir)
    try:
        result = module_loader(path, function)
    except ConfigError:
        raise
    except Exception as e:  # user code: whatever it raised is the user's to read
        raise ConfigError(f"{what}: failed: {type(e).__name__}: {e}") from None
    if isinstance(result, Mapping):
        arrays = result
    elif isinstance(result, (tuple, list)) and len(result) == 4:
        arrays = dict(zip(ARRAYS, result))
    else:
        got = f"{len(result)} values" if isinstance(result, (tuple, list)) else type(result).__name__
        raise ConfigError(f"{what}: returned {got}, expected (x_train, y_train, x_test, y_test)")
    return checked_arrays(arrays, what, source_name(module))


# Bundled and downloadable datasets --------------------------------------------------------------
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
    """scikit-learn's 8x8 digits (1,797 images, shipped with the package): (n, 8, 8, 1) in [0, 1]."""
    pixels, y = digits_arrays()
    x = (pixels / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return Dataset("digits", x[train], y[train], x[test], y[test])


MAX_DATA_FILE_BYTES = 4 << 30  # a data set's file (IDX, CIFAR-10 batch) larger than this is refused


def read_bounded(path: str, max_bytes: int = MAX_DATA_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (a link to a device or a pipe is refused, not read),
    at most ``max_bytes``; a ConfigError naming it otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path}: not a regular file")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ConfigError(f"{path}: larger than {max_bytes} bytes")
    return data


def _read_idx(path: str) -> np.ndarray:
    try:
        data = read_bounded(path)
        if path.endswith(".gz"):
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
                data = f.read(MAX_DATA_FILE_BYTES + 1)
    except (OSError, EOFError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    if len(data) < 4 or data[:2] != b"\0\0" or data[2] != 8:
        raise ConfigError(f"{path}: not an IDX file of unsigned bytes")
    ndim = data[3]
    if len(data) < 4 + 4 * ndim:
        raise ConfigError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise ConfigError(f"{path}: {body.size} values, header says {dims}")
    return body.reshape(dims)


def _idx_file(directory: str, stem: str) -> Optional[str]:
    for name in (stem, stem + ".gz"):
        if os.path.exists(os.path.join(directory, name)):
            return os.path.join(directory, name)
    return None


def absent(directory: str, looked_for: str) -> ConfigError:
    return ConfigError(f"{directory}: no data: looked for {looked_for}; nothing is downloaded at run time: "
                       f"put the files there before the run")


def load_mnist_like(name: str, directory: str) -> Dataset:
    """MNIST or Fashion-MNIST from ``directory``: ``<name>.npz`` (x_train, y_train, x_test,
    y_test) or the four IDX files (train-images-idx3-ubyte[.gz], ...); images (n, 28, 28, 1)."""
    npz = os.path.join(directory, f"{name}.npz")
    if os.path.exists(npz):
        return read_npz(npz, npz, name)
    files = [_idx_file(directory, stem) for stem in IDX_STEMS]
    if not any(files):
        raise absent(directory, f"{name}.npz or the IDX files {', '.join(s + '[.gz]' for s in IDX_STEMS)}")
    missing = [s + "[.gz]" for s, f in zip(IDX_STEMS, files) if f is None]
    if missing:
        raise absent(directory, f"{', '.join(IDX_STEMS)} (each maybe .gz), missing {', '.join(missing)}")
    parts = [_read_idx(f) for f in files]  # type: ignore[arg-type]
    return checked_arrays(dict(zip(ARRAYS, parts)), directory, name)


def read_cifar10_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One file of CIFAR-10's binary version: records of 1 label byte and 3072 pixel bytes
    (1024 red, 1024 green, 1024 blue, each 32x32 row-major) -> (n, 32, 32, 3) float32 / 255, labels."""
    data = read_bounded(path, 4 * 10_000 * CIFAR10_RECORD_BYTES)  # (a batch file holds 10,000)
    if not data or len(data) % CIFAR10_RECORD_BYTES:
        raise ConfigError(f"{path}: {len(data)} bytes, not a positive multiple of {CIFAR10_RECORD_BYTES} "
                          f"(CIFAR-10 records: 1 label byte and 3072 pixel bytes)")
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, CIFAR10_RECORD_BYTES)
    y = records[:, 0].astype(np.int64)
    if y.max() > 9:
        raise ConfigError(f"{path}: label {int(y.max())} at record {int(np.argmax(y > 9))}: CIFAR-10 has 10 classes")
    x = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return (x / 255.0).astype(np.float32), y


def load_cifar10(directory: str) -> Dataset:
    """CIFAR-10 from its official binary files in ``directory`` or its ``cifar-10-batches-bin/``."""
    names = (*CIFAR10_TRAIN, CIFAR10_TEST)
    inner = os.path.join(directory, CIFAR10_DIR)
    where = next((d for d in (directory, inner) if any(os.path.exists(os.path.join(d, n)) for n in names)), None)
    if where is None:
        raise absent(directory, f"{', '.join(names)} (here or in {CIFAR10_DIR}/, CIFAR-10's binary version)")
    missing = [n for n in names if not os.path.exists(os.path.join(where, n))]
    if missing:
        raise absent(where, f"{', '.join(names)}, missing {', '.join(missing)}")
    train = [read_cifar10_batch(os.path.join(where, n)) for n in CIFAR10_TRAIN]
    x_test, y_test = read_cifar10_batch(os.path.join(where, CIFAR10_TEST))
    return Dataset("cifar10", np.concatenate([t[0] for t in train]), np.concatenate([t[1] for t in train]),
                   x_test, y_test)


def load(source: Source, directory: str = "dataset", workdir: Optional[str] = None,
         module_loader: Optional[ModuleLoader] = None) -> Dataset:
    """The dataset ``source`` names: a dataset's name (files under ``directory``), an .npz path or
    a data module ``{"module": ..., "function": ...}`` (both relative to ``workdir``, default:
    the parent of ``directory``; the module run by ``module_loader``)."""
    workdir = workdir if workdir is not None else os.path.dirname(os.path.abspath(directory))
    if is_module(source):
        return load_module_data(workdir, source, module_loader)  # type: ignore[arg-type]
    if is_npz(source):
        return read_npz(confined(workdir, source, "dataset file"), str(source), source_name(source))  # type: ignore
    name = builtin_name(source)
    if name == "digits":
        return load_digits()
    folder, root = os.path.join(directory, name), os.path.realpath(workdir)
    if os.path.exists(folder):  # its files, as the user's: inside the experiment directory
        inside(root, folder, folder)
        for entry in os.scandir(folder) if os.path.isdir(folder) else ():
            inside(root, entry.path, entry.path)
    if name in MNIST_LIKE:
        return load_mnist_like(name, os.path.join(directory, name))
    if name == "cifar10":
        return load_cifar10(os.path.join(directory, name))
    raise ConfigError(f"unknown dataset {source!r}{unknown_name_hint(str(source))}: use digits, mnist, "
                      f"fashion_mnist, cifar10, a .npz file or a data module")


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
    """Split train (by ``split``) and test (IID) sets over ``nodes``; write shards (images as bytes,
    ``dml_app.models.samples``) and manifest."""
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
        np.savez(path, x_train=samples.pack(dataset.x_train[tr]), y_train=dataset.y_train[tr],
                 x_test=samples.pack(dataset.x_test[te]), y_test=dataset.y_test[te])
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        shards[node] = {"file": f"{node}.npz", "train_samples": int(len(tr)), "test_samples": int(len(te)),
                        "labels": np.bincount(dataset.y_train[tr], minlength=dataset.n_classes).tolist(),
                        "sha256": digest}
    manifest = {"version": SHARD_VERSION, "dataset": dataset.name, "split": split, "alpha": alpha if split == "dirichlet" else None,
                "seed": seed, "input_shape": dataset.input_shape, "n_features": dataset.n_features,
                "n_classes": dataset.n_classes, "shards": shards}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


# EdgeTB's per-node format: consecutive 1-based shards ------------------------------------------
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
        for i, p in zip(range(start, start + length), parts):
            if p[0].shape[1:] != parts[0][0].shape[1:]:
                raise ConfigError(f"{self.description}: shard {i}'s samples are of shape {p[0].shape[1:]}, "
                                  f"shard {start}'s {parts[0][0].shape[1:]}: all shards need the same")
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def input_shape(self) -> list[int]:
        """The per-sample shape (of the first shard)."""
        return [int(d) for d in self.shard(1)[0].shape[1:]] if self.count() else []


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
            labels_ = np.load(self._path("labels", index), allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self.directory}: shard {index}: cannot read: {e}") from None
        what = f"{self.directory}: shard {index}"
        x, y = as_features(images, what, f"images_{index}.npy", scale_integers=True), \
            as_labels(labels_, what, f"labels_{index}.npy")
        if len(x) != len(y):
            raise ConfigError(f"{what}: {len(x)} images but {len(y)} labels")
        return x, y

    def n_classes(self) -> int:
        return max(int(self.shard(i)[1].max(initial=0)) for i in range(1, self.n + 1)) + 1 if self.n else 0


def edgetb_sources(source: Source, directory: str, shard_size: int, workdir: Optional[str] = None,
                   module_loader: Optional[ModuleLoader] = None) -> tuple[Shards, Shards, int]:
    """(train shards, test shards, number of classes) for ``source``.

    EdgeTB's own shard files are used as they are when present: ``<directory>/<name>/train_data/``
    and ``test_data/`` (EdgeTB's layout), else ``<directory>/<name>/`` for both. Otherwise the
    dataset is loaded (``load``: a dataset's name, an .npz, a data module) and its train and test
    splits cut into shards of ``shard_size``.
    """
    if isinstance(source, str) and not is_npz(source):
        base = os.path.join(directory, source)
        train_dir, test_dir = os.path.join(base, "train_data"), os.path.join(base, "test_data")
        if FileShards.present(train_dir):
            train = FileShards(train_dir)
            test = FileShards(test_dir) if FileShards.present(test_dir) else train
            return train, test, max(train.n_classes(), test.n_classes() if test is not train else 0)
        if FileShards.present(base):
            train = FileShards(base)
            return train, train, train.n_classes()
    dataset = load(source, directory, workdir, module_loader)
    name = source_name(source)
    return (ArrayShards(dataset.x_train, dataset.y_train, shard_size, f"{name} train split"),
            ArrayShards(dataset.x_test, dataset.y_test, shard_size, f"{name} test split"),
            dataset.n_classes)


def write_windows(train: Shards, test: Shards, windows: dict[str, dict[str, int]], out_dir: str,
                  n_classes: int, name: str, shard_size: int) -> dict:
    """Write ``<node>.npz`` from each node's train and test windows (checked beforehand); manifest too."""
    os.makedirs(out_dir, exist_ok=True)
    shards = {}
    for node, w in windows.items():
        x_tr, y_tr = train.take(w["train_start_index"], w["train_len"])
        x_te, y_te = test.take(w["test_start_index"], w["test_len"])
        if x_tr.shape[1:] != x_te.shape[1:]:
            raise ConfigError(f"node {node!r}: train samples of shape {x_tr.shape[1:]} ({train.description}) but "
                              f"test samples of shape {x_te.shape[1:]} ({test.description})")
        path = os.path.join(out_dir, f"{node}.npz")
        np.savez(path, x_train=samples.pack(x_tr), y_train=y_tr, x_test=samples.pack(x_te), y_test=y_te)
        shards[node] = {"file": f"{node}.npz", "train_samples": int(len(y_tr)), "test_samples": int(len(y_te)),
                        "labels": np.bincount(y_tr, minlength=n_classes).tolist(), "windows": w}
    shape = train.input_shape()
    manifest = {"version": SHARD_VERSION, "dataset": name, "format": "edgetb", "shard_size": shard_size,
                "train": train.description, "test": test.description, "input_shape": shape,
                "n_features": int(np.prod(shape)), "n_classes": n_classes, "shards": shards}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


GLOBAL_TEST_FILE = "global_test.npz"


def write_global_test(x: np.ndarray, y: np.ndarray, out_dir: str) -> str:
    """Write the global test set ``global_test.npz`` (``x``, ``y``; no pickle; images as bytes,
    ``dml_app.models.samples``); returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, GLOBAL_TEST_FILE)
    np.savez(path, x=samples.pack(np.asarray(x, dtype=np.float32)), y=np.asarray(y, dtype=np.int64))
    return path
