"""Clipping of the cotangent inside the network (loss-logits gradient clipping).

**What the clipped rows' float32 norms are proven to be.** A row z of n coordinates is
multiplied by ``c = min(1, fl(t / fl(||z||)))`` with the target ``t = fl(C fl(f_n))``,
``f_n = (1 - 2^-40) / ((1 + eps_n) (1 + u)^3)`` (`lipdp.rounding.rescaling_error`): the
float32 factor and the product each round by at most u, so ``t <= C f_n (1 + u)^2``. Then

- ``||fl(z c)|| <= ||z||``: c is 1 (exact) or at most ``1 - u``, and ``|fl(z_i c)| <=
  |z_i| c (1 + u) <= |z_i|`` (flushing only shrinks);
- when ``||z||^2 >= 4 n mu / u``: ``c <= (1 + eps_n) t / ||z||``, so ``||fl(z c)|| <=
  (1 + eps_n)(1 + u) t + 3 UNDERFLOW <= C (1 - 2^-40) + 3 UNDERFLOW`` (the proof of
  `DP_BoundedInput.rounding_error`); otherwise ``||z|| < sqrt(n) 2^-49 < 2^-33``.

So every clipped row has norm at most ``min(||z||, max(C, 2^-32) + 3 UNDERFLOW)``
(`clipped_norm_bound`), what the bound pass uses.
"""

from __future__ import annotations

import tensorflow as tf

from lipdp.layers.base import DPLayer, as_bound, check_positive
from lipdp.rounding import UNDERFLOW, UNIT_ROUNDOFF, rescaling_error

# Below this clip value the clipped norm is bounded by it instead (module docstring).
_SMALLEST_CLIP = 2.0 ** -32


def row_clip_factor(n) -> float:
    """``f_n``: rows of n coordinates are rescaled to norm ``fl(C f_n)`` (module docstring).

    Raises:
        ValueError: float32 cannot bound the rounding of n coordinates (n >= 2^24 - 1).
    """
    eps = rescaling_error(n)
    if not eps < 1.0:
        raise ValueError(f"Cannot clip rows of {n} coordinates provably in float32.")
    return (1.0 - 2.0 ** -40) / ((1.0 + eps) * (1.0 + UNIT_ROUNDOFF) ** 3)


def clipped_norm_bound(gradient_bound, clip_value):
    """Bound of the norm of a clipped row whose unclipped norm is at most `gradient_bound`:
    ``min(G, max(C, 2^-32) + 3 UNDERFLOW)`` (float64; module docstring), 2^-32 for a C that is
    not above it (negative or NaN: `_clip_rows` zeroes the rows then)."""
    clip = as_bound(clip_value)
    return tf.minimum(as_bound(gradient_bound),
                      tf.where(clip > _SMALLEST_CLIP, clip, _SMALLEST_CLIP) + 3.0 * UNDERFLOW)


def _clip_rows(cotangent, clip_value):
    """Rescale each example's cotangent (all non-batch axes) to norm <= ``clip_value``, up to
    the float32 rounding `clipped_norm_bound` accounts for."""
    size = cotangent.shape[1:].num_elements()
    if size is None:
        raise ValueError("Clipping per-example cotangents needs their size to be known; "
                         f"got the shape {cotangent.shape}.")
    axes = list(range(1, cotangent.shape.rank))
    norms = tf.sqrt(tf.reduce_sum(tf.square(cotangent), axis=axes, keepdims=True))
    clip = tf.cast(clip_value, cotangent.dtype)
    # A C that is not positive (negative, or NaN) zeroes the rows: its negative factor
    # rescaled each row to norm |C|, while the bound took max(C, 2^-32) (an audit,
    # 2026-12-07: C_t = -1 set by set_weights released gradients 4e9 times their bound).
    target = tf.where(clip > 0, clip, tf.zeros_like(clip)) * row_clip_factor(size)
    return cotangent * tf.minimum(1.0, target / tf.maximum(norms, 1e-30))


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
        return clipped_norm_bound(gradient_bound, self.clip_value)

    def backpropagate_lipschitz(self, input_bound, gradient_bound):
        return gradient_bound  # the forward map is the identity

    def rounding_error(self, input_bound):
        return 0.0  # the forward map is the identity

    def get_config(self):
        return {**super().get_config(), "clip_value": self.clip_value}
