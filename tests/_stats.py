"""Exact tests of Gaussian noise samples, with a stated error rate and a checked power.

`assert_gaussian_noise(samples, std)` tests that ``samples`` are i.i.d. ``N(0, std^2)``:

* **False-failure rate <= 1e-6** for the whole call: the variance test (``sum z^2`` against
  exact chi-square quantiles with ``n`` degrees of freedom, ``z = samples / std``, the mean
  being known to be 0) and the mean test (``sum z / sqrt(n)`` against normal quantiles)
  each run at level ``1e-6 / (2 * nb_tests)``, two-sided (Bonferroni over the
  ``nb_tests`` calls a test makes and the two statistics of each call).
* **Power >= 1 - 1e-6 against a 10% error**, *asserted before testing*: the sample must be
  large enough that a standard deviation of ``1.1 std`` or ``0.9 std``, and a mean of
  ``+-0.1 std``, each fail the test with probability at least ``1 - 1e-6`` (exact chi-square
  and normal tail probabilities). A sample too small for that is a broken test, and says so.
"""

import math

import numpy as np
from scipy import stats

FALSE_FAILURE_RATE = 1e-6  # per test function, whatever the number of variables it tests
MISS_RATE = 1e-6  # probability that a 10% error goes unnoticed
ERROR = 0.10  # relative error of the std (x1.1 or x0.9), or mean shift in units of the std


def _acceptance_region(n, level):
    """Two-sided acceptance regions at `level` (per statistic) for n standard normal samples."""
    chi_lo = stats.chi2.ppf(level / 2, n)
    chi_hi = stats.chi2.isf(level / 2, n)
    z_crit = stats.norm.isf(level / 2)
    return chi_lo, chi_hi, z_crit


def miss_probabilities(n, nb_tests=1):
    """Probabilities that a sample of n passes although its std is x1.1, x0.9, or its mean is
    shifted by 0.1 std (the largest of the two signs)."""
    level = FALSE_FAILURE_RATE / (2 * nb_tests)
    chi_lo, chi_hi, z_crit = _acceptance_region(n, level)
    too_large = stats.chi2.cdf(chi_hi / (1 + ERROR) ** 2, n) - stats.chi2.cdf(
        chi_lo / (1 + ERROR) ** 2, n)
    too_small = stats.chi2.sf(chi_lo / (1 - ERROR) ** 2, n) - stats.chi2.sf(
        chi_hi / (1 - ERROR) ** 2, n)
    shift = ERROR * math.sqrt(n)
    mean = stats.norm.cdf(z_crit - shift) - stats.norm.cdf(-z_crit - shift)
    return {"std x1.1": float(too_large), "std x0.9": float(too_small), "mean +0.1 std": float(mean)}


def minimum_sample_size(nb_tests=1):
    """Smallest n (to 1%) with every miss probability <= `MISS_RATE`."""
    n = 1000
    while max(miss_probabilities(n, nb_tests).values()) > MISS_RATE:
        n = int(n * 1.01) + 1
    return n


def assert_gaussian_noise(samples, std, name="", nb_tests=1):
    """Assert that `samples` (any shape, flattened) are i.i.d. N(0, std^2).

    Args:
        samples: the noise, e.g. ``noisy - clean`` gradients.
        std: the expected standard deviation (a scalar, or an array broadcastable to
            `samples` when each sample has its own, e.g. standardised over several steps).
        name: what is tested, for the messages.
        nb_tests: number of calls the test function makes (Bonferroni), so that the
            test function as a whole fails falsely with probability <= 1e-6.
    """
    z = (np.asarray(samples, np.float64) / np.asarray(std, np.float64)).ravel()
    n = z.size
    misses = miss_probabilities(n, nb_tests)
    assert max(misses.values()) <= MISS_RATE, (
        f"{name}: {n} samples cannot catch a 10% error with probability 1 - {MISS_RATE} "
        f"(miss probabilities {misses}); at least {minimum_sample_size(nb_tests)} are needed")
    chi_lo, chi_hi, z_crit = _acceptance_region(n, FALSE_FAILURE_RATE / (2 * nb_tests))
    sum_sq, mean_stat = float(np.sum(z * z)), float(np.sum(z) / math.sqrt(n))
    assert chi_lo <= sum_sq <= chi_hi, (
        f"{name}: sample std / expected = {math.sqrt(sum_sq / n):.4f} over {n} samples, outside "
        f"[{math.sqrt(chi_lo / n):.4f}, {math.sqrt(chi_hi / n):.4f}]")
    assert abs(mean_stat) <= z_crit, (
        f"{name}: sample mean = {mean_stat / math.sqrt(n):.4f} std over {n} samples, outside "
        f"+-{z_crit / math.sqrt(n):.4f} std")
