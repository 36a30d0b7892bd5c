"""Björck orthogonalisation of an elongated kernel in its Gram space: deel-lip's iterates,
one large matrix product at each end instead of two per iteration.

deel-lip's `bjorck_normalization` iterates, for a tall ``W`` (m x n, m >= n),
``W_{k+1} = (1 + b) W_k - b W_k (W_k^T W_k)`` until ``||W_{k+1} - W_k||_F < eps`` (or
`maxiter` iterations): two m x n x n products per iteration. Writing
``M_k = (1 + b) I - b W_k^T W_k``, every iterate is ``W_k = W_0 P_k`` with
``P_{k+1} = P_k M_k``, and everything the loop needs lives in n x n matrices. With the
deviation from orthogonality ``D_k = I - W_k^T W_k`` (so ``M_k = I + b D_k``, a polynomial in
``D_k``, which therefore commutes with it):

- ``D_{k+1} = I - M_k (I - D_k) M_k = (1 - 2b) D_k + (2b - b^2) D_k^2 + b^2 D_k^3``;
- ``P_{k+1} = I + Q_{k+1}`` with ``Q_{k+1} = Q_k + b D_k + b Q_k D_k``, ``Q_0 = 0``;
- deel-lip's stopping quantity ``||W_{k+1} - W_k||_F = b ||W_k D_k||_F``, whose square is
  ``b^2 tr(D_k (I - D_k) D_k) = b^2 (||D_k||_F^2 - <D_k^2, D_k>)``.

So one Gram matrix ``W_0^T W_0`` (m n^2 multiply-adds) and its square start the loop, each
iteration after the first costs three n x n products (n^3 each), and ``W_0 + W_0 Q_K`` (m n^2)
ends it: for K iterations ``2 m n^2 + (3K - 2) n^3`` against deel-lip's ``2 K m n^2``. On the
paper's CNN the dense kernel is 3136 x 512 and deel-lip runs two or three iterations a step:
about half the time. Keeping the deviation ``D`` and the increment ``Q`` instead of ``W^T W``
and ``P`` avoids the cancellations of ``I - W^T W`` and ``W_0 P`` near orthogonality: the
result agrees with deel-lip's to float32 rounding and is as orthogonal
(`tests/test_gram_bjorck.py`). A wide kernel (m < n) is handled the same way on ``W W^T``.

Privacy never rests on this projection: the bounds use the norms certified at every step on
the kernel the forward pass uses (`lipdp.gram_certificates`).
"""

from __future__ import annotations

import tensorflow as tf

# Gram-space iterations pay when the long side is at least this many times the short one
# (cost ratio about 1/2 + short/long for two iterations); below it, deel-lip's own loop runs.
GRAM_SPACE_MIN_ASPECT = 3


def orthogonalise(w, eps, beta, maxiter):
    """deel-lip's Björck orthogonalisation of the 2-D `w`: in Gram space when one side is at
    least `GRAM_SPACE_MIN_ASPECT` times the other (`gram_space_bjorck`), else deel-lip's
    `bjorck_normalization` itself. Same arguments, same iterates, same stopping rule."""
    rows, cols = w.shape
    if max(rows, cols) >= GRAM_SPACE_MIN_ASPECT * min(rows, cols):
        return gram_space_bjorck(w, eps, beta, maxiter)
    from deel.lip.normalizers import bjorck_normalization

    return bjorck_normalization(w, eps=eps, beta=beta, maxiter=maxiter)


def gram_space_bjorck(w, eps, beta, maxiter):
    """deel-lip's `bjorck_normalization(w, eps, beta, maxiter)`, computed in Gram space
    (module docstring): iteration 1 always runs, iteration k + 1 runs while iteration k moved
    the kernel by ``>= eps`` in Frobenius norm and ``k < maxiter``. A non-finite result (the
    iteration diverges when a singular value exceeds sqrt(3)) is returned as such, as
    deel-lip's is, for the caller to restart from a safer scaling."""
    w = tf.convert_to_tensor(w)
    wide = w.shape[0] < w.shape[1]  # then W_k = P_k W_0 and the Gram matrix is W W^T
    gram = tf.matmul(w, w, transpose_a=not wide, transpose_b=wide)
    return _from_gram(w, gram, eps, beta, maxiter)


def normalised_gram_space_bjorck(w, u, eps_spectral, maxiter_spectral, eps, beta, maxiter):
    """deel-lip's ``spectral_normalization(w, u, eps_spectral, maxiter_spectral)`` followed
    by `gram_space_bjorck`, for a tall `w` (rows >= cols), from one Gram matrix.

    deel-lip's power iteration ``u <- normalise((u W^T) W)`` is ``u <- normalise(u G)``
    with ``G = W^T W``, and its estimate ``||u W^T||`` is ``sqrt(u G u^T)``; the kernel it
    returns, ``W / s`` with ``s = sigma + eps_spectral``, has the Gram matrix ``G / s^2``,
    which starts Björck. So the power iteration runs on k x k matrices instead of reading
    the m x k kernel twice per iteration, and the Gram matrix is formed once for both (the
    same iterates and stopping rules, to float32 rounding).

    Returns:
        ``(orthogonalised kernel, new power-iteration vector)``; the kernel is not finite
        when Björck diverged (as `gram_space_bjorck`'s).
    """
    from deel.lip.normalizers import _power_iteration  # pylint: disable=import-outside-toplevel

    w = tf.convert_to_tensor(w)
    if w.shape[0] < w.shape[1]:
        raise ValueError(f"Expected a tall kernel (rows >= cols). Received: shape {w.shape}")
    gram = _symmetric(tf.matmul(w, w, transpose_a=True))
    u = _power_iteration(lambda u: tf.matmul(u, gram), lambda v: v, u, eps=eps_spectral,
                         maxiter=maxiter_spectral)
    sigma = tf.sqrt(tf.maximum(tf.reduce_sum(tf.matmul(u, gram) * u), 0.0))
    scale = sigma + eps_spectral
    return _from_gram(w / scale, gram / (scale * scale), eps, beta, maxiter), u


def _from_gram(w, gram, eps, beta, maxiter):
    """`gram_space_bjorck` of `w` whose Gram matrix (``W^T W``, or ``W W^T`` when `w` is
    wide) is `gram`."""
    wide = w.shape[0] < w.shape[1]
    eye = tf.eye(min(w.shape), dtype=w.dtype)
    deviation = _symmetric(eye - gram)

    def moved(deviation):
        """``(||W_{k+1} - W_k||_F, D_k^2)``."""
        square = tf.matmul(deviation, deviation)
        energy = tf.reduce_sum(deviation * deviation) - tf.reduce_sum(square * deviation)
        return beta * tf.sqrt(tf.maximum(energy, 0.0)), square

    distance, square = moved(deviation)
    increment = beta * deviation  # Q_1 = b D_0: iteration 1

    def keep_going(iteration, increment, deviation, square, distance):
        return tf.logical_and(distance >= eps, iteration < maxiter)

    def iterate(iteration, increment, deviation, square, distance):
        deviation = _symmetric((1.0 - 2.0 * beta) * deviation
                               + (2.0 * beta - beta * beta) * square
                               + beta * beta * tf.matmul(square, deviation))
        if wide:  # P_{k+1} = M_k P_k for the left factor
            increment = increment + beta * deviation + beta * tf.matmul(deviation, increment)
        else:
            increment = increment + beta * deviation + beta * tf.matmul(increment, deviation)
        distance, square = moved(deviation)
        return iteration + 1, increment, deviation, square, distance

    _, increment, _, _, distance = tf.while_loop(
        keep_going, iterate, (tf.constant(1), increment, deviation, square, distance))
    result = w + (tf.matmul(increment, w) if wide else tf.matmul(w, increment))
    # Diverging, deel-lip's iterates overflow to inf and NaN; here the deviation overflows
    # first and the loop stops on an increment that is still finite: report it as deel-lip.
    return tf.where(tf.math.is_finite(distance), result, tf.constant(float("nan"), w.dtype))


def _symmetric(matrix):
    return 0.5 * (matrix + tf.transpose(matrix))
