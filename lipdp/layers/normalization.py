"""Affine layers without a kernel: layer centering and norm-bounded biases."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from lipdp.layers.base import DPLayer, as_bound, check_positive, pin_input_shape, weight_norm
from lipdp.rounding import UNDERFLOW, UNIT_ROUNDOFF, addition_error, gamma


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_LayerCentering(tf.keras.layers.Layer, DPLayer):
    """Subtracts the mean over `axis`: ``f(x) = x - mean_axis(x)`` (appendix C.2.3).

    A drop-in replacement for LayerNormalization without its unbounded division:
    f is the orthogonal projection onto the vectors of zero mean along `axis`
    (singular values 0 and 1), so ``X_out = X_in`` and ``G_in = G``. No
    parameters, no statistics shared across examples.

    Float32 rounding (`lipdp.rounding`, A1), with n the number of coordinates
    averaged by one mean: ``rounding_error(X) = (gamma_{n+1} (1 + u) + u) X + 6 UNDERFLOW``.
    Proof: the mean of a group g is a sum (any order: error ``<= gamma_{n-1} sum |x_i|``)
    divided by n (or multiplied by a rounded 1/n), so ``|m^ - m| <= gamma_{n+1}
    sum |x_i| / n <= gamma_{n+1} ||x_g|| / sqrt(n)``. Then ``fl(x_i - m^) = (x_i - m^)(1 + d_i)``
    errs from ``x_i - m`` by ``(m - m^) + d_i (x_i - m^)``: over the group, at most
    ``sqrt(n) |m - m^| + u (||x_g - m|| + sqrt(n) |m - m^|) <= (gamma_{n+1} (1 + u) + u) ||x_g||``
    (``||x_g - m|| <= ||x_g||``); summed in quadrature over the groups. Flushed operands
    and results move a coordinate by at most 6 mu. QED

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
        shape = tf.TensorShape(input_shape)
        rank = shape.rank
        if any(not -rank < a < rank or a % rank == 0 for a in self.axis):
            raise ValueError(f"DP_LayerCentering axis {self.axis} must name non-batch axes of "
                             f"inputs of rank {rank}: a mean over the batch would mix examples.")
        if len({a % rank for a in self.axis}) != len(self.axis):
            raise ValueError(f"DP_LayerCentering axis {self.axis} names an axis twice (inputs of "
                             f"rank {rank}).")
        sizes = [shape[a] for a in self.axis]
        self._group_size = math.prod(sizes) if None not in sizes else None
        super().build(input_shape)
        pin_input_shape(self, input_shape)

    def call(self, inputs):
        return inputs - tf.reduce_mean(inputs, axis=self.axis, keepdims=True)

    def compute_output_shape(self, input_shape):
        return input_shape

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound

    def rounding_error(self, input_bound):
        if self._group_size is None:
            return math.inf
        u = UNIT_ROUNDOFF
        return (gamma(self._group_size + 1) * (1.0 + u) + u) * input_bound + 6.0 * UNDERFLOW

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
    - ``backpropagate_inputs(X, G) = G``;
    - ``rounding_error(X)``: Lemma 2 of `lipdp.rounding` on outputs of norm
      ``<= X + sqrt(P) ||b||``.

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
        pin_input_shape(self, input_shape)

    def call(self, inputs):
        return inputs + self.bias

    def compute_output_shape(self, input_shape):
        return input_shape

    def project(self, orthogonalise=True):
        del orthogonalise  # no Björck here
        norm = tf.norm(self.bias)
        self.bias.assign(self.bias * tf.minimum(1.0, self.norm_max / tf.maximum(norm, 1e-30)))

    def propagate_inputs(self, input_bound):
        return as_bound(input_bound) + math.sqrt(self._positions) * weight_norm(self.bias)

    def backpropagate_params(self, input_bound, gradient_bound):
        return [(self.bias, math.sqrt(self._positions) * gradient_bound)]

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound

    def rounding_error(self, input_bound):
        bias_norm = np.linalg.norm(np.asarray(self.bias, np.float64))
        return addition_error(0.0, input_bound + math.sqrt(self._positions) * bias_norm)

    def get_config(self):
        return {**super().get_config(), "norm_max": self.norm_max}
