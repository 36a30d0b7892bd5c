"""Certified upper bounds on the operator norm of linear layers.

Projections (spectral normalisation, Björck, RKO) are iterative and numerical:
power iteration returns a *lower* bound of the largest singular value, so a kernel
"normalised" by it may have a spectral norm slightly above 1. lipdp never uses
such estimates in a privacy bound. The functions below return *upper* bounds of
the operator norm, computed from the current weights:

- dense kernels: a Cholesky test of ``t^2 I - W^T W`` in float64 (the Gram
  matrix of the smaller side, computed by BLAS), with every rounding error of the
  Gram matrix, of the shift and of the factorisation added to ``t^2``: a proven
  bound at most ``(1 + 1e-6)^(1/2)`` times the exact norm in practice, for one Gram
  matrix and one Cholesky factorisation; for a near-orthogonal kernel (after the
  projections), ``lambda_max <= c + ||G - c I||_F`` from the Gram matrix alone
  (`dense_spectral_norm_upper`);
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

_U64 = 2.0 ** -53  # unit roundoff of float64
# Shifts tried by the Cholesky test, relative to a lower estimate of the largest
# eigenvalue: the first that succeeds is the certificate (at most that much above it).
_CHOLESKY_SHIFTS = (1e-6, 1e-4, 1e-2, 1.0)
# ||G^ - c I||_F / c below which lambda_max(G) <= c + ||G^ - c I||_F serves (Björck leaves
# ~1e-5 on a 784 x 1024 kernel): at most sqrt(1 + 1e-4) above the exact norm.
_NEAR_MULTIPLE_OF_IDENTITY = 1e-4
_LANCZOS_STEPS = 30


def _gamma64(n):
    """``n u / (1 - n u)`` in float64 (Higham's gamma_n)."""
    return n * _U64 / (1.0 - n * _U64)


def _max_eig_upper(gram):
    """Upper bound of the largest eigenvalue of a batch of Hermitian PSD matrices."""
    eigs = tf.linalg.eigvalsh(gram)
    lam = tf.reduce_max(tf.math.real(eigs))
    scale = tf.reduce_max(tf.abs(gram))
    n = tf.cast(tf.shape(gram)[-1], tf.float64)
    return lam + _EIG_RELATIVE_MARGIN * n * scale


def _round_up_float32(value):
    """The smallest float32 >= `value` (a non-negative float64)."""
    rounded = np.float32(value)
    return rounded if rounded >= value else np.nextafter(rounded, np.float32(np.inf))


def _largest_eigenvalue_estimate(gram):
    """An estimate (not a bound) of the largest eigenvalue of the symmetric `gram`:
    the largest Ritz value of ``_LANCZOS_STEPS`` Lanczos steps from a fixed vector,
    with full reorthogonalisation (about 1e-7 relative on the kernels of lipdp's
    layers, orthogonal or Gaussian), and at least the largest diagonal entry."""
    k = gram.shape[0]
    steps = min(_LANCZOS_STEPS, k)
    basis = np.zeros((steps, k))
    alpha, beta = np.zeros(steps), np.zeros(steps)
    q = np.cos(np.arange(1, k + 1, dtype=np.float64)) + 2.0  # fixed, positive
    q /= np.linalg.norm(q)
    for j in range(steps):
        basis[j] = q
        r = gram @ q
        alpha[j] = q @ r
        for _ in range(2):  # full reorthogonalisation, twice
            r -= basis[:j + 1].T @ (basis[:j + 1] @ r)
        norm = np.linalg.norm(r)
        if j + 1 == steps or not norm > 1e-12 * max(abs(alpha[j]), 1e-300):
            steps = j + 1
            break
        beta[j], q = norm, r / norm
    tridiagonal = (np.diag(alpha[:steps]) + np.diag(beta[:steps - 1], 1)
                   + np.diag(beta[:steps - 1], -1))
    return max(float(np.linalg.eigvalsh(tridiagonal)[-1]), float(np.max(np.diag(gram))))


def gram_spectral_norm_upper(kernel) -> np.float32:
    """Certified upper bound of ``||W||_2`` for a float32 matrix (numpy, float32 result).

    W (``(p, k)`` after transposing so that ``k <= p``) is converted to float64
    exactly; G = W^T W. With ``u = 2^-53`` and conventional (non-Strassen) BLAS:

    1. The computed Gram matrix satisfies ``|G^ - G| <= gamma_p |W|^T |W|``
       entry-wise, in any summation order (Higham, eq. 3.13), so
       ``||G^ - G||_2 <= gamma_p || |W| ||_2^2 <= gamma_p ||W||_F^2 =: e_G``
       (the squared Frobenius norm is a float64 sum of pk exact squares, enlarged
       by ``1 + 2 gamma_{pk}``).
    2. For a shift t^2, the computed ``M^ = fl(t^2 I - G^)`` differs from
       ``t^2 I - G^`` on its diagonal only, by at most ``2u |M^_ii| =: e_D``.
    3. If LAPACK's Cholesky factorisation of M^ (``numpy.linalg.cholesky``, which
       reads one triangle: the bounds above hold entry-wise for both) runs to
       completion, the computed factor satisfies ``R^T R = M^ + dM`` with
       ``|dM| <= gamma_{k+1} |R^T| |R|`` (Higham, Theorem 10.3, which holds for
       every ordering of the inner products, blocked ones included), hence
       ``||dM||_2 <= gamma_{k+1} ||R||_F^2 <= gamma_{k+1} tr|M^| / (1 - gamma_{k+1})
       =: e_C``, and ``M^ >= -e_C I`` since ``R^T R >= 0``.

    0. Shortcut for near-orthogonal kernels (what the projections produce): for
       any c, ``v^T G v <= v^T G^ v + e_G <= c + ||G^ - c I||_F + e_G`` for unit
       v. With c the mean of G^'s diagonal and the Frobenius norm computed in
       float64 (enlarged by ``1 + gamma_{k^2+4}`` for the subtractions, squares,
       sum and square root), this is the bound whenever ``||G^ - c I||_F <= 1e-4 c``
       (then at most ``sqrt(1 + 1e-4)`` times the exact norm). Otherwise:

    Then ``t^2 I - G = M^ - (diagonal <= e_D) + (G^ - G) >= -(e_C + e_D + e_G) I``,
    i.e. ``lambda_max(G) <= t^2 + e_C + e_D + e_G``, whose square root (times
    ``1 + 16u``, covering the float64 sums, square root and product) rounded *up* to float32
    is returned. The shifts tried are ``t^2 = l (1 + s)`` for s in
    ``_CHOLESKY_SHIFTS``, with l a lower estimate of ``lambda_max(G^)``; if none
    succeeds (never seen), the largest eigenvalue from ``numpy.linalg.eigvalsh``
    plus ``1e-9 k max|G^|`` (the eigen-solver's backward error) and e_G is used.
    All margins are below 1e-9 relative for realistic layers: the certificate is
    at most ``sqrt(1 + 1e-6)`` times the exact norm when the first shift succeeds
    (the estimate is a Lanczos Ritz value, within 1e-6 of lambda_max on every
    kernel tried).
    """
    w = np.asarray(kernel, np.float32).astype(np.float64)
    w = w.reshape(-1, w.shape[-1])
    if w.shape[0] < w.shape[1]:
        w = w.T
    p, k = w.shape
    frobenius_sq = float(np.sum(w * w)) * (1.0 + 2.0 * _gamma64(p * k))
    if frobenius_sq == 0.0:
        return np.float32(0.0)
    if not np.isfinite(frobenius_sq):
        return np.float32(np.inf)
    gram = w.T @ w
    gram_error = _gamma64(p) * frobenius_sq
    # A near-orthogonal kernel (c = the mean squared column norm): no factorisation.
    centre = float(np.trace(gram)) / k
    deviation = gram.copy()
    deviation[np.diag_indices(k)] -= centre
    spread = float(np.linalg.norm(deviation)) * (1.0 + _gamma64(k * k + 4))
    if spread <= _NEAR_MULTIPLE_OF_IDENTITY * centre:
        return _round_up_float32(np.sqrt(centre + spread + gram_error) * (1.0 + 16.0 * _U64))
    estimate = _largest_eigenvalue_estimate(gram)
    for shift in _CHOLESKY_SHIFTS:
        t_sq = estimate * (1.0 + shift) + gram_error
        shifted = -gram
        shifted[np.diag_indices(k)] += t_sq
        diagonal = np.abs(np.diag(shifted))
        try:
            np.linalg.cholesky(shifted)
        except np.linalg.LinAlgError:
            continue
        else:
            factor_error = _gamma64(k + 1) * float(np.sum(diagonal)) / (1.0 - _gamma64(k + 1))
            bound = t_sq + factor_error + 2.0 * _U64 * float(np.max(diagonal)) + gram_error
            return _round_up_float32(np.sqrt(bound) * (1.0 + 16.0 * _U64))
    largest = float(np.max(np.linalg.eigvalsh(gram)))
    bound = largest + _EIG_RELATIVE_MARGIN * k * float(np.max(np.abs(gram))) + gram_error
    return _round_up_float32(np.sqrt(max(bound, 0.0)) * (1.0 + 16.0 * _U64))


def dense_spectral_norm_upper(kernel):
    """Upper bound of ``||kernel||_2`` (largest singular value) for a 2D kernel.

    Formal guarantee: the result (a float32 scalar tensor) is >= the exact spectral
    norm of `kernel` (`gram_spectral_norm_upper`: a Cholesky test with every
    rounding error bounded), whatever the projection did. Runs on the host, in
    the compiled train step too (``tf.numpy_function``).
    """
    bound = tf.numpy_function(gram_spectral_norm_upper, [tf.convert_to_tensor(kernel)],
                              tf.float32, stateful=False, name="certified_spectral_norm")
    return tf.ensure_shape(bound, [])


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
    k = tf.transpose(tf.cast(kernel, tf.float64), [2, 3, 0, 1])  # (C_in, C_out, kh, kw)
    # A real kernel has K_hat(-w) = conj(K_hat(w)), with the same singular values: the
    # half-spectrum of the real FFT holds every frequency up to that symmetry.
    k_hat = tf.signal.rfft2d(k, fft_length=[nh, nw])  # (C_in, C_out, nh, nw // 2 + 1)
    k_hat = tf.transpose(k_hat, [2, 3, 0, 1])  # (nh, nw // 2 + 1, C_in, C_out)
    if cin <= cout:
        gram = tf.matmul(k_hat, k_hat, adjoint_b=True)  # (..., C_in, C_in)
    else:
        gram = tf.matmul(k_hat, k_hat, adjoint_a=True)  # (..., C_out, C_out)
    lam = _max_eig_upper(gram)
    return _round_up_to_float32(tf.sqrt(tf.maximum(lam, 0.0)))


def _round_up_to_float32(value):
    """The smallest float32 >= `value` (a float64 tensor): a plain cast rounds to nearest."""
    rounded = tf.cast(value, tf.float32)
    below = tf.cast(rounded, tf.float64) < value
    return tf.where(below, tf.math.nextafter(rounded, tf.constant(np.inf, tf.float32)), rounded)


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
