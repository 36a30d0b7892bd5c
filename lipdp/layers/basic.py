"""Parameter-free DP layers: input bounding, flatten, GroupSort, L2-norm pooling."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from deel.lip.layers import GroupSort, ScaledL2NormPooling2D

from lipdp.layers.base import DPLayer

# Inputs are clipped to (1 - _CLIP_SLACK) * bound so that float32 rounding in the
# rescaling can never push a norm above the declared bound.
_CLIP_SLACK = 1e-6


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_BoundedInput(tf.keras.layers.Layer, DPLayer):
    """Clips every example to the declared L2 bound, in the forward pass.

    ``f(x) = x * min(1, X0 / ||x||_2)`` where the norm runs over all non-batch
    axes. This is the projection onto the ball of radius X0 (1-Lipschitz), so

    - ``propagate_inputs(X) = min(X, X0)``: the bound every later layer starts from;
    - ``backpropagate_inputs(X, G) = G``.

    It must be the first layer of a DP model: without it the input norm, hence
    every gradient bound, is unbounded.

    Args:
        upper_bound: X0 > 0, the L2 bound declared on every input.
    """

    def __init__(self, upper_bound, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(upper_bound, (int, float, np.floating)) or not np.isfinite(upper_bound) \
                or upper_bound <= 0:
            raise ValueError(
                "Received an invalid value for `upper_bound`, expected a finite positive "
                f"number. Received: upper_bound={upper_bound!r}"
            )
        self.upper_bound = float(upper_bound)

    def call(self, inputs):
        axes = list(range(1, inputs.shape.rank))
        norms = tf.sqrt(tf.reduce_sum(tf.square(inputs), axis=axes, keepdims=True))
        target = self.upper_bound * (1.0 - _CLIP_SLACK)
        scale = tf.minimum(1.0, target / tf.maximum(norms, 1e-30))
        return inputs * scale

    def propagate_inputs(self, input_bound):
        return tf.minimum(input_bound, self.upper_bound)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound

    def get_config(self):
        return {**super().get_config(), "upper_bound": self.upper_bound}


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_Flatten(tf.keras.layers.Flatten, DPLayer):
    """Flatten: a reshape, so norms and cotangent norms are unchanged."""

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_GroupSort(GroupSort, DPLayer):
    """GroupSort activation (deel-lip): sorts the channels within groups of size n.

    ``n=2`` is GroupSort2 (MaxMin), ``n=None`` sorts all channels (FullSort). A
    permutation of coordinates on each input, it is norm preserving and
    1-Lipschitz: ``X_out = X_in`` and ``G_in = G``.

    The bound ``G_in = G`` is on the cotangent *autodiff computes*, so the
    backward pass must be a permutation too. deel-lip's GroupSort2 uses
    ``tf.maximum`` / ``tf.minimum``, whose gradients at a tie (``a == b``, e.g. on
    constant or zero regions) both go to the same input: the computed cotangent
    ``(g1 + g2, 0)`` has norm up to ``sqrt(2) G``. For ``n=2`` this layer
    therefore selects both outputs with one shared comparison mask, so ties are
    broken consistently and the backward pass is an exact permutation.
    (``tf.sort``, used for ``n > 2``, already backpropagates through a
    permutation of indices.)
    """

    def __init__(self, n=2, **kwargs):
        if n is not None and (not isinstance(n, (int, np.integer)) or n < 1):
            raise ValueError(
                "Received an invalid value for `n`, expected a positive integer or None. "
                f"Received: n={n!r}"
            )
        if kwargs.get("k_coef_lip", 1.0) != 1.0:
            raise ValueError("DP_GroupSort is norm preserving; it does not take k_coef_lip. "
                             f"Received: k_coef_lip={kwargs['k_coef_lip']!r}")
        super().__init__(n=n, **kwargs)

    def call(self, x):
        if self.n != 2:
            return super().call(x)
        pairs = tf.reshape(x, self.flat_shape)
        first, second = pairs[..., 0], pairs[..., 1]
        first_is_max = first >= second
        high = tf.where(first_is_max, first, second)
        low = tf.where(first_is_max, second, first)
        return tf.reshape(tf.stack([low, high], axis=-1), tf.shape(x))

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_ScaledL2NormPooling2D(ScaledL2NormPooling2D, DPLayer):
    """L2-norm pooling over non-overlapping windows (deel-lip), times ``k_coef_lip``.

    Each output is ``k * ||x_window||_2``; windows are disjoint (strides equal
    the pool size, 'valid' padding drops border pixels), so
    ``||f(x)||_2 <= k ||x||_2`` and each window map is k-Lipschitz on disjoint
    coordinates: ``X_out = k X_in`` and ``G_in = k G``. (deel-lip's custom
    gradient of the square root, ``dy / (2 (sqrt(u) + eps))``, only shrinks
    the true derivative, so the computed cotangents obey the same bound.)
    """

    def _coef(self):
        return tf.constant(float(self.k_coef_lip), tf.float32)

    def propagate_inputs(self, input_bound):
        return self._coef() * input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return self._coef() * gradient_bound
