"""DP layers defined outside lipdp (the `lipdp.layers.DPLayer` extension point) are probed at
compile for what their bound methods cannot express: mixing the examples of a batch, or
writing the training data into their state (`DP_Model._check_user_layers_per_example`, the
probe of classic DP-SGD, `lipdp.clipping.check_no_batch_coupling`)."""

import numpy as np
import pytest
import tensorflow as tf

import lipdp
from lipdp.clipping import BatchCouplingError
from lipdp.layers import DP_BoundedInput, DP_QuickSpectralDense
from lipdp.layers.base import DPLayer
from lipdp.losses import DP_TauCategoricalCrossentropy

N, BATCH, DIM, X0 = 64, 8, 4, 1.0


class _BatchCentring(tf.keras.layers.Layer, DPLayer):
    """Subtracts the batch mean, with the bounds of a per-example 1-Lipschitz map: they hold
    for every example with the others fixed, not for the change one example makes to the
    others."""

    def call(self, inputs):
        return inputs - tf.reduce_mean(inputs, axis=0, keepdims=True)

    def propagate_inputs(self, input_bound):
        return 2.0 * input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound


class _BatchMaxScaling(_BatchCentring):
    """Divides by the batch's largest magnitude (kept at least 1): the replaced example of
    the probe is rarely that maximum."""

    def call(self, inputs):
        return inputs / tf.maximum(1.0, tf.reduce_max(tf.abs(inputs)))


class _NaNCounter(_BatchCentring):
    """Per-example forward (the identity), but counts the non-finite inputs of training
    passes in a non-trainable variable saved with the model."""

    def build(self, input_shape):
        self.count = self.add_weight(name="count", shape=(), initializer="zeros",
                                     trainable=False)

    def call(self, inputs, training=None):
        if training:
            self.count.assign_add(
                tf.reduce_sum(tf.cast(~tf.math.is_finite(inputs), tf.float32)))
        return inputs


class _Halving(_BatchCentring):
    """Per example: half its input; bounds to match."""

    def call(self, inputs):
        return 0.5 * inputs

    def propagate_inputs(self, input_bound):
        return 0.5 * input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return 0.5 * gradient_bound


def _model(layer):
    metadata = lipdp.DatasetMetadata((DIM,), 3, N, 8, BATCH, X0, "shuffle")
    return lipdp.DP_Sequential(
        [DP_BoundedInput(X0, input_shape=(DIM,)), DP_QuickSpectralDense(6), layer,
         DP_QuickSpectralDense(3)],
        dp_parameters=lipdp.DPParameters(noise_multiplier=1.0, delta=1e-5),
        dataset_metadata=metadata)


@pytest.mark.parametrize("layer,message", [
    (lambda: _BatchCentring(name="centring"), "layer 'centring' .* mixes the examples"),
    (lambda: _BatchMaxScaling(name="max_scaling"),
     "one example NaN in a batch .* layer 'max_scaling' .* mixes the examples"),
    (lambda: _NaNCounter(name="counter"),
     "'counter/count:0' of layer 'counter' .* depends on the input data"),
])
def test_a_user_dp_layer_coupling_examples_or_recording_data_is_refused(layer, message):
    """Clipless DP-SGD differentiates the sum of the batch's losses: a layer whose output for
    one example moves with another escapes the per-example bounds (the batch centring let
    one example move the others' gradients), and a state written from the records is
    released without noise. Before, each compiled and trained."""
    model = _model(layer())
    with pytest.raises(BatchCouplingError, match=message):
        model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")


def test_a_per_example_user_dp_layer_trains():
    rng = np.random.default_rng(3)
    model = _model(_Halving(name="halving"))
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    x = rng.normal(size=(N, DIM)).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, N)]
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert model.dp_steps_taken == N // BATCH


class _FrobeniusDense(tf.keras.layers.Layer, DPLayer):
    """x W with ||W||_F <= 1 kept by `project` (bounds: kernel X G, Lipschitz 1); it starts
    from a kernel of Frobenius norm about 5 and does not project at build."""

    def __init__(self, units, twice=False, **kwargs):
        super().__init__(**kwargs)
        self.units, self.twice = units, twice

    def build(self, input_shape):
        self.kernel = self.add_weight(
            name="kernel", shape=(int(input_shape[-1]), self.units),
            initializer=tf.keras.initializers.RandomNormal(stddev=1.0, seed=0))

    def call(self, inputs):
        return tf.matmul(inputs, self.kernel)

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_params(self, input_bound, gradient_bound):
        bounds = [(self.kernel, gradient_bound * input_bound)]
        return bounds + [(self.kernel, 0.1 * gradient_bound * input_bound)] if self.twice \
            else bounds

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound

    def project(self, orthogonalise=True):
        self.kernel.assign(self.kernel / tf.maximum(1.0, tf.norm(self.kernel)))


def test_a_user_layer_listing_a_variable_twice_is_refused():
    """The bound pass keeps a variable's last bound: a kernel listed again with a bound 10x
    smaller trained at 6.4x that bound (an audit)."""
    model = _model(_FrobeniusDense(6, twice=True, name="frobenius"))
    with pytest.raises(ValueError, match=r"\['frobenius/kernel:0'\] have more than one"):
        model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")


def test_a_user_layer_is_projected_before_the_first_step():
    """lipdp's layers project at build; a user layer's constraint held only after the first
    step, which ran at ||W||_F = 5.08 under bounds for 1 (exact per-example norms 2.7x the
    bound, an audit). compile projects it once."""
    layer = _FrobeniusDense(6, name="frobenius")
    model = _model(layer)
    assert float(tf.norm(layer.kernel)) > 2.0
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    assert float(tf.norm(layer.kernel)) <= 1.0 + 1e-6
