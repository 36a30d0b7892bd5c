"""Element-wise 1-Lipschitz activations, with the range bounds of each.

For an element-wise ``phi`` with ``|phi'| <= c`` everywhere, the computed
cotangent is ``phi'(x) * g``, so ``G_in = c G``. The output bound uses
``|phi(t)| <= a + b |t|`` (then ``||phi(x)|| <= a sqrt(n) + b ||x||`` by the
triangle inequality, n the number of units per example) and, for bounded
activations, ``|phi(t)| <= M`` (``||phi(x)|| <= M sqrt(n)``). Float32 rounding:
``K u ||phi(x)||`` (Lemma 3 of `lipdp.rounding`, assumption A3) for tanh, sigmoid
and softplus; ReLU only compares (Lemma 4).

GroupSort (`DP_GroupSort`), the activation recommended for Lipschitz networks,
is in `lipdp.layers.basic`.
"""

from __future__ import annotations

import math

import tensorflow as tf

from lipdp.layers.base import DPLayer, pin_input_shape
from lipdp.rounding import comparison_error, elementwise_error


class _ElementwiseActivation(tf.keras.layers.Layer, DPLayer):
    """An element-wise activation; subclasses set the constants of the bounds.

    ``OFFSET`` (a), ``SLOPE`` (b): ``|phi(t)| <= a + b |t|``; ``MAGNITUDE`` (M or
    None): ``|phi(t)| <= M``; ``DERIVATIVE`` (c): ``|phi'(t)| <= c``.
    """

    OFFSET = 0.0
    SLOPE = 1.0
    MAGNITUDE = None
    DERIVATIVE = 1.0

    def build(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        if any(d is None for d in input_shape[1:]):
            raise ValueError(f"{type(self).__name__} needs a fully known input shape to bound "
                             f"its output norm. Received: input_shape={input_shape}")
        self._units = int(math.prod(input_shape[1:]))
        super().build(input_shape)
        pin_input_shape(self, input_shape)

    def compute_output_shape(self, input_shape):
        return input_shape

    def propagate_inputs(self, input_bound):
        root_n = math.sqrt(self._units)
        bound = self.OFFSET * root_n + self.SLOPE * input_bound
        if self.MAGNITUDE is not None:
            bound = tf.minimum(bound, self.MAGNITUDE * root_n)
        return bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return self.DERIVATIVE * gradient_bound

    def rounding_error(self, input_bound):
        return elementwise_error(float(self.propagate_inputs(input_bound)))


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_ReLU(_ElementwiseActivation):
    """``max(x, 0)``: ``|relu(t)| <= |t|``, derivative in {0, 1} (0 at the kink)."""

    def call(self, inputs):
        return tf.nn.relu(inputs)

    def rounding_error(self, input_bound):
        return comparison_error()


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_Tanh(_ElementwiseActivation):
    """``tanh``: ``|tanh(t)| <= min(|t|, 1)``, derivative ``1 - tanh^2`` in (0, 1]."""

    MAGNITUDE = 1.0

    def call(self, inputs):
        return tf.tanh(inputs)


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_Sigmoid(_ElementwiseActivation):
    """``1 / (1 + e^-t)``: in (0, 1), ``|s(t)| <= 1/2 + |t|/4``, derivative ``s(1-s) <= 1/4``.

    Its Lipschitz constant is 1/4 (tighter than the paper's table, which lists 1).
    """

    OFFSET = 0.5
    SLOPE = 0.25
    MAGNITUDE = 1.0
    DERIVATIVE = 0.25

    def call(self, inputs):
        return tf.sigmoid(inputs)


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_Softplus(_ElementwiseActivation):
    """``log(1 + e^t)``: ``0 < softplus(t) <= log 2 + max(t, 0)``, derivative ``s(t)`` in (0, 1)."""

    OFFSET = math.log(2.0)

    def call(self, inputs):
        return tf.nn.softplus(inputs)
