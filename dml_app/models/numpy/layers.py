"""Numpy layers with forward and backward passes, laid out as Keras lays them out.

Images are NHWC (samples, height, width, channels). Every layer keeps its
arrays in ``params`` in Keras' order (a Conv2D: kernel ``(kh, kw, C_in, C_out)``
then bias; a BatchNormalization: gamma, beta, moving_mean, moving_variance), so
the same weight list can be set in a Keras model and in a numpy one. After
``backward`` a layer's ``grads`` holds one gradient per trainable array (None
for the moving statistics, which ``forward`` updates in training mode).

Convolutions copy no windows (no im2col): a batch lives in one matrix with a
row per pixel, each sample in a block padded with zeros (``_Grid``). The ``kw``
pixels of a window's row are then ``kw`` consecutive rows, and for the outputs
``kw`` apart those runs tile the matrix, so a reshape (a view) gives one window
row per output: per kernel row and per phase (output index modulo ``kw``) one
matrix product of ``kw * C_in`` numbers per output. Backward, the kernel's
gradient is the same views' products with the output gradient, and the input's
the same correlation of the output gradient (in the same layout) with the
flipped kernel. Inputs of a few channels (a first layer's 1 or 3) make thin
products: their kernel rows are folded side by side (``kh`` shifted copies of
the thin input), one product per phase. The temporaries are the input and the
outputs in that layout (the outputs twice: a kernel row's products before they
are added), a few percent larger than the maps: nothing the size of the windows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from dml_app.models.numpy.rand import Rng

Shape = tuple[int, ...]
THIN_ROW = 16  # numbers in a kernel row (kw * C_in) below which a convolution folds its rows (_fold_rows)


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
    place on their fresh outputs. Training keeps the mask of the positive outputs (a byte a
    number: the outputs themselves are freed once the next layer is done with them); backward
    multiplies by it (as ``np.where`` for finite gradients, and 15 times faster)."""

    keras_name = "re_lu"

    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = in_place
        self._mask: Optional[np.ndarray] = None

    def forward(self, x: np.ndarray, training: bool) -> np.ndarray:
        out = np.maximum(x, 0, out=x if self.in_place else None)
        self._mask = np.greater(out, 0) if training else None
        return out

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> Optional[np.ndarray]:
        return self.backward_into(dy, None)

    def backward_into(self, dy: np.ndarray, out: Optional[np.ndarray]) -> np.ndarray:
        """The input's gradient written into ``out`` (a new array if None)."""
        mask, self._mask = self._mask, None
        if mask is None:
            raise ValueError(f"{self.name}: backward needs a forward pass in training mode")
        return np.multiply(dy, mask, out=out)


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


def _column_sums(a: np.ndarray, rows_per_chunk: int = 4096) -> np.ndarray:
    """Float64 sums of the columns of 2-D ``a``: products of ones with float64 copies of a few rows
    at a time (twice as fast as ``a.sum(axis=0, dtype=np.float64)``, float64 all the same)."""
    ones = np.ones(min(len(a), rows_per_chunk))
    sums = np.zeros(a.shape[1])
    for start in range(0, len(a), rows_per_chunk):
        part = a[start:start + rows_per_chunk]
        sums += ones[:len(part)] @ part.astype(np.float64)
    return sums


@dataclass(frozen=True)
class _Grid:
    """A batch of maps as one matrix with a row per pixel, for a ``kh x kw`` kernel: each sample a
    block of ``block_h x block_w`` pixels, its map at the top left and zeros around it (the zeros
    are the padding, shared by neighbouring blocks), blocks one after the other. An output at row
    ``r`` has its window's pixels at rows ``r + i * block_w + j``; ``rows`` output rows are computed
    (every block's pixels, rounded up to a multiple of ``kw``), the valid ones read back by ``blocks``."""

    n: int
    block_h: int
    block_w: int
    kh: int
    kw: int

    @property
    def pixels(self) -> int:
        return self.n * self.block_h * self.block_w

    @property
    def rows(self) -> int:
        return -(-self.pixels // self.kw) * self.kw

    @property
    def per_phase(self) -> int:
        """Output rows per phase (the outputs ``phase``, ``phase + kw``, ...)."""
        return self.rows // self.kw

    @property
    def reach(self) -> int:
        """How many rows past an output its window ends (its last pixel's row, minus its own)."""
        return (self.kh - 1) * self.block_w + self.kw - 1

    def blocks(self, flat: np.ndarray, first_row: int = 0) -> np.ndarray:
        """The ``(n, block_h, block_w, channels)`` view of ``flat`` from ``first_row``."""
        return flat[first_row:first_row + self.pixels].reshape(self.n, self.block_h, self.block_w, flat.shape[1])

    def place(self, maps: np.ndarray, first_row: int, relu: Optional["ReLU"] = None) -> np.ndarray:
        """A matrix of ``rows + reach`` rows, ``maps`` (n, h, w, channels) in its blocks from
        ``first_row``, zeros everywhere else (written there alone: the maps are most of it).
        With ``relu``, its backward pass of ``maps`` is written there instead (no copy between)."""
        _, h, w, c = maps.shape
        flat = np.empty((self.rows + self.reach, c), maps.dtype)
        flat[:first_row] = 0
        flat[first_row + self.pixels:] = 0
        blocks = self.blocks(flat, first_row)
        if relu is None:
            blocks[:, :h, :w] = maps
        else:
            relu.backward_into(maps, blocks[:, :h, :w])
        blocks[:, :h, w:] = 0
        blocks[:, h:] = 0
        return flat

    def windows(self, flat: np.ndarray, i: int, phase: int) -> np.ndarray:
        """Row ``i`` of the windows of the outputs ``phase``, ``phase + kw``, ...: a view of ``flat``
        with one window row (``kw`` pixels, all channels, contiguous) per output. The windows of
        outputs ``kw`` apart tile the matrix, so this is a plain reshape: no copy."""
        start = i * self.block_w + phase
        return flat[start:start + self.rows].reshape(self.per_phase, self.kw * flat.shape[1])


def _correlate(flat: np.ndarray, kernel: np.ndarray, grid: _Grid) -> np.ndarray:
    """``out[r] = sum over (i, j) of flat[r + i * block_w + j] @ kernel[i, j]`` for the grid's rows:
    for each kernel row and phase, one matrix product of a view (``kw * C_in`` numbers per output).
    Each kernel row's products fill a whole matrix, added to the first's in one pass (faster than
    adding phase by phase, through strided views)."""
    kh, kw, c_in, c_out = kernel.shape
    kernel_rows = kernel.reshape(kh, kw * c_in, c_out)
    out = np.empty((grid.rows, c_out), flat.dtype)
    term = np.empty_like(out) if kh > 1 else out
    for i in range(kh):
        by_phase = (out if i == 0 else term).reshape(grid.per_phase, kw, c_out)  # [:, p]: outputs p, p + kw, ...
        for phase in range(kw):
            np.matmul(grid.windows(flat, i, phase), kernel_rows[i], out=by_phase[:, phase])
        if i > 0:
            out += term
    return out


def _kernel_gradient(flat_x: np.ndarray, flat_dy: np.ndarray, grid: _Grid, c_in: int) -> np.ndarray:
    """``sum over r of outer(flat_x[r + i * block_w + j], flat_dy[r])`` for each (i, j): the
    ``(kh, kw, C_in, C_out)`` kernel gradient, one matrix product per kernel row and phase."""
    c_out = flat_dy.shape[1]
    by_phase = flat_dy.reshape(grid.per_phase, grid.kw, c_out)
    grad = np.zeros((grid.kh, grid.kw * c_in, c_out), flat_dy.dtype)
    for i in range(grid.kh):
        for phase in range(grid.kw):
            grad[i] += grid.windows(flat_x, i, phase).T @ by_phase[:, phase]
    return grad.reshape(grid.kh, grid.kw, c_in, c_out)


def _fold_rows(flat: np.ndarray, grid: _Grid) -> tuple[np.ndarray, _Grid]:
    """Thin inputs (a kernel row of a few numbers makes thin, slow matrix products): the ``kh``
    rows of every window side by side, row ``r`` holding ``flat[r + i * block_w]`` for each ``i``
    (``kh`` shifted copies of a thin input), and the grid of a one-row kernel over them."""
    folded = replace(grid, kh=1)
    length = folded.rows + folded.reach
    starts = [i * grid.block_w for i in range(grid.kh)]
    return np.concatenate([flat[start:start + length] for start in starts], axis=1), folded


def _fold_kernel(kernel: np.ndarray) -> np.ndarray:
    """``(kh, kw, C_in, C_out)`` as the one-row kernel of ``_fold_rows``' matrix: ``(1, kw, kh * C_in, C_out)``."""
    kh, kw, c_in, c_out = kernel.shape
    return np.ascontiguousarray(kernel.transpose(1, 0, 2, 3)).reshape(1, kw, kh * c_in, c_out)


def _unfold_kernel(folded: np.ndarray, kh: int) -> np.ndarray:
    """``_fold_kernel`` undone: ``(1, kw, kh * C_in, C_out)`` back to ``(kh, kw, C_in, C_out)``."""
    _, kw, rows_c_in, c_out = folded.shape
    return np.ascontiguousarray(folded.reshape(kw, kh, rows_c_in // kh, c_out).transpose(1, 0, 2, 3))


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

    def _grid(self, n: int, h: int, w: int) -> _Grid:
        """The layout of ``n`` maps of ``h x w``: blocks as large as the maps plus the larger of
        each axis' two paddings (a block's zeros after its map pad the next map before it)."""
        (top, bottom), (left, right) = self.pad
        return _Grid(n, h + max(top, bottom), w + max(left, right), self.k, self.k)

    def _thin(self, c_in: int) -> bool:
        """Whether a kernel row holds so few numbers that the kernel's rows are folded (``_fold_rows``)."""
        return self.k * c_in < THIN_ROW

    def forward(self, x: np.ndarray, training: bool) -> np.ndarray:
        n, h, w, _ = x.shape
        (top, bottom), (left, right) = self.pad
        h_out, w_out = h + top + bottom - self.k + 1, w + left + right - self.k + 1
        grid = self._grid(n, h, w)
        flat_x = grid.place(x, top * grid.block_w + left)  # each output's window starts at the output's row
        kernel = self.params[0]
        if self._thin(x.shape[-1]):
            flat_x, grid = _fold_rows(flat_x, grid)
            kernel = _fold_kernel(kernel)
        out = _correlate(flat_x, kernel, grid)
        y = np.add(grid.blocks(out)[:, :h_out, :w_out], self.params[1])  # the valid outputs, compact
        self._flat_x = flat_x if training else None
        self._in_shape = x.shape
        return self.act.forward(y, training) if self.act else y

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> Optional[np.ndarray]:
        flat_x, self._flat_x = self._flat_x, None
        if flat_x is None:
            raise ValueError(f"{self.name}: backward needs a forward pass in training mode")
        n, h, w, c = self._in_shape
        grid = self._grid(n, h, w)
        # the outputs' own rows shifted by reach (zeros before them), through ReLU's mask if any
        flat_dy = grid.place(dy, grid.reach, self.act)
        dy_rows = flat_dy[grid.reach:grid.reach + grid.rows]
        if self._thin(c):  # flat_x is _fold_rows' matrix
            dkernel = _unfold_kernel(_kernel_gradient(flat_x, dy_rows, replace(grid, kh=1), self.k * c), self.k)
        else:
            dkernel = _kernel_gradient(flat_x, dy_rows, grid, c)
        self.grads = [dkernel, _column_sums(dy_rows).astype(dy.dtype)]  # (the padding's zeros add nothing)
        if not need_dx:
            return None
        # a pixel's gradient sums dy at the outputs whose windows hold it: dy at (row - i * block_w - j)
        # with kernel[i, j].T, i.e. flat_dy at (row + (kh-1-i) * block_w + (kw-1-j)): a correlation of
        # flat_dy with the flipped, transposed kernel, read at the pixels' rows
        flipped = np.ascontiguousarray(self.params[0][::-1, ::-1].transpose(0, 1, 3, 2))
        (top, _), (left, _) = self.pad
        dx = grid.blocks(_correlate(flat_dy, flipped, grid))[:, top:top + h, left:left + w]
        return np.ascontiguousarray(dx)


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
        if not training:  # x * scale + shift: two passes over the maps (three as (x - mean) * scale + beta)
            self._centred = None
            scale = gamma / np.sqrt(moving_var + self.epsilon)
            y = np.multiply(x, scale)
            y += beta - moving_mean * scale
            return y
        x2 = x.reshape(-1, x.shape[-1])
        mean = _column_sums(x2) / len(x2)  # float64 sums: a float32 running sum over
        centred = x2 - mean.astype(x.dtype)  # thousands of pixels loses digits BN then magnifies
        y = np.multiply(centred, centred)  # (the squares' array then holds the outputs)
        var = _column_sums(y) / len(x2)
        m = self.momentum
        moving_mean[:] = moving_mean * m + mean * (1 - m)
        moving_var[:] = moving_var * m + var * (1 - m)
        self._inv_std = 1.0 / np.sqrt(var + self.epsilon)
        np.multiply(centred, (gamma * self._inv_std).astype(x.dtype), out=y)  # xhat * gamma, one pass
        y += beta
        self._centred = centred
        return y.reshape(x.shape)

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> Optional[np.ndarray]:
        centred, self._centred = self._centred, None
        if centred is None:
            raise ValueError(f"{self.name}: backward needs a forward pass in training mode")
        dy2 = dy.reshape(centred.shape)
        inv_std = self._inv_std
        product = np.multiply(dy2, centred)
        dgamma = _column_sums(product) * inv_std  # the sum of dy * xhat
        dbeta = _column_sums(dy2)
        self.grads = [dgamma.astype(dy.dtype), dbeta.astype(dy.dtype), None, None]
        if not need_dx:
            return None
        count = len(dy2)
        scale = self.params[0] * inv_std
        # dx = gamma / std * (dy - mean(dy) - xhat * mean(dy * xhat)), xhat = centred / std:
        # scale * dy + centred * slope + offset per channel (the product's array holds the middle term)
        slope, offset = -scale * inv_std * (dgamma / count), -scale * (dbeta / count)
        dx = np.multiply(dy2, scale.astype(dy.dtype))
        dx += np.multiply(centred, slope.astype(dy.dtype), out=product)
        dx += offset.astype(dy.dtype)
        return dx.reshape(dy.shape)


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
        # which corner holds the maximum, the first one on ties: how many corners before it differ from it
        differs = corners[0] != out
        self._arg = differs.astype(np.int8)
        for corner in corners[1:3]:
            differs &= corner != out
            self._arg += differs
        return out

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> Optional[np.ndarray]:
        _, h, w, _ = self._in_shape
        h2, w2 = h // 2, w // 2
        odd = h % 2 or w % 2  # (an odd last row or column gets no gradient)
        dx = (np.zeros if odd else np.empty)(self._in_shape, dy.dtype)
        for k, (a, b) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
            np.multiply(dy, self._arg == k, out=dx[:, a:2 * h2:2, b:2 * w2:2, :])
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
