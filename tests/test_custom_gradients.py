"""Layers whose backward pass is not the plain chain rule (`tf.custom_gradient`) under classic
DP-SGD.

A backward pass that clips or renormalises each example's cotangent (lipdp's own
`DP_ClipGradient`) is not linear in the cotangent: Algorithm 1's second backward pass of the
reweighted loss ``sum_i nu_i loss_i``, which the ghost engines took for flat clipping, then did
not scale example i's gradient by ``nu_i``, and removing one example moved the clipped sum by
24 C (2026-12-05). The ghost engines now take the local product of each layer's output with the
reweighted cotangents ``nu_i g_i``: the very vectors whose norms were clipped. A backward pass
that mixes the rows of the batch (a roll along the batch axis: 92 C) is refused at compile by
the batch-coupling probe, which now compares the gradients reaching every layer's output too.
The reference is the vectorized engine (each example's gradient alone, through the model).
"""

import numpy as np
import pytest
import tensorflow as tf

import lipdp
from lipdp.clipping import BatchCouplingError
from lipdp.layers import DP_BoundedInput, DP_ClipGradient, DP_QuickSpectralDense
from lipdp.layers.base import DPLayer
from lipdp.losses import DP_TauCategoricalCrossentropy

D, C, DIM, CLASSES = 8, 0.05, 20, 3


def _model(head, engine, clipping="flat"):
    inputs = tf.keras.Input((DIM,))
    outputs = head(tf.keras.layers.Dense(CLASSES, name="dense")(inputs))
    metadata = lipdp.DatasetMetadata((DIM,), CLASSES, 64, 8, D, None, "shuffle")
    model = lipdp.DP_Model(inputs, outputs, dataset_metadata=metadata, dp_parameters=lipdp.
                           DPParameters(0.0, 1e-5, mode="clipped", l2_norm_clip=C,
                                        engine=engine, clipping=clipping))
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="sgd")
    return model


def _batch():
    rng = np.random.default_rng(0)
    return (tf.constant(25.0 * rng.normal(size=(D, DIM)), tf.float32),  # norms about 110
            tf.constant(rng.integers(0, CLASSES, D), tf.int32))


def _sums(model, x, y, traced):
    step = tf.function(model.private_gradients) if traced else model.private_gradients
    return [D * g.numpy() for g in step(x, y)[0]]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("engine", ["ghost", "mixed-ghost"])
def test_a_clipped_cotangent_keeps_each_example_within_the_threshold(engine, traced):
    x, y = _batch()
    vectorized = _model(DP_ClipGradient(0.01), "vectorized")
    model = _model(DP_ClipGradient(0.01), engine)
    model.set_weights(vectorized.get_weights())
    full = _sums(model, x, y, traced)
    for a, b in zip(full, _sums(vectorized, x, y, traced)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    for i in range(D):
        keep = [j for j in range(D) if j != i]
        rest = _sums(model, tf.gather(x, keep), tf.gather(y, keep), traced)
        change = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(full, rest)))
        assert change <= C * (1 + 1e-5), (i, change / C)


@tf.custom_gradient
def _rolled(t):
    """Identity forward; backward, example i receives example i - 1's cotangent."""
    return tf.identity(t), lambda g: tf.roll(g, 1, axis=0)


@pytest.mark.parametrize("engine", ["ghost", "mixed-ghost", "vectorized"])
def test_a_backward_pass_mixing_the_examples_is_refused(engine):
    with pytest.raises(BatchCouplingError, match="gradient reaching the output of layer "
                                                 "'dense'.*mixes the examples"):
        _model(tf.keras.layers.Lambda(_rolled), engine)


class _RolledBackward(tf.keras.layers.Layer, DPLayer):
    """A user DP layer: identity forward with 1-Lipschitz bounds, a batch-mixing backward."""

    def call(self, inputs):
        return _rolled(inputs)

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound


def test_clipless_refuses_a_user_layer_mixing_the_examples_backward():
    layers = [DP_BoundedInput(1.0, input_shape=(DIM,)), DP_QuickSpectralDense(6, name="first"),
              _RolledBackward(name="rolled"), DP_QuickSpectralDense(CLASSES)]
    model = lipdp.DP_Sequential(layers, dp_parameters=lipdp.DPParameters(1.0, 1e-5),
                                dataset_metadata=lipdp.DatasetMetadata((DIM,), CLASSES, 64, 8,
                                                                       D, 1.0, "shuffle"))
    with pytest.raises(BatchCouplingError, match="output of layer 'first'"):
        model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
