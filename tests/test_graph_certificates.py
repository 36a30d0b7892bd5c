"""`lipdp.graph_certificates`: the dense certificate of `lipdp.gram_certificates`, computed by
float64 TensorFlow ops in the step, against the exact norm and against the host's."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from lipdp import graph_certificates
from lipdp.gram_certificates import conv_norm_upper, dense_norm_upper
from lipdp.graph_certificates import certified_in_graph, dense_norm_upper_in_graph
from lipdp.operator_norms import certified_norms
from tests._certificates import exact_norm, orthogonal_kernel

SVD_SLACK = 1e-12  # the float64 SVD's own error, relative


def _in_graph(w):
    return float(tf.function(dense_norm_upper_in_graph)(tf.constant(w, tf.float32)))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 200), cols=st.integers(1, 32), log_scale=st.floats(-30, 30),
       seed=st.integers(0, 2 ** 16), kind=st.sampled_from(["gaussian", "orthogonal",
                                                          "stepped", "rank-one"]),
       wide=st.booleans())
def test_the_certificate_bounds_the_norm_and_matches_the_hosts(rows, cols, log_scale, seed,
                                                               kind, wide):
    """Random kernels (the small side at most 32, either orientation), at scales 1e-30 to
    1e30: Gaussian, orthogonal, orthogonal after an Adam-like step (its top singular values
    crowd within 1e-3), rank one. The certificate bounds the exact norm, lies within
    sqrt(1 + 2e-6) of it, and within 2e-6 of the host's (`dense_norm_upper`)."""
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        w = rng.normal(size=(rows, cols))
    elif kind == "rank-one":
        w = np.outer(rng.normal(size=rows), rng.normal(size=cols))
    else:
        w = orthogonal_kernel(rows, cols, rng)
        if kind == "stepped":
            w = w + 1e-3 * np.sign(rng.normal(size=w.shape))
    w = (w.T if wide else w) * 10.0 ** log_scale
    w = w.astype(np.float32)
    if not np.any(w):
        return  # underflowed to zero: the zero kernel has its own test
    exact = exact_norm(w)
    bound = _in_graph(w)
    assert exact * (1 - SVD_SLACK) <= bound <= exact * (1 + 1e-6) + 1e-44, (bound / exact - 1)
    host = float(dense_norm_upper(w))
    assert abs(bound - host) <= 2e-6 * host


def test_the_main_jobs_output_layer_is_certified_tightly():
    """The 1024 x 10 output layer after an Adam-like step and a spectral normalisation, as the
    steps between Björck refreshes leave it: within sqrt(1 + 2e-6) of the norm."""
    rng = np.random.default_rng(0)
    w = orthogonal_kernel(1024, 10, rng) + 1e-3 * np.sign(rng.normal(size=(1024, 10)))
    w = (w / exact_norm(w)).astype(np.float32)
    exact = exact_norm(w)
    assert exact <= _in_graph(w) <= exact * (1 + 1e-6)


def test_zero_and_non_finite_kernels():
    assert _in_graph(np.zeros((40, 10), np.float32)) == 0.0
    for bad in (np.nan, np.inf, -np.inf):
        w = np.ones((40, 10), np.float32)
        w[3, 4] = bad
        assert _in_graph(w) == np.inf


def test_without_a_successful_shift_the_eigenvalue_fallback_bounds_the_norm(monkeypatch):
    monkeypatch.setattr(graph_certificates, "CHOLESKY_SHIFTS", (-0.5,))  # every one fails
    rng = np.random.default_rng(3)
    for shape in [(40, 9), (9, 40), (25, 25)]:
        w = rng.normal(size=shape).astype(np.float32)
        exact = exact_norm(w)
        assert exact <= _in_graph(w) <= exact * (1 + 1e-6)


def test_a_low_estimate_climbs_the_shift_ladder(monkeypatch):
    """An estimate 1% below the top eigenvalue: the first shifts' factorisations fail (NaN
    factors), a later one succeeds; the certificate still bounds the norm, within the
    ladder's step."""
    original = tf.linalg.eigvalsh
    monkeypatch.setattr(graph_certificates.tf.linalg, "eigvalsh",
                        lambda m: original(m) * 0.99)
    w = np.random.default_rng(5).normal(size=(60, 12)).astype(np.float32)
    exact = exact_norm(w)
    assert exact <= _in_graph(w) <= exact * 1.02


def test_certified_norms_routes_small_dense_kernels_into_the_graph():
    """Small dense kernels are certified in the graph (no host call when all are), the others
    on the host, each result in its request's place; a cached certificate serves while fresh
    and finite."""
    rng = np.random.default_rng(7)
    small = rng.normal(size=(300, 10)).astype(np.float32)
    large = rng.normal(size=(80, 64)).astype(np.float32)
    conv = rng.normal(size=(3, 3, 2, 4)).astype(np.float32)
    assert certified_in_graph(small.shape) and not certified_in_graph(large.shape)
    assert not certified_in_graph((70000, 32))  # its Gram matrix: above IN_GRAPH_MAX_WORK

    def run(requests):
        function = tf.function(lambda: certified_norms(requests))
        ops = {op.type for op in function.get_concrete_function().graph.get_operations()}
        return [float(t) for t in function()], "PyFuncStateless" in ops

    norms, host = run([("dense", tf.constant(small), None)])
    assert not host and norms == [_in_graph(small)]
    norms, host = run([("dense", tf.constant(large), None), ("dense", tf.constant(small), None),
                       ("conv", tf.constant(conv), (6, 6))])
    assert host and norms[1] == _in_graph(small)
    assert norms[0] == float(dense_norm_upper(large))
    assert norms[2] == float(conv_norm_upper(conv, (6, 6)))
    for fresh, norm, expected in [(True, 5.0, 5.0), (False, 5.0, _in_graph(small)),
                                  (True, np.inf, _in_graph(small))]:
        norms, host = run([("cached-dense", tf.constant(small), None, tf.constant(fresh),
                            tf.constant(norm, tf.float32))])
        assert not host and norms == [np.float32(expected)]


@pytest.mark.parametrize("shape", [(784, 10), (10, 784), (64, 32)])
def test_the_bound_scaled_down_would_be_caught(shape):
    """The tests above can fail: 1/1.4 of the certificate is below the exact norm."""
    w = np.random.default_rng(9).normal(size=shape).astype(np.float32)
    assert _in_graph(w) / 1.4 < exact_norm(w)


def test_kernels_of_one_shape_share_one_traced_certificate_and_keep_their_own_values():
    """Inside traced functions the certificate is one graph function per kernel shape and
    dtype (`graph_certificates._traced_certificate`), traced once however many layers and
    steps call it; each kernel still gets its own certificate, the eager one. Broken on
    purpose (one certificate tensor shared per shape and graph instead of one function),
    the second kernel of a shape gets the first's value and this fails."""
    traced = graph_certificates._traced_certificate
    traced.cache_clear()
    rng = np.random.default_rng(5)
    kernels = [tf.constant(rng.normal(size=(12, 6)) * scale, tf.float32) for scale in (1, 3)]
    kernels.append(tf.constant(rng.normal(size=(6, 20)), tf.float32))
    eager = [float(dense_norm_upper_in_graph(k)) for k in kernels]

    @tf.function
    def all_three(a, b, c):
        return [dense_norm_upper_in_graph(k) for k in (a, b, c)]

    @tf.function
    def one(kernel):
        return dense_norm_upper_in_graph(kernel)

    got = [float(v) for v in all_three(*kernels)] + [float(one(kernels[1]))]
    assert got == pytest.approx(eager + [eager[1]], rel=1e-6)
    assert got[1] > 2 * got[0]
    for kernel, value in zip(kernels, got):
        assert value >= exact_norm(kernel.numpy())
    assert traced.cache_info().currsize == 2
    assert traced((12, 6), "float32").experimental_get_tracing_count() == 1
