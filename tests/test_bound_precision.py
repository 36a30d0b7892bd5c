"""Precision of the bound pass (`lipdp.layers.base`, "Precision"): float64, the pass's slack
after the last operation, and the noise's standard deviation rounded up to float32.

The references are exact: rational arithmetic on the float values the pass starts from (the
float32 certified norms, the float32 weights, the python constants), with square roots in
60-digit decimals. Without the slack the computed bounds sit within 1e-15 of the references,
on either side; with it, 2^-28 above: the first test fails if the slack is dropped or doubled,
the second if the standard deviation is rounded to nearest instead of up.
"""

import decimal
from fractions import Fraction

import numpy as np
import pytest
import tensorflow as tf

from lipdp.bounds import backpropagate_bounds, dp_layers, lipschitz_bound
from lipdp.layers import DP_BoundedInput, DP_GroupSort, DP_QuickSpectralDense
from lipdp.layers.base import BOUND_PASS_SLACK, round_up_to_float32
from lipdp.losses import DP_TauCategoricalCrossentropy
from lipdp.metadata import DPParameters
from lipdp.model import DP_Sequential
from lipdp.operator_norms import certified_norms
from tests._models import metadata

X0 = 3.0
LOSS_LIPSCHITZ = 1.7


def _sqrt(value: Fraction) -> Fraction:
    with decimal.localcontext() as context:
        context.prec = 60
        root = (decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)).sqrt()
    return Fraction(root)


def _norm(values) -> Fraction:
    return _sqrt(sum(Fraction(float(v)) ** 2 for v in np.ravel(values)))


def _model(strategy="global"):
    model = DP_Sequential(
        [DP_BoundedInput(X0, input_shape=(6,)), DP_QuickSpectralDense(4, use_bias=True),
         DP_GroupSort(2), DP_QuickSpectralDense(3, use_bias=True)],
        dp_parameters=DPParameters(1.3, 1e-5, strategy), dataset_metadata=metadata((6,), 3))
    rng = np.random.default_rng(3)
    for layer in model.layers[1::2]:
        layer.bias.assign(rng.normal(size=layer.bias.shape).astype(np.float32) / 3)
    return model


def _in_slack(computed, exact):
    ratio = Fraction(float(computed)) / exact
    return 1 + Fraction(BOUND_PASS_SLACK) / 2 <= ratio <= 1 + 2 * Fraction(BOUND_PASS_SLACK)


def test_bound_pass_is_float64_and_its_slack_sits_above_the_exact_formula():
    """The norms are those each pass uses: the gradient bounds take the certificates the
    projections left (`certified_norm_request`), the Lipschitz bound certifies the kernels
    from their weights alone (`_spectral_bound` outside a pass)."""
    model = _model()
    first, second = model.layers[1], model.layers[3]
    s1, s2 = (Fraction(float(certified_norms([layer.certified_norm_request()])[0]))
              for layer in (first, second))
    g = Fraction(LOSS_LIPSCHITZ)
    x1 = Fraction(X0)
    x2 = s1 * x1 + _norm(first.bias.numpy())  # one position: sqrt(1) = 1
    exact = {second.kernel.ref(): x2 * g, second.bias.ref(): g,
             first.kernel.ref(): x1 * s2 * g, first.bias.ref(): s2 * g}
    bounds = backpropagate_bounds(dp_layers(model), LOSS_LIPSCHITZ)
    assert len(bounds) == 4
    for variable, bound in bounds:
        assert bound.dtype == tf.float64
        assert _in_slack(bound, exact[variable.ref()]), variable.name
    lip = lipschitz_bound(model)
    s1, s2 = (Fraction(float(layer._spectral_bound())) for layer in (first, second))
    assert lip.dtype == tf.float64 and _in_slack(lip, s1 * s2)


@pytest.mark.parametrize("strategy", ["global", "per-layer"])
def test_noise_stddevs_are_float32_at_least_sigma_times_the_sensitivity(strategy):
    model = _model(strategy)
    model.compile(loss=DP_TauCategoricalCrossentropy(2.0), optimizer="sgd")
    sigma = Fraction(model.step_mechanism.noise_multiplier)
    rng = np.random.default_rng(4)
    rounded_down = 0
    for _ in range(25):
        sensitivities = [tf.constant(v, tf.float64) for v in rng.uniform(0.01, 2.0, size=4)]
        stddevs = model._noise_stddevs(sensitivities)
        values = [Fraction(float(s)) for s in sensitivities]
        if strategy == "global":
            exact = [sigma * _sqrt(sum(v * v for v in values))] * 4
        else:
            exact = [sigma * v for v in values]
        for stddev, target in zip(stddevs, exact):
            assert stddev.dtype == tf.float32
            assert Fraction(float(stddev)) >= target
            below = np.nextafter(np.float32(stddev), np.float32(0))
            assert Fraction(float(below)) < target * (1 + 2 * Fraction(BOUND_PASS_SLACK))
            rounded_down += float(np.float32(float(target))) < target
    assert rounded_down > 10  # rounding to nearest would have gone below about half the time


def test_round_up_to_float32_gives_the_smallest_float32_above():
    values = np.concatenate([np.random.default_rng(5).uniform(0, 10, 200), [0.0, 1.0, 0.1]])
    rounded = round_up_to_float32(tf.constant(values, tf.float64)).numpy()
    assert rounded.dtype == np.float32
    assert np.all(rounded.astype(np.float64) >= values)
    below = np.nextafter(rounded, np.float32(-np.inf)).astype(np.float64)
    assert np.all(below < values)


def test_round_up_to_float32_stays_above_values_below_the_normal_range():
    """TensorFlow's cast flushes subnormals to zero, and the float32 after zero (1.4e-45)
    fell below 1e-39 (an audit): a noise stddev rounded *down*. Below float32's smallest
    normal number the rounding now gives that number."""
    tiny = float(np.finfo(np.float32).tiny)
    values = np.array([1e-39, 5e-40, 1.1e-38, 1e-300, tiny, 0.0])
    rounded = round_up_to_float32(tf.constant(values, tf.float64)).numpy().astype(np.float64)
    assert np.all(rounded >= values)
    assert list(rounded[:5]) == [tiny] * 5 and rounded[5] == 0.0
