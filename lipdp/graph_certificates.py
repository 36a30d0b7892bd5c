"""The certified spectral norm of a dense kernel with a small side, in float64 TensorFlow ops.

`lipdp.gram_certificates.dense_norm_upper` certifies ``||W||_2`` on the host (numpy) from the
Gram matrix of W's smaller side. Inside a private step that host call holds one of
TensorFlow's pool threads, and the step's sharded operations wait for it: on the main job's MLP
at batch 256 the step ran 0.945x as long without it (paired), although the certificate of its
1024 x 10 output layer is 0.1 ms of numpy. `dense_norm_upper_in_graph` computes the same
certificate in the step's graph, in float64, for kernels whose smaller side has at most
`IN_GRAPH_MAX_SIDE` entries; `lipdp.operator_norms.certified_norms` routes such requests here.

The proof is `lipdp.gram_certificates`' (its module docstring), steps 1 and 3, with the same
arithmetic model: W (p x k, p >= k after transposing) is converted to float64 exactly, but
for its subnormal entries E, which TensorFlow's threads flush to zero: the steps below certify
W' = W - E, and the result adds ``||E||_2 <= sqrt(n) 2^-126`` (n counted from the bits; that
module's "Subnormal entries"). A float32 kernel's products never underflow in float64 (their
magnitudes are at least 2^-298).

1. ``F = fl(sum W_ij^2) (1 + 2 gamma_{pk})`` bounds ``||W||_F^2`` (any summation order), and
   ``G^ = fl(W^T W)`` (TensorFlow's float64 product, any order of each dot product) satisfies
   ``||G^ - W^T W||_2 <= gamma_p F =: e_G``.
2. An estimate l of ``lambda_max(G^)``: the top eigenvalue from ``tf.linalg.eigvalsh``, at least
   the largest diagonal entry. It only picks the shifts; it never enters the bound.
3. For each shift ``t^2 = fl(l (1 + s) + e_G)``, s in `CHOLESKY_SHIFTS`,
   ``M^ = fl(t^2 I - G^)`` (off its diagonal exact; its diagonal within
   ``e_D = 4u max_i (t^2 + |G^_ii|)`` of ``t^2 - G^_ii``: two roundings in any order, so the
   bound does not rest on how a graph rewrite evaluates the subtraction; the host's
   ``2u |M^_ii|`` assumes one) is factorised by ``tf.linalg.cholesky`` (Eigen's LLT; a failed
   factorisation comes back filled with NaN). A factorisation that completes gives
   ``lambda_max(W^T W) <= t^2 + e_C + e_D + e_G`` with ``e_C = gamma_{k+1} tr|M^| / (1 -
   gamma_{k+1})`` (Higham, Theorem 10.3, any ordering of the inner products). The first shift
   whose factor is finite decides.
4. No shift succeeds (never seen): the top eigenvalue plus ``EIG_RELATIVE_MARGIN k max|G^|``
   and e_G, `lipdp.gram_certificates`' step 6.

The result is ``sqrt(max(lambda, 0)) (1 + 16u)`` (the float64 roundings of the last sums,
products and the square root), plus the subnormal entries' term when there are any, rounded up
to float32; 0 for a zero kernel, +inf for a kernel with a non-finite entry. It bounds the
norm; on the main job's output layer it lies within sqrt(1 + 2e-6) of it
(`tests/test_graph_certificates.py`), as the host's does.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import tensorflow as tf

from lipdp.gram_certificates import (CHOLESKY_SHIFTS, EIG_RELATIVE_MARGIN,
                                     FLOAT32_MAGNITUDE_MASK, FLOAT32_SMALLEST_NORMAL_BITS, MU32,
                                     U64, gamma64)

#: Kernels whose smaller side has at most this many entries are certified in the graph
#: (`dense_norm_upper_in_graph`); larger ones on the host, where the Lanczos estimate and the
#: Gram matrix's float64 product cost less than TensorFlow's eigen-decomposition.
IN_GRAPH_MAX_SIDE = 32
#: ... and whose Gram matrix costs at most this many float64 multiply-adds ``p k^2``.
IN_GRAPH_MAX_WORK = 2 ** 22
_FINAL_SLACK = 1.0 + 16.0 * U64


def oriented_size(shape):
    """``(p, k, wide)`` of a dense kernel of static `shape` reshaped to ``(-1, out)``: its long
    and short sides, and whether the long one is ``out``; None when the shape is not fully
    known."""
    shape = tf.TensorShape(shape)
    if not shape.is_fully_defined() or shape.rank is None or shape.rank < 2:
        return None
    rows, cols = math.prod(int(d) for d in shape[:-1]), int(shape[-1])
    return max(rows, cols), min(rows, cols), rows < cols


def certified_in_graph(shape) -> bool:
    """Whether a dense kernel of `shape` is certified by `dense_norm_upper_in_graph`: fully
    known, its smaller side at most `IN_GRAPH_MAX_SIDE` and its Gram matrix at most
    `IN_GRAPH_MAX_WORK` multiply-adds."""
    size = oriented_size(shape)
    return (size is not None and size[1] <= IN_GRAPH_MAX_SIDE
            and size[0] * size[1] ** 2 <= IN_GRAPH_MAX_WORK)


def dense_norm_upper_in_graph(kernel):
    """A float32 scalar tensor ``>= ||kernel||_2`` (the kernel reshaped to ``(-1, out)``), by
    the proof of the module docstring; `certified_in_graph` must hold for its shape. Placed
    on the CPU, whose Cholesky kernel reports a failed factorisation (NaN).

    Inside a traced function, the certificate is a call of a graph function shared by every
    kernel of the same shape and dtype in the process (`_traced_certificate`): traced once,
    not once per layer and per traced step. The function is pure (the kernel in, the bound
    out), so sharing it changes no value."""
    kernel = tf.convert_to_tensor(kernel)
    if tf.executing_eagerly():
        return _on_the_cpu(kernel)
    return _traced_certificate(tuple(kernel.shape), kernel.dtype.name)(kernel)


def _on_the_cpu(kernel):
    with tf.device("/CPU:0"):
        return _dense_norm_upper(kernel)


@functools.lru_cache(maxsize=256)
def _traced_certificate(shape, dtype):
    """The graph function of `_dense_norm_upper` for kernels of `shape` and `dtype`."""
    return tf.function(_on_the_cpu, autograph=False,
                       input_signature=[tf.TensorSpec(shape, tf.as_dtype(dtype))])


def _dense_norm_upper(kernel):
    p, k, wide = oriented_size(kernel.shape)
    w = tf.reshape(tf.cast(tf.convert_to_tensor(kernel), tf.float64), [-1, kernel.shape[-1]])
    if wide:
        w = tf.transpose(w)  # p x k, p >= k: the Gram matrix of the smaller side is W^T W
    squares = tf.reduce_sum(w * w)
    finite, zero = tf.math.is_finite(squares), tf.equal(squares, 0.0)
    # A zero or non-finite kernel's result is decided at the end (0, inf); its arithmetic runs
    # on the identity instead, whose factorisations succeed.
    usable = tf.logical_and(finite, tf.logical_not(zero))
    w = tf.where(usable, w, tf.eye(p, k, dtype=tf.float64))
    frobenius_sq = (tf.where(usable, squares, tf.constant(float(k), tf.float64))
                    * (1.0 + 2.0 * gamma64(p * k)))
    gram = tf.matmul(w, w, transpose_a=True)
    gram_diagonal = tf.linalg.diag_part(gram)  # sums of squares: non-negative
    largest_diagonal = tf.reduce_max(gram_diagonal)
    gram_error = gamma64(p) * frobenius_sq
    eigenvalues = tf.linalg.eigvalsh(gram)
    estimate = tf.maximum(eigenvalues[-1], largest_diagonal)
    shifts = tf.constant(CHOLESKY_SHIFTS, tf.float64)
    t_sq = estimate * (1.0 + shifts) + gram_error  # one per shift
    shifted = tf.linalg.set_diag(
        tf.broadcast_to(-gram, [len(CHOLESKY_SHIFTS), k, k]),
        t_sq[:, None] - gram_diagonal[None, :])
    diagonal = tf.abs(tf.linalg.diag_part(shifted))
    factors = tf.linalg.cholesky(shifted)
    succeeded = tf.reduce_all(tf.math.is_finite(factors), axis=[1, 2])
    factor_gamma = gamma64(k + 1)
    diagonal_error = 4.0 * U64 * (t_sq + largest_diagonal)
    upper = (t_sq + factor_gamma * tf.reduce_sum(diagonal, 1) / (1.0 - factor_gamma)
             + diagonal_error + gram_error)
    fallback = (eigenvalues[-1] + EIG_RELATIVE_MARGIN * k * tf.reduce_max(tf.abs(gram))
                + gram_error)
    first = tf.argmax(tf.cast(succeeded, tf.int32))  # the first success (0 when none)
    lam = tf.where(tf.reduce_any(succeeded), tf.gather(upper, first), fallback)
    norm = tf.sqrt(tf.maximum(lam, 0.0)) * _FINAL_SLACK
    norm = tf.where(finite, norm, tf.constant(np.inf, tf.float64))
    norm = tf.where(zero, tf.zeros_like(norm), norm)
    return _round_up_to_float32(_plus_flushed_entries(norm, kernel))


def _plus_flushed_entries(norm, kernel):
    """`norm` plus the bound of the float32 `kernel`'s subnormal entries, as
    `lipdp.gram_certificates.flushed_entries_bound`: `norm` itself when there are none."""
    magnitudes = tf.bitwise.bitwise_and(tf.bitcast(tf.cast(kernel, tf.float32), tf.int32),
                                        FLOAT32_MAGNITUDE_MASK)
    subnormal = tf.logical_and(magnitudes > 0, magnitudes < FLOAT32_SMALLEST_NORMAL_BITS)
    entries = tf.reduce_sum(tf.cast(subnormal, tf.float64))
    return tf.where(entries > 0, (norm + tf.sqrt(entries) * MU32) * (1.0 + 8.0 * U64), norm)


def _round_up_to_float32(value):
    """The smallest float32 ``>= value`` (a float64 scalar tensor, non-negative or inf)."""
    rounded = tf.cast(value, tf.float32)
    return tf.where(tf.cast(rounded, tf.float64) >= value, rounded,
                    tf.math.nextafter(rounded, tf.constant(np.inf, tf.float32)))
