"""Affine layers without a kernel: layer centering and norm-bounded biases."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from lipdp.layers.base import DPLayer, check_positive


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_LayerCentering(tf.keras.layers.Layer, DPLayer):
    """Subtracts the mean over `axis`: ``f(x) = x - mean_axis(x)`` (appendix C.2.3).

    A drop-in replacement for LayerNormalization without its unbounded division:
    f is the orthogonal projection onto the vectors of zero mean along `axis`
    (singular values 0 and 1), so ``X_out = X_in`` and ``G_in = G``. No
    parameters, no statistics shared across examples.

    Args:
        axis: the axis, or tuple of non-batch axes, to centre along (default -1,
            the channels: one mean per position).
    """

    def __init__(self, axis=-1, **kwargs):
        super().__init__(**kwargs)
        axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
        if not axes or not all(isinstance(a, (int, np.integer)) and a != 0 for a in axes):
            raise ValueError("Received an invalid value for `axis`, expected a non-batch axis or "
                             f"a tuple of them. Received: axis={axis!r}")
        self.axis = tuple(int(a) for a in axes)

    def build(self, input_shape):
        rank = tf.TensorShape(input_shape).rank
        if any(not -rank < a < rank or a % rank == 0 for a in self.axis):
            raise ValueError(f"DP_LayerCentering axis {self.axis} must name non-batch axes of "
                             f"inputs of rank {rank}: a mean over the batch would mix examples.")
        super().build(input_shape)

    def call(self, inputs):
        return inputs - tf.reduce_mean(inputs, axis=self.axis, keepdims=True)

    def compute_output_shape(self, input_shape):
        return input_shape

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound

    def get_config(self):
        return {**super().get_config(), "axis": list(self.axis)}


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_AddBias(tf.keras.layers.Layer, DPLayer):
    """``y = x + b`` with one bias per channel, projected onto ``||b|| <= norm_max``.

    The bias is broadcast over the ``P`` positions of an example (``P = 1`` for
    vectors), so its per-example gradient is ``sum_p g_p``, of norm at most
    ``sqrt(P) G``. Bounds (``||b||`` at the current weights, ``<= norm_max``
    after every projection):

    - ``propagate_inputs(X) = X + sqrt(P) ||b||``;
    - bias: ``sqrt(P) G``;
    - ``backpropagate_inputs(X, G) = G``.

    Args:
        norm_max: radius of the ball the bias is projected onto after each step.
    """

    def __init__(self, norm_max=1.0, **kwargs):
        super().__init__(**kwargs)
        self.norm_max = check_positive(norm_max, "norm_max")

    def build(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        if any(d is None for d in input_shape[1:]):
            raise ValueError("DP_AddBias needs a fully known input shape to bound its bias "
                             f"gradient. Received: input_shape={input_shape}")
        self._positions = int(math.prod(input_shape[1:-1]))
        self.bias = self.add_weight(name="bias", shape=(int(input_shape[-1]),),
                                    initializer="zeros", trainable=True)
        super().build(input_shape)

    def call(self, inputs):
        return inputs + self.bias

    def compute_output_shape(self, input_shape):
        return input_shape

    def project(self):
        norm = tf.norm(self.bias)
        self.bias.assign(self.bias * tf.minimum(1.0, self.norm_max / tf.maximum(norm, 1e-30)))

    def propagate_inputs(self, input_bound):
        return input_bound + math.sqrt(self._positions) * tf.norm(self.bias)

    def backpropagate_params(self, input_bound, gradient_bound):
        return [(self.bias, math.sqrt(self._positions) * gradient_bound)]

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound

    def get_config(self):
        return {**super().get_config(), "norm_max": self.norm_max}
