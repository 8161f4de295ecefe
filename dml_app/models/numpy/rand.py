"""Seeded random arrays for node code, without ``numpy.random``.

Importing ``numpy.random`` costs a node about 2 MiB of RSS (its generator
extensions, plus OpenSSL through ``secrets``); with hundreds of nodes per host
that matters. Python's ``random`` supplies the bits, numpy does the arithmetic.
"""
from __future__ import annotations

import math
import random
from typing import Sequence, Union

import numpy as np


class Rng:
    """Uniform, normal and permutation draws from a seeded ``random.Random``."""

    def __init__(self, seed: Union[int, str] = 0) -> None:
        self._random = random.Random(seed)

    def uniform(self, n: int) -> np.ndarray:
        """``n`` float64 values in [0, 1), 53 random bits each."""
        bits = np.frombuffer(self._random.randbytes(8 * n), dtype=np.uint64) >> np.uint64(11)
        return bits.astype(np.float64) * 2.0 ** -53

    def standard_normal(self, shape: Union[int, Sequence[int]]) -> np.ndarray:
        """Normal(0, 1) values of ``shape`` (Box-Muller)."""
        n = math.prod(shape) if isinstance(shape, Sequence) else int(shape)
        radius = np.sqrt(-2.0 * np.log(1.0 - self.uniform(n)))  # 1 - u is in (0, 1]
        return (radius * np.cos(2.0 * np.pi * self.uniform(n))).reshape(shape)

    def permutation(self, n: int) -> np.ndarray:
        """A random order of ``range(n)``."""
        return np.argsort(self.uniform(n), kind="stable")
