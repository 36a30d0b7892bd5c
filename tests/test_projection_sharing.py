"""A traced projection is a graph function shared by the kernels of one shape and one set of
projection settings in the process (`lipdp.layers._projection._traced_projection`). Sharing
must change no value: each layer's projected kernel, power-iteration vector and certificate
are those of the projection run eagerly on that layer's own kernel, and layers whose settings
differ (Björck iterations, a schedule, certifying or not) never share a function."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.layers import DP_QuickSpectralConv2D, DP_QuickSpectralDense, DP_SpectralDense
from lipdp.layers import _projection
from lipdp.layers._projection import project_kernel, uncertified


# The graph functions made during a test, in the order they were first handed out.
_MADE = []


@pytest.fixture(autouse=True)
def _record_made(monkeypatch):
    """An empty cache, and `_MADE` recording the functions it hands out."""
    made = _projection._traced_projection
    made.cache_clear()
    _MADE.clear()

    def recording(*key):
        function = made(*key)
        if all(function is not other for other in _MADE):
            _MADE.append(function)
        return function

    monkeypatch.setattr(_projection, "_traced_projection", recording)


def _traced_count():
    return sum(function.experimental_get_tracing_count() for function in _MADE)


def _layer(cls, units, input_dim, seed, **kwargs):
    """A built layer whose kernel is `seed`'s draw, scaled far from orthogonal (norm ~3)."""
    layer = cls(units, **kwargs)
    layer.build((None, input_dim))
    kernel = np.random.default_rng(seed).normal(size=layer.kernel.shape) / np.sqrt(input_dim)
    layer.kernel.assign(1.5 * kernel.astype(np.float32))
    return layer


def _eager(layer, orthogonalise=True, certify=None):
    """The layer's projection, run op by op (no traced function): (kernel, u, certificate)."""
    if certify is None:
        certify = getattr(layer, "_certificate_cache", None) is not None
    kernel, u, certificate = project_kernel(
        layer.kernel, layer.u, layer.projection, layer.projection.maxiter_spectral,
        orthogonalise, certify=certify)
    return (kernel.numpy(), u.numpy(), None if certificate is None else float(certificate))


def _assert_projected_as_eagerly(layer, expected):
    kernel, u, certificate = expected
    np.testing.assert_allclose(layer.bounded_kernel().numpy(), kernel, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(layer.u.numpy(), u, rtol=1e-6, atol=1e-7)
    cache = getattr(layer, "_certificate_cache", None)
    if certificate is not None:
        assert float(cache[1].numpy()) == pytest.approx(certificate, rel=1e-6)


def test_same_shape_layers_share_one_trace_and_keep_their_own_projections():
    layers = [_layer(DP_QuickSpectralDense, 8, 8, seed) for seed in range(3)]
    layers.append(_layer(DP_QuickSpectralDense, 8, 12, 3))  # another shape
    expected = [_eager(layer) for layer in layers]

    @tf.function
    def project_all():
        for layer in layers:
            layer.project()

    project_all()
    for layer, values in zip(layers, expected):
        _assert_projected_as_eagerly(layer, values)
    assert not np.allclose(layers[0].kernel.numpy(), layers[1].kernel.numpy())
    assert len(_MADE) == 2 and _traced_count() == 2  # one function, one trace per shape
    assert expected[0][2] is not None  # these layers certify: the certificate was compared


def test_settings_that_change_the_graph_get_their_own_function():
    """Same matrix shape, different settings: each gets its own function and its own eager
    result (Björck iterations, no Björck, certifying or not, a conv kernel of the same RKO
    matrix shape); `DP_SpectralDense` projects its free kernel with the same settings as
    `DP_QuickSpectralDense` and shares its function."""
    layers = [_layer(DP_QuickSpectralDense, 8, 18, 0),
              _layer(DP_QuickSpectralDense, 8, 18, 1, maxiter_bjorck=2),
              _layer(DP_QuickSpectralDense, 8, 18, 2, eps_bjorck=None),
              _layer(DP_SpectralDense, 8, 18, 3)]
    conv = DP_QuickSpectralConv2D(8, 3)
    conv.build((None, 5, 5, 2))
    conv.kernel.assign(1.5 * np.random.default_rng(4).normal(size=(3, 3, 2, 8)).astype(
        np.float32) / np.sqrt(18))
    uncertified_twin = _layer(DP_QuickSpectralDense, 8, 18, 5)
    expected = [_eager(layer) for layer in layers + [conv]]
    expected_uncertified = _eager(uncertified_twin, certify=False)

    @tf.function
    def project_all():
        for layer in layers + [conv]:
            layer.project()
        with uncertified():
            uncertified_twin.project()

    project_all()
    for layer, values in zip(layers + [conv], expected):
        _assert_projected_as_eagerly(layer, values)
    _assert_projected_as_eagerly(uncertified_twin, expected_uncertified)
    assert expected[0][2] is not None and expected_uncertified[2] is None
    assert len(_MADE) == 5 and _traced_count() == 5


@pytest.mark.parametrize("orthogonalise", [True, False])
def test_a_schedule_decided_in_the_graph_projects_as_its_value_says(orthogonalise):
    layers = [_layer(DP_QuickSpectralDense, 8, 8, seed) for seed in range(2)]
    expected = [_eager(layer, orthogonalise, certify=False) for layer in layers]

    @tf.function
    def project_all(flag):
        for layer in layers:
            layer.project(flag)

    project_all(tf.constant(orthogonalise))
    for layer, values in zip(layers, expected):
        _assert_projected_as_eagerly(layer, values)
    assert len(_MADE) == 1 and _traced_count() == 1
