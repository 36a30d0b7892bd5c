"""The certified spectral norm of dense kernels against exact singular values.

`lipdp.gram_certificates.dense_norm_upper` must be an upper bound of the exact
spectral norm of the float32 kernel (float64 SVD of the exactly converted kernel, whose
relative error is ~1e-15) for every kernel, and within its documented tightness
(``sqrt(1 + 1e-5)``) whenever its first Cholesky shift succeeds.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from lipdp import gram_certificates
from lipdp.gram_certificates import conv_norm_upper, dense_norm_upper
from lipdp.operator_norms import conv_operator_norm_upper, dense_spectral_norm_upper
from tests._certificates import (CONV_GRAM_WAYS, exact_conv_norm, exact_norm,
                                 force_conv_gram_way, orthogonal_kernel)

SVD_SLACK = 1e-12  # float64 SVD error on the largest singular value, relative, generous
TIGHT = 5e-5  # documented: at most sqrt(1 + 1e-4) above the exact norm (first shift: 1e-6)


def _kernels():
    rng = np.random.default_rng(0)
    yield "gaussian tall", rng.normal(size=(50, 7)).astype(np.float32)
    yield "gaussian wide", rng.normal(size=(7, 50)).astype(np.float32)
    yield "gaussian square", rng.normal(size=(64, 64)).astype(np.float32)
    yield "orthogonal 784x1024", orthogonal_kernel(784, 1024, rng)
    yield "orthogonal 300x40", orthogonal_kernel(300, 40, rng)
    yield "near-orthogonal (clustered spectrum)", (orthogonal_kernel(120, 80, rng)
                                                   + 1e-4 * rng.normal(size=(120, 80))
                                                   ).astype(np.float32)
    yield "rank one", np.outer(rng.normal(size=30), rng.normal(size=20)).astype(np.float32)
    yield "one output", rng.normal(size=(40, 1)).astype(np.float32)
    yield "one input", rng.normal(size=(1, 40)).astype(np.float32)
    yield "scalar", np.array([[-0.7310001]], np.float32)
    yield "huge entries", (1e30 * rng.normal(size=(20, 10))).astype(np.float32)
    yield "tiny entries", (1e-30 * rng.normal(size=(20, 10))).astype(np.float32)
    yield "subnormal entries", np.full((3, 4), 1e-44, np.float32)


@pytest.mark.parametrize("name, kernel", list(_kernels()), ids=[n for n, _ in _kernels()])
def test_certificate_bounds_the_exact_norm_and_is_tight(name, kernel):
    exact = exact_norm(kernel)
    bound = float(dense_norm_upper(kernel))
    assert bound >= exact * (1 + SVD_SLACK) or bound >= exact, (name, bound, exact)
    # Subnormal entries add their bound, sqrt(n) 2^-126, whether or not this thread flushes.
    flushed = np.sqrt(gram_certificates.subnormal_count(kernel)) * 2.0 ** -126
    assert exact * (1 - SVD_SLACK) <= bound <= exact * (1 + TIGHT) + 1.001 * flushed + 1e-44, (
        name, bound, exact)


def _float64_kernel_above_its_rounding():
    """A 64 x 64 float64 kernel that rounds to the orthogonal float32 kernel H / 8 (H a
    Sylvester Hadamard matrix) but has norm at least ``1 + 64 d`` (d = 0.9 2^-28, under half
    a float32 ulp of 1/8): H / 8 + d s t^T with t a bent function's signs and s = H t / 8
    (entries +-1), so that ``s^T W t / 64 = 1 + 64 d`` (an audit, 2026-12-05: 1024 x 1024,
    certificate 0.99999926 of the norm)."""
    hadamard = np.array([[1.0]])
    for _ in range(6):
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    index = np.arange(64)
    t = (-1.0) ** np.array([bin((i >> 3) & (i & 7)).count("1") for i in index])
    s = hadamard @ t / 8
    assert np.array_equal(np.abs(s), np.ones(64))
    kernel = hadamard / 8 + 0.9 * 2.0 ** -28 * np.outer(s, t)
    assert np.array_equal(kernel.astype(np.float32), (hadamard / 8).astype(np.float32))
    return kernel, s @ kernel @ t / 64


def test_a_kernel_float32_does_not_hold_is_refused_and_a_float64_copy_is_not():
    """The certificates bound float32 values: a float64 kernel was certified as its float32
    rounding, below its own norm. Refused by every route; a float64 array of float32 values
    gets the float32 kernel's certificate."""
    kernel, lower = _float64_kernel_above_its_rounding()
    rounded = kernel.astype(np.float32)
    assert float(dense_norm_upper(rounded)) < lower  # what was returned for the float64 kernel
    with pytest.raises(TypeError, match="float32"):
        dense_norm_upper(kernel)
    with pytest.raises(TypeError, match="float32"):
        conv_norm_upper(kernel.reshape(1, 1, 64, 64), (2, 2))
    for function in (dense_spectral_norm_upper,
                     tf.function(dense_spectral_norm_upper, autograph=False),
                     lambda k: conv_operator_norm_upper(tf.reshape(k, [1, 1, 64, 64]), (1, 1))):
        with pytest.raises(TypeError, match="float32"):
            function(tf.constant(kernel))
    copy = rounded.astype(np.float64)
    assert dense_norm_upper(copy) == dense_norm_upper(rounded)
    assert (conv_norm_upper(copy.reshape(1, 1, 64, 64), (2, 2))
            == conv_norm_upper(rounded.reshape(1, 1, 64, 64), (2, 2)))


def test_zero_and_non_finite_kernels():
    assert float(dense_norm_upper(np.zeros((5, 3), np.float32))) == 0.0
    assert float(dense_norm_upper(np.full((5, 3), np.nan, np.float32))) == np.inf
    assert float(dense_norm_upper(np.full((5, 3), np.inf, np.float32))) == np.inf


def test_a_top_direction_the_power_iteration_misses_is_still_bounded():
    """G = V diag(4, 1, ..., 1) V^T with the top eigenvector orthogonal to the power
    iteration's start vector: its estimate stays near 1, the Cholesky test fails at the
    small shifts, and the certificate still bounds the norm 2."""
    k = 30
    start = np.cos(np.arange(1, k + 1)) + 2.0
    basis, _ = np.linalg.qr(np.column_stack([start, np.random.default_rng(1).normal(size=(k, k - 1))]))
    top = basis[:, 1]  # orthogonal to the start vector
    singular = np.ones(k)
    singular[0] = 2.0
    v = np.column_stack([top, basis[:, [0] + list(range(2, k))]])
    w = (orthogonal_kernel(k + 10, k, np.random.default_rng(2)) * singular) @ v.T
    w = w.astype(np.float32)
    exact = exact_norm(w)
    assert exact == pytest.approx(2.0, rel=1e-6)
    assert float(dense_norm_upper(w)) >= exact


def _spectrally_normalised(rng):
    """A 784 x 1024 kernel as a Björck schedule leaves it between refreshes: orthogonal
    plus a noisy step, divided by its norm (top singular values crowd near 0.999), and
    the right vector of 10 power iterations from a perturbed top vector (a layer's u)."""
    w = orthogonal_kernel(784, 1024, rng).astype(np.float64) + 0.003 * rng.normal(size=(784, 1024))
    _, singular, vt = np.linalg.svd(w, full_matrices=False)
    w = (0.999 * w / singular[0]).astype(np.float32)
    u = vt[0] + 0.05 * rng.normal(size=1024)
    for _ in range(10):
        u = w.T @ (w @ u)
        u /= np.linalg.norm(u)
    return w, u


def test_a_hint_never_loosens_or_breaks_the_certificate():
    """Whatever the hint (the exact top right singular vector, one orthogonal to it, zeros,
    NaN, huge values, a wrong length), the certificate bounds the exact norm, within the
    documented tightness on these kernels."""
    rng = np.random.default_rng(11)
    for name, w in [("gaussian tall", rng.normal(size=(50, 7))),
                    ("gaussian wide", rng.normal(size=(7, 50))),
                    ("near-orthogonal",
                     orthogonal_kernel(120, 80, rng) + 1e-4 * rng.normal(size=(120, 80)))]:
        w = w.astype(np.float32)
        exact = exact_norm(w)
        top = np.linalg.svd(w.astype(np.float64))[2][0]
        other = rng.normal(size=top.shape)
        other -= (other @ top) * top
        for hint_name, hint in [("top", top), ("orthogonal to top", other),
                                ("zeros", np.zeros_like(top)), ("nan", np.full_like(top, np.nan)),
                                ("huge", 1e300 * np.ones_like(top)), ("wrong length", np.ones(3))]:
            bound = float(dense_norm_upper(w, hint))
            assert exact * (1 - SVD_SLACK) <= bound <= exact * (1 + TIGHT), (name, hint_name)


def _count_factorisations(monkeypatch):
    """A list that grows by one at every Cholesky factorisation numpy runs."""
    calls, factorise = [], np.linalg.cholesky

    def counting(matrix):
        calls.append(1)
        return factorise(matrix)

    monkeypatch.setattr(np.linalg, "cholesky", counting)
    return calls


def test_the_power_iteration_vector_spares_a_cholesky_factorisation(monkeypatch):
    """On a spectrally normalised 784 x 1024 kernel (clustered top spectrum) Lanczos from
    the fixed vector under-estimates by ~1e-5, so the 1e-6 shift fails and a second
    factorisation is needed; from the layer's power-iteration vector the first succeeds.
    Both certificates bound the exact norm; the hinted one within sqrt(1 + 2e-6)."""
    w, u = _spectrally_normalised(np.random.default_rng(12))
    exact = exact_norm(w)
    calls = _count_factorisations(monkeypatch)
    hinted = float(dense_norm_upper(w, u))
    assert len(calls) == 1 and exact <= hinted <= exact * (1 + 1e-6)
    calls.clear()
    assert float(dense_norm_upper(w)) >= exact and len(calls) == 2


def test_a_kernel_between_bjorck_refreshes_costs_two_factorisations_and_stays_tight(
        monkeypatch):
    """An orthogonal 784 x 1024 kernel after one Adam-like step (every entry moved by
    +-1e-3) and a spectral normalisation: the top eigenvalues of its Gram matrix crowd
    within 1e-4 of each other, Lanczos settles near the second one and the 1e-6 shift
    fails. The next shift must succeed and stay within 2e-4 of the exact norm (a ladder
    with 1e-4 next took three factorisations and certified 0.5% above it)."""
    rng = np.random.default_rng(0)  # Lanczos from the hint: 1.06e-4 below the top
    q, _ = np.linalg.qr(rng.normal(size=(1024, 784)))
    w = q.T + 1e-3 * np.sign(rng.normal(size=(784, 1024)))
    u = rng.normal(size=1024)
    for _ in range(100):
        u = w.T @ (w @ u)
        u /= np.linalg.norm(u)
    w = (w / np.linalg.norm(w @ u)).astype(np.float32)
    exact = exact_norm(w)
    calls = _count_factorisations(monkeypatch)
    bound = float(dense_norm_upper(w, u))
    assert exact <= bound <= exact * (1 + 2e-4) and len(calls) == 2, (bound / exact - 1, calls)


@pytest.mark.parametrize("shape", [(1024, 10), (10, 1024), (300, 96)])
def test_a_small_gram_matrix_is_certified_from_its_eigenvalues_in_one_factorisation(
        monkeypatch, shape):
    """Up to `EIGVALSH_ESTIMATE_MAX_SIDE` rows the shift comes from LAPACK's top eigenvalue
    of the Gram matrix, not Lanczos: the first shift (1e-6) succeeds, one factorisation, and
    the certificate lies within sqrt(1 + 2e-6) of the exact norm, on the main job's output
    layer after an Adam-like step and a spectral normalisation (top singular values
    crowded) and on a Gaussian kernel at the threshold."""
    rng = np.random.default_rng(sum(shape))
    if 96 in shape:
        w = rng.normal(size=shape)
    else:
        w = orthogonal_kernel(*shape, rng) + 1e-3 * np.sign(rng.normal(size=shape))
    w = (w / exact_norm(w)).astype(np.float32)
    exact = exact_norm(w)
    calls = _count_factorisations(monkeypatch)
    bound = float(dense_norm_upper(w))
    assert exact <= bound <= exact * (1 + 1e-6) and len(calls) == 1, (bound / exact - 1, calls)


def test_eigenvalue_fallback_bounds_the_norm(monkeypatch):
    monkeypatch.setattr(gram_certificates, "CHOLESKY_SHIFTS", ())
    rng = np.random.default_rng(3)
    for shape in [(40, 9), (9, 40), (25, 25)]:
        w = rng.normal(size=shape).astype(np.float32)
        exact = exact_norm(w)
        assert exact <= float(dense_norm_upper(w)) <= exact * (1 + 1e-6)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40),
       log_scale=st.floats(-20, 20), seed=st.integers(0, 2 ** 16),
       orthogonal=st.booleans())
def test_certificate_is_an_upper_bound_on_random_kernels(rows, cols, log_scale, seed, orthogonal):
    rng = np.random.default_rng(seed)
    w = orthogonal_kernel(rows, cols, rng) if orthogonal else rng.normal(size=(rows, cols))
    w = (w * 10.0 ** log_scale).astype(np.float32)
    exact = exact_norm(w)
    bound = float(dense_norm_upper(w))
    assert exact * (1 - SVD_SLACK) <= bound
    assert bound <= exact * np.sqrt(2.0) * (1 + 1e-6) + 1e-44  # the ladder's worst case


def test_in_a_compiled_function_the_same_certificate_as_eagerly():
    w = tf.constant(np.random.default_rng(4).normal(size=(33, 17)), tf.float32)
    compiled = tf.function(dense_spectral_norm_upper)
    assert compiled(w).shape == ()
    assert float(compiled(w)) == float(dense_spectral_norm_upper(w)) == \
        float(dense_norm_upper(w.numpy()))


def test_near_orthogonal_shortcut_is_taken_and_bounds_the_norm(monkeypatch):
    """Projected kernels take the Gram-only shortcut (no estimate, no Cholesky): the
    certificate still bounds, and nearly equals, the exact norm."""
    calls = []
    monkeypatch.setattr(gram_certificates, "_top_eigenvalue_estimate",
                        lambda gram, start=None:
                        calls.append(1) or float(np.max(np.linalg.eigvalsh(gram))))
    rng = np.random.default_rng(5)
    for scale in (1.0, 0.37, 3.0):
        for shape in [(784, 1024), (300, 40), (10, 10)]:
            w = (scale * orthogonal_kernel(*shape, rng)).astype(np.float32)
            exact = exact_norm(w)
            assert exact <= float(dense_norm_upper(w)) <= exact * (1 + 1e-5)
    assert not calls
    # A kernel whose spread exceeds 1e-4 relative takes the Cholesky test.
    w = (orthogonal_kernel(50, 20, rng) * np.linspace(1.0, 1.01, 20)).astype(np.float32)
    assert exact_norm(w) <= float(dense_norm_upper(w))
    assert calls


def _conv_kernels():
    rng = np.random.default_rng(6)
    yield "3x3 1->32 on 28x28", rng.normal(size=(3, 3, 1, 32)), (30, 30)
    yield "3x3 32->64 on 14x14", rng.normal(size=(3, 3, 32, 64)), (16, 16)
    yield "3x3 64->32 (more inputs)", rng.normal(size=(3, 3, 64, 32)), (10, 10)
    yield "5x5 2->2 on 6x5", rng.normal(size=(5, 5, 2, 2)), (10, 9)
    yield "2x2 3->4 on 7x8 (odd torus)", rng.normal(size=(2, 2, 3, 4)), (8, 9)
    yield "3x1 3->3", rng.normal(size=(3, 1, 3, 3)), (8, 5)
    yield "1x1 8->4", rng.normal(size=(1, 1, 8, 4)), (4, 4)
    yield "constant kernel", np.ones((3, 3, 4, 4)), (9, 9)
    yield "huge", 1e30 * rng.normal(size=(3, 3, 2, 3)), (7, 7)
    yield "tiny", 1e-30 * rng.normal(size=(3, 3, 2, 3)), (7, 7)
    q, _ = np.linalg.qr(rng.normal(size=(3 * 3 * 16, 16)))
    yield "RKO-orthogonal 3x3 16->16", q.reshape(3, 3, 16, 16) / 3.0, (12, 12)
    # The frequencies' top eigenvalues within 1.4% of each other: ten power iterations rank
    # another frequency first (the estimate is taken again from every matrix).
    q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(3 * 3 * 32, 64)))
    yield "RKO-orthogonal 3x3 32->64 on 14x14", q.reshape(3, 3, 32, 64) / 3.0, (16, 16)


@pytest.mark.parametrize("name, kernel, grid", list(_conv_kernels()),
                         ids=[n for n, _, _ in _conv_kernels()])
def test_conv_certificate_bounds_the_exact_circular_norm_and_is_tight(name, kernel, grid):
    kernel = np.asarray(kernel, np.float32)
    exact = exact_conv_norm(kernel, grid)
    bound = float(conv_norm_upper(kernel, grid))
    assert exact * (1 - SVD_SLACK) <= bound <= exact * (1 + 1e-4), (name, bound, exact)


@pytest.mark.parametrize("way", CONV_GRAM_WAYS)
@pytest.mark.parametrize("name, kernel, grid", list(_conv_kernels()),
                         ids=[n for n, _, _ in _conv_kernels()])
def test_both_ways_to_the_frequency_grams_certify_every_kernel(monkeypatch, way, name, kernel,
                                                               grid):
    """`conv_norm_upper` picks the cheaper of its two Gram computations; each one alone,
    forced on every kernel, gives a bound of the exact norm as tight as the documented one."""
    used = force_conv_gram_way(monkeypatch, way)
    kernel = np.asarray(kernel, np.float32)
    exact = exact_conv_norm(kernel, grid)
    bound = float(conv_norm_upper(kernel, grid))
    assert used == [way]
    assert exact * (1 - SVD_SLACK) <= bound <= exact * (1 + 1e-4), (name, bound, exact)


@pytest.mark.parametrize("shape, grid", [((3, 3, 4, 6), (7, 9)), ((3, 3, 6, 4), (6, 6)),
                                         ((2, 3, 3, 3), (5, 8)), ((3, 1, 2, 5), (4, 5))])
def test_tap_pair_grams_are_within_their_error_bound_of_the_exact_ones(shape, grid):
    """The Gram matrices `_grams_by_tap_pairs` computes, against ``K_hat K_hat^H`` in long
    double from the definition of the transform, frequency by frequency: every one within the
    returned spectral-norm error (a wrong tap offset or sign is off by O(1), not 1e-14)."""
    kh, kw, cin, cout = shape
    kernel = np.random.default_rng(11).normal(size=shape).astype(np.float32)
    k = kernel.astype(np.float64).reshape(kh * kw, cin, cout)
    k = np.swapaxes(k, 1, 2) if cin > cout else k
    frobenius_sq = float(np.sum(k * k)) * (1 + 1e-12)
    grams, error, transform_error = gram_certificates._grams_by_tap_pairs(k, kw, grid,
                                                                          frobenius_sq)
    assert transform_error == 0.0 and 0 < error < 1e-12 * frobenius_sq
    nh, nw = grid
    taps_h, taps_w = np.divmod(np.arange(kh * kw), kw)
    wide = k.astype(np.longdouble)
    index = 0
    for w1 in range(nh):
        for w2 in range(nw // 2 + 1):
            phase = (np.longdouble(w1) * taps_h / nh + np.longdouble(w2) * taps_w / nw)
            angle = -2 * np.arccos(np.longdouble(-1)) * phase
            re = np.tensordot(np.cos(angle), wide, 1)
            im = np.tensordot(np.sin(angle), wide, 1)
            exact_re = re @ re.T + im @ im.T  # (re + i im)(re - i im)^T
            exact_im = im @ re.T - re @ im.T
            difference = (grams[index].real - exact_re) + 1j * (grams[index].imag - exact_im)
            assert np.linalg.norm(difference.astype(np.complex128), 2) <= error, (w1, w2)
            index += 1
    assert index == len(grams)


@pytest.mark.parametrize("way", CONV_GRAM_WAYS)
def test_conv_certificate_bounds_the_convolution_tensorflow_runs(monkeypatch, way):
    """Against the operator itself: power iteration on x -> conv2d(x, k) (a lower
    estimate) for 'same' and 'valid' padding and strides never exceeds the bound, with the
    frequency Gram matrices computed either way (forced)."""
    from lipdp.operator_norms import conv_operator_norm_power, conv_operator_norm_upper

    used = force_conv_gram_way(monkeypatch, way)
    rng = np.random.default_rng(7)
    for shape, hw in [((3, 3, 3, 5), (9, 9)), ((5, 5, 2, 2), (6, 5)), ((2, 2, 3, 4), (7, 8))]:
        k = tf.constant(rng.normal(size=shape), tf.float32)
        bound = float(conv_operator_norm_upper(k, hw))
        for padding in ("SAME", "VALID"):
            for strides in (1, 2):
                measured = conv_operator_norm_power(
                    lambda t: tf.nn.conv2d(t, k, strides, padding), hw + (shape[2],),
                    iterations=200)
                assert measured <= bound * (1 + 1e-5), (shape, padding, strides)
    assert used and set(used) == {way}


def test_conv_certificate_of_zero_and_non_finite_kernels():
    assert float(conv_norm_upper(np.zeros((3, 3, 2, 2), np.float32), (5, 5))) == 0.0
    assert float(conv_norm_upper(np.full((3, 3, 2, 2), np.nan, np.float32), (5, 5))) == np.inf


def test_conv_certificate_eigenvalue_fallback(monkeypatch):
    monkeypatch.setattr(gram_certificates, "CHOLESKY_SHIFTS", ())
    kernel = np.random.default_rng(8).normal(size=(3, 3, 4, 6)).astype(np.float32)
    exact = exact_conv_norm(kernel, (9, 9))
    assert exact <= float(conv_norm_upper(kernel, (9, 9))) <= exact * (1 + 1e-6)


def test_one_host_call_gives_each_kernel_its_own_certificate():
    """`certified_norms` batches dense and convolution requests into one host call; each
    result is that kernel's own certificate, in order."""
    from lipdp.operator_norms import certified_norms

    rng = np.random.default_rng(9)
    dense = rng.normal(size=(20, 7)).astype(np.float32)
    conv = rng.normal(size=(3, 3, 2, 4)).astype(np.float32)
    hint = rng.normal(size=(1, 7)).astype(np.float32)
    requests = [("conv", tf.constant(conv), (9, 9)), ("dense", tf.constant(dense), None),
                ("dense", tf.constant(2.0 * dense), None, tf.constant(hint)),
                ("dense", tf.constant(3.0 * dense), None)]
    norms = tf.function(lambda: certified_norms(requests))()
    assert [float(n) for n in norms] == [float(conv_norm_upper(conv, (9, 9))),
                                         float(dense_norm_upper(dense)),
                                         float(dense_norm_upper(2.0 * dense, hint)),
                                         float(dense_norm_upper(3.0 * dense))]
