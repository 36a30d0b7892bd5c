"""gradient_bounds(model) and lipschitz_bound(model) against independent computations on
whole networks: exact per-example gradients (one tape per example) on adversarial inputs and
on inputs optimised to maximise a gradient, and a proven lower bound of the Lipschitz
constant (power iteration on J^T J, gradient ascent on ||f(a) - f(b)|| / ||a - b||)."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.bounds import gradient_bounds, lipschitz_bound
from lipdp.layers import DP_BoundedInput, DP_Flatten, DP_QuickSpectralConv2D, DP_QuickSpectralDense
from lipdp.losses import (DP_MulticlassHinge, DP_MulticlassHKR, DP_MulticlassKR, DP_TauBCE,
                          DP_TauCategoricalCrossentropy)
from lipdp.metadata import DPParameters
from lipdp.model import DP_Model, DP_Sequential
from tests._certificates import CONV_GRAM_WAYS, force_conv_gram_way
from tests._models import X0, cnn, metadata, mlp
from tests._soundness import (REL_TOL, adversarial_inputs, assert_within_bounds,
                              lipschitz_lower_bound, maximize_gradient_norm, one_hot_labels,
                              per_example_gradient_norms, perturb_weights,
                              top_singular_directions)

LOSSES = {
    "cce": lambda: DP_TauCategoricalCrossentropy(5.0),
    "cce margin": lambda: DP_TauCategoricalCrossentropy(5.0, margin=0.5),
    "bce": lambda: DP_TauBCE(3.0),
    "hinge": lambda: DP_MulticlassHinge(1.0),
    "kr": lambda: DP_MulticlassKR(),
    "hkr": lambda: DP_MulticlassHKR(alpha=2.0, min_margin=10.0),
}


def _inputs(rng, shape, n=12):
    """Random inputs below, on and far beyond the bound; constant images; one hot pixel."""
    return adversarial_inputs(rng, shape, X0, n=n)


def _cnn_cases(seed, loss, context, bias=True):
    """The test CNN, its bounds for `loss`, and the inputs to hold them on: ``(inputs,
    labels, context)`` for the adversarial inputs of `_inputs`, then for three of them
    optimised to maximise the first kernel's gradient."""
    rng = np.random.default_rng(seed)
    model = cnn(bias=bias)
    x = _inputs(rng, (8, 8, 2))
    y = one_hot_labels(rng, len(x), 4)
    bounds = gradient_bounds(model, loss)
    x_adv = maximize_gradient_norm(model, loss, x[:3], y[:3], model.trainable_variables[0], X0)
    return model, bounds, [(x, y, context), (x_adv, y[:3], f"{context}, gradient ascent")]


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_cnn_bounds_hold(loss_name, bias):
    loss = LOSSES[loss_name]()
    model, bounds, cases = _cnn_cases(0, loss, loss_name, bias)
    for inputs, labels, context in cases:
        assert_within_bounds(per_example_gradient_norms(model, loss, inputs, labels), bounds,
                             context)


def test_bounds_hold_with_chunked_float32_certificates(monkeypatch):
    """The CNN's dense kernels certified from chunked float32 Gram matrices (blocks of 3
    rows, as the paper's CNN's 3136 x 512 kernel gets in blocks of 392): exact per-example
    gradients on adversarial and gradient-ascent inputs stay within the bounds. (The dense
    kernels' projections' certificates are withheld: they would serve instead.)"""
    from lipdp import gram_certificates, operator_norms
    from lipdp.layers._projection import ProjectedKernelMixin

    monkeypatch.setattr(ProjectedKernelMixin, "certificate_cache", lambda self: None)
    monkeypatch.setattr(operator_norms, "CHUNKED_GRAM_MIN_WORK", 1)
    monkeypatch.setattr(operator_norms, "CHUNKED_GRAM_MIN_ASPECT", 1)
    monkeypatch.setattr(operator_norms, "CHUNK_ROWS", 3)
    chunked, certify = [], gram_certificates.chunked_dense_norm_upper
    monkeypatch.setattr(operator_norms, "chunked_dense_norm_upper",
                        lambda *a, **k: chunked.append(1) or certify(*a, **k))
    loss = LOSSES["cce"]()
    model, bounds, cases = _cnn_cases(2, loss, "chunked")
    assert len(chunked) == 2  # both dense kernels
    for inputs, labels, context in cases:
        assert_within_bounds(per_example_gradient_norms(model, loss, inputs, labels), bounds,
                             context)


@pytest.mark.parametrize("way", CONV_GRAM_WAYS)
def test_bounds_hold_with_either_way_to_the_convolution_certificate(monkeypatch, way):
    """The CNN's two convolutions certified with their frequency Gram matrices computed one
    way or the other (`lipdp.gram_certificates.conv_norm_upper` picks the cheaper; here the
    choice is forced): exact per-example gradients on adversarial and gradient-ascent inputs
    stay within the bounds. (The gradients of the variables before a convolution reach 0.1-0.25
    of their bounds on this small CNN: a certificate 1.4x too small passes here; it fails
    `test_a_convolution_certificate_enters_a_bound_that_inputs_reach` and the certificate's own
    tests, against exact SVDs and power iteration on TensorFlow's conv2d, either way.)"""
    used = force_conv_gram_way(monkeypatch, way)
    loss = LOSSES["cce"]()
    model, bounds, cases = _cnn_cases(4, loss, way)
    assert used and set(used) == {way}
    for inputs, labels, context in cases:
        assert_within_bounds(per_example_gradient_norms(model, loss, inputs, labels), bounds,
                             context)


def test_bounds_hold_for_gradients_taken_as_the_traced_step_takes_them(monkeypatch):
    """Traced, GroupSort2 and the L2-norm pooling after it run as one fused kernel (when the
    kernels are available), its gradient included: exact per-example gradients taken that
    way, on adversarial and gradient-ascent inputs, stay within the bounds and equal the
    eager ones (where the layers run apart)."""
    from lipdp import kernels
    from lipdp.layers import basic

    fused, find = [], basic._fused_group_sort_input  # pylint: disable=protected-access

    def spy(x):
        found = find(x)
        fused.append(found is not None)
        return found

    monkeypatch.setattr(basic, "_fused_group_sort_input", spy)
    loss = LOSSES["cce"]()
    model, bounds, cases = _cnn_cases(3, loss, "traced")
    for inputs, labels, context in cases:
        traced = per_example_gradient_norms(model, loss, inputs, labels, traced=True)
        assert_within_bounds(traced, bounds, context)
        eager = per_example_gradient_norms(model, loss, inputs, labels)
        for name in traced:
            np.testing.assert_allclose(traced[name], eager[name], rtol=1e-5, atol=1e-7)
    assert any(fused) == (kernels.fused_ops() is not None)


def test_bounds_hold_after_noisy_training_moves_the_weights():
    rng = np.random.default_rng(1)
    model = cnn(sigma=2.0)
    model.compile(loss=LOSSES["cce"](), optimizer=tf.keras.optimizers.SGD(0.05))
    x, y = _inputs(rng, (8, 8, 2), n=64)[:64], one_hot_labels(rng, 64, 4)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=3, verbose=0)
    bounds = gradient_bounds(model)
    assert_within_bounds(per_example_gradient_norms(model, model.dp_loss, x[:16], y[:16]), bounds,
                         "after training")


def test_functional_model_bounds_hold():
    rng = np.random.default_rng(2)
    model = mlp()
    loss = LOSSES["hkr"]()
    x = _inputs(rng, (10,))
    y = one_hot_labels(rng, len(x), 3)
    assert_within_bounds(per_example_gradient_norms(model, loss, x, y), gradient_bounds(model, loss),
                         "functional")


# name -> (model factory, input shape, weights, least measured / certified asserted).
LIPSCHITZ_CASES = {
    # Tight: the kernels have orthonormal rows and non-increasing widths and GroupSort is a
    # permutation, so ||J|| = 1 = the certified product exactly (measured 1.000001).
    "mlp": (mlp, (10,), "projected", 0.98),
    # Sound only: off the constraint set the product of the kernels' norms is loose
    # (measured/certified ~0.7), and so it is on conv nets (~0.25-0.4: the top singular
    # vectors of consecutive convolutions and the L2 pooling's per-window projections are not
    # aligned); each conv layer's own constant is checked tight in test_layer_bounds.
    "mlp perturbed": (mlp, (10,), "perturbed", None),
    "cnn": (lambda: cnn(bias=False), (8, 8, 2), "projected", None),
    "cnn perturbed": (cnn, (8, 8, 2), "perturbed", None),
}


@pytest.mark.parametrize("name", sorted(LIPSCHITZ_CASES))
def test_model_lipschitz_bound_is_sound_and_tight_where_it_can_be(name):
    """certified >= a proven lower bound (power iteration on J^T J, then gradient ascent on
    ||f(a) - f(b)|| / ||a - b||, tests._soundness.lipschitz_lower_bound), up to float32
    rounding (REL_TOL); where the certificate is tight, the lower bound must reach
    `minimum` x certified (> 1/1.4), so a constant 1.4x too small fails the first assertion."""
    make, shape, weights, minimum = LIPSCHITZ_CASES[name]
    rng = np.random.default_rng(3)
    model = make()
    if weights == "perturbed":
        perturb_weights(model, rng, 0.2)
    certified = float(lipschitz_bound(model))
    measured, _ = lipschitz_lower_bound(model, rng.normal(size=(8,) + shape), X0)
    assert measured <= certified * (1 + REL_TOL), (name, measured, certified)
    if minimum is not None:
        assert measured >= minimum * certified, (name, measured, certified)


def test_each_certified_norm_is_computed_once_per_bound_pass(monkeypatch):
    """The cache is scoped to one pass: same bounds, every layer's certified norm computed
    once per pass, all of them in one host call."""
    import lipdp.bounds as bounds

    model = mlp()
    loss = DP_TauCategoricalCrossentropy(5.0)
    expected = gradient_bounds(model, loss)
    calls = []
    original = bounds.certified_norms
    monkeypatch.setattr(bounds, "certified_norms",
                        lambda requests: calls.append(len(requests)) or original(requests))
    assert gradient_bounds(model, loss) == expected
    assert calls == [2]  # two dense layers, each needed forward and backward, one call
    model.layers[-1].kernel.assign(model.layers[-1].kernel * 3.0)  # a new pass sees new weights
    assert gradient_bounds(model, loss) != expected


@pytest.mark.parametrize("way", CONV_GRAM_WAYS)
def test_a_convolution_certificate_enters_a_bound_that_inputs_reach(monkeypatch, way):
    """A bound that a convolution's certified norm scales, reached by exact per-example
    gradients, so that a certificate 1.4x too small fails (either way to it forced).

    ``BoundedInput(X0) -> conv 3x3 'same' (8x8x2 -> 8x8x4) -> Flatten -> Dense(3)`` with the KR
    loss, whose logit gradient has norm exactly its Lipschitz constant L: the dense kernel's
    gradient is ``h g^T`` of norm ``||conv(x)|| L``, and its bound is ``S X0 L`` with S the
    convolution's certified operator norm. The input of norm X0 along the top right singular
    vector of the zero-padded convolution (power iteration on TensorFlow's conv2d) reaches
    its operator norm, at least 0.9 S on this 8x8 input (0.960 measured)."""
    from lipdp import operator_norms

    used = force_conv_gram_way(monkeypatch, way)
    tf.keras.utils.set_random_seed(5)
    model = DP_Sequential(
        [DP_BoundedInput(X0, input_shape=(8, 8, 2)), DP_QuickSpectralConv2D(4, 3, use_bias=False),
         DP_Flatten(), DP_QuickSpectralDense(3, use_bias=False)],
        dp_parameters=DPParameters(1.0, 1e-5), dataset_metadata=metadata((8, 8, 2), 3))
    loss = LOSSES["kr"]()
    # Power iteration on conv^T conv, the operator the layer runs (linear: any point will do).
    _, v = top_singular_directions(model.layers[1], np.zeros((1, 8, 8, 2)), 1e-2,
                                   iterations=200, seed=5)
    x = (X0 * v).numpy()
    y = np.eye(3, dtype=np.float32)[[0]]
    bounds = gradient_bounds(model, loss)
    assert used and set(used) == {way}
    norms = per_example_gradient_norms(model, loss, x, y)
    assert_within_bounds(norms, bounds, way)
    dense_kernel = list(bounds)[-1]
    reached = norms[dense_kernel][0] / bounds[dense_kernel]
    assert reached >= 0.9, reached
    certify = operator_norms.conv_norm_upper
    monkeypatch.setattr(operator_norms, "conv_norm_upper",
                        lambda *args: np.float32(certify(*args) / 1.4))
    with pytest.raises(AssertionError):
        assert_within_bounds(norms, gradient_bounds(model, loss), f"{way}, certificate / 1.4")


class _ScaledOutputs(DP_Sequential):
    def call(self, inputs, training=None, mask=None):
        return super().call(inputs, training=training, mask=mask) / 0.01


class _ScaledFunctionalOutputs(DP_Model):
    def call(self, inputs, training=None, mask=None):
        return super().call(inputs, training=training, mask=mask) / 0.01


class _KerasCallOnTheClass:
    """A descriptor showing Keras' Sequential `call` on the class and a scaled one on the
    model: a check comparing ``type(model).call`` passed it."""

    def __get__(self, model, cls):
        if model is None:
            return tf.keras.Sequential.call
        return lambda inputs, training=None, mask=None: tf.keras.Sequential.call(
            model, inputs, training=training, mask=mask) / 0.01


class _DisguisedCall(DP_Sequential):
    call = _KerasCallOnTheClass()


def test_a_call_disguised_by_a_descriptor_is_refused():
    """(The scaled `call` runs: outputs 100x those of the layers.)"""
    model = _DisguisedCall([DP_BoundedInput(X0, input_shape=(10,)), DP_QuickSpectralDense(3)],
                           dp_parameters=DPParameters(1.0, 1e-5),
                           dataset_metadata=metadata((10,), 3))
    with pytest.raises(ValueError, match=r"computes its outputs with a `call` of its own"):
        model.compile(loss=DP_MulticlassKR(), optimizer=tf.keras.optimizers.SGD(0.1))


@pytest.mark.parametrize("functional", [False, True])
def test_a_model_whose_own_call_leaves_its_layer_graph_is_refused(functional):
    """The bound pass and the certificates walk the layer graph: a subclass whose `call`
    divided the outputs by 0.01 compiled and trained with exact per-example gradients 100x
    the bound (an audit). compile, the bounds and the certificates refuse it."""
    import lipdp

    parameters, md = DPParameters(1.0, 1e-5), metadata((10,), 3)
    message = r"computes its outputs with a `call` of its own"
    if functional:  # DP_Model checks its graph when it is built
        inputs = tf.keras.Input((10,))
        outputs = DP_QuickSpectralDense(3)(DP_BoundedInput(X0)(inputs))
        with pytest.raises(ValueError, match=message):
            _ScaledFunctionalOutputs(inputs, outputs, dp_parameters=parameters,
                                     dataset_metadata=md)
        return
    model = _ScaledOutputs([DP_BoundedInput(X0, input_shape=(10,)), DP_QuickSpectralDense(3)],
                           dp_parameters=parameters, dataset_metadata=md)
    with pytest.raises(ValueError, match=message):
        model.compile(loss=DP_MulticlassKR(), optimizer=tf.keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=message):
        gradient_bounds(model, DP_MulticlassKR())
    with pytest.raises(ValueError, match=message):
        lipdp.certify.certified_radii(model, np.zeros((2, 10), "float32"))
