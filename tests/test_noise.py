"""`lipdp.noise`: the private step's Gaussian noise (Box–Muller of TF uniforms).

Against independent computations: scipy's normal CDF (Kolmogorov–Smirnov), exact chi-square
and normal quantiles for the std and mean (`tests._stats`), binomial tails for P(|z| > 3),
and the correlation of the two halves of a draw (the cos and sin outputs of the same
uniforms). Seeded, so each test's outcome is fixed; the thresholds are those of tests with
a false-failure rate of 1e-6 had the draws been fresh."""

import math

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from lipdp.noise import gaussian_noise, standard_normal
from tests._stats import assert_gaussian_noise

N = 2_000_001  # odd: the last Box–Muller pair is cut


def _draw(dtype=tf.float32, n=N, seed=7):
    tf.random.set_seed(seed)
    return tf.function(lambda: standard_normal(n, dtype))().numpy().astype(np.float64)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_draw_is_standard_normal(dtype):
    z = _draw(dtype)
    assert z.shape == (N,) and np.all(np.isfinite(z))
    assert_gaussian_noise(z, 1.0, f"standard_normal {dtype.name}")
    # Kolmogorov-Smirnov against the exact normal CDF: sup |F_n - Phi| at level 1e-6 is
    # about 2.7 / sqrt(n) (0.0019 here); a std off by 1% gives about 0.0024.
    assert stats.kstest(z, "norm").statistic < stats.kstwo.isf(1e-6, N)
    # Tails: P(|z| > 3) = 0.0027; the count is binomial.
    p = 2 * stats.norm.sf(3.0)
    count = int(np.sum(np.abs(z) > 3.0))
    low, high = stats.binom.ppf(5e-7, N, p), stats.binom.isf(5e-7, N, p)
    assert low <= count <= high, (count, low, high)


def test_the_two_outputs_of_a_pair_are_uncorrelated():
    """Box–Muller's cos and sin outputs (first and second half of a draw) share their
    uniforms: they are independent only if the transform is right. Their correlation, and
    that of their squares (dependent radii), stay within the null's 1e-6 band."""
    z = _draw(n=N - 1)
    a, b = z[: (N - 1) // 2], z[(N - 1) // 2:]
    band = stats.norm.isf(5e-7) / math.sqrt(a.size)
    assert abs(np.corrcoef(a, b)[0, 1]) < band
    assert abs(np.corrcoef(a * a, b * b)[0, 1]) < band


def test_consecutive_draws_differ_and_seeds_repeat():
    tf.random.set_seed(3)
    draw = tf.function(lambda: standard_normal(1000))
    first, second = draw().numpy(), draw().numpy()
    assert not np.array_equal(first, second)
    tf.random.set_seed(3)
    draw = tf.function(lambda: standard_normal(1000))
    np.testing.assert_array_equal(draw().numpy(), first)


def test_noise_takes_each_tensors_shape_dtype_and_std():
    like = [tf.zeros([300, 200]), tf.zeros([7]), tf.zeros([0, 3]), tf.zeros([], tf.float32),
            tf.zeros([400, 250], tf.float64)]
    stds = [2.0, tf.constant(0.5), 1.0, 3.0, tf.constant(0.25, tf.float64)]
    tf.random.set_seed(11)
    noise = tf.function(lambda: gaussian_noise(like, stds))()
    for n, t in zip(noise, like):
        assert n.shape == t.shape and n.dtype == t.dtype
    assert_gaussian_noise(noise[0].numpy(), 2.0, "300x200, std 2", nb_tests=2)
    assert_gaussian_noise(noise[4].numpy(), 0.25, "400x250 float64, std 0.25", nb_tests=2)
    # Each tensor has a draw of its own (no value of one repeats in another).
    assert not np.any(np.isin(noise[1].numpy() / 0.5, noise[0].numpy() / 2.0))


def test_dynamic_shapes_in_a_graph():
    @tf.function(input_signature=[tf.TensorSpec([None, 5]), tf.TensorSpec([None])])
    def draw(a, b):
        return gaussian_noise([a, b], [1.0, 1.0])

    a, b = draw(tf.zeros([4, 5]), tf.zeros([3]))
    assert a.shape == (4, 5) and b.shape == (3,)
    a, b = draw(tf.zeros([0, 5]), tf.zeros([0]))
    assert a.shape == (0, 5) and b.shape == (0,)
