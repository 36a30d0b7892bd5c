"""The chunked float32 Gram certificate of large dense kernels against exact norms.

`lipdp.operator_norms.certified_norms` certifies an elongated dense kernel from float32
block products summed in float32 (`lipdp.gram_certificates`, step 4). The certificate must
bound the exact spectral norm (float64 SVD of the exactly converted kernel) for every
kernel, its stated Gram error must cover the rounding of the Gram matrix it describes
(exact reference: float64 products of float32 entries are exact, their sums err by ~1e-16),
and it must be no looser than that error allows.
"""

import numpy as np
import pytest
import tensorflow as tf

from lipdp import gram_certificates, operator_norms
from lipdp.gram_certificates import chunked_gram_error, dense_norm_upper
from lipdp.operator_norms import certified_norms, dense_spectral_norm_upper
from tests._certificates import exact_norm, orthogonal_kernel


def _exact_abs_perron(w):
    """rho(|W|^T |W|) in float64 (the quantity the Collatz-Wielandt bound replaces)."""
    a = np.abs(np.asarray(w, np.float64))
    return float(np.linalg.eigvalsh(a.T @ a if a.shape[0] >= a.shape[1] else a @ a.T)[-1])


@pytest.fixture
def chunk_small(monkeypatch):
    """Small kernels take the chunked path, in blocks of at most 7 rows (padding included)."""
    monkeypatch.setattr(operator_norms, "CHUNKED_GRAM_MIN_WORK", 1)
    monkeypatch.setattr(operator_norms, "CHUNK_ROWS", 7)


@pytest.fixture
def chunked_calls(monkeypatch):
    """The (chunk_rows, chunks) of every chunked certificate computed."""
    calls, certify = [], gram_certificates.chunked_dense_norm_upper

    def spy(kernel, gram, stats, chunk_rows, chunks, start=None):
        calls.append((chunk_rows, chunks))
        return certify(kernel, gram, stats, chunk_rows, chunks, start=start)

    monkeypatch.setattr(operator_norms, "chunked_dense_norm_upper", spy)
    return calls


def _stated_error(w, chunk_rows, chunks):
    """The Gram error the certificate states for `w`, from float64 statistics (within
    float32 rounding of what the certificate itself computes)."""
    w = np.asarray(w, np.float64)
    w = w if w.shape[0] >= w.shape[1] else w.T
    a = np.abs(w)
    r = a.sum(1)
    return chunked_gram_error(w.shape[0], w.shape[1], chunk_rows, chunks,
                              np.max(r @ a), np.max(r), np.max(a))


def test_the_papers_cnn_dense_kernel_is_certified_within_half_a_percent(chunked_calls):
    """The 3136 x 512 kernel of the paper's CNN (orthogonal, as Björck leaves it) takes the
    chunked path in 8 blocks of 392 rows: the certificate bounds the exact norm and is within
    0.5% of it (the stated error is 0.77% of ||W||^2 there)."""
    w = orthogonal_kernel(3136, 512, np.random.default_rng(0))
    exact = exact_norm(w)
    bound = float(dense_spectral_norm_upper(tf.constant(w)))
    assert chunked_calls == [(392, 8)]
    assert exact <= bound <= exact * 1.005, bound / exact - 1
    assert _stated_error(w, 392, 8) == pytest.approx(0.0077, rel=0.05)


KERNELS = {
    "orthogonal tall": lambda rng: orthogonal_kernel(60, 9, rng),
    "orthogonal wide": lambda rng: orthogonal_kernel(9, 60, rng),
    "gaussian tall": lambda rng: rng.normal(size=(50, 11)).astype(np.float32),
    "near-orthogonal, clustered": lambda rng: (orthogonal_kernel(45, 12, rng)
                                               + 1e-4 * rng.normal(size=(45, 12))
                                               ).astype(np.float32),
    "positive (worst case for |W|)": lambda rng: rng.uniform(1.0, 1.0 + 2.0 ** -10,
                                                             size=(64, 8)).astype(np.float32),
    "rank one": lambda rng: np.outer(rng.normal(size=40), rng.normal(size=6)).astype(np.float32),
    "one heavy row": lambda rng: np.vstack([1e3 * np.ones((1, 5)), rng.normal(size=(30, 5))]
                                           ).astype(np.float32),
    "rows not a multiple of the block": lambda rng: rng.normal(size=(37, 4)).astype(np.float32),
    "4-D kernel (..., out)": lambda rng: rng.normal(size=(3, 3, 4, 8)).astype(np.float32),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_chunked_certificate_bounds_the_exact_norm_and_is_as_tight_as_stated(
        name, chunk_small, chunked_calls):
    w = KERNELS[name](np.random.default_rng(sorted(KERNELS).index(name)))
    flat = w.reshape(-1, w.shape[-1])
    exact = exact_norm(flat)
    bound = float(dense_spectral_norm_upper(tf.constant(w)))
    assert len(chunked_calls) == 1, "the chunked path was not taken"
    stated = _stated_error(flat, *chunked_calls[0])
    assert exact <= bound, (name, bound, exact)
    # no looser than the stated error allows (plus the Cholesky ladder's first shifts)
    assert bound ** 2 <= (exact ** 2 + stated) * (1 + 2e-3), (name, bound, exact, stated)


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 392, 2000])
def test_stated_gram_error_covers_the_rounding_of_the_gram_matrix(chunk_rows, monkeypatch):
    """Against the exact Gram matrix, on kernels that maximise float32 accumulation error
    (all entries equal to within 2^-10: every product and partial sum of one sign) and on
    mixed-scale ones: ``||G^ - G||_2 <= stated error``."""
    monkeypatch.setattr(operator_norms, "CHUNK_ROWS", chunk_rows)
    rng = np.random.default_rng(chunk_rows)
    for w in [rng.uniform(1.0, 1.0 + 2.0 ** -10, size=(2000, 6)),
              rng.normal(size=(1500, 20)) * np.exp(rng.uniform(-8, 8, size=(1500, 1))),
              orthogonal_kernel(1200, 40, rng)]:
        w = w.astype(np.float32)
        gram, stats = (t.numpy() for t in operator_norms._chunked_gram(tf.constant(w)))
        rows, chunks = operator_norms._chunking(tf.TensorShape(w.shape))
        w64 = w.astype(np.float64)
        actual = float(np.linalg.norm(gram - w64.T @ w64, 2))
        stated = chunked_gram_error(w.shape[0], w.shape[1], rows, chunks, *stats)
        assert actual <= stated, (chunk_rows, actual, stated)
        assert stats[0] >= _exact_abs_perron(w) * (1 - 1e-3)  # the Perron bound's input


def test_collatz_wielandt_bound_is_exact_on_constant_row_sums_and_bounds_the_perron_root():
    """For |W| with constant row sums the bound equals rho(|W|^T |W|); otherwise above it."""
    rng = np.random.default_rng(3)
    ones = np.ones((50, 8), np.float32)
    s = float(np.max(np.abs(ones).sum(1) @ np.abs(ones)))
    assert s == pytest.approx(_exact_abs_perron(ones), rel=1e-12)
    for _ in range(5):
        w = rng.normal(size=(40, 6)).astype(np.float32)
        a = np.abs(w.astype(np.float64))
        assert np.max(a.sum(1) @ a) >= _exact_abs_perron(w) * (1 - 1e-12)


@pytest.mark.parametrize("name, w, expected", [
    ("zero", np.zeros((40, 5), np.float32), 0.0),
    ("nan", np.full((40, 5), np.nan, np.float32), np.inf),
    ("inf", np.full((40, 5), np.inf, np.float32), np.inf),
    ("tiny (float32 products underflow)", 1e-30 * np.ones((40, 5), np.float32), None),
    ("huge (float32 products overflow)", 1e30 * np.ones((40, 5), np.float32), None),
])
def test_unusable_chunked_inputs_fall_back_to_the_float64_certificate(name, w, expected,
                                                                     chunk_small):
    bound = float(dense_spectral_norm_upper(tf.constant(w)))
    assert bound == float(dense_norm_upper(w))
    if expected is not None:
        assert bound == expected
    else:
        assert exact_norm(w) <= bound <= exact_norm(w) * (1 + 1e-6)


def test_a_reduced_precision_onednn_mode_keeps_the_float64_gram(monkeypatch, chunked_calls):
    """oneDNN's BF16 / TF32 floating-point modes round float32 products to fewer bits than
    the stated error assumes: the float64 Gram matrix is used instead."""
    w = tf.constant(orthogonal_kernel(3136, 512, np.random.default_rng(4)))
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    assert float(dense_spectral_norm_upper(w)) == float(dense_norm_upper(w.numpy()))
    assert not chunked_calls
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "strict")
    dense_spectral_norm_upper(w)
    assert chunked_calls == [(392, 8)]


def test_squarer_and_smaller_kernels_keep_the_float64_gram(chunked_calls):
    """The main job's 784 x 1024 kernel (aspect 1.3) and the CNN's 512 x 10 head."""
    rng = np.random.default_rng(5)
    for w in (orthogonal_kernel(784, 1024, rng), rng.normal(size=(512, 10)).astype(np.float32)):
        assert float(dense_spectral_norm_upper(tf.constant(w))) == float(dense_norm_upper(w))
    assert not chunked_calls


def test_hints_and_compilation_never_change_what_is_bounded(chunk_small):
    """With the power-iteration vector (right or wrong, any length) and inside a compiled
    function, the chunked certificate bounds the same norm."""
    rng = np.random.default_rng(6)
    for w in (rng.normal(size=(50, 9)), rng.normal(size=(9, 50))):
        w = tf.constant(w, tf.float32)
        exact = exact_norm(w.numpy())
        top = np.linalg.svd(w.numpy().astype(np.float64))[2][0]
        for hint in (top, -top, np.zeros_like(top), np.full_like(top, np.nan), np.ones(3)):
            hint = tf.constant(hint[None], tf.float32)
            eager = float(certified_norms([("dense", w, None, hint)])[0])
            compiled = float(tf.function(lambda w=w, hint=hint: certified_norms(
                [("dense", w, None, hint)])[0])())
            assert exact <= eager == compiled <= exact * 1.01
