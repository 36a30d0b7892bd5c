"""Certified norms of kernels with subnormal entries, where TensorFlow flushes them to zero.

TensorFlow's threads run with denormals-are-zero: a float32 entry below 2^-126 in magnitude
reads as 0 in its kernels and in the numpy code of a ``tf.numpy_function``, which is where the
train step computes its certificates. A certificate computed from the values alone then bounds
the kernel with those entries zeroed, not the stored kernel: an all-subnormal 20 x 8 kernel
(norm 1.3e-38) was certified 0. Each certificate adds the flushed entries' bound
(`lipdp.gram_certificates`, "Subnormal entries"); these tests compare every route of
`lipdp.operator_norms.certified_norms` (the in-graph dense certificate, the host's dense and
convolution certificates), inside a traced function and eagerly, with the exact norm computed
on the test's own thread (which does not flush: checked)."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.gram_certificates import conv_norm_upper, dense_norm_upper, subnormal_count
from lipdp.graph_certificates import certified_in_graph, dense_norm_upper_in_graph
from lipdp.operator_norms import certified_norms
from tests._certificates import exact_conv_norm, exact_norm

SMALLEST_SUBNORMAL = np.float32(2.0 ** -149)
GRID = (7, 7)


def _subnormals(rng, shape):
    """float32 subnormals of random signs and magnitudes, from their bits."""
    bits = rng.integers(1, 0x00800000, size=shape, dtype=np.uint32)
    bits |= rng.integers(0, 2, size=shape, dtype=np.uint32) << np.uint32(31)
    return bits.view(np.float32)


def _kernels(shape):
    rng = np.random.default_rng(sum(shape))
    yield "all subnormal", _subnormals(rng, shape)
    tiny = (1e-37 * rng.normal(size=shape)).astype(np.float32)  # normal float32 entries
    every_third = np.arange(tiny.size).reshape(shape) % 3 == 0
    yield "tiny, a third subnormal", np.where(every_third, _subnormals(rng, shape), tiny)
    lone = np.zeros(shape, np.float32)
    lone.flat[lone.size // 2] = SMALLEST_SUBNORMAL
    yield "one subnormal entry", lone


# (kind, shape): a dense kernel the graph certifies, one the host certifies, two convolutions.
ROUTES = [("dense", (20, 8)), ("dense", (64, 40)), ("conv", (3, 3, 2, 3)), ("conv", (1, 1, 4, 6))]
CASES = [(kind, shape, name, kernel) for kind, shape in ROUTES for name, kernel in _kernels(shape)]


def _exact(kind, kernel):
    return exact_norm(kernel) if kind == "dense" else exact_conv_norm(kernel, GRID)


def _request(kind, kernel):
    return (kind, tf.constant(kernel), None if kind == "dense" else GRID)


def test_this_thread_keeps_subnormals_and_the_counts_read_the_bits():
    assert np.float32(SMALLEST_SUBNORMAL).astype(np.float64) == 2.0 ** -149
    assert certified_in_graph((20, 8)) and not certified_in_graph((64, 40))
    kernel = np.array([0.0, -0.0, SMALLEST_SUBNORMAL, -SMALLEST_SUBNORMAL, 1.1e-38, 1.2e-38,
                       np.inf, np.nan, 1.0], np.float32)
    assert subnormal_count(kernel) == 3  # 1.2e-38 is normal (the smallest: 1.1755e-38)


@pytest.mark.parametrize("kind, shape, name, kernel", CASES,
                         ids=[f"{kind}{shape}-{name}" for kind, shape, name, _ in CASES])
def test_certificates_bound_the_stored_kernel_where_subnormals_are_flushed(kind, shape, name,
                                                                            kernel):
    exact = _exact(kind, kernel)
    assert exact > 0, name
    traced = float(tf.function(lambda: certified_norms([_request(kind, kernel)])[0])())
    eager = float(certified_norms([_request(kind, kernel)])[0])
    host = float(dense_norm_upper(kernel) if kind == "dense" else conv_norm_upper(kernel, GRID))
    for route, bound in [("traced", traced), ("eager", eager), ("host", host)]:
        assert bound >= exact, (route, name, bound, exact)
    if kind == "dense" and certified_in_graph(shape):
        assert float(tf.function(dense_norm_upper_in_graph)(tf.constant(kernel))) >= exact


def test_kernels_without_subnormal_entries_keep_their_certificate():
    """The term is added only where there are subnormal entries: a kernel with tiny normal
    entries and zeros is certified within 1e-5 of its norm on every route."""
    rng = np.random.default_rng(3)
    for kind, shape in ROUTES:
        kernel = (1e-30 * rng.normal(size=shape)).astype(np.float32)
        kernel.flat[::4] = 0.0
        assert subnormal_count(kernel) == 0
        exact = _exact(kind, kernel)
        traced = float(tf.function(lambda: certified_norms([_request(kind, kernel)])[0])())
        assert exact <= traced <= exact * (1 + 1e-5), (kind, shape, traced, exact)
