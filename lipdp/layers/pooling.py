"""Pooling layers with Lipschitz bounds: global L2-norm pooling and max pooling.

(`DP_ScaledL2NormPooling2D`, windowed L2-norm pooling, is in `lipdp.layers.basic`.)
"""

from __future__ import annotations

import math

import tensorflow as tf
from deel.lip.layers import ScaledGlobalL2NormPooling2D

from lipdp.layers.base import DPLayer, check_eps_grad_sqrt, check_positive
from lipdp.rounding import block_norm_error, comparison_error


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_GlobalL2NormPooling2D(ScaledGlobalL2NormPooling2D, DPLayer):
    """Global L2-norm pooling (deel-lip): channel c becomes ``k ||x[:, :, c]||_2``.

    The channels are disjoint blocks of coordinates, so ``||f(x)|| = k ||x||``,
    and the Jacobian of each block is ``k x_c^T / ||x_c||`` (norm k). deel-lip's
    square root backpropagates ``dy / (2 (sqrt(u) + eps))``, which only shrinks
    the true derivative (up to rounding; eps at least `lipdp.layers.base.MIN_EPS_GRAD_SQRT`
    covers the underflow of tiny blocks' squares): ``X_out = k X_in``, ``G_in = k G``. Float32 rounding:
    `lipdp.rounding.block_norm_error` on blocks of ``H W`` coordinates (no division).
    """

    def __init__(self, k_coef_lip=1.0, eps_grad_sqrt=1e-6, data_format="channels_last", **kwargs):
        if data_format not in (None, "channels_last"):
            raise ValueError("DP_GlobalL2NormPooling2D only supports data_format='channels_last'. "
                             f"Received: data_format={data_format!r}")
        if kwargs.pop("keepdims", False):
            raise ValueError("DP_GlobalL2NormPooling2D does not support keepdims=True.")
        check_positive(float(k_coef_lip), "k_coef_lip")
        # deel-lip's square root backpropagates dy / (2 (sqrt(u) + eps)): with eps = 0 an
        # all-zero input block gives 0 / 0, a NaN gradient from a finite record (an audit),
        # and below MIN_EPS_GRAD_SQRT underflowed squares break the gradient's bound.
        check_eps_grad_sqrt(float(eps_grad_sqrt))
        super().__init__(data_format="channels_last", k_coef_lip=k_coef_lip,
                         eps_grad_sqrt=eps_grad_sqrt, **kwargs)

    def build(self, input_shape):
        height, width = tf.TensorShape(input_shape)[1:3].as_list()
        self._block_size = height * width if height and width else None
        super().build(input_shape)

    def propagate_inputs(self, input_bound):
        return float(self.k_coef_lip) * input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return float(self.k_coef_lip) * gradient_bound

    def rounding_error(self, input_bound):
        if self._block_size is None:
            return math.inf
        k = float(self.k_coef_lip)
        return block_norm_error(self._block_size, 1, k, k * input_bound)

    def get_config(self):
        # deel-lip's leaves eps_grad_sqrt out: a saved or cloned layer came back at 1e-6
        # (an audit, 2026-12-07: the same weights then took gradients 1.66x larger).
        return {**super().get_config(), "eps_grad_sqrt": float(self.eps_grad_sqrt)}


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_MaxPool2D(tf.keras.layers.MaxPooling2D, DPLayer):
    """Max pooling, ``sqrt(m)``-Lipschitz with ``m = ceil(ph/sh) ceil(pw/sw)``.

    m is the most windows one pixel belongs to (1 when the strides equal the pool
    size, the default). Each output is one input coordinate of its window (the
    padding of 'same' never wins a max), so ``||f(x)||^2 <= sum over windows of
    ||x_window||^2 <= m ||x||^2``. Backward, each output cotangent goes to one
    input pixel (TensorFlow routes ties to a single arg-max), and a pixel gathers
    at most m of them: ``||g_in||^2 <= m ||g||^2`` (Cauchy-Schwarz).
    ``X_out = sqrt(m) X_in``, ``G_in = sqrt(m) G``. Float32: comparisons only.
    """

    def __init__(self, pool_size=(2, 2), strides=None, padding="valid",
                 data_format="channels_last", **kwargs):
        if data_format not in (None, "channels_last"):
            raise ValueError("DP_MaxPool2D only supports data_format='channels_last'. "
                             f"Received: data_format={data_format!r}")
        if not isinstance(padding, str) or padding.lower() not in ("valid", "same"):
            raise ValueError("DP_MaxPool2D's padding must be 'valid' or 'same'. "
                             f"Received: padding={padding!r}")
        super().__init__(pool_size=pool_size, strides=strides, padding=padding,
                         data_format="channels_last", **kwargs)

    @property
    def _multiplicity(self) -> int:
        """m, from the pool size and strides as they are now, as `call` reads them."""
        return math.prod(math.ceil(p / s) for p, s in zip(self.pool_size, self.strides))

    def propagate_inputs(self, input_bound):
        return math.sqrt(self._multiplicity) * input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return math.sqrt(self._multiplicity) * gradient_bound

    def rounding_error(self, input_bound):
        return comparison_error()
