"""Proven upper bounds of spectral norms from Gram matrices, in float64 on the host (numpy).

The largest singular value of a matrix K is ``sqrt(lambda_max(K K^H))``. Every bound
here follows one recipe, with every rounding error bounded (``u = 2^-53``; IEEE
float64, correctly rounded ``+ - * / sqrt``, conventional non-Strassen BLAS and
LAPACK; ``gamma_n = n u / (1 - n u)``; complex arithmetic is covered by taking
``gamma_{4n}`` wherever real arithmetic needs ``gamma_n``, Higham section 3.6):

1. **Gram matrices.** For the computed ``G^ = fl(K^H K)`` (inner dimension p, any
   summation order): ``|G^ - G| <= gamma_p |K|^H |K|`` entry-wise (Higham eq. 3.13),
   so ``||G^ - G||_2 <= gamma_p || |K| ||_2^2 <= gamma_p ||K||_F^2 =: e_G``. A
   matrix K itself computed with error (the Fourier transform of a convolution
   kernel) is handled by Weyl: ``sigma_max(K) <= sigma_max(K^) + ||K - K^||_2``; or the
   convolution's Gram matrices are formed from products of its taps, with their error
   against those of the exact transform (`_grams_by_tap_pairs`).
2. **Near-orthogonal shortcut** (one real matrix): for any c and unit v,
   ``v^T G v <= v^T G^ v + e_G <= c + ||G^ - c I||_F + e_G``. With c the mean of the
   diagonal, this is the bound when ``||G^ - c I||_F <= 1e-4 c`` (what Björck leaves:
   about 1e-5 on a 784 x 1024 kernel): at most ``sqrt(1 + 1e-4)`` above the norm.
3. **Cholesky test.** For a shift t^2, ``M^ = fl(t^2 I - G^)`` differs from
   ``t^2 I - G^`` on its diagonal only, by at most ``2u |M^_ii| =: e_D``. If LAPACK's
   Cholesky factorisation of M^ (which reads one triangle; the bounds above hold
   entry-wise for both) runs to completion, the computed factor satisfies
   ``R^H R = M^ + dM``, ``|dM| <= gamma_{k+1} |R^H| |R|`` (Higham, Theorem 10.3, for
   every ordering of the inner products, blocked ones included), hence
   ``||dM||_2 <= gamma_{k+1} ||R||_F^2 <= gamma_{k+1} tr|M^| / (1 - gamma_{k+1}) =: e_C``
   and ``M^ >= -e_C I``. So ``t^2 I - G >= -(e_C + e_D + e_G) I``: ``lambda_max(G)
   <= t^2 + e_C + e_D + e_G``. The shifts tried are ``t^2 = l (1 + s)``, s in
   ``CHOLESKY_SHIFTS``, l an estimate of ``lambda_max(G^)`` (for one matrix, LAPACK's
   eigenvalues when it has at most `EIGVALSH_ESTIMATE_MAX_SIDE` rows, else Lanczos from a
   fixed vector or from a caller's guess of the top eigenvector, e.g. the layer's cached
   power-iteration vector: the estimate only picks the shift, never enters the bound;
   for a batch, power iteration ranks the matrices and the
   eigenvalues of the eight best ranked decide, and when the first test fails the
   eigenvalues of every matrix decide instead: on clustered spectra the ranking can
   miss the top matrix, and the shift ladder alone then certified 0.8% above the norm
   after four factorisations); one batched factorisation tests every matrix. The
   shifts after 1e-6 are for the kernels a Björck schedule leaves between refreshes:
   after an Adam step and a spectral normalisation the top eigenvalues crowd within
   1e-4 to 1e-3 of each other and 30 Lanczos steps can settle below the top by as much
   (eight seeded draws: 2e-7 to 1e-3); the former ladder (1e-6, 1e-4, 1e-2, 1) needed
   three factorisations on one of them and certified at 1e-2 (0.5% above the norm), the
   present one two, at 3e-4 (1.5e-4 above).
4. **Chunked float32 Gram matrices** (large dense kernels, `chunked_gram_error`): for a
   p x k matrix W split into ``c`` blocks of ``b`` rows (zero rows pad the last one),
   ``G^ = fl32(sum_c fl32(W_c^T W_c))``: each block product in float32 (any summation
   order, fused or not: ``gamma32_b |W_c|^T |W_c|``, Higham eq. 3.13, plus underflow), the
   c blocks summed in float32 in any order (``gamma32_{c-1}`` of the sum of their absolute
   values, plus underflow). Entry-wise, ``|G^ - G| <= eps |W|^T |W| + a`` with
   ``eps = gamma32_b + gamma32_{c-1} (1 + gamma32_b)`` and a per-entry underflow term a, so
   ``||G^ - G||_2 <= eps rho(|W|^T |W|) + k a``, and ``rho(|W|^T |W|) <= max_i
   (|W|^T |W| 1)_i`` (Collatz-Wielandt: the Perron root of a non-negative matrix A is at
   most ``max_i (A x)_i / x_i`` for every positive x; here x = 1), computed in float32 from the
   row sums ``r = |W| 1`` with its own rounding and underflow bounded. On a near-orthogonal
   kernel ``rho(|W|^T |W|)`` is about ``(2 / pi) k``, so with b = 392 the bound is 0.8% of
   ``||W||^2`` (0.4% of the norm) on the paper's CNN's 3136 x 512 kernel, in 0.6x the time
   of the float64 Gram matrix.
5. **The last Björck iteration** (`bjorck_step_norm_upper`; no Gram matrix of the result):
   ``W^ = fl32(V P^)`` with ``P^ = fl32(a I - fl32(b G^))`` and ``G^`` V's chunked Gram
   matrix (step 4). In exact arithmetic ``||V p(G)||^2 = max_i f(lambda_i(G))``,
   ``f(x) = x (a - b x)^2``, at most 1 for deel-lip's a = 1.5, b = 0.5 whenever
   ``lambda_max(G) <= 4``; the function bounds lambda_max by the row sums of ``|G^|`` and
   adds the roundings of G^, P^ and the product: 0.3% above the norm on the main job's
   784 x 1024 kernel (the worst-case float32 error of its Gram matrix and product).
6. **Fallback** (no shift succeeded; never seen): the largest eigenvalue from
   ``numpy.linalg.eigvalsh`` plus ``1e-9 k max|G^|`` (the eigen-solver's backward
   error, ~k u ||G^||, with a wide margin) and e_G.

The final square root, sums and products add a relative ``16u``; the result is
rounded *up* to float32. All margins are below 1e-9 relative for lipdp's layers.

**Subnormal entries.** TensorFlow runs its kernels, and the numpy code of a
``tf.numpy_function`` (how these certificates run inside a train step), on threads that flush
subnormal float32 operands to zero: there the float64 copy of the kernel is W' = W - E, E
the kernel's subnormal entries (magnitudes below ``mu = 2^-126``), and every step above
certifies W'. Each certificate adds ``||E|| <= sqrt(n) mu`` (`flushed_entries_bound`, n
counted from the bits, which flushing does not touch): ``||W||_2 <= ||W'||_2 + ||E||_2``,
and a convolution by E has an operator norm of at most ``sum_t ||E_t||_F <= sqrt(T)
||E||_F``. Without flushing W' = W and the term only loosens the bound; a kernel with no
subnormal entry gets exactly the certificate it got without it. Without the term an
all-subnormal kernel was certified 0 inside the step (its norm 1.3e-38 on a 20 x 8 one).
"""

from __future__ import annotations

import numpy as np

from lipdp.rounding import SMALLEST_NORMAL as MU32  # float32: what an underflow moves a value
from lipdp.rounding import UNIT_ROUNDOFF as U32  # float32's unit roundoff
from lipdp.rounding import gamma as gamma32  # float32's gamma_n

U64 = 2.0 ** -53
CHOLESKY_SHIFTS = (1e-6, 3e-4, 3e-3, 3e-2, 1.0)
NEAR_MULTIPLE_OF_IDENTITY = 1e-4
EIG_RELATIVE_MARGIN = 1e-9
LANCZOS_STEPS = 30
#: Up to this many rows a single Gram matrix's top eigenvalue is estimated by LAPACK's
#: ``eigvalsh`` rather than Lanczos: exact to rounding, and faster (one thread: 0.007
#: against 0.13 ms at 10 rows, the main job's 1024 x 10 output layer, certified at every
#: step; 0.14 against 0.39 ms at 64, 0.58 against 0.60 at 128, 2.3 against 0.63 at 256).
EIGVALSH_ESTIMATE_MAX_SIDE = 96
# Ten batched iterations rank the frequency matrices well enough for eight candidates to hold
# the largest eigenvalue (20 and 4 before: the same estimates on trained, perturbed, Gaussian
# and orthogonal 3x3x32x64 kernels, in 0.7x the time; 10 and 4 missed on a Gaussian 64->32).
POWER_ITERATIONS = 10
POWER_CANDIDATES = 8
#: A complex exponential's time in real multiply-adds, in numpy on a 2-core CPU (about 35 ns
#: against 0.13 ns): it decides between the two ways to the frequency Gram matrices of a
#: convolution (`conv_norm_upper`).
TWIDDLE_COST = 256
_FINAL_SLACK = 1.0 + 16.0 * U64


def gamma64(n) -> float:
    """``n u / (1 - n u)`` in float64 (Higham's gamma_n)."""
    return n * U64 / (1.0 - n * U64)


#: A float32's bits with the sign cleared, and the bits of its smallest normal magnitude
#: (2^-126): a magnitude's bits are non-zero and below it exactly for a subnormal.
FLOAT32_MAGNITUDE_MASK = 0x7FFFFFFF
FLOAT32_SMALLEST_NORMAL_BITS = 0x00800000


def float32_values(kernel) -> np.ndarray:
    """`kernel` as a float32 array, when its values are float32 numbers (any dtype holding
    them exactly: a float64 copy of float32 weights passes): the certificates below bound
    the norm of those values.

    Raises:
        TypeError: a value float32 does not hold exactly (a float64 kernel's certificate
            would be that of its float32 rounding, which can be below its own norm).
    """
    array = np.asarray(kernel)
    if array.dtype == np.float32:
        return array
    rounded = array.astype(np.float32)
    with np.errstate(invalid="ignore"):
        exact = np.array_equal(rounded.astype(array.dtype), array, equal_nan=True)
    if not exact:
        raise TypeError(f"The certificates bound float32 kernels; this {array.dtype} kernel "
                        "holds values float32 rounds (its rounding's norm can be below its "
                        "own): cast it to float32 first, or certify it another way.")
    return rounded


def subnormal_count(kernel) -> int:
    """How many entries of the float32 `kernel` are subnormal (non-zero, below ``2^-126`` in
    magnitude), read from their bits: a thread that flushes subnormals reads them as 0."""
    bits = (np.ascontiguousarray(kernel, np.float32).view(np.uint32)
            & np.uint32(FLOAT32_MAGNITUDE_MASK))
    return int(np.count_nonzero((bits != 0) & (bits < np.uint32(FLOAT32_SMALLEST_NORMAL_BITS))))


def flushed_entries_bound(value, entries) -> float:
    """`value` (a non-negative float64 bound of ``||W'||``, possibly inf) plus
    ``sqrt(entries) 2^-126``, a bound of the norm that `entries` flushed subnormal entries
    take away (module docstring), as a float64 bound of the sum: ``(value + sqrt(entries)
    mu) (1 + 8u)`` covers the rounding of the square root, the sum and the product. `value`
    itself when `entries` is 0."""
    if entries == 0:
        return value
    return (value + float(np.sqrt(float(entries))) * MU32) * (1.0 + 8.0 * U64)


def round_up_float32(value) -> np.float32:
    """The smallest float32 >= `value` (a non-negative float64)."""
    rounded = np.float32(value)
    return rounded if rounded >= value else np.nextafter(rounded, np.float32(np.inf))


def _start_vector(k, start):
    """A unit float64 vector: a fixed vector, plus `start` normalised when it is a usable
    guess (k finite entries, not all zero). The fixed part keeps a component along every
    eigenvector a bad guess would miss (a guess orthogonal to the top one would otherwise
    hide it from Lanczos: a looser certificate, never a wrong one)."""
    fixed = np.cos(np.arange(1, k + 1, dtype=np.float64)) + 2.0
    fixed /= np.linalg.norm(fixed)
    if start is None:
        return fixed
    with np.errstate(all="ignore"):
        q = np.asarray(start, np.float64).ravel()
        norm = np.linalg.norm(q) if q.shape == (k,) else np.nan
        if not (np.isfinite(norm) and norm > 0):
            return fixed
        q = q / norm + fixed
        norm = np.linalg.norm(q)
    return q / norm if norm > 0.1 else fixed


def _lanczos_estimate(gram, start=None) -> float:
    """An estimate (not a bound) of ``lambda_max`` of one symmetric matrix: the largest
    Ritz value of `LANCZOS_STEPS` Lanczos steps, fully reorthogonalised, from `start`
    (a guess of the top eigenvector) or a fixed vector. Within 1e-6 relative on
    orthogonal and Gaussian kernels from the fixed vector; on a spectrally normalised
    784 x 1024 kernel, whose top singular values crowd near 1, 1e-5 from it and 1e-8
    with the power-iteration vector added (`_start_vector`)."""
    k = gram.shape[0]
    steps = min(LANCZOS_STEPS, k)
    basis = np.zeros((steps, k))
    alpha, beta = np.zeros(steps), np.zeros(steps)
    q = _start_vector(k, start)
    for j in range(steps):
        basis[j] = q
        r = gram @ q
        alpha[j] = q @ r
        for _ in range(2):
            r -= basis[:j + 1].T @ (basis[:j + 1] @ r)
        norm = np.linalg.norm(r)
        if j + 1 == steps or not norm > 1e-12 * max(abs(alpha[j]), 1e-300):
            steps = j + 1
            break
        beta[j], q = norm, r / norm
    tridiagonal = (np.diag(alpha[:steps]) + np.diag(beta[:steps - 1], 1)
                   + np.diag(beta[:steps - 1], -1))
    return float(np.linalg.eigvalsh(tridiagonal)[-1])


def _top_eigenvalue_estimate(gram, start=None) -> float:
    """An estimate (not a bound) of ``lambda_max`` of one symmetric matrix: LAPACK's up to
    `EIGVALSH_ESTIMATE_MAX_SIDE` rows (`start` unused), `_lanczos_estimate`'s above."""
    if gram.shape[0] <= EIGVALSH_ESTIMATE_MAX_SIDE:
        return float(np.linalg.eigvalsh(gram)[-1])
    return _lanczos_estimate(gram, start)


def _power_estimate(grams) -> float:
    """An estimate (not a bound) of the largest ``lambda_max`` over a batch: Rayleigh
    quotients after `POWER_ITERATIONS` batched power iterations rank the matrices;
    the exact eigenvalues of the `POWER_CANDIDATES` best ranked decide."""
    v = np.ones(grams.shape[:2], grams.dtype)[..., None]
    for _ in range(POWER_ITERATIONS):
        v = grams @ v
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-300)
    quotients = np.real(np.swapaxes(np.conj(v), 1, 2) @ grams @ v)[:, 0, 0]
    candidates = grams[np.argsort(quotients)[-POWER_CANDIDATES:]]
    return float(np.max(np.linalg.eigvalsh(candidates)))


def max_eigenvalue_upper(grams, gram_error, complex_arithmetic=False, start=None) -> float:
    """Upper bound of ``max_b lambda_max(G_b)`` for every Hermitian ``G_b`` with
    ``||G_b - grams[b]||_2 <= gram_error`` (steps 2, 3 and 6 of the module docstring; a
    1 x 1 matrix is its own eigenvalue: the largest real part plus the error).

    Args:
        grams: ``(batch, k, k)`` computed Gram matrices (float64 or complex128).
        gram_error: the bound e_G of step 1 (or 4).
        complex_arithmetic: the matrices were computed in complex arithmetic.
        start: a guess of the top eigenvector of a single real matrix (any values: it
            only starts the estimate; the bound holds whatever it is).
    """
    batch, k, _ = grams.shape
    diagonal_index = np.arange(k)
    if k == 1:  # the eigenvalue of a 1 x 1 Hermitian matrix is its (real) entry
        return float(np.max(np.real(grams))) + gram_error
    if batch == 1 and not complex_arithmetic:
        gram = grams[0]
        centre = float(np.trace(gram)) / k
        deviation = gram.copy()
        deviation[diagonal_index, diagonal_index] -= centre
        spread = float(np.linalg.norm(deviation)) * (1.0 + gamma64(k * k + 4))
        if spread <= NEAR_MULTIPLE_OF_IDENTITY * centre:
            return centre + spread + gram_error
        estimate = _top_eigenvalue_estimate(gram, start)
    else:
        estimate = _power_estimate(grams)
    largest_diagonal = float(np.max(np.real(grams[:, diagonal_index, diagonal_index])))
    estimate = max(estimate, largest_diagonal)
    factor_gamma = gamma64((4 if complex_arithmetic else 1) * (k + 1))
    ranked = batch > POWER_CANDIDATES  # the estimate came from the best-ranked matrices only
    shift_index = 0
    while shift_index < len(CHOLESKY_SHIFTS):
        t_sq = estimate * (1.0 + CHOLESKY_SHIFTS[shift_index]) + gram_error
        shifted = -grams
        shifted[:, diagonal_index, diagonal_index] += t_sq
        diagonal = np.abs(shifted[:, diagonal_index, diagonal_index])
        try:
            np.linalg.cholesky(shifted)
        except np.linalg.LinAlgError:
            if ranked:  # the ranking may have missed the top matrix: ask every matrix, once
                ranked = False
                every = float(np.max(np.linalg.eigvalsh(grams)))
                if every > estimate:
                    estimate = every
                    continue  # the same shift, from the better estimate
            shift_index += 1
            continue
        factor_error = factor_gamma * float(np.max(np.sum(diagonal, axis=1))) / (1.0 - factor_gamma)
        return t_sq + factor_error + 2.0 * U64 * float(np.max(diagonal)) + gram_error
    largest = float(np.max(np.linalg.eigvalsh(grams)))
    return largest + EIG_RELATIVE_MARGIN * k * float(np.max(np.abs(grams))) + gram_error


def chunked_gram_error(rows, cols, chunk_rows, chunks, abs_gram_row_sum, abs_row_sum,
                       max_abs) -> float:
    """Bound of ``||G^ - W^T W||_2`` for the chunked float32 Gram matrix of step 4.

    Args:
        rows, cols: p and k, the shape of W (p >= k: the Gram matrix is k x k).
        chunk_rows, chunks: b and c, the blocks' rows and their number (``b c >= p``).
        abs_gram_row_sum: the float32 ``max_i fl(sum_l |W_li| fl(r_l))`` with
            ``r_l = sum_j |W_lj|`` (any summation orders).
        abs_row_sum, max_abs: the float32 ``max_l fl(r_l)`` and ``max |W|``.

    Proof of the parts step 4 does not spell out (``mu`` the smallest normal float32,
    covering flushed operands and underflowing results). Row sums of non-negative terms:
    ``fl(r_l) >= (1 - gamma32_k) r_l - 2 k mu``. The products and sums of ``fl(r_l)``:
    each term loses at most ``mu (|W_li| + fl(r_l) + 2)`` to underflow and the p sums
    ``p mu``, the rest is relative, ``gamma32_{p+1}``. So ``sum_l |W_li| r_l <=
    ((s^ + p mu (max_abs + r^ + 3)) / (1 - gamma32_{p+1}) + 2 k mu p max_abs) /
    (1 - gamma32_k)``. A block product's entry sums b terms, each losing at most
    ``mu (2 max_abs + 2)`` to underflow and each sum ``mu``, carried by ``(1 + u)^b <= 2``:
    ``a_c = 2 b mu (2 max_abs + 3)``. The float32 sum of the c blocks loses at most
    ``mu`` to each flushed operand and each underflowing partial sum, ``2 c mu`` in all,
    and carries the c block terms by ``1 + gamma32_{c-1}``. The float64 evaluation of this
    formula (non-negative terms, a few operations) is covered by a final ``1 + 16 u64``.
    """
    p, k, b, c = int(rows), int(cols), int(chunk_rows), int(chunks)
    rho = abs_gram_radius_upper(p, k, abs_gram_row_sum, abs_row_sum, max_abs)
    eps = gamma32(b) + gamma32(c - 1) * (1.0 + gamma32(b))
    underflow = (1.0 + gamma32(c - 1)) * c * (2.0 * b * MU32 * (2.0 * float(max_abs) + 3.0)
                                               + 2.0 * MU32)
    return (eps * rho + k * underflow) * (1.0 + 16.0 * U64)


def abs_gram_radius_upper(rows, cols, abs_gram_row_sum, abs_row_sum, max_abs) -> float:
    """Upper bound of ``rho(|W|^T |W|) = || |W| ||_2^2`` for a p x k float32 matrix W, from
    the float32 statistics of `chunked_gram_error` (its proof)."""
    p, k = int(rows), int(cols)
    s_hat, r_hat, max_abs = float(abs_gram_row_sum), float(abs_row_sum), float(max_abs)
    return ((s_hat + p * MU32 * (max_abs + r_hat + 3.0)) / (1.0 - gamma32(p + 1))
            + 2.0 * k * MU32 * p * max_abs) / (1.0 - gamma32(k))


def _chunk_stats_usable(stats) -> bool:
    """Whether float32 statistics ``(abs_gram_row_sum, abs_row_sum, max_abs, ...)`` of a
    matrix serve a float32 certificate: all finite, and ``max |W|`` in ``[2^-40, 2^40]``
    (below, float32 products underflow and the bound is useless; above, they may overflow)."""
    return bool(np.all(np.isfinite(stats)) and 2.0 ** -40 <= stats[2] <= 2.0 ** 40)


def bjorck_step_norm_upper(rows, cols, chunk_rows, chunks, alpha, beta, abs_gram_row_sum,
                           abs_row_sum, max_abs, gram_abs_sum, step_abs_sum,
                           step_max_diagonal) -> np.float32:
    """Certified upper bound of ``||W^||_2`` for the last Björck iteration
    ``W^ = fl32(V P^)``, ``P^ = fl32(a I - fl32(b G^))``, ``G^ = fl32(sum_c fl32(V_c^T V_c))``
    (`lipdp.layers._bjorck.certifying_bjorck`), from statistics only: no Gram matrix of W^.
    Float32, rounded up; inf when the statistics are not finite or ``max |V|`` lies outside
    ``[2^-40, 2^40]`` (as `chunked_dense_norm_upper`).

    Args:
        rows, cols, chunk_rows, chunks: p, k, b, c of V (p x k, p >= k) and its blocks.
        alpha, beta: the float32 a and b > 0 of the iteration.
        abs_gram_row_sum, abs_row_sum, max_abs: V's statistics of `chunked_gram_error`.
        gram_abs_sum: the float32 largest row or column sum of ``|G^|``.
        step_abs_sum: the float32 largest row or column sum of ``|P^|``.
        step_max_diagonal: ``max_i |P^_ii|``.

    Proof (G = V^T V exact; ``mu`` the smallest normal float32; sums of k non-negative
    float32 terms are at most ``(computed + k mu) / (1 - gamma32_k)``, which bounds the exact
    ``g >= max(||G^||_1, ||G^||_inf)`` and ``s >= max(||P^||_1, ||P^||_inf)``):

    1. ``||G^ - G||_2 <= e_G`` (`chunked_gram_error`), so ``lambda_max(G) <= max_x x^T G^ x
       + e_G <= ||G^||_2 + e_G <= g + e_G =: l`` (``||A||_2 <= sqrt(||A||_1 ||A||_inf)``).
    2. With ``p(x) = a - b x`` (exact), ``||V p(G)||^2 = lambda_max(p(G) G p(G)) =
       max_i f(lambda_i)``, ``f(x) = x (a - b x)^2``, over the eigenvalues of the PSD G, all in
       ``[0, l]``. f increases up to ``x* = a / (3 b)``, decreases to 0 at ``a / b`` and
       increases after: ``max_[0, l] f = max(f(min(l, x*)), f(l))`` (1 for a = 1.5, b = 0.5
       whenever ``1 <= l <= 4``).
    3. ``P^ = p(G) - b (G^ - G) + R``: R is the rounding of forming P^ from G^; off the
       diagonal ``|R_ij| <= u b |G^_ij| + mu`` (the product; the negation is exact), on it
       ``|R_ii| <= u |P^_ii| / (1 - u) + u b |G^_ii| + 2 mu`` (one FMA or two roundings), so
       ``||R||_2 <= 2 u max|P^_ii| + u b g + 2 k mu =: e_R``.
    4. ``W^ = V P^ + E`` with ``|E| <= gamma32_k |V| |P^| + 4 k mu`` entry-wise (Higham eq.
       3.13, any summation order; each of the k products and sums loses at most mu to
       underflow, carried by ``(1 + u)^k <= 2``): ``||E||_2 <= gamma32_k || |V| ||_2
       || |P^| ||_2 + 4 k mu sqrt(p k)`` with ``|| |V| ||_2^2 <= rho`` of
       `abs_gram_radius_upper` and ``|| |P^| ||_2 <= s``.
    5. So ``||W^||_2 <= sqrt(max f) + sqrt(l) (b e_G + e_R) + ||E||_2``; the float64
       evaluation (non-negative terms, a few dozen operations) is covered by ``1 + 64 u64``.
    """
    p, k, b, c = int(rows), int(cols), int(chunk_rows), int(chunks)
    a, beta = float(np.float32(alpha)), float(np.float32(beta))
    values = np.asarray([abs_gram_row_sum, abs_row_sum, max_abs, gram_abs_sum, step_abs_sum,
                         step_max_diagonal], np.float32).astype(np.float64)
    if not (_chunk_stats_usable(values) and beta > 0.0 and a > 0.0):
        return np.float32(np.inf)
    gram_error = chunked_gram_error(p, k, b, c, *values[:3])
    g = (values[3] + k * MU32) / (1.0 - gamma32(k))
    s = (values[4] + k * MU32) / (1.0 - gamma32(k))
    top = g + gram_error

    def f(x):
        return x * (a - beta * x) ** 2

    largest_f = max(f(min(top, a / (3.0 * beta))), f(top))
    step_error = 2.0 * U32 * values[5] + U32 * beta * g + 2.0 * k * MU32
    rho = abs_gram_radius_upper(p, k, *values[:3])
    product_error = gamma32(k) * np.sqrt(rho) * s + 4.0 * k * MU32 * np.sqrt(float(p) * k)
    bound = (np.sqrt(largest_f) + np.sqrt(top) * (beta * gram_error + step_error)
             + product_error)
    return round_up_float32(bound * (1.0 + 64.0 * U64))


def chunked_dense_norm_upper(kernel, gram, stats, chunk_rows, chunks, start=None) -> np.float32:
    """Certified upper bound of ``||W||_2`` from the chunked float32 Gram matrix of the
    float32 matrix W (`kernel`, reshaped to ``(-1, out)``; step 4), float32, rounded up.

    Args:
        kernel: the kernel itself; its float64 certificate (`dense_norm_upper`) is
            returned instead when the chunked inputs cannot serve: entries outside
            ``[2^-40, 2^40]`` in magnitude (float32 products would underflow or overflow),
            or anything non-finite.
        gram: ``fl32(sum_c fl32(W_c^T W_c))`` for W oriented with ``rows >= cols``.
        stats: float32 ``(max_i fl(sum_l |W_li| fl(r_l)), max_l fl(r_l), max |W|)`` of the
            oriented W (`chunked_gram_error`).
        chunk_rows, chunks: b and c.
        start: a guess of the top eigenvector of the Gram matrix (only starts the estimate).
    """
    gram = np.asarray(gram, np.float64)
    stats = np.asarray(stats, np.float32).astype(np.float64)
    if not (_chunk_stats_usable(stats) and np.all(np.isfinite(gram))):
        return dense_norm_upper(kernel)
    k = gram.shape[0]  # the short side; the long one holds the rest of the entries
    error = chunked_gram_error(np.size(kernel) // k, k, chunk_rows, chunks, *stats)
    # G^ need not be symmetric (a block product may sum (i, j) and (j, i) in different
    # orders): every step reads one triangle or bounds ``v^T G^ v`` by a norm of all of
    # ``G^ - c I``, and the entry-wise error bound holds for every entry.
    lam = max_eigenvalue_upper(gram[None], error, start=start)
    return round_up_float32(np.sqrt(max(lam, 0.0)) * _FINAL_SLACK)


def dense_norm_upper(kernel, hint=None) -> np.float32:
    """Certified upper bound of ``||W||_2`` for a float32 matrix (a ``(..., out)``
    tensor is reshaped to ``(-1, out)``); float32, rounded up.

    W is converted to float64 exactly (but for subnormal entries a flushing thread reads
    as 0: their bound is added, module docstring); the Gram matrix of its smaller side gives
    the bound (module docstring, steps 1-3 and 6). Zero for a zero kernel, inf for a
    non-finite one. `hint`, a guess of the top right singular vector (``out``
    values: a layer's power-iteration vector), only starts the Lanczos estimate.
    """
    kernel = float32_values(kernel)
    flushed = subnormal_count(kernel)
    w = kernel.astype(np.float64)
    w = w.reshape(-1, w.shape[-1])
    start = None if hint is None else np.asarray(hint, np.float64).ravel()
    if w.shape[0] < w.shape[1]:
        if start is not None and start.shape == (w.shape[1],):
            with np.errstate(all="ignore"):  # a non-finite guess is dropped later
                start = w @ start  # the top left singular vector, of the smaller side
        w = w.T
    p, k = w.shape
    flat = w.T.ravel() if w.flags.f_contiguous else w.ravel()  # a view: no copy of W
    frobenius_sq = float(flat @ flat) * (1.0 + 2.0 * gamma64(p * k))  # any order: gamma_{pk}
    if frobenius_sq == 0.0:
        return round_up_float32(flushed_entries_bound(0.0, flushed))
    if not np.isfinite(frobenius_sq):
        return np.float32(np.inf)
    lam = max_eigenvalue_upper((w.T @ w)[None], gamma64(p) * frobenius_sq, start=start)
    return round_up_float32(flushed_entries_bound(np.sqrt(max(lam, 0.0)) * _FINAL_SLACK,
                                                  flushed))


def conv_norm_upper(kernel, grid) -> np.float32:
    """Certified upper bound of ``max_w sigma_max(K_hat(w))`` over the frequencies of
    the ``grid = (nh, nw)`` torus, for a float32 ``(kh, kw, C_in, C_out)`` kernel:
    the operator norm of the circular convolution (`lipdp.operator_norms`).

    ``K_hat(w) = sum_t z_t(w) k_t`` over the T = kh kw taps ``t = (a, b)``, with
    ``z_t(w) = exp(-2 pi i phi_t(w))``, ``phi_t(w) = w_1 a / nh + w_2 b / nw`` and ``k_t`` the
    ``C_in x C_out`` slice of the tap, taken on the half spectrum ``w_2 <= nw / 2`` (a real
    kernel has ``K_hat(-w) = conj(K_hat(w))``, same singular values). The Gram matrices of the
    smaller side (n = min(C_in, C_out); m the other side; a kernel with more inputs is handled
    through its transposed slices, whose Gram matrices are the conjugates: same eigenvalues)
    are computed by whichever of two exact identities costs fewer multiply-adds; both are
    bounded by `max_eigenvalue_upper` from their proven errors (`_grams_by_tap_pairs`,
    `_grams_by_transform`).
    """
    kernel = float32_values(kernel)
    kh, kw, cin, cout = kernel.shape
    taps = kh * kw
    flushed = taps * subnormal_count(kernel)  # sqrt(T) ||E||_F <= sqrt(T n) mu
    k = kernel.astype(np.float64).reshape(taps, cin, cout)
    if cin > cout:
        k = np.swapaxes(k, 1, 2)
    frobenius_sq = float(np.sum(k * k)) * (1.0 + 2.0 * gamma64(k.size + 2))
    if frobenius_sq == 0.0:
        return round_up_float32(flushed_entries_bound(0.0, flushed))
    if not np.isfinite(frobenius_sq):
        return np.float32(np.inf)
    by_pairs, by_transform = _conv_gram_costs(kernel.shape, grid)
    compute = _grams_by_tap_pairs if by_pairs < by_transform else _grams_by_transform
    grams, gram_error, transform_error = compute(k, kw, grid, frobenius_sq)
    lam = max_eigenvalue_upper(grams, gram_error, complex_arithmetic=True)
    return round_up_float32(flushed_entries_bound(
        (np.sqrt(max(lam, 0.0)) + transform_error) * _FINAL_SLACK, flushed))


def _conv_gram_costs(kernel_shape, grid):
    """``(by tap pairs, by transform)``: the cost of `conv_norm_upper`'s two ways to its Gram
    matrices in real multiply-adds (a complex one: four; a twiddle, a complex exponential:
    `TWIDDLE_COST`), which picked the faster way on every kernel timed here."""
    kh, kw, cin, cout = (int(d) for d in kernel_shape)
    n, m, taps = min(cin, cout), max(cin, cout), kh * kw
    frequencies = int(grid[0]) * (int(grid[1]) // 2 + 1)
    by_pairs = ((frequencies + m) * (taps * n) ** 2
                + TWIDDLE_COST * frequencies * taps * (taps - 1) // 2)
    by_transform = 4 * frequencies * n * m * (taps + n) + TWIDDLE_COST * frequencies * taps
    return by_pairs, by_transform


def conv_certificate_work(kernel_shape, grid) -> int:
    """Real multiply-adds of `conv_norm_upper`'s Gram matrices for a kernel of
    `kernel_shape` on the `grid` torus (the cheaper way's, `_conv_gram_costs`)."""
    return min(_conv_gram_costs(kernel_shape, grid))


def _twiddles(offsets_h, offsets_w, grid):
    """``exp(-2 pi i (((w_1 a) mod nh) / nh + ((w_2 b) mod nw) / nw))`` for every frequency
    ``w`` of the half spectrum (rows) and every integer tap offset ``(a, b)`` (columns).

    The phase differs from ``w_1 a / nh + w_2 b / nw`` by an integer (the mods are exact
    integer operations) and is computed within ``5u`` of exact; times ``2 pi`` (``|angle| <
    4 pi``) and with cos/sin within an ulp, each twiddle is within ``70u`` of exact."""
    nh, nw = grid
    freq_h, freq_w = np.meshgrid(np.arange(nh), np.arange(nw // 2 + 1), indexing="ij")
    phase = (np.outer(freq_h.ravel(), offsets_h) % nh / nh
             + np.outer(freq_w.ravel(), offsets_w) % nw / nw)
    return np.exp(-2j * np.pi * phase)


def _grams_by_transform(k, kw, grid, frobenius_sq):
    """``(grams, gram_error, transform_error)``: ``K_hat^ = twiddles @ k`` (one product with
    the `_twiddles` of the taps), then ``G^ = fl(K_hat^ K_hat^H)`` per frequency.

    Each entry of ``K_hat^`` sums T complex products of a twiddle (within ``70u``) and a
    real kernel entry: within ``(70u + 1.01 gamma_{4T}) sum_t |k_t| <= (70u + 1.01
    gamma_{4T}) sqrt(T) ||k_.||`` of exact (Cauchy-Schwarz), so ``||K_hat(w) -
    K_hat^(w)||_2 <= (70u + 1.01 gamma_{4T}) sqrt(T) ||k||_F =: e_K`` (Weyl: it is added to
    the singular value); the Gram matrices of ``K_hat^`` have step 1's error with inner
    dimension m, from ``max_w ||K_hat^(w)||_F^2`` computed here."""
    taps, n, m = k.shape
    taps_h, taps_w = np.divmod(np.arange(taps), kw)
    k_hat = (_twiddles(taps_h, taps_w, grid) @ k.reshape(taps, n * m)).reshape(-1, n, m)
    grams = k_hat @ np.conj(np.swapaxes(k_hat, 1, 2))
    largest_sq = float(np.max(np.sum(np.abs(k_hat) ** 2, axis=(1, 2)))) * (1.0 + 2.0 * gamma64(
        4 * (n * m + 2)))
    transform_error = ((70.0 * U64 + 1.01 * gamma64(4 * taps)) * np.sqrt(taps)
                       * np.sqrt(frobenius_sq))
    return grams, gamma64(4 * m) * largest_sq, transform_error


def _grams_by_tap_pairs(k, kw, grid, frobenius_sq):
    """``(grams, gram_error, 0)``: the Gram matrices from the products of the taps' slices,
    with no Fourier transform of the kernel.

    Exactly, ``G(w) = K_hat K_hat^H = sum_{t, s} c_ts M_ts`` with ``M_ts = k_t k_s^T``
    (real n x n) and ``c_ts = z_t conj(z_s)``, the `_twiddles` of the offset ``t - s``; as
    ``c_st = conj(c_ts)`` and ``M_st = M_ts^T``:
    ``Re G = sum_t M_tt + sum_{t<s} Re(c_ts) S_ts``, ``Im G = sum_{t<s} Im(c_ts) D_ts``, with
    ``S_ts = M_ts + M_ts^T`` and ``D_ts = M_ts - M_ts^T``. Computed: every ``M^_ts`` from one
    product of the stacked slices (inner dimension m), ``S^``, ``D^`` with one rounding, and
    both parts as products with inner dimension ``L = T (T + 1) / 2`` (coefficients 1 for the
    diagonal terms, exact).

    Error, entry-wise, with ``B_ts = |k_t| |k_s|^T`` and ``A = sum_t |k_t|``: ``|M^_ts - M_ts|
    <= gamma_m B_ts`` (Higham eq. 3.13) and ``|M^_ts| <= (1 + gamma_m) B_ts``; ``|S^_ts -
    S_ts| <= (u (1 + gamma_m) + gamma_m) (B_ts + B_st)``, ``|S^_ts| <= (1 + u) (1 + gamma_m)
    (B_ts + B_st)`` (and the same for D); each twiddle is within ``70u`` of exact and at most
    ``1 + 70u`` in modulus; each part's product adds ``gamma_L`` times the sum of its terms'
    magnitudes. Summing, each part is within ``e A A^T`` of exact, with
    ``e = (gamma_L (1 + 70u) + 70u) (1 + u) (1 + gamma_m) + u (1 + gamma_m) + gamma_m``
    (``sum_{t, s} B_ts = A A^T``), so ``|G^ - G| <= 2 e A A^T`` and ``||G^ - G||_2 <=
    2 e ||A||_2^2 <= 2 e ||A||_F^2 <= 2 e T ||k||_F^2`` (Cauchy-Schwarz over the taps). The
    bound is on the exact Gram matrices of the exact transform: no transform error."""
    taps, n, m = k.shape
    stacked = k.reshape(taps * n, m)
    products = (stacked @ stacked.T).reshape(taps, n, taps, n).transpose(0, 2, 1, 3)
    first, second = np.triu_indices(taps, 1)
    upper = products[first, second]  # M^_ts for t < s: (pairs, n, n)
    transposed = np.swapaxes(upper, 1, 2)
    diagonal = products[np.arange(taps), np.arange(taps)]
    real_terms = np.concatenate([diagonal, upper + transposed]).reshape(-1, n * n)
    imaginary_terms = (upper - transposed).reshape(-1, n * n)
    taps_h, taps_w = np.divmod(np.arange(taps), kw)
    twiddles = _twiddles(taps_h[first] - taps_h[second], taps_w[first] - taps_w[second], grid)
    real_coefficients = np.concatenate([np.ones((twiddles.shape[0], taps)), twiddles.real], 1)
    imaginary_coefficients = np.ascontiguousarray(twiddles.imag)  # a strided view: no BLAS
    grams = np.empty((twiddles.shape[0], n, n), np.complex128)
    grams.real = (real_coefficients @ real_terms).reshape(-1, n, n)
    grams.imag = (imaginary_coefficients @ imaginary_terms).reshape(-1, n, n)
    length = taps * (taps + 1) // 2
    error = ((gamma64(length) * (1.0 + 70.0 * U64) + 70.0 * U64) * (1.0 + U64)
             * (1.0 + gamma64(m)) + U64 * (1.0 + gamma64(m)) + gamma64(m))
    return grams, 2.0 * error * taps * frobenius_sq, 0.0
