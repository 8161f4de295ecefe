"""Numpy layers with forward and backward passes, laid out as Keras lays them out.

Images are NHWC (samples, height, width, channels). Every layer keeps its
arrays in ``params`` in Keras' order (a Conv2D: kernel ``(kh, kw, C_in, C_out)``
then bias; a BatchNormalization: gamma, beta, moving_mean, moving_variance), so
the same weight list can be set in a Keras model and in a numpy one. After
``backward`` a layer's ``grads`` holds one gradient per trainable array (None
for the moving statistics, which ``forward`` updates in training mode).

Convolutions are im2col: the windows of the padded input (a strided view) are
copied once into a ``(samples * H_out * W_out, kh * kw * C_in)`` matrix and
multiplied by the kernel in one matmul, a few samples at a time so that the
matrix stays near 4 MiB (a node's memory stays low, the matrix in cache).
Backward, the kernel's gradient is one matmul with the same windows, and the
input's a convolution of the padded output gradient with the flipped kernel
(im2col and one matmul again): no Python loop over pixels.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from dml_app.models.numpy.rand import Rng

Shape = tuple[int, ...]
COLS_ELEMENTS = 1 << 20  # numbers per im2col matrix (4 MiB in float32): convolutions go by chunks of samples


def glorot_uniform(rng: Rng, shape: Sequence[int], fan_in: int, fan_out: int, dtype: np.dtype) -> np.ndarray:
    """Keras' default kernel initialiser: uniform in +-sqrt(6 / (fan_in + fan_out))."""
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    n = math.prod(shape)
    return ((rng.uniform(n) * 2.0 - 1.0) * limit).reshape(tuple(shape)).astype(dtype)


class Layer:
    """A layer: ``build`` for an input shape (per sample), then ``forward`` and ``backward``."""

    keras_name = "layer"  # the prefix Keras gives layers of this class ("conv2d", "dense", ...)
    param_names: tuple[str, ...] = ()
    trainable: tuple[bool, ...] = ()

    def __init__(self) -> None:
        self.params: list[np.ndarray] = []
        self.grads: list[Optional[np.ndarray]] = []
        self.name = self.keras_name

    def build(self, input_shape: Shape, rng: Rng, dtype: np.dtype) -> Shape:
        """Create the arrays for inputs of ``input_shape``; return the output shape."""
        return input_shape

    def forward(self, x: np.ndarray, training: bool) -> np.ndarray:
        raise NotImplementedError

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> Optional[np.ndarray]:
        """Gradients of the loss: store the parameters' in ``grads``, return the input's."""
        raise NotImplementedError


class ReLU(Layer):
    """max(x, 0); its gradient at 0 is 0 (as TensorFlow's). Inside Conv2D and Dense it works in
    place on their fresh outputs (layers never change their inputs, so outputs can be kept)."""

    keras_name = "re_lu"

    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = in_place

    def forward(self, x: np.ndarray, training: bool) -> np.ndarray:
        self._out = np.maximum(x, 0, out=x if self.in_place else None)
        return self._out

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> Optional[np.ndarray]:
        out, self._out = self._out, None
        return np.where(out > 0, dy, dy.dtype.type(0))


def _activation(activation: Optional[str]) -> Optional[ReLU]:
    if activation is None:
        return None
    if activation != "relu":
        raise ValueError(f"activation must be 'relu' or None, got {activation!r}")
    return ReLU(in_place=True)


class Dense(Layer):
    """``x @ kernel + bias`` over the last axis, optionally followed by ReLU."""

    keras_name = "dense"
    param_names = ("kernel", "bias")
    trainable = (True, True)

    def __init__(self, units: int, activation: Optional[str] = None) -> None:
        super().__init__()
        self.units = int(units)
        self.act = _activation(activation)

    def build(self, input_shape: Shape, rng: Rng, dtype: np.dtype) -> Shape:
        if len(input_shape) != 1:
            raise ValueError(f"{self.name}: Dense takes (features,) inputs, got {input_shape} (add a Flatten)")
        fan_in = input_shape[0]
        self.params = [glorot_uniform(rng, (fan_in, self.units), fan_in, self.units, dtype),
                       np.zeros(self.units, dtype)]
        return (self.units,)

    def forward(self, x: np.ndarray, training: bool) -> np.ndarray:
        self._x = x
        y = x @ self.params[0] + self.params[1]
        return self.act.forward(y, training) if self.act else y

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> Optional[np.ndarray]:
        if self.act:
            dy = self.act.backward(dy)
        self.grads = [self._x.T @ dy, dy.sum(axis=0)]
        return dy @ self.params[0].T if need_dx else None


def _windows(xp: np.ndarray, kh: int, kw: int) -> np.ndarray:
    """The ``kh x kw`` windows (stride 1) of a padded NHWC array: a view of shape
    ``(n, H_out, W_out, kh, kw, C)``."""
    n, hp, wp, c = xp.shape
    s0, s1, s2, s3 = xp.strides
    return as_strided(xp, (n, hp - kh + 1, wp - kw + 1, kh, kw, c), (s0, s1, s2, s1, s2, s3), writeable=False)


class Conv2D(Layer):
    """2-D convolution (cross-correlation, as Keras), stride 1, 'same' or 'valid' padding,
    optionally followed by ReLU."""

    keras_name = "conv2d"
    param_names = ("kernel", "bias")
    trainable = (True, True)

    def __init__(self, filters: int, kernel_size: int, padding: str = "same",
                 activation: Optional[str] = None) -> None:
        super().__init__()
        if padding not in ("same", "valid"):
            raise ValueError(f"padding must be 'same' or 'valid', got {padding!r}")
        self.filters = int(filters)
        self.k = int(kernel_size)
        self.padding = padding
        self.act = _activation(activation)

    def build(self, input_shape: Shape, rng: Rng, dtype: np.dtype) -> Shape:
        if len(input_shape) != 3:
            raise ValueError(f"{self.name}: Conv2D takes (H, W, C) inputs, got {input_shape}")
        h, w, c = input_shape
        k = self.k
        if self.padding == "same":  # as TensorFlow: the extra row/column of an even kernel goes after
            total = k - 1
            self.pad = ((total // 2, total - total // 2), (total // 2, total - total // 2))
            out = (h, w)
        else:
            self.pad = ((0, 0), (0, 0))
            out = (h - k + 1, w - k + 1)
        if min(out) < 1:
            raise ValueError(f"{self.name}: a {k}x{k} 'valid' convolution does not fit inputs of {h}x{w}")
        self.params = [glorot_uniform(rng, (k, k, c, self.filters), k * k * c, k * k * self.filters, dtype),
                       np.zeros(self.filters, dtype)]
        return (*out, self.filters)

    def _padded(self, x: np.ndarray) -> np.ndarray:
        (t, b), (l, r) = self.pad
        return np.pad(x, ((0, 0), (t, b), (l, r), (0, 0))) if t or b or l or r else x

    def _chunks(self, n: int, rows_per_sample: int, width: int) -> list[slice]:
        """Sample ranges whose im2col matrices hold about COLS_ELEMENTS numbers (at least one sample)."""
        step = max(1, COLS_ELEMENTS // max(1, rows_per_sample * width))
        return [slice(start, min(n, start + step)) for start in range(0, n, step)]

    def forward(self, x: np.ndarray, training: bool) -> np.ndarray:
        n, _, _, c = x.shape
        k, f = self.k, self.filters
        xp = self._padded(x)
        ho, wo = xp.shape[1] - k + 1, xp.shape[2] - k + 1
        kernel = self.params[0].reshape(k * k * c, f)
        y = np.empty((n, ho, wo, f), x.dtype)
        for part in self._chunks(n, ho * wo, k * k * c):  # im2col: one copy of the windows, one matmul
            cols = _windows(xp[part], k, k).reshape(-1, k * k * c)
            np.matmul(cols, kernel, out=y[part].reshape(-1, f))
        y += self.params[1]
        self._xp = xp if training else None  # backward makes the windows again, chunk by chunk
        self._in_shape = x.shape
        return self.act.forward(y, training) if self.act else y

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> Optional[np.ndarray]:
        if self.act:
            dy = self.act.backward(dy)
        n, ho, wo, f = dy.shape
        k = self.k
        _, h, w, c = self._in_shape
        xp, self._xp = self._xp, None
        if xp is None:
            raise ValueError(f"{self.name}: backward needs a forward pass in training mode")
        kernel = self.params[0]
        dkernel = np.zeros((k * k * c, f), dy.dtype)
        for part in self._chunks(n, ho * wo, k * k * c):
            cols = _windows(xp[part], k, k).reshape(-1, k * k * c)
            dkernel += cols.T @ dy[part].reshape(-1, f)
        self.grads = [dkernel.reshape(kernel.shape), dy.reshape(-1, f).sum(axis=0)]
        if not need_dx:
            return None
        # dx[h, w] = sum over (i, j) of dy[h + t - i, w + l - j] @ kernel[i, j].T: a stride-1
        # convolution of dy, padded to keep every term, with the flipped, transposed kernel
        (t, _), (l, _) = self.pad
        top, left = k - 1 - t, k - 1 - l
        dyp = np.zeros((n, top + h + t, left + w + l, f), dy.dtype)
        dyp[:, top:top + ho, left:left + wo, :] = dy
        flipped = kernel[::-1, ::-1].transpose(0, 1, 3, 2).reshape(k * k * f, c)
        dx = np.empty(self._in_shape, dy.dtype)
        for part in self._chunks(n, h * w, k * k * f):
            cols = _windows(dyp[part], k, k).reshape(-1, k * k * f)
            np.matmul(cols, flipped, out=dx[part].reshape(-1, c))
        return dx


class BatchNormalization(Layer):
    """Keras' BatchNormalization over the last axis (momentum 0.99, epsilon 1e-3).

    Training: normalises with the batch's mean and (biased) variance and moves
    the moving statistics toward them; evaluation: normalises with the moving
    statistics. All four arrays are weights, so the statistics travel and are
    averaged with the rest of the model."""

    keras_name = "batch_normalization"
    param_names = ("gamma", "beta", "moving_mean", "moving_variance")
    trainable = (True, True, False, False)

    def __init__(self, momentum: float = 0.99, epsilon: float = 1e-3) -> None:
        super().__init__()
        self.momentum = float(momentum)
        self.epsilon = float(epsilon)

    def build(self, input_shape: Shape, rng: Rng, dtype: np.dtype) -> Shape:
        c = input_shape[-1]
        self.params = [np.ones(c, dtype), np.zeros(c, dtype), np.zeros(c, dtype), np.ones(c, dtype)]
        return input_shape

    def forward(self, x: np.ndarray, training: bool) -> np.ndarray:
        gamma, beta, moving_mean, moving_var = self.params
        if not training:
            self._xhat = None
            return (x - moving_mean) * (gamma / np.sqrt(moving_var + self.epsilon)) + beta
        x2 = x.reshape(-1, x.shape[-1])
        mean = x2.mean(axis=0, dtype=np.float64)  # float64 sums: a float32 running sum over
        centred = x2 - mean.astype(x.dtype)        # thousands of pixels loses digits BN then magnifies
        var = (centred * centred).sum(axis=0, dtype=np.float64) / len(x2)
        m = self.momentum
        moving_mean[:] = moving_mean * m + mean * (1 - m)
        moving_var[:] = moving_var * m + var * (1 - m)
        self._inv_std = (1.0 / np.sqrt(var + self.epsilon)).astype(x.dtype)
        centred *= self._inv_std
        self._xhat = centred.reshape(x.shape)
        return self._xhat * gamma + beta

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> Optional[np.ndarray]:
        if self._xhat is None:
            raise ValueError(f"{self.name}: backward needs a forward pass in training mode")
        c = dy.shape[-1]
        dy2, xhat = dy.reshape(-1, c), self._xhat.reshape(-1, c)
        self._xhat = None
        dgamma = (dy2 * xhat).sum(axis=0, dtype=np.float64)
        dbeta = dy2.sum(axis=0, dtype=np.float64)
        self.grads = [dgamma.astype(dy.dtype), dbeta.astype(dy.dtype), None, None]
        if not need_dx:
            return None
        count = len(dy2)
        gamma = self.params[0]
        # dx = gamma / std * (dy - mean(dy) - xhat * mean(dy * xhat))
        mean_dy, mean_dyx = (dbeta / count).astype(dy.dtype), (dgamma / count).astype(dy.dtype)
        return ((gamma * self._inv_std) * (dy2 - mean_dy - xhat * mean_dyx)).reshape(dy.shape)


class MaxPool2D(Layer):
    """2x2 max pooling, stride 2, 'valid' (an odd last row or column is dropped, as Keras).
    The gradient goes to the first maximum of each window (row-major), as TensorFlow's."""

    keras_name = "max_pooling2d"

    def build(self, input_shape: Shape, rng: Rng, dtype: np.dtype) -> Shape:
        h, w, c = input_shape
        if h < 2 or w < 2:
            raise ValueError(f"{self.name}: 2x2 pooling needs inputs of at least 2x2, got {h}x{w}")
        return (h // 2, w // 2, c)

    def forward(self, x: np.ndarray, training: bool) -> np.ndarray:
        h2, w2 = x.shape[1] // 2, x.shape[2] // 2
        self._in_shape = x.shape
        corners = [x[:, a:2 * h2:2, b:2 * w2:2, :] for a in (0, 1) for b in (0, 1)]  # row-major in the window
        out = np.maximum(np.maximum(corners[0], corners[1]), np.maximum(corners[2], corners[3]))
        if not training:
            return out
        # which corner holds the maximum, the first one on ties
        self._arg = np.full(out.shape, 3, np.int8)
        for k in (2, 1, 0):
            self._arg[corners[k] == out] = k
        return out

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> Optional[np.ndarray]:
        _, h, w, _ = self._in_shape
        h2, w2 = h // 2, w // 2
        dx = np.zeros(self._in_shape, dy.dtype)
        zero = dy.dtype.type(0)
        for k, (a, b) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
            dx[:, a:2 * h2:2, b:2 * w2:2, :] = np.where(self._arg == k, dy, zero)
        self._arg = None
        return dx


class Flatten(Layer):
    """(n, ...) -> (n, features), in C order (as Keras' Flatten on NHWC)."""

    keras_name = "flatten"

    def build(self, input_shape: Shape, rng: Rng, dtype: np.dtype) -> Shape:
        return (math.prod(input_shape),)

    def forward(self, x: np.ndarray, training: bool) -> np.ndarray:
        self._in_shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> Optional[np.ndarray]:
        return dy.reshape(self._in_shape)
