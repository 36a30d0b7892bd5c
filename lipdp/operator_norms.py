"""Certified upper bounds on the operator norm of linear layers.

Projections (spectral normalisation, Björck, RKO) are iterative and numerical:
power iteration returns a *lower* bound of the largest singular value, so a kernel
"normalised" by it may have a spectral norm slightly above 1. lipdp never uses
such estimates in a privacy bound. The functions below return *upper* bounds of
the operator norm, computed from the current weights:

- dense kernels: from the float64 Gram matrix of the smaller side, either
  ``lambda_max <= c + ||G - c I||_F`` (near-orthogonal kernels, what the
  projections produce) or a Cholesky test of ``t^2 I - G`` (`dense_spectral_norm_upper`);
- convolutions: the maximum over a finite frequency grid of the largest singular
  value of the kernel's Fourier transform. A zero-padded 2D convolution on an
  ``H x W`` input (any padding, any stride) only keeps some outputs of the full
  linear convolution, which coincides with a circular convolution on any torus of
  size at least ``(H + kh - 1) x (W + kw - 1)``; the operator norm of that circular
  convolution is exactly the maximum of ``sigma_max(K_hat(omega))`` over the
  torus' frequencies, bounded by one batched Cholesky test of their Gram matrices
  (`conv_operator_norm_upper`).

Both run in float64 on the host (``tf.numpy_function``, also inside the compiled
train step), with every rounding error bounded: `lipdp.gram_certificates` states
the arithmetic model and the proofs; a dense kernel whose smaller side has at most
`lipdp.graph_certificates.IN_GRAPH_MAX_SIDE` entries gets the same certificate from float64
TensorFlow ops in the graph (a host call holds one of TensorFlow's threads while it runs).
The results are float32, rounded up. For a large, elongated dense kernel (p x k with p >= 3 k and ``p k^2 >= CHUNKED_GRAM_MIN_WORK``: the
paper's CNN's 3136 x 512, not the main job's 784 x 1024) the Gram matrix is computed on the
CPU by TensorFlow as float32 products of blocks of at most 392 rows summed in float32, with
its proven rounding error (`lipdp.gram_certificates`, step 4: on that kernel the
certificate is 0.4% above the norm, in 0.54x the time), unless oneDNN is told to trade
float32 precision for speed (``ONEDNN_DEFAULT_FPMATH_MODE`` set to anything but
``strict``): then the float64 one. On a squarer kernel the float64 Gram matrix costs little
more than the chunked one and its certificate stays within 1e-5 of the norm.

A dense kernel exactly as its last projection left it (Björck every step, sides within a
factor 3, or a single Björck iteration on a kernel that would get the chunked certificate)
comes with that projection's certificate
(`lipdp.layers._bjorck.certifying_bjorck`): the gradient bound pass uses it instead of a Gram
matrix, chunked or not (``"cached-dense"`` requests); what
is reported for a trained model (Lipschitz constant, certified radii) is certified from the
weights alone (`without_projection_certificate`).

The power iteration on the convolution *operator* (`conv_operator_norm_power`)
is a lower estimate used by tests to show the bound is tight.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from lipdp.gram_certificates import (chunked_dense_norm_upper, conv_certificate_work,
                                     conv_norm_upper, dense_norm_upper)
from lipdp.graph_certificates import (certified_in_graph, dense_norm_upper_in_graph,
                                      oriented_size)
from lipdp.host_memory import keep_host_memory

#: Multiply-adds ``p k^2`` of a dense kernel's Gram matrix from which it is chunked.
CHUNKED_GRAM_MIN_WORK = 2 ** 26
#: Least ratio of a dense kernel's long side to its short one for a chunked Gram matrix.
CHUNKED_GRAM_MIN_ASPECT = 3
#: Most rows of a float32 block of a chunked Gram matrix (its error grows with them).
CHUNK_ROWS = 392


def certified_norms(requests):
    """Certified operator norms of several kernels: a dense kernel whose smaller side is small
    in the graph (`lipdp.graph_certificates`), every other in **one** host call.

    Args:
        requests: ``[(kind, kernel, grid), ...]`` with kind ``"dense"`` (grid None: the
            spectral norm of the kernel reshaped to ``(-1, out)``) or ``"conv"`` (the
            operator norm of the convolution by the ``(kh, kw, C_in, C_out)`` kernel on
            inputs whose circular extension is the ``grid`` torus, `conv_frequency_grid`).
            A dense request may carry a fourth element, a guess of the kernel's top right
            singular vector (the layer's power-iteration vector): it starts the estimate
            that picks the certificate's shift, and never enters the bound
            (`lipdp.gram_certificates.dense_norm_upper`). Kind ``"cached-dense"``,
            ``(kind, kernel, None, fresh, norm[, hint])``, is a dense request with the
            certificate its layer's projection left (`ProjectedKernelMixin.certificate_cache`):
            `norm` is returned as it is when `fresh` (a boolean scalar) holds and it is
            finite, else the kernel is certified here.

    Raises:
        TypeError: a kernel that is not float32.

    Returns:
        a list of float32 scalar tensors, each an upper bound of its kernel's norm
        (`lipdp.gram_certificates`). One call, not one per kernel: separate host calls
        run concurrently and contend for the interpreter lock and the cores (34 ms
        against 22 ms for the paper's CNN on 2 cores). The first call keeps the host
        memory they free for the next step (`lipdp.host_memory`).
    """
    results, host_indices = [None] * len(requests), []
    specs, inputs = [], []
    for index, request in enumerate(requests):
        kind, kernel, grid = request[:3]
        tensors = [tf.convert_to_tensor(t) for t in (kernel,) + tuple(request[3:])]
        cached = kind == "cached-dense"  # (kind, kernel, None, fresh, norm[, hint])
        split = 3 if cached else 1
        kernel, cache, extra = tensors[0], tensors[1:split], tensors[split:]
        if kernel.dtype != tf.float32:
            raise TypeError(f"certified_norms bounds float32 kernels; got a {kernel.dtype.name} "
                            f"kernel of shape {kernel.shape} (its certificate would be that of "
                            "its float32 rounding, which can be below its own norm): cast it "
                            "to float32 first.")
        kind = "dense" if cached else kind
        chunked = kind == "dense" and chunked_certificate(kernel.shape)
        if kind == "dense" and not chunked and certified_in_graph(kernel.shape):
            if cached:  # the projection's certificate serves while it certifies this kernel
                fresh, norm = cache
                results[index] = tf.cond(
                    tf.logical_and(fresh, tf.math.is_finite(norm)),
                    lambda norm=norm: tf.cast(norm, tf.float32),
                    lambda kernel=kernel: dense_norm_upper_in_graph(kernel))
            else:
                results[index] = dense_norm_upper_in_graph(kernel)
            continue
        host_indices.append(index)
        if chunked:
            # A cached kernel got one Björck iteration (`runs_certifying_bjorck`): its Gram
            # matrix is computed only when the projection's certificate cannot serve.
            extra = (_chunked_gram_unless_cached(kernel, *cache, *extra) if cached
                     else _chunked_gram(kernel, *extra))
            kind, grid = "chunked", _chunking(kernel.shape)
        specs.append((kind, grid, cached, len(extra)))
        inputs.extend([kernel] + cache + extra)

    def compute(*tensors):
        tensors, norms = iter(tensors), []
        for kind, grid, cached, extras in specs:
            kernel = next(tensors)
            fresh, norm = (next(tensors), next(tensors)) if cached else (False, None)
            extra = [next(tensors) for _ in range(extras)]
            if fresh and np.isfinite(norm):  # the projection certified this very kernel
                norms.append(np.float32(norm))  # (and no chunked Gram matrix was computed)
            elif kind == "chunked":
                gram, stats, *start = extra
                norms.append(chunked_dense_norm_upper(kernel, gram, stats, *grid,
                                                      start=start[0] if start else None))
            elif kind == "dense":
                norms.append(dense_norm_upper(kernel, *extra))
            else:
                norms.append(conv_norm_upper(kernel, grid))
        return np.array(norms, np.float32)

    if host_indices:
        keep_host_memory()
        norms = tf.numpy_function(compute, inputs, tf.float32, stateful=False,
                                  name="certified_norms")
        for index, norm in zip(host_indices,
                               tf.unstack(tf.ensure_shape(norms, [len(host_indices)]))):
            results[index] = norm
    return results


def host_work(request) -> int:
    """Multiply-adds of the largest float64 products `certified_norms` runs on the host for
    `request` (of `certified_norms`), when its kernel is certified there: a convolution's
    Gram matrices (`lipdp.gram_certificates.conv_certificate_work`), a dense kernel's Gram
    matrix ``p k^2`` (k its short side), or for a chunked one (its Gram matrix is computed by
    TensorFlow) the Cholesky factorisation's ``k^3 / 3``. What decides whether numpy's BLAS
    threads pay in the step (`lipdp.host_blas`)."""
    kind, kernel, grid = request[:3]
    shape = tf.TensorShape(kernel.shape)
    if kind == "conv":
        return conv_certificate_work(shape, grid)
    p, k, _ = oriented_size(shape)
    if chunked_certificate(shape):
        return k ** 3 // 3
    return 0 if certified_in_graph(shape) else p * k * k


def without_projection_certificate(request):
    """`request` (of `certified_norms`) certified from the kernel alone: a ``"cached-dense"``
    request becomes the plain dense one, any other is returned as it is."""
    if request[0] != "cached-dense":
        return request
    return ("dense",) + tuple(request[1:3]) + tuple(request[5:])


def chunked_certificate(shape) -> bool:
    """Whether the dense kernel of `shape` gets the chunked float32 Gram matrix: fully known,
    large and elongated (`CHUNKED_GRAM_MIN_WORK`, `CHUNKED_GRAM_MIN_ASPECT`), and float32
    products rounded to nearest (oneDNN's default ``strict`` floating-point mode)."""
    if not shape.is_fully_defined() or len(shape) < 2:
        return False
    p, k, _ = oriented_size(shape)
    return (p * k * k >= CHUNKED_GRAM_MIN_WORK and p >= CHUNKED_GRAM_MIN_ASPECT * k
            and float32_products_rounded_to_nearest())


def float32_products_rounded_to_nearest(device_products=False) -> bool:
    """Whether TensorFlow's float32 matrix products round every operation to nearest float32,
    as the float32 certificates assume: on the CPU, oneDNN's default ``strict`` floating-point
    mode (`ONEDNN_DEFAULT_FPMATH_MODE`: no bfloat16 shortcut); with `device_products` (products
    placed wherever TensorFlow puts them), also no GPU running them in TensorFloat-32."""
    fpmath = os.environ.get("ONEDNN_DEFAULT_FPMATH_MODE", "strict").strip().lower()
    if fpmath not in ("", "strict"):
        return False
    return not (device_products and tf.config.list_physical_devices("GPU")
                and tf.config.experimental.tensor_float_32_execution_enabled())


def _chunking(shape):
    """``(b, c)``: rows per block and blocks of the long side p, ``b c >= p`` and
    ``b <= CHUNK_ROWS``; a divisor of p when one lies in ``(CHUNK_ROWS / 2, CHUNK_ROWS]``
    (no padding rows)."""
    p = oriented_size(shape)[0]
    for rows in range(min(CHUNK_ROWS, p), CHUNK_ROWS // 2, -1):
        if p % rows == 0:
            return rows, p // rows
    chunks = -(-p // CHUNK_ROWS)
    return -(-p // chunks), chunks


def _usable_hint(kernel, hint):
    """`hint` when it has one entry per column of the dense `kernel` reshaped to ``(-1, out)``
    (the layer's power-iteration vector: it starts `_chunked_gram`'s estimate), else None."""
    p, k, wide = oriented_size(kernel.shape)
    if hint is None or hint.shape.num_elements() != (p if wide else k):
        return None
    return hint


def _chunked_gram(kernel, hint=None):
    """``[gram, stats]`` (plus the start vector when `hint` is given) of
    `lipdp.gram_certificates.chunked_dense_norm_upper`, computed by TensorFlow on the CPU."""
    p, k, wide = oriented_size(kernel.shape)
    rows, chunks = _chunking(kernel.shape)
    with tf.device("/CPU:0"):
        w = tf.reshape(tf.cast(kernel, tf.float32), [k, p] if wide else [p, k])
        extra = []
        if _usable_hint(kernel, hint) is not None:
            hint = tf.reshape(tf.cast(hint, tf.float32), [-1])
            extra = [tf.linalg.matvec(w, hint) if wide else hint]
        if wide:
            w = tf.transpose(w)
        blocks = tf.reshape(tf.pad(w, [[0, rows * chunks - p], [0, 0]]), [chunks, rows, k])
        gram = tf.reduce_sum(tf.matmul(blocks, blocks, transpose_a=True), 0)
        magnitudes = tf.abs(w)
        row_sums = tf.reduce_sum(magnitudes, 1)
        stats = tf.stack([tf.reduce_max(tf.linalg.matvec(magnitudes, row_sums, transpose_a=True)),
                          tf.reduce_max(row_sums), tf.reduce_max(magnitudes)])
    return [gram, stats] + extra


def _chunked_gram_unless_cached(kernel, fresh, norm, hint=None):
    """`_chunked_gram`'s tensors when the projection's certificate cannot serve (stale or
    not finite), zeros of their shapes, never read, when it can: the Gram matrix is then not
    computed at all (`certified_norms` decides on the same `fresh` and `norm`)."""
    k = oriented_size(kernel.shape)[1]
    hint = _usable_hint(kernel, hint)

    def unused():
        return [tf.zeros([k, k]), tf.zeros([3])] + ([] if hint is None else [tf.zeros([k])])

    return tf.cond(tf.logical_and(fresh, tf.math.is_finite(norm)), unused,
                   lambda: _chunked_gram(kernel, hint))


def dense_spectral_norm_upper(kernel):
    """Upper bound of ``||kernel||_2`` (largest singular value) for a 2D kernel.

    Formal guarantee: the result (a float32 scalar tensor) is >= the exact spectral
    norm of `kernel`, whatever the projection did (`lipdp.gram_certificates`).
    """
    return certified_norms([("dense", kernel, None)])[0]


def conv_frequency_grid(input_hw, kernel_hw):
    """Torus size used for the certified convolution bound: ``H + kh - 1`` etc."""
    return (int(input_hw[0]) + int(kernel_hw[0]) - 1, int(input_hw[1]) + int(kernel_hw[1]) - 1)


def conv_operator_norm_upper(kernel, input_hw):
    """Upper bound of the L2 operator norm of ``x -> conv2d(x, kernel)``.

    Args:
        kernel: ``(kh, kw, C_in, C_out)`` tensor, exactly as passed to conv2d.
        input_hw: spatial size ``(H, W)`` of the inputs.

    Formal guarantee: for every padding ('same' or 'valid') and every stride,
    ``||conv2d(x, kernel)||_2 <= result * ||x||_2`` (see module docstring).
    """
    return certified_norms([("conv", kernel, conv_frequency_grid(input_hw, kernel.shape[:2]))])[0]


def conv_operator_norm_power(conv_fn, input_shape, iterations=200, seed=0):
    """Power iteration on the operator ``x -> conv_fn(x)`` itself (a lower estimate).

    Uses automatic differentiation for the adjoint, so it measures exactly the
    operator Keras runs (padding, strides and all). Returns a python float.
    """
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=(1,) + tuple(input_shape)), tf.float32)

    @tf.function(autograph=False)  # one trace; the iterations run as a graph, not op by op
    def iteration(x):
        x = x / tf.norm(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            half_sq = 0.5 * tf.reduce_sum(tf.square(conv_fn(x)))
        return tf.sqrt(2.0 * half_sq), tape.gradient(half_sq, x)  # (||A x||, A^T A x)

    sigma = 0.0
    for _ in range(iterations):
        sigma, x = iteration(x)
    return float(sigma)
