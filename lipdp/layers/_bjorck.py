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

So one Gram matrix ``W_0^T W_0`` (m n^2 multiply-adds; 2/3 of them from
`GRAM_BLOCKS_MIN_SIDE` columns on, `symmetric_gram`) and its square start the loop, each
iteration after the first costs three n x n products (n^3 each), and ``W_0 + W_0 Q_K`` (m n^2)
ends it: for K iterations ``2 m n^2 + (3K - 2) n^3`` against deel-lip's ``2 K m n^2``. On the
paper's CNN the dense kernel is 3136 x 512 and deel-lip runs two or three iterations a step:
about half the time. Keeping the deviation ``D`` and the increment ``Q`` instead of ``W^T W``
and ``P`` avoids the cancellations of ``I - W^T W`` and ``W_0 P`` near orthogonality: the
result agrees with deel-lip's to float32 rounding and is as orthogonal
(`tests/test_gram_bjorck.py`). A wide kernel (m < n) is handled the same way on ``W W^T``.

A squarer kernel, or a large one projected with a single iteration (Gram space saves nothing
then), keeps deel-lip's iterates in its own space, written so that the last iteration
certifies its result (`certifying_bjorck`): ``W_K = fl(V P^)`` with V the last input,
``P^ = fl(a I - b G^)`` and ``G^`` V's Gram matrix computed in float32 blocks; in exact
arithmetic ``||V p(G)||^2 = max_i f(lambda_i(G))`` with ``f(l) = l (a - b l)^2``, at most 1
when ``lambda_max(G) <= 4`` (a = 1.5, b = 0.5), and the rounding of each step is bounded from
a few statistics of V, G^ and P^ (`lipdp.gram_certificates.bjorck_step_norm_upper`). The bound
pass uses that certificate for as long as the kernel is exactly the one it certifies. A squarer
kernel orthogonalised without a certificate (on a `bjorck_every` schedule) runs deel-lip's
iterates in its own space with `symmetric_gram` (`kernel_space_bjorck`).

Privacy never rests on this projection: the bounds use the norms certified on the kernel the
forward pass uses (`lipdp.gram_certificates`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from lipdp import operator_norms
from lipdp.gram_certificates import bjorck_step_norm_upper

# Gram-space iterations pay when the long side is at least this many times the short one
# (cost ratio about 1/2 + short/long for two iterations); below it, deel-lip's own loop runs.
GRAM_SPACE_MIN_ASPECT = 3
#: Rows of the float32 blocks of `certifying_bjorck`'s Gram matrices: the bound of their
#: rounding error grows with the block (0.4% of the norm at 256 on the main job's 784 x 1024
#: kernel, 0.2% at 128) and 128 costs no more time than one product (4.0 against 4.6 ms).
CERTIFYING_CHUNK_ROWS = 128


#: A Gram matrix with at least this many rows is computed in `GRAM_BLOCKS` x `GRAM_BLOCKS`
#: blocks, the upper ones only (`symmetric_gram`). On the main job's 784 x 1024 kernel this
#: takes 0.65x the time of one product (5.1 against 7.9 ms on 2 cores; smaller blocks of a
#: small Gram matrix only add operations).
GRAM_BLOCKS_MIN_SIDE = 384
GRAM_BLOCKS = 3


def symmetric_gram(w, wide):
    """``W W^T`` (`wide`) or ``W^T W``: every entry a float32 dot product of two rows
    (columns) of `w`, as in a single product (within ``gamma_n`` of the exact one), and the
    matrix exactly symmetric (a product's ``(i, j)`` and ``(j, i)`` entries, which TensorFlow's
    AVX2 kernels may sum in different orders, averaged: a machine without AVX-512 failed the
    test of it, 2026-12-06). From `GRAM_BLOCKS_MIN_SIDE` rows on, only the blocks on and
    above the diagonal of a `GRAM_BLOCKS` x `GRAM_BLOCKS` split are computed and the others
    mirrored: ``(GRAM_BLOCKS + 1) / (2 GRAM_BLOCKS)`` of the multiply-adds."""
    w = tf.convert_to_tensor(w)
    side = w.shape[0] if wide else w.shape[1]
    if side < GRAM_BLOCKS_MIN_SIDE:
        return _symmetric(tf.matmul(w, w, transpose_a=not wide, transpose_b=wide))
    # Rows of V = W (wide) or W^T (tall) against columns of V^T: V V^T block by block.
    rows = w if wide else tf.transpose(w)
    columns = tf.transpose(w) if wide else w
    cuts = [round(i * side / GRAM_BLOCKS) for i in range(GRAM_BLOCKS + 1)]
    upper = {(i, j): tf.matmul(rows[cuts[i]:cuts[i + 1]], columns[:, cuts[j]:cuts[j + 1]])
             for i in range(GRAM_BLOCKS) for j in range(i, GRAM_BLOCKS)}
    for i in range(GRAM_BLOCKS):  # the diagonal blocks are products of X and X^T
        upper[i, i] = _symmetric(upper[i, i])
    return tf.concat([
        tf.concat([upper[i, j] if j >= i else tf.transpose(upper[j, i])
                   for j in range(GRAM_BLOCKS)], 1)
        for i in range(GRAM_BLOCKS)], 0)


def orthogonalise(w, eps, beta, maxiter):
    """deel-lip's Björck orthogonalisation of the 2-D `w`: in Gram space when one side is at
    least `GRAM_SPACE_MIN_ASPECT` times the other (`gram_space_bjorck`), else in its own
    (`kernel_space_bjorck`). Same arguments, same iterates, same stopping rule."""
    rows, cols = w.shape
    if max(rows, cols) >= GRAM_SPACE_MIN_ASPECT * min(rows, cols):
        return gram_space_bjorck(w, eps, beta, maxiter)
    return kernel_space_bjorck(w, eps, beta, maxiter)


def kernel_space_bjorck(w, eps, beta, maxiter):
    """deel-lip's `bjorck_normalization(w, eps, beta, maxiter)`: the iterates
    ``W <- (1 + b) W - b (W W^T) W`` (``W (W^T W)`` when `w` has more rows than columns), run
    while the last one moved the kernel by ``>= eps`` in Frobenius norm (the first always,
    unless ``9 ||W||_F < eps``: deel-lip's start) and at most `maxiter` times; each Gram
    matrix from `symmetric_gram` (the same entries, computed in blocks)."""
    w = tf.convert_to_tensor(w)
    tall = w.shape[0] > w.shape[1]

    def keep_going(current, previous):
        return tf.linalg.norm(current - previous) >= eps

    def iterate(current, previous):
        del previous
        gram = symmetric_gram(current, wide=not tall)
        product = tf.matmul(current, gram) if tall else tf.matmul(gram, current)
        return (1 + beta) * current - beta * product, current

    result, _ = tf.while_loop(keep_going, iterate, (w, 10 * w), maximum_iterations=maxiter)
    return result


def runs_certifying_bjorck(rows, cols, maxiter=None) -> bool:
    """Whether a rows x cols kernel orthogonalised every step, at most `maxiter` iterations
    a projection, runs `certifying_bjorck`: its sides differ by less than
    `GRAM_SPACE_MIN_ASPECT` (longer ones run in Gram space), or it runs one iteration (one
    Gram matrix and one product in either space) and its certificate from scratch would be
    the chunked Gram matrix (`lipdp.operator_norms`): a smaller kernel's float64 certificate
    in the bound pass's one host call costs less than a host call of its own (the main job's
    1024 x 10 output layer certified by its projection made the step 1.6-3.6% slower)."""
    if max(rows, cols) < GRAM_SPACE_MIN_ASPECT * min(rows, cols):
        return True
    return maxiter == 1 and operator_norms.chunked_certificate(tf.TensorShape([rows, cols]))


def certifying_bjorck(w, eps, beta, maxiter):
    """deel-lip's `bjorck_normalization(w, eps, beta, maxiter)` (same iterates to float32
    rounding, same stopping rule), with a certified upper bound of the result's spectral norm.

    The proof is written for a tall kernel V (p x k, p >= k). Each iteration computes
    ``G^ = fl32(sum_c fl32(V_c^T V_c))`` over blocks of `CERTIFYING_CHUNK_ROWS` rows (zero rows
    pad the last one), ``P^ = fl32(a I - fl32(b G^))`` with the float32 ``a = 1 + b`` and b,
    and ``fl32(V P^)``: deel-lip's ``(1 + b) V - b V (V^T V)``. A wide kernel W (k x p) is V^T
    and is never transposed: its blocks are blocks of columns, ``G^ = fl32(sum_c fl32(W_c
    W_c^T))`` (the same dot products), and ``fl32(P^T W)`` is ``fl32(V P^)^T`` entry for entry
    (the same dot products, in an order the proof leaves free); its statistics are V's, read
    along the other axis. The certificate is computed on the host from the last iteration's
    statistics (`lipdp.gram_certificates.bjorck_step_norm_upper`): inf when the iteration
    did not run or its inputs fall outside the range the proof covers.

    Returns:
        ``(kernel, certificate)``: the float32 result (not finite when the iteration diverged,
        as deel-lip's) and a float32 scalar tensor ``>= ||kernel||_2``.
    """
    w = tf.convert_to_tensor(w)
    wide = w.shape[0] < w.shape[1]
    k, p = w.shape if wide else w.shape[::-1]
    chunks = -(-p // CERTIFYING_CHUNK_ROWS)
    rows = -(-p // chunks)
    alpha, beta32 = np.float32(1.0 + beta), np.float32(beta)

    def gram_of(v):
        padding = [[0, 0], [0, rows * chunks - p]] if wide else [[0, rows * chunks - p], [0, 0]]
        padded = tf.pad(v, padding)
        if wide:  # (chunks, k, rows): the column blocks W_c, and G^ = sum_c W_c W_c^T
            blocks = tf.transpose(tf.reshape(padded, [k, chunks, rows]), [1, 0, 2])
            return tf.reduce_sum(tf.matmul(blocks, blocks, transpose_b=True), 0)
        blocks = tf.reshape(padded, [chunks, rows, k])
        return tf.reduce_sum(tf.matmul(blocks, blocks, transpose_a=True), 0)

    def keep_going(iteration, current, previous, gram, step):
        # The first iteration always runs; the kernels' distance is computed only after it.
        return tf.cond(tf.equal(iteration, 0), lambda: True,
                       lambda: tf.norm(current - previous) >= eps)

    def iterate(iteration, current, previous, gram, step):
        gram = gram_of(current)
        # fl32(a I - fl32(b G^)) entry for entry: off the diagonal 0 - fl32(b g) is exact.
        step = tf.linalg.set_diag(-(beta32 * gram), alpha - beta32 * tf.linalg.diag_part(gram))
        result = (tf.matmul(step, current, transpose_a=True) if wide
                  else tf.matmul(current, step))
        return iteration + 1, result, current, gram, step

    start = (tf.constant(0), w, w, tf.zeros([k, k], w.dtype), tf.zeros([k, k], w.dtype))
    if maxiter == 1:  # no loop: one iteration, no stopping test to evaluate
        iterations, result, last_input, gram, step = iterate(*start)
    else:
        iterations, result, last_input, gram, step = tf.while_loop(
            keep_going, iterate, start, maximum_iterations=maxiter)
    magnitudes = tf.abs(last_input)
    row_sums = tf.reduce_sum(magnitudes, 0 if wide else 1)  # V's rows: p sums of k entries
    abs_gram, abs_step = tf.abs(gram), tf.abs(step)
    stats = tf.stack([
        tf.reduce_max(tf.linalg.matvec(magnitudes, row_sums, transpose_a=not wide)),
        tf.reduce_max(row_sums), tf.reduce_max(magnitudes),
        tf.maximum(tf.reduce_max(tf.reduce_sum(abs_gram, 0)),
                   tf.reduce_max(tf.reduce_sum(abs_gram, 1))),
        tf.maximum(tf.reduce_max(tf.reduce_sum(abs_step, 0)),
                   tf.reduce_max(tf.reduce_sum(abs_step, 1))),
        tf.reduce_max(tf.linalg.diag_part(abs_step)),
        tf.cast(tf.reduce_all(tf.math.is_finite(result)), w.dtype),
        tf.cast(iterations, w.dtype)])

    def certify(stats):
        if not (stats[-1] >= 1 and stats[-2] == 1):  # no iteration, or it diverged
            return np.float32(np.inf)
        return bjorck_step_norm_upper(p, k, rows, chunks, alpha, beta32, *stats[:-2])

    certificate = tf.numpy_function(certify, [stats], tf.float32, stateful=False,
                                    name="bjorck_certificate")
    return result, tf.ensure_shape(certificate, [])


def gram_space_bjorck(w, eps, beta, maxiter):
    """deel-lip's `bjorck_normalization(w, eps, beta, maxiter)`, computed in Gram space
    (module docstring): iteration 1 always runs, iteration k + 1 runs while iteration k moved
    the kernel by ``>= eps`` in Frobenius norm and ``k < maxiter``. A non-finite result (the
    iteration diverges when a singular value exceeds sqrt(3)) is returned as such, as
    deel-lip's is, for the caller to restart from a safer scaling."""
    w = tf.convert_to_tensor(w)
    wide = w.shape[0] < w.shape[1]  # then W_k = P_k W_0 and the Gram matrix is W W^T
    return _from_gram(w, symmetric_gram(w, wide), eps, beta, maxiter)


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
    gram = symmetric_gram(w, wide=False)
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
        # Each sum has two terms with a product between them: Grappler's AddOpsRewrite turns a
        # sum of three same-shape terms into an AddN, and its memory optimizer may turn that
        # AddN into a TemporaryVariable, which fails in a loop's second iteration
        # (AlreadyExistsError; tensorflow/tensorflow#23780).
        deviation = _symmetric((1.0 - 2.0 * beta) * deviation + tf.matmul(
            square, (2.0 * beta - beta * beta) * eye + beta * beta * deviation))
        if wide:  # P_{k+1} = M_k P_k for the left factor
            increment = increment + beta * (deviation + tf.matmul(deviation, increment))
        else:
            increment = increment + beta * (deviation + tf.matmul(increment, deviation))
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
