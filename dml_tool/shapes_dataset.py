"""A synthetic image set where position does not matter but shape does (a convolutional
network's home ground): ``python3 dml_tool/shapes_dataset.py shapes.npz --size 16 --train 2000``.

Each image is a ``size`` x ``size`` grey picture of one of four shapes (a horizontal bar, a
vertical bar, a plus, a square outline) drawn at a random place and scale, over noise and a few
stray pixels; the label is the shape. The file has ``x_train, y_train, x_test, y_test`` (float32
pixels in [0, 1] with a channel axis, int64 labels): a dataset file's ``"dataset": "shapes.npz"``
reads it as the user's own data set.
"""
from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, REPO)
    from controller.bootstrap import use_venv

    use_venv(REPO, "shapes_dataset.py", ("numpy",))

import numpy as np  # noqa: E402

CLASSES = ("horizontal bar", "vertical bar", "plus", "square outline")


def draw(kind: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One image of shape ``kind`` (an index of ``CLASSES``)."""
    img = rng.normal(0.0, 0.08, (size, size))
    img[rng.integers(0, size, 4), rng.integers(0, size, 4)] += 0.8  # stray pixels
    length = int(rng.integers(size // 3, size // 2 + 1))
    top, left = (int(v) for v in rng.integers(0, size - length + 1, 2))
    ink = float(rng.uniform(0.6, 1.0))
    mid_r, mid_c = top + length // 2, left + length // 2
    if kind == 0:
        img[mid_r, left:left + length] += ink
    elif kind == 1:
        img[top:top + length, mid_c] += ink
    elif kind == 2:
        img[mid_r, left:left + length] += ink
        img[top:top + length, mid_c] += ink
    else:
        img[top, left:left + length] += ink
        img[top + length - 1, left:left + length] += ink
        img[top:top + length, left] += ink
        img[top:top + length, left + length - 1] += ink
    return np.clip(img, 0.0, 1.0)


def make(n: int, size: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images (n, size, size, 1) and their labels, classes balanced and shuffled."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % len(CLASSES)
    rng.shuffle(y)
    x = np.stack([draw(int(k), size, rng) for k in y]).astype(np.float32)[..., None]
    return x, y.astype(np.int64)


def write(path: str, train: int = 2000, test: int = 500, size: int = 16, seed: int = 0) -> str:
    """The data set as an npz (no pickle) at ``path``."""
    x_train, y_train = make(train, size, seed)
    x_test, y_test = make(test, size, seed + 1)
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the .npz to write")
    parser.add_argument("--size", type=int, default=16, help="image side in pixels (default 16)")
    parser.add_argument("--train", type=int, default=2000, help="training images (default 2000)")
    parser.add_argument("--test", type=int, default=500, help="test images (default 500)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 8 <= args.size <= 256 or args.train < 1 or args.test < 1:
        parser.error("--size must be in [8, 256], --train and --test at least 1")
    write(args.out, args.train, args.test, args.size, args.seed)
    print(f"{args.out}: {args.train} + {args.test} images of {args.size}x{args.size}, classes: {', '.join(CLASSES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
