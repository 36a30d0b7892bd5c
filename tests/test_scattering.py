"""DP_Scattering: kymatio's scattering in float64, and its computed Lipschitz constant.

The constant (`lipdp.layers.scattering.scattering_lipschitz`) must hold for the operator the
code runs: it is checked against gradient ascent on ``||S x - S y|| / ||x - y||`` and power
iteration on the Jacobian, and its building blocks against dense computations. The
aliased-power formula for filtering + decimation is an equality, and so is its mirror average
on real signals without decimation: scaled by 1/1.4 each fails its test. The whole constant is
2.2x to 4x the largest quotient power iteration finds on 16 x 16 images (0.33 against 0.80
unweighted, 1.08 against 4.29 with weights (0.3, 2, 12); the padding factor sqrt(m) = 2 and the
modulus are worst cases the search does not reach): the search test fails once the constant
is divided by 2.5, not by 1.4. DP_MultiscaleScattering concatenates scatterings at several
scales: its features are theirs, its constant the root of the sum of their squared constants.
"""

import numpy as np
import pytest
import tensorflow as tf
from kymatio.tensorflow import Scattering2D

from lipdp.bounds import gradient_bounds, lipschitz_bound
from lipdp.certify import certified_accuracy, float_error_bound
from lipdp.layers import DP_BoundedInput, DP_Flatten, DP_QuickSpectralDense
from lipdp.losses import DP_TauCategoricalCrossentropy
from lipdp.layers.scattering import (DP_MultiscaleScattering, DP_Scattering, _decimated_power,
                                     _padding_multiplicity, _real_input_power,
                                     scattering_lipschitz)
from tests._soundness import (adversarial_inputs, assert_within_bounds, maximize_gradient_norm,
                              one_hot_labels, per_example_gradient_norms, top_singular_directions)


def _images(n, seed, shape=(16, 16, 1)):
    return tf.random.stateless_uniform((n,) + shape, seed=[seed, 0])


@pytest.mark.parametrize("k", [1, 2, 4])
def test_decimated_power_is_the_exact_norm_of_filtering_then_decimating(k):
    rng = np.random.default_rng(k)
    n = 8
    h = rng.standard_normal((n, n)) + 1j * rng.standard_normal((n, n))  # Fourier domain
    # Dense matrix of u -> ifft(subsample_fourier(h * fft(u))) on the n x n grid, built the
    # way kymatio computes it (Fourier-domain mean over the k x k aliases).
    columns = []
    for index in range(n * n):
        u = np.zeros(n * n)
        u[index] = 1.0
        spectrum = h * np.fft.fft2(u.reshape(n, n))
        folded = spectrum.reshape(k, n // k, k, n // k).mean(axis=(0, 2))
        columns.append(np.fft.ifft2(folded).ravel())
    operator = np.stack(columns, axis=1)
    exact = np.linalg.norm(operator, 2) ** 2
    assert float(_decimated_power(h, k).max()) == pytest.approx(exact, rel=1e-10)


def _real_input_operator_norm_sq(h, k):
    """Squared norm of ``u -> ifft(subsample_fourier(h * fft(u)))`` on real n x n signals u:
    the complex outputs stacked as real and imaginary parts, a dense SVD."""
    n = h.shape[0]
    columns = []
    for index in range(n * n):
        u = np.zeros(n * n)
        u[index] = 1.0
        folded = (h * np.fft.fft2(u.reshape(n, n))).reshape(k, n // k, k, n // k).mean(axis=(0, 2))
        out = np.fft.ifft2(folded).ravel()
        columns.append(np.concatenate([out.real, out.imag]))
    return np.linalg.norm(np.stack(columns, axis=1), 2) ** 2


@pytest.mark.parametrize("k", [1, 2, 4])
def test_mirror_averaged_power_bounds_filtering_real_signals_exactly_without_decimation(k):
    rng = np.random.default_rng(10 + k)
    n = 8
    h = rng.standard_normal((n, n)) + 1j * rng.standard_normal((n, n))  # not Hermitian
    one_sided = h * ((np.arange(n) > 0) & (np.arange(n) < n // 2))[:, None]  # a half plane
    for filter_ in (h, one_sided):
        exact = _real_input_operator_norm_sq(filter_, k)
        complex_bound = float(_decimated_power(filter_, k).max())
        real_bound = float(_real_input_power(_decimated_power(filter_, k)).max())
        assert exact <= real_bound * (1 + 1e-12) and real_bound <= complex_bound
        if k == 1:  # one frequency per alias class: the bound is the norm
            assert real_bound == pytest.approx(exact, rel=1e-10)
    if k == 1:  # a one-sided filter (a Morlet wavelet, roughly): half of the complex bound
        assert real_bound == pytest.approx(0.5 * complex_bound, rel=1e-12)


def test_padding_multiplicity_counts_the_copies_of_the_most_copied_pixel():
    scattering = Scattering2D(J=2, shape=(16, 16))
    top, bottom, left, right = scattering.pad.pad_size
    basis = tf.reshape(tf.eye(256, dtype=tf.float64), (256, 16, 16))
    padded = tf.pad(basis, [[0, 0], [top, bottom], [left, right]], mode="REFLECT")
    copies = tf.reduce_sum(padded, axis=[1, 2]).numpy()
    assert _padding_multiplicity(scattering, (16, 16)) == int(copies.max()) == 4
    zero_padded = DP_Scattering(J=2, padding="zero")
    zero_padded(_images(1, 0))
    assert _padding_multiplicity(zero_padded._scattering, (16, 16)) == 1


def test_zero_padding_matches_kymatio_on_an_image_padded_beforehand_and_halves_the_constant():
    x = _images(2, 11)
    layer = DP_Scattering(J=2, padding="zero")
    y = layer(x).numpy()
    from kymatio.numpy import Scattering2D as NumpyScattering2D

    kymatio = NumpyScattering2D(J=2, shape=(16, 16), pre_pad=True)  # takes a padded image
    top, bottom, left, right = Scattering2D(J=2, shape=(16, 16)).pad.pad_size
    padded = np.pad(np.transpose(x.numpy(), [0, 3, 1, 2]).astype(np.float64),
                    [[0, 0], [0, 0], [top, bottom], [left, right]])
    expected = np.transpose(kymatio(padded), (0, 3, 4, 1, 2)).reshape(y.shape)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    reflect = DP_Scattering(J=2)
    reflect(x)
    assert layer.lipschitz_constant == pytest.approx(reflect.lipschitz_constant / 2, rel=1e-12)


def test_output_matches_kymatio_and_is_channels_last():
    x = _images(3, 1, (16, 16, 2))
    layer = DP_Scattering(J=2, order_weights=(1.0, 2.0, 3.0))
    y = layer(x).numpy()
    assert y.shape == (3, 4, 4, 2 * 81) and y.dtype == np.float32
    reference = Scattering2D(J=2, shape=(16, 16))(tf.transpose(x, [0, 3, 1, 2])).numpy()
    weights = np.array([1.0] + [2.0] * 16 + [3.0] * 64)
    reference = reference * weights[None, None, :, None, None]  # (B, C, K, H', W')
    expected = np.transpose(reference, (0, 3, 4, 1, 2)).reshape(3, 4, 4, -1)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("max_order,weights,padding,angles", [
    (2, (1.0, 1.0, 1.0), "reflect", 8), (2, (0.3, 2.0, 12.0), "reflect", 4),
    (1, (1.0, 1.0), "reflect", 8), (2, (0.3, 2.0, 12.0), "zero", 4)])
def test_lipschitz_constant_holds_against_gradient_ascent_and_power_iteration(max_order, weights,
                                                                              padding, angles):
    """The order weights and the padding enter the constant whatever the number of angles:
    their cases run 4 (a graph 3.4x cheaper to build than 8's); 8 angles with those weights
    and zero padding are held by the multiscale tests below."""
    layer = DP_Scattering(J=2, angles=angles, max_order=max_order, order_weights=weights,
                          padding=padding)
    layer(_images(1, 0))
    bound = layer.lipschitz_constant
    # Gradient ascent on the difference quotient, from random pairs (small and large gaps).
    a = tf.Variable(_images(8, 2))
    d = tf.Variable(tf.random.stateless_normal(a.shape, seed=[3, 0])
                    * tf.constant([1e-3] * 4 + [0.3] * 4)[:, None, None, None])
    optimizer = tf.keras.optimizers.Adam(1e-2)
    optimizer.build([a, d])  # built inside the tf.function, it would be traced twice

    @tf.function  # the same steps as eager ones, traced once (kymatio is slow eagerly)
    def ascent_step():
        with tf.GradientTape() as tape:
            moved, start = tf.split(layer(tf.concat([a + d, a], axis=0)), 2)  # one trace
            gap = tf.norm(tf.reshape(moved - start, [8, -1]), axis=1)
            ratio = gap / tf.norm(tf.reshape(d, [8, -1]), axis=1)
            loss = -tf.reduce_sum(ratio)
        optimizer.apply_gradients(zip(tape.gradient(loss, [a, d]), [a, d]))
        return tf.reduce_max(ratio)  # at the point before the step

    best = max(float(ascent_step()) for _ in range(40))
    # Power iteration on J^T J at one point (J v by forward differences of step 1e-2 on an
    # image of norm ~9: accurate to ~1e-4, far inside the margin the test needs).
    sigma = float(top_singular_directions(layer, _images(1, 4), 1e-2, iterations=20)[0][0])
    assert best > 0.1 * bound and sigma > 0.1 * bound  # the search found something
    assert best <= bound and sigma <= bound


def test_bounds_and_certification_of_a_scatternet_classifier():
    layer = DP_Scattering(J=2, order_weights=(0.5, 1.0, 4.0))
    model = tf.keras.Sequential([
        tf.keras.layers.Input((16, 16, 1)), DP_BoundedInput(16.0), layer,
        DP_BoundedInput(3.0), DP_Flatten(), DP_QuickSpectralDense(10, use_bias=False)])
    assert layer.propagate_inputs(2.0) == pytest.approx(2.0 * layer.lipschitz_constant)
    assert layer.propagate_inputs(2.0) == pytest.approx(
        2.0 * layer.lipschitz_constant + layer.rounding_error(2.0), rel=1e-12)
    lip = float(lipschitz_bound(model))
    assert lip == pytest.approx(layer.lipschitz_constant, rel=1e-5)  # head projected: norm ~1
    error = float_error_bound(model)
    assert 0 < error < 1e-3
    x, y = _images(16, 7).numpy(), np.eye(10)[np.arange(16) % 10]
    accuracy = certified_accuracy(model, (x, y), [0.0, 0.01])
    assert accuracy[0.01] <= accuracy[0.0]


def test_config_round_trip_and_argument_errors():
    layer = DP_Scattering(J=1, angles=4, max_order=1, order_weights=(1.0, 2.0), padding="zero",
                          name="scat")
    clone = DP_Scattering.from_config(layer.get_config())
    x = _images(2, 9)
    np.testing.assert_array_equal(layer(x).numpy(), clone(x).numpy())
    assert not layer.trainable_weights
    with pytest.raises(ValueError, match="order_weights"):
        DP_Scattering(J=2, order_weights=(1.0, 1.0))
    # The default weights follow max_order (three weights refused max_order=1: an audit).
    assert DP_Scattering(J=1, max_order=1).order_weights == (1.0, 1.0)
    assert DP_Scattering(J=1).order_weights == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="multiples of 4"):
        DP_Scattering(J=2)(tf.zeros((1, 14, 14, 1)))
    with pytest.raises(ValueError, match="max_order"):
        DP_Scattering(max_order=3)
    with pytest.raises(ValueError, match="padding"):
        DP_Scattering(padding="circular")
    # A reflection wider than the image failed in TensorFlow's MirrorPad at the first call.
    with pytest.raises(ValueError, match=r"more than a reflection can fill: use padding='zero'"):
        DP_Scattering(J=3, angles=2)(tf.zeros((1, 8, 8, 1)))
    assert DP_Scattering(J=3, angles=2, padding="zero")(tf.zeros((1, 8, 8, 1))).shape[1:3] == (1, 1)
    assert clone.padding == "zero"


def test_scattering_lipschitz_grows_with_the_order_weights():
    scattering = Scattering2D(J=2, shape=(16, 16))
    base = scattering_lipschitz(scattering, (16, 16), (1.0, 1.0, 1.0))
    assert scattering_lipschitz(scattering, (16, 16), (2.0, 2.0, 2.0)) == pytest.approx(2 * base)
    assert scattering_lipschitz(scattering, (16, 16), (1.0, 1.0, 5.0)) > base


def test_multiscale_features_are_each_scales_scattering_flattened_and_concatenated():
    """Scale J gets orders up to min(2, J), the first order weights times its scale weight;
    the features are those scatterings' outputs, flattened, one scale after the other."""
    layer = DP_MultiscaleScattering(scales=(2, 1), order_weights=(0.3, 1.0, 4.0),
                                    scale_weights=(1.0, 0.5), padding="zero")
    x = _images(3, 11)
    features = layer(x).numpy()
    coarse = DP_Scattering(J=2, order_weights=(0.3, 1.0, 4.0), padding="zero")(x)
    fine = DP_Scattering(J=1, max_order=1, order_weights=(0.15, 0.5), padding="zero")(x)
    expected = np.concatenate([coarse.numpy().reshape(3, -1), fine.numpy().reshape(3, -1)], 1)
    np.testing.assert_array_equal(features, expected)
    assert features.shape == (3, 81 * 4 * 4 + 9 * 8 * 8)
    assert layer.compute_output_shape(x.shape)[1] == features.shape[1]
    assert not layer.trainable_weights


def test_multiscale_constant_is_the_root_of_the_sum_of_squares_and_holds():
    """``sqrt(L_2^2 + L_1^2)`` (the scales fill disjoint coordinates); power iteration on the
    Jacobian finds no larger local gain, and the bounds and certificate of a classifier on
    it use that constant."""
    layer = DP_MultiscaleScattering(scales=(2, 1), order_weights=(0.3, 2.0, 12.0))
    x = _images(1, 12)
    layer(x)
    parts = [s.lipschitz_constant for s in layer.scatterings]
    assert layer.lipschitz_constant == pytest.approx(np.hypot(*parts), rel=1e-12)
    assert layer.lipschitz_constant >= np.hypot(*parts)
    sigma = float(top_singular_directions(layer, _images(1, 13), 1e-2, iterations=20)[0][0])
    assert 0.1 * layer.lipschitz_constant < sigma <= layer.lipschitz_constant
    assert sigma > max(parts) * 0.1
    model = tf.keras.Sequential([
        tf.keras.layers.Input((16, 16, 1)), DP_BoundedInput(16.0), layer,
        DP_BoundedInput(3.0), DP_Flatten(), DP_QuickSpectralDense(10, use_bias=False)])
    assert float(lipschitz_bound(model)) == pytest.approx(layer.lipschitz_constant, rel=1e-5)
    assert layer.propagate_inputs(2.0) == pytest.approx(
        2.0 * layer.lipschitz_constant + layer.rounding_error(2.0), rel=1e-12)
    assert 0 < float_error_bound(model) < 1e-3 * layer.lipschitz_constant


@pytest.mark.slow
def test_head_gradients_on_the_multiscale_front_end_stay_within_their_bounds():
    """No `DP_BoundedInput` after the front end: the head's bounds use its output bound
    ``(1 + r) Lip X0``. Exact per-example gradients (traced, as the step takes them) on
    inputs inside, on and far beyond the input bound, constant images, one hot pixel and
    inputs optimised to maximise the head kernel's gradient stay within them. They reach
    more than a quarter of the head kernel's bound: a constant divided by 4 fails this test,
    by 2.5 it does not (the constant's padding and modulus factors are worst cases no input
    here reaches; the formula test above holds the constant itself)."""
    rng = np.random.default_rng(15)
    model = tf.keras.Sequential([
        tf.keras.layers.Input((16, 16, 1)), DP_BoundedInput(4.0),
        DP_MultiscaleScattering(scales=(2, 1), order_weights=(0.3, 2.0, 12.0), padding="zero"),
        DP_Flatten(), DP_QuickSpectralDense(4, use_bias=True)])
    loss = DP_TauCategoricalCrossentropy(2.0)
    x = adversarial_inputs(rng, (16, 16, 1), 4.0)
    y = one_hot_labels(rng, len(x), 4)
    bounds = gradient_bounds(model, loss)
    assert_within_bounds(per_example_gradient_norms(model, loss, x, y, traced=True), bounds,
                         "multiscale")
    head = model.layers[-1].kernel
    x_adv = maximize_gradient_norm(model, loss, x[:2], y[:2], head, 4.0, steps=20)
    norms = per_example_gradient_norms(model, loss, x_adv, y[:2], traced=True)
    assert_within_bounds(norms, bounds, "multiscale, gradient ascent")
    head_name = next(name for name in norms if name.endswith("kernel"))
    assert np.max(norms[head_name]) > 0.25 * bounds[head_name]  # the search found something


def test_multiscale_config_round_trip_and_argument_errors():
    layer = DP_MultiscaleScattering(scales=(1, 2), angles=4, order_weights=(1.0, 2.0),
                                    scale_weights=(2.0, 1.0), padding="zero", name="multi")
    clone = DP_MultiscaleScattering.from_config(layer.get_config())
    x = _images(2, 14)
    np.testing.assert_array_equal(layer(x).numpy(), clone(x).numpy())
    assert clone.lipschitz_constant == layer.lipschitz_constant
    for kwargs, message in [({"scales": (2, 2)}, "distinct"), ({"scales": ()}, "distinct"),
                            ({"scales": (2, 1), "scale_weights": (1.0,)}, "scale_weights"),
                            ({"scales": (2, 1), "scale_weights": (1.0, -1.0)}, "scale_weights"),
                            ({"padding": "circular"}, "padding")]:
        with pytest.raises(ValueError, match=message):
            DP_MultiscaleScattering(**kwargs)
