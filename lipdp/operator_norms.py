"""Certified upper bounds on the operator norm of linear layers.

Projections (spectral normalisation, Björck, RKO) are iterative and numerical:
power iteration returns a *lower* bound of the largest singular value, so a kernel
"normalised" by it may have a spectral norm slightly above 1. lipdp never uses
such estimates in a privacy bound. The functions below return *upper* bounds of
the operator norm, computed from the current weights:

- dense kernels: the largest eigenvalue of the (smaller) Gram matrix, computed in
  float64, plus a margin covering the eigen-solver's backward error;
- convolutions: the maximum over a finite frequency grid of the largest singular
  value of the kernel's Fourier transform. A zero-padded 2D convolution on an
  ``H x W`` input (any padding, any stride) only keeps some outputs of the full
  linear convolution, which coincides with a circular convolution on any torus of
  size at least ``(H + kh - 1) x (W + kw - 1)``; the operator norm of that circular
  convolution is exactly the maximum of ``sigma_max(K_hat(omega))`` over the
  torus' frequencies. Hence the value returned is a proven upper bound.

The power iteration on the convolution *operator* (`conv_operator_norm_power`)
is a lower estimate used by tests and by `check_projections` to show the bound is
tight.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

# Relative margin added to float64 eigenvalues: symmetric eigen-solvers are
# backward stable with error ~ n * eps64 * ||A||; 1e-9 dominates that for any
# realistic layer (n < 1e5) and is negligible for the bounds.
_EIG_RELATIVE_MARGIN = 1e-9


def _max_eig_upper(gram):
    """Upper bound of the largest eigenvalue of a batch of Hermitian PSD matrices."""
    eigs = tf.linalg.eigvalsh(gram)
    lam = tf.reduce_max(tf.math.real(eigs))
    scale = tf.reduce_max(tf.abs(gram))
    n = tf.cast(tf.shape(gram)[-1], tf.float64)
    return lam + _EIG_RELATIVE_MARGIN * n * scale


def dense_spectral_norm_upper(kernel):
    """Upper bound of ``||kernel||_2`` (largest singular value) for a 2D kernel.

    Formal guarantee: the result is >= the exact spectral norm of the float64
    version of `kernel` (up to the stated eigen-solver margin), whatever the
    projection did.
    """
    w = tf.cast(tf.reshape(kernel, [-1, tf.shape(kernel)[-1]]), tf.float64)
    rows, cols = w.shape
    gram = tf.matmul(w, w, transpose_a=True) if cols <= rows else tf.matmul(w, w, transpose_b=True)
    lam = _max_eig_upper(gram)
    return tf.cast(tf.sqrt(tf.maximum(lam, 0.0)), tf.float32)


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
    kh, kw, cin, cout = kernel.shape
    nh, nw = conv_frequency_grid(input_hw, (kh, kw))
    k = tf.cast(kernel, tf.float64)
    k = tf.transpose(k, [2, 3, 0, 1])  # (C_in, C_out, kh, kw)
    k = tf.pad(k, [[0, 0], [0, 0], [0, nh - kh], [0, nw - kw]])
    k_hat = tf.signal.fft2d(tf.cast(k, tf.complex128))  # (C_in, C_out, nh, nw)
    k_hat = tf.transpose(k_hat, [2, 3, 0, 1])  # (nh, nw, C_in, C_out)
    if cin <= cout:
        gram = tf.matmul(k_hat, k_hat, adjoint_b=True)  # (nh, nw, C_in, C_in)
    else:
        gram = tf.matmul(k_hat, k_hat, adjoint_a=True)  # (nh, nw, C_out, C_out)
    lam = _max_eig_upper(gram)
    return tf.cast(tf.sqrt(tf.maximum(lam, 0.0)), tf.float32)


def conv_operator_norm_power(conv_fn, input_shape, iterations=200, seed=0):
    """Power iteration on the operator ``x -> conv_fn(x)`` itself (a lower estimate).

    Uses automatic differentiation for the adjoint, so it measures exactly the
    operator Keras runs (padding, strides and all). Returns a python float.
    """
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=(1,) + tuple(input_shape)), tf.float32)
    sigma = 0.0
    for _ in range(iterations):
        x = x / tf.norm(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = conv_fn(x)
            half_sq = 0.5 * tf.reduce_sum(tf.square(y))
        sigma = float(tf.sqrt(2.0 * half_sq))
        x = tape.gradient(half_sq, x)  # = A^T A x
    return sigma
