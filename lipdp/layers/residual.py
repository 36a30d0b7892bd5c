"""Residual connections whose bounds travel as pairs (appendix B.4 of the paper).

Inside a residual section the activation carries both paths stacked on axis 1,
``z = stack([skip, branch], axis=1)`` of shape ``(batch, 2, ...)``, so that the
model stays a chain of single-tensor layers (Sequential, `.keras` saving):

- `DP_SplitResidual` copies ``x`` into both paths. Bounds: ``X -> (X, X)``;
  backward, the cotangent of x is ``g_skip + g_branch``: ``(G_s, G_b) -> G_s + G_b``.
- `DP_WrappedResidual(layer)` applies ``layer`` (or a list of layers) to the
  branch only. Bounds: ``(X_s, X_b) -> (X_s, X_out(X_b))``; its variables get
  the layer's bounds at ``(X_b, G_b)``; backward ``(G_s, G_b) -> (G_s, G_in(X_b, G_b))``.
- `DP_MergeResidual` returns ``c (skip + branch)`` with ``c = 1/2``
  ("1-lip-add": ``(1 + Lip(branch)) / 2 <= 1`` when the branch is 1-Lipschitz)
  or ``c = 1`` ("add"). Bounds: ``(X_s, X_b) -> c (X_s + X_b)``; backward
  ``G -> (c G, c G)``.

Float32 rounding errors travel as pairs too (`DPLayer.propagate_error`):
``E -> (E, E)`` at the split (a copy, exact); the wrapped branch propagates its
entry through its chain (`chain_rounding_error`); the merge gives
``c (E_s + E_b)`` plus its own rounding, Lemma 2 of `lipdp.rounding` for the sum
(the factor 1/2 is exact but for underflow).

`make_residuals(layers)` returns ``[DP_SplitResidual(), DP_WrappedResidual(l)
for l in layers..., DP_MergeResidual()]``. Each wrapped layer (or wrapped list)
must give back the shape of its input (both paths are stacked), and residual
sections do not nest.
"""

from __future__ import annotations

import tensorflow as tf

from lipdp.layers.base import (DPLayer, chain_backward, chain_forward, chain_lipschitz,
                               chain_rounding_error)
from lipdp.rounding import UNDERFLOW, addition_error

MERGE_POLICIES = {"1-lip-add": 0.5, "add": 1.0}


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_SplitResidual(tf.keras.layers.Layer, DPLayer):
    """Opens a residual section: ``x -> stack([x, x], axis=1)``."""

    def call(self, inputs):
        return tf.stack([inputs, inputs], axis=1)

    def compute_output_shape(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        return input_shape[:1].concatenate([2]).concatenate(input_shape[1:])

    def propagate_inputs(self, input_bound):
        return (input_bound, input_bound)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        skip, branch = gradient_bound
        return skip + branch

    def rounding_error(self, input_bound):
        return (0.0, 0.0)

    def propagate_error(self, input_bound, input_error):
        return (input_error, input_error)


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_WrappedResidual(tf.keras.layers.Layer, DPLayer):
    """Applies a DP layer, or a chain of them, to the branch path of a residual section.

    The skip path is left as is. Both paths are stacked, so the branch must give
    back the shape it received: one shape-preserving layer (as `make_residuals`
    wraps them), or a list of layers whose composition preserves the shape
    (e.g. an MLP-Mixer's ``Permute -> Dense -> GroupSort -> Dense -> Permute``).
    Bounds are those of the chain (`chain_backward`) on the branch's pair entry.

    Args:
        layer: a DP layer, or a list of DP layers, none of them a residual layer.
    """

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        branch = list(layer) if isinstance(layer, (list, tuple)) else [layer]
        for inner in branch:
            if not isinstance(inner, DPLayer) or isinstance(
                    inner, (DP_SplitResidual, DP_WrappedResidual, DP_MergeResidual)):
                raise TypeError("DP_WrappedResidual wraps DP layers that are not themselves "
                                f"residual layers (sections do not nest). Received: "
                                f"{type(inner).__name__}")
        if not branch:
            raise ValueError("DP_WrappedResidual needs at least one layer.")
        self.branch = branch

    def build(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        if input_shape.rank is None or input_shape.rank < 3 or input_shape[1] != 2:
            raise ValueError(f"DP_WrappedResidual '{self.name}' must come after a "
                             f"DP_SplitResidual (expected (batch, 2, ...) inputs). Received: "
                             f"input_shape={input_shape}")
        path_shape = shape = input_shape[:1].concatenate(input_shape[2:])
        for inner in self.branch:
            with tf.name_scope(inner.name):
                inner.build(shape)
            shape = tf.TensorShape(inner.compute_output_shape(shape))
        if shape[1:] != path_shape[1:]:
            names = ", ".join(inner.name for inner in self.branch)
            raise ValueError(
                f"The branch [{names}] maps {path_shape[1:]} to {shape[1:]} inside a residual "
                "section: both paths are added at the merge, so the branch must keep the shape "
                "of its input.")
        super().build(input_shape)

    def call(self, inputs):
        # One unstack, not two slices: the gradient of a slice is a full-size tensor of
        # zeros around the slice's cotangent (StridedSliceGrad), that of an unstack one stack.
        skip, branch = tf.unstack(inputs, num=2, axis=1)
        for inner in self.branch:
            branch = inner(branch)
        return tf.stack([skip, branch], axis=1)

    def compute_output_shape(self, input_shape):
        return input_shape

    def propagate_inputs(self, input_bound):
        skip, branch = input_bound
        return (skip, chain_forward(self.branch, branch))

    def backpropagate_params(self, input_bound, gradient_bound):
        return chain_backward(self.branch, input_bound[1], gradient_bound[1])[0]

    def backpropagate_inputs(self, input_bound, gradient_bound):
        skip, branch = gradient_bound
        return (skip, chain_backward(self.branch, input_bound[1], branch)[1])

    def backpropagate_lipschitz(self, input_bound, gradient_bound):
        skip, branch = gradient_bound
        return (skip, chain_lipschitz(self.branch, input_bound[1], branch))

    def rounding_error(self, input_bound):
        return self.propagate_error(input_bound, (0.0, 0.0))

    def propagate_error(self, input_bound, input_error):
        skip, branch = input_error
        return (skip, chain_rounding_error(self.branch, input_bound[1], branch))

    def project(self, orthogonalise=True):
        for inner in self.branch:
            inner.project(orthogonalise)

    def get_config(self):
        serialized = [tf.keras.layers.serialize(inner) for inner in self.branch]
        return {**super().get_config(),
                "layer": serialized[0] if len(serialized) == 1 else serialized}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        layer = config.pop("layer")
        layers = [tf.keras.layers.deserialize(c, custom_objects=custom_objects)
                  for c in (layer if isinstance(layer, list) else [layer])]
        return cls(layers if isinstance(layer, list) else layers[0], **config)


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_MergeResidual(tf.keras.layers.Layer, DPLayer):
    """Closes a residual section: ``c (skip + branch)``.

    Args:
        merge_policy: "1-lip-add" (c = 1/2, the default: a 1-Lipschitz merge)
            or "add" (c = 1, the plain sum; the block is then up to 2-Lipschitz).
    """

    def __init__(self, merge_policy="1-lip-add", **kwargs):
        super().__init__(**kwargs)
        if merge_policy not in MERGE_POLICIES:
            raise ValueError(f"Received an invalid value for `merge_policy`, expected one of "
                             f"{sorted(MERGE_POLICIES)}. Received: merge_policy={merge_policy!r}")
        self.merge_policy = merge_policy
        self._coef = MERGE_POLICIES[merge_policy]

    def build(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        if input_shape.rank is None or input_shape.rank < 3 or input_shape[1] != 2:
            raise ValueError(f"DP_MergeResidual '{self.name}' must close a residual section "
                             f"(expected (batch, 2, ...) inputs). Received: input_shape={input_shape}")
        super().build(input_shape)

    def call(self, inputs):
        skip, branch = tf.unstack(inputs, num=2, axis=1)  # see DP_WrappedResidual.call
        return self._coef * (skip + branch)

    def compute_output_shape(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        return input_shape[:1].concatenate(input_shape[2:])

    def propagate_inputs(self, input_bound):
        skip, branch = input_bound
        return self._coef * (skip + branch)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return (self._coef * gradient_bound, self._coef * gradient_bound)

    def rounding_error(self, input_bound):
        skip, branch = input_bound
        return self._coef * addition_error(0.0, float(skip) + float(branch)) + UNDERFLOW

    def propagate_error(self, input_bound, input_error):
        (skip, branch), (skip_error, branch_error) = input_bound, input_error
        return (self._coef * (skip_error + branch_error)
                + self.rounding_error((float(skip) + skip_error, float(branch) + branch_error)))

    def get_config(self):
        return {**super().get_config(), "merge_policy": self.merge_policy}


def make_residuals(layers, merge_policy="1-lip-add"):
    """``[DP_SplitResidual(), *map(DP_WrappedResidual, layers), DP_MergeResidual(merge_policy)]``.

    The returned list is spliced into a `DP_Sequential` list of layers:
    ``x -> c (x + branch(x))`` with ``branch`` the composition of `layers`.
    """
    layers = list(layers)
    if not layers:
        raise ValueError("make_residuals needs at least one layer for the branch.")
    return ([DP_SplitResidual()] + [DP_WrappedResidual(layer) for layer in layers]
            + [DP_MergeResidual(merge_policy)])
