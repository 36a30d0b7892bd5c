"""Layers that only move coordinates: reshape, permute, image-to-patches.

Each is a permutation of the coordinates of one example, so it preserves the
norm of the input and of the cotangent: ``X_out = X_in`` and ``G_in = G``; it
moves values without arithmetic, so float32 evaluation is exact.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from lipdp.layers.base import DPLayer


class _NormPreserving(DPLayer):
    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound

    def rounding_error(self, input_bound):
        return 0.0


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_Reshape(_NormPreserving, tf.keras.layers.Reshape):
    """`tf.keras.layers.Reshape`: the same coordinates in another shape."""


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_Permute(_NormPreserving, tf.keras.layers.Permute):
    """`tf.keras.layers.Permute`: a transposition of the non-batch axes."""


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_Patches(_NormPreserving, tf.keras.layers.Layer):
    """Cuts ``(H, W, C)`` images into non-overlapping ``p x p`` patches: ``(H W / p^2, p p C)``.

    The tokens of an MLP-Mixer. Every pixel lands in exactly one patch (H and W
    must be multiples of p), so this is a permutation of coordinates.

    Args:
        patch_size: p, an int or a pair ``(ph, pw)``.
    """

    def __init__(self, patch_size, **kwargs):
        super().__init__(**kwargs)
        whole = (int, np.integer)
        size = (patch_size, patch_size) if isinstance(patch_size, whole) else tuple(patch_size)
        if len(size) != 2 or not all(isinstance(p, whole) and not isinstance(p, bool) and p >= 1
                                     for p in size):
            raise ValueError("Received an invalid value for `patch_size`, expected a positive "
                             f"integer or a pair of them. Received: patch_size={patch_size!r}")
        self.patch_size = tuple(int(p) for p in size)

    def build(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        ph, pw = self.patch_size
        if input_shape.rank != 4 or any(d is None for d in input_shape[1:]) \
                or input_shape[1] % ph or input_shape[2] % pw:
            raise ValueError(f"DP_Patches needs (H, W, C) inputs with H a multiple of {ph} and W "
                             f"a multiple of {pw}. Received: input_shape={input_shape}")
        super().build(input_shape)

    def compute_output_shape(self, input_shape):
        _, h, w, c = tf.TensorShape(input_shape).as_list()
        ph, pw = self.patch_size
        return tf.TensorShape((input_shape[0], (h // ph) * (w // pw), ph * pw * c))

    def call(self, inputs):
        _, h, w, c = inputs.shape.as_list()
        ph, pw = self.patch_size
        x = tf.reshape(inputs, (-1, h // ph, ph, w // pw, pw, c))
        x = tf.transpose(x, (0, 1, 3, 2, 4, 5))
        return tf.reshape(x, (-1, (h // ph) * (w // pw), ph * pw * c))

    def get_config(self):
        return {**super().get_config(), "patch_size": list(self.patch_size)}
