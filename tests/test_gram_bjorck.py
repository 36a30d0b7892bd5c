"""Gram-space Björck (`lipdp.layers._bjorck`) against deel-lip's own iteration.

The Gram-space form must give deel-lip's iterates (same recursion, same stopping rule) to
float32 rounding, and kernels as orthogonal. The stopping rule is checked with tolerances
placed between the iterations' step sizes, where running one iteration more or less moves
the result by far more than the tolerance of the comparison.
"""

import numpy as np
import pytest
import tensorflow as tf
from deel.lip.normalizers import bjorck_normalization, spectral_normalization

from lipdp.layers._bjorck import (GRAM_BLOCKS_MIN_SIDE, GRAM_SPACE_MIN_ASPECT,
                                  gram_space_bjorck, kernel_space_bjorck,
                                  normalised_gram_space_bjorck, orthogonalise, symmetric_gram)
from lipdp.layers._projection import ProjectionConfig, project_kernel

SHAPES = [(600, 96), (96, 600), (300, 40), (40, 300), (3136, 64)]
# Square-ish kernels (deel-lip's loop in their own space), Gram matrices below and above the
# side computed in blocks (not a multiple of the block count: uneven blocks).
NEAR_SQUARE = [(40, 40), (60, 50), (GRAM_BLOCKS_MIN_SIDE + 1, 600), (600, GRAM_BLOCKS_MIN_SIDE + 1),
               (500, 500)]


def _near_orthogonal(shape, seed, step=1e-3):
    """An orthonormal matrix after an Adam-like step (every entry +-step), scaled to
    spectral norm 1: what the projection meets after a training step."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((max(shape), min(shape))))
    w = (q if shape[0] >= shape[1] else q.T) + step * rng.choice([-1.0, 1.0], size=shape)
    return (w / np.linalg.norm(w, 2)).astype(np.float32)


def _spread(shape, seed):
    """A random Gaussian matrix scaled to spectral norm 1: singular values spread over
    (0, 1], many iterations to converge (what the projection meets at build)."""
    w = np.random.default_rng(seed).standard_normal(shape)
    return (w / np.linalg.norm(w, 2)).astype(np.float32)


def _deviation(w):
    w = np.asarray(w, np.float64)
    gram = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T
    return np.linalg.norm(gram - np.eye(gram.shape[0]))


# Each form on its kernels: Gram space for elongated ones, their own space for square-ish ones
# (each Gram matrix in blocks from `GRAM_BLOCKS_MIN_SIDE` rows on).
FORMS = ([pytest.param(gram_space_bjorck, shape, id=f"gram-{shape}") for shape in SHAPES]
         + [pytest.param(kernel_space_bjorck, shape, id=f"kernel-{shape}")
            for shape in NEAR_SQUARE])


@pytest.mark.parametrize("bjorck, shape", FORMS)
@pytest.mark.parametrize("iterations", [1, 2, 3, 5])
def test_fixed_iteration_counts_match_deel_lip(bjorck, shape, iterations):
    """eps tiny: both run exactly `iterations` iterations; the recursion alone is compared."""
    for make in (_near_orthogonal, _spread):
        w = tf.constant(make(shape, seed=iterations))
        expected = bjorck_normalization(w, eps=1e-30, beta=0.5, maxiter=iterations).numpy()
        got = bjorck(w, eps=1e-30, beta=0.5, maxiter=iterations).numpy()
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("bjorck, shape", FORMS)
def test_stopping_rule_matches_deel_lip(bjorck, shape):
    """deel-lip runs iteration k + 1 when iteration k moved the kernel by ``d_k >= eps``
    (Frobenius). From a kernel after an Adam-like step, scaled to spectral norm 1, d_1, d_2,
    d_3 are about 0.4, 0.04 and 3e-4; tolerances 0.8 d_k and 1.25 d_k fall on either side of
    each, so the form's rule must place every stop where deel-lip's does, and a
    distance off by a factor 1.25 in either direction fails. Each result must be ten times
    closer to deel-lip's than the results of one iteration more or less are to it (after
    three iterations they agree to rounding: a fourth is harmless and not looked for)."""
    w = tf.constant(_near_orthogonal(shape, seed=0, step=3e-3))
    fixed = [w.numpy()] + [bjorck_normalization(w, eps=1e-30, beta=0.5, maxiter=k).numpy()
                           for k in (1, 2, 3)]
    moved = [np.linalg.norm(after - before) for before, after in zip(fixed, fixed[1:])]
    cases = [(1, 1.25 * moved[0]), (2, 0.8 * moved[0]), (2, 1.25 * moved[1]),
             (3, 0.8 * moved[1]), (3, 1.25 * moved[2])]
    for count, eps in cases:
        expected = bjorck_normalization(w, eps=eps, beta=0.5, maxiter=15).numpy()
        np.testing.assert_array_equal(expected, fixed[count])
        neighbours = [fixed[k] for k in (count - 1, count + 1) if 1 <= k <= 2]
        margin = min(np.linalg.norm(expected - other) for other in neighbours)
        got = bjorck(w, eps=eps, beta=0.5, maxiter=15).numpy()
        assert np.linalg.norm(got - expected) <= 0.1 * margin, (count, eps, margin)


@pytest.mark.parametrize("beta", [0.5, 0.3, 0.1])
def test_other_step_sizes_match_deel_lip(beta):
    w = tf.constant(_spread((500, 60), seed=7))
    expected = bjorck_normalization(w, eps=1e-3, beta=beta, maxiter=20).numpy()
    got = gram_space_bjorck(w, eps=1e-3, beta=beta, maxiter=20).numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_results_are_as_orthogonal_as_deel_lips(shape):
    w = tf.constant(_near_orthogonal(shape, seed=1))
    expected = bjorck_normalization(w, eps=1e-3, beta=0.5, maxiter=15).numpy()
    got = gram_space_bjorck(w, eps=1e-3, beta=0.5, maxiter=15).numpy()
    assert _deviation(got) <= max(2 * _deviation(expected), 1e-5)
    assert _deviation(got) < 1e-4  # within the certificate's near-orthogonal shortcut


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] > s[1]])
@pytest.mark.parametrize("bjorck_iterations", [1, 15])
def test_normalisation_from_the_gram_matrix_matches_deel_lips(shape, bjorck_iterations):
    """`normalised_gram_space_bjorck` is deel-lip's `spectral_normalization` (power
    iteration from a cached vector, its stopping rule, ``W / (sigma + eps)``) then Björck:
    the same vector and kernel to float32 rounding. From a random kernel and vector, with
    the power iteration's tolerance placed between the moves of its 2nd and 3rd iterations
    (a stop one iteration early or late moves the vector by far more than the comparison's
    tolerance), and one Björck iteration (whose result scales with the normalisation) or
    up to 15; then from a kernel after a step (norm 1.3) and the vector cached before it.
    `project_kernel` takes this path for tall kernels."""
    rng = np.random.default_rng(5)
    left, _ = np.linalg.qr(rng.standard_normal(shape))
    right, _ = np.linalg.qr(rng.standard_normal((shape[1], shape[1])))
    singular = np.concatenate([[1.2], np.linspace(0.1, 0.6, shape[1] - 1)])  # a gap
    w = tf.constant(((left * singular) @ right.T).astype(np.float32))
    u = rng.uniform(size=(1, shape[1]))
    iterates = [u / np.linalg.norm(u)]  # the power iteration in float64
    gram = w.numpy().astype(np.float64).T @ w.numpy().astype(np.float64)
    for _ in range(4):
        iterates.append(iterates[-1] @ gram / np.linalg.norm(iterates[-1] @ gram))
    moves = [np.linalg.norm(b - a) for a, b in zip(iterates, iterates[1:])]
    assert moves[1] > 2 * moves[2] > 4 * moves[3]
    eps_spectral = float(np.sqrt(moves[1] * moves[2]))  # deel-lip stops after iteration 3
    cases = [(w, tf.constant(u, tf.float32), eps_spectral, iterates[3],
              min(moves[2], moves[3]))]
    w = tf.constant(1.3 * _near_orthogonal(shape, seed=4))
    top = np.linalg.svd(w.numpy().astype(np.float64))[2][:1] + 1e-3
    cases.append((w, tf.constant(top, tf.float32), 1e-3, None, None))
    bjorck_eps = 1e-30 if bjorck_iterations == 1 else 1e-3
    for w, u, eps_spectral, u_stop, margin in cases:
        normalised, u_expected, _ = spectral_normalization(w, u, eps=eps_spectral, maxiter=10)
        if u_stop is not None:  # deel-lip stopped after 3 iterations, far from 2 or 4
            np.testing.assert_allclose(u_expected.numpy(), u_stop, rtol=0, atol=1e-5)
            assert margin > 100 * 1e-5
        expected = bjorck_normalization(normalised, eps=bjorck_eps, beta=0.5,
                                        maxiter=bjorck_iterations).numpy()
        got, u_got = normalised_gram_space_bjorck(w, u, eps_spectral, 10, bjorck_eps, 0.5,
                                                  bjorck_iterations)
        np.testing.assert_allclose(u_got.numpy(), u_expected.numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=5e-6)
        config = ProjectionConfig(eps_spectral=eps_spectral, eps_bjorck=bjorck_eps,
                                  maxiter_bjorck=bjorck_iterations)
        projected, u_projected, _ = project_kernel(w, u, config, 10)
        np.testing.assert_array_equal(projected.numpy(), got.numpy())
        np.testing.assert_array_equal(u_projected.numpy(), u_got.numpy())


def test_the_normalised_form_refuses_wide_kernels():
    with pytest.raises(ValueError, match="tall"):
        normalised_gram_space_bjorck(tf.ones((4, 40)), tf.ones((1, 40)), 1e-3, 3, 1e-3, 0.5, 15)


def test_divergence_is_reported_as_deel_lips_and_the_projection_recovers():
    """A singular value above sqrt(3) makes Björck diverge: the result is not finite (as
    deel-lip's), and `project_kernel` restarts from the Frobenius scaling."""
    w = _near_orthogonal((600, 96), seed=2) * 3.0
    diverged = gram_space_bjorck(tf.constant(w), eps=1e-3, beta=0.5, maxiter=15).numpy()
    assert not np.all(np.isfinite(diverged))
    # a power-iteration vector orthogonal to the top direction makes the estimate too small
    _, _, vt = np.linalg.svd(w.astype(np.float64), full_matrices=False)
    u = tf.constant(vt[-1][None, :].astype(np.float32))
    config = ProjectionConfig(maxiter_spectral=1)
    projected, _, _ = project_kernel(tf.constant(w), u, config, maxiter_spectral=1)
    projected = projected.numpy()
    assert np.all(np.isfinite(projected))
    assert np.linalg.svd(projected.astype(np.float64), compute_uv=False)[0] <= 1 + 1e-4


def _projected_norm(kernel, u, config, orthogonalise, traced):
    project = lambda k, v: project_kernel(k, v, config, maxiter_spectral=10,  # noqa: E731
                                          orthogonalise=orthogonalise)
    if traced:
        project = tf.function(project, autograph=False)
    projected, vector, _ = project(tf.constant(kernel), tf.constant(u))
    projected = projected.numpy()
    assert np.all(np.isfinite(projected))
    return np.linalg.svd(projected.astype(np.float64), compute_uv=False), vector.numpy()


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("orthogonalise", [False, True])
@pytest.mark.parametrize("shape", [(40, 30), (600, 96)])
def test_huge_kernels_and_collapsed_vectors_are_still_projected(shape, orthogonalise, traced):
    """A kernel of norm above ~4e9 overflowed the power iteration (``||W^T W u||^2`` beyond
    float32): its vector became 0 and stayed 0, the estimate 0, and every later spectral
    normalisation multiplied the kernel by 1 / eps_spectral (an audit: 5e13 after one
    projection, then x1000 a projection of a normal kernel); entries above ~1.8e19 made the
    Frobenius norm of Björck's restart inf and the kernel 0. Each projection now ends near
    norm 1, not zero, and the next one from the vector it leaves too."""
    rng = np.random.default_rng(sum(shape))
    gaussian = rng.standard_normal(shape).astype(np.float32)
    ones = np.ones((1, shape[1]), np.float32)
    config = ProjectionConfig(eps_bjorck=1e-3 if orthogonalise else None)
    # ten power iterations from a cold start under-estimate the norm a little (1.03)
    normal = 1 + 1e-3 if orthogonalise else 1.1
    left = []
    for scale in (1e10, 1e20, 1e30):
        singular, vector = _projected_norm(gaussian * np.float32(scale), ones, config,
                                           orthogonalise, traced)
        assert 0.05 < singular[0] <= 1 + 1e-3, (scale, singular[0])
        left.append(vector)
    # the vectors left by such steps (0 after an overflow), or loaded: the next projection
    for vector in left + [np.zeros_like(ones), np.full_like(ones, np.nan)]:
        singular, _ = _projected_norm(gaussian, vector, config, orthogonalise, traced)
        assert 0.5 < singular[0] <= normal, (vector, singular)
    if orthogonalise:
        assert singular[-1] > 0.9  # orthogonal, not the Frobenius scaling alone


def test_dispatch_by_aspect_ratio(monkeypatch):
    """Elongated kernels take the Gram-space form, square-ish ones deel-lip's iteration."""
    import lipdp.layers._bjorck as bjorck

    calls = []
    monkeypatch.setattr(bjorck, "gram_space_bjorck",
                        lambda w, *args: calls.append(tuple(w.shape)) or w)
    long_side = 20 * GRAM_SPACE_MIN_ASPECT
    for shape in [(long_side, 20), (20, long_side), (long_side - 1, 20), (40, 40)]:
        orthogonalise(tf.constant(_spread(shape, seed=3)), eps=1e-3, beta=0.5, maxiter=15)
    assert calls == [(long_side, 20), (20, long_side)]


@pytest.mark.parametrize("shape", [(GRAM_BLOCKS_MIN_SIDE - 1, 700), (GRAM_BLOCKS_MIN_SIDE, 700),
                                   (700, GRAM_BLOCKS_MIN_SIDE + 2), (500, 500)])
def test_symmetric_gram_is_the_gram_matrix_to_float32_rounding(shape):
    """Computed in blocks or not, every entry is a float32 dot product of length n: within
    ``n u sum_k |a_k b_k|`` (u = 2^-24, the classic bound ``gamma_n``) of the exact one, and
    the matrix is exactly symmetric; a block placed or mirrored wrongly is off by O(1)."""
    w = _spread(shape, seed=sum(shape)).astype(np.float32)
    for wide in (True, False):
        v = w.astype(np.float64) if wide else w.T.astype(np.float64)
        gram = symmetric_gram(tf.constant(w), wide).numpy()
        assert gram.shape == (v.shape[0],) * 2
        np.testing.assert_array_equal(gram, gram.T)
        bound = v.shape[1] * 2.0 ** -24 * (np.abs(v) @ np.abs(v).T)
        assert np.all(np.abs(gram - v @ v.T) <= bound)
