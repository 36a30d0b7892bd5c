"""Clipping of the cotangent inside the network (loss-logits gradient clipping)."""

from __future__ import annotations

import tensorflow as tf

from lipdp.layers.base import DPLayer, check_positive


def _clip_rows(cotangent, clip_value):
    """Rescale each example's cotangent (all non-batch axes) to norm <= clip_value."""
    axes = list(range(1, cotangent.shape.rank))
    norms = tf.sqrt(tf.reduce_sum(tf.square(cotangent), axis=axes, keepdims=True))
    return cotangent * tf.minimum(1.0, clip_value / tf.maximum(norms, 1e-30))


def clip_gradient_rows(inputs, clip_value):
    """Identity forward; backward, each example's cotangent (row) clipped to norm
    `clip_value` (a number or a scalar tensor, read once, at the forward pass)."""
    @tf.custom_gradient
    def identity_with_clipped_gradient(x):
        return tf.identity(x), lambda g: _clip_rows(g, clip_value)

    return identity_with_clipped_gradient(inputs)


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_ClipGradient(tf.keras.layers.Layer, DPLayer):
    """Identity forward; backward, each example's cotangent is clipped to norm C (appendix B.5).

    Placed after the logits, it replaces the loss constant L by ``min(L, C)`` for
    every layer below it: ``backpropagate_inputs(X, G) = min(G, C)``. Noise then
    scales with C instead of L, at the price of a biased descent direction. The
    forward map is the identity, so it is 1-Lipschitz for certification
    (``backpropagate_lipschitz(X, G) = G``).

    The clipping is per example: it assumes each row of the cotangent is one
    example's own, which holds in DP models (their train step differentiates the
    *sum* of per-example losses). Under a Keras mean-reduced loss, the rows are
    divided by the batch size before they reach this layer.

    Args:
        clip_value: C > 0.
    """

    def __init__(self, clip_value, **kwargs):
        super().__init__(**kwargs)
        self.clip_value = check_positive(clip_value, "clip_value")

    def call(self, inputs):
        return clip_gradient_rows(inputs, self.clip_value)

    def compute_output_shape(self, input_shape):
        return input_shape

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return tf.minimum(gradient_bound, self.clip_value)

    def backpropagate_lipschitz(self, input_bound, gradient_bound):
        return gradient_bound  # the forward map is the identity

    def rounding_error(self, input_bound):
        return 0.0  # the forward map is the identity

    def get_config(self):
        return {**super().get_config(), "clip_value": self.clip_value}
